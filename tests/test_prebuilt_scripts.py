"""The device scripts' prebuilt-binary checks (no GPU, no compiler): bench/cpuflags.sh names the SIMD flags a
build needs that this CPU lacks, and bench/upstream_build.sh unpacks prebuilt upstream binaries only when they
match the tree, patch and targets asked and this CPU, else falls back to a build."""
from __future__ import annotations

import io
import os
import subprocess
import tarfile

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def bash(script: str, env: dict | None = None, cwd: str = REPO) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", "-c", script], cwd=cwd, env={**os.environ, **(env or {})},
                          capture_output=True, text=True, timeout=60)


def this_cpu_flags() -> list[str]:
    return bash("source bench/cpuflags.sh; cpu_flags").stdout.split()


def test_missing_cpu_flags_names_only_what_this_cpu_lacks(tmp_path):
    flags = tmp_path / "flags"
    flags.write_text("\n".join(this_cpu_flags() + ["amx_imaginary"]) + "\n")
    missing = bash(f"set -euo pipefail; source bench/cpuflags.sh; missing_cpu_flags {flags}")
    assert missing.returncode == 0 and missing.stdout.split() == ["amx_imaginary"]
    flags.write_text("\n".join(reversed(this_cpu_flags())) + "\n")  # any order: compared sorted
    assert bash(f"source bench/cpuflags.sh; missing_cpu_flags {flags}").stdout.strip() == ""
    assert bash(f"source bench/cpuflags.sh; missing_cpu_flags {tmp_path / 'absent'}").stdout.strip() == ""


def add(archive: tarfile.TarFile, name: str, data: bytes, mode: int = 0o644) -> None:
    info = tarfile.TarInfo(name)
    info.size, info.mode = len(data), mode
    archive.addfile(info, io.BytesIO(data))


def upstream_run(tmp_path, stamp_targets: str, cpuflags: list[str]) -> subprocess.CompletedProcess:
    """upstream_build.sh with a stand-in source tarball and a prebuilt archive of one fake binary."""
    source = tmp_path / "upstream-src.tar.gz"
    source.write_bytes(b"not a tarball")  # only its checksum matters to the prebuilt path
    stamp = bash(f"echo \"$(cksum < {source}) replay=0 \"").stdout.rstrip("\n")
    prebuilt = tmp_path / "upstream-bin.tar.xz"
    with tarfile.open(prebuilt, "w:xz") as archive:
        add(archive, "STAMP", f"{stamp} targets={stamp_targets}\n".encode())
        add(archive, "CPUFLAGS", ("\n".join(cpuflags) + "\n").encode())
        add(archive, "llama-batched-bench", b"#!/bin/sh\necho fake\n", 0o755)
    return bash("bash bench/upstream_build.sh", env=dict(
        UPSTREAM_DIR=str(tmp_path / "up"), UPSTREAM_TARBALL=str(source), UPSTREAM_REPLAY="0",
        UPSTREAM_PREBUILT=str(prebuilt), UPSTREAM_LOG=str(tmp_path / "log"), OUT=""))


def test_upstream_prebuilt_is_unpacked_when_it_matches(tmp_path):
    run = upstream_run(tmp_path, "llama-batched-bench", this_cpu_flags())
    assert run.returncode == 0, run.stderr
    assert "prebuilt" in run.stdout and "upstream build ok" in run.stdout
    binary = tmp_path / "up" / "build" / "bin" / "llama-batched-bench"
    assert binary.read_text() == "#!/bin/sh\necho fake\n" and os.access(binary, os.X_OK)


@pytest.mark.parametrize("targets, extra_flag, reason", [
    ("llama-batched-bench llama-completion", None, "another tree, patch or targets"),
    ("llama-batched-bench", "amx_imaginary", "CPU flags this machine lacks (amx_imaginary"),
])
def test_upstream_prebuilt_that_does_not_match_falls_back_to_a_build(tmp_path, targets, extra_flag, reason):
    run = upstream_run(tmp_path, targets, this_cpu_flags() + ([extra_flag] if extra_flag else []))
    assert reason in run.stdout
    # the build then starts from the (stand-in, unreadable) source tarball and fails closed, naming it
    assert run.returncode != 0 and "upstream build FAILED: cannot unpack" in run.stderr
    assert not (tmp_path / "up" / "build" / "bin" / "llama-batched-bench").exists()


def test_pack_cuda_libs_stores_copies_once_and_splits(tmp_path):
    """bench/pack_cuda_libs.sh: cp -L copies of one lib under several names travel once (hard links), a
    symlink stays a link, SPLIT_MIB parts join back to the archive, and the cpuflags file is this CPU's."""
    build = tmp_path / "build"
    cuda = os.urandom(3 << 20)  # incompressible: a second stored copy would double the archive
    for variant in ("patched", "vanilla"):
        (build / variant).mkdir(parents=True)
        for name in ("libggml-cuda.so", "libggml-cuda.so.0"):
            (build / variant / name).write_bytes(cuda)
        (build / variant / "libllama.so.0").write_text(variant)
        (build / variant / "libllama.so").symlink_to("libllama.so.0")
    archive = tmp_path / "libs.tar.xz"
    run = bash(f"bash bench/pack_cuda_libs.sh {build} {archive}", env=dict(SPLIT_MIB="1"))
    assert run.returncode == 0, run.stderr
    with tarfile.open(archive) as tar:  # the cuda libs first (xz's window), the other names of one as links
        members = {m.name: m for m in tar.getmembers()}
        assert [m.name for m in tar.getmembers()][:2] == ["patched/libggml-cuda.so", "vanilla/libggml-cuda.so"]
    assert members["patched/libggml-cuda.so.0"].islnk() and members["vanilla/libggml-cuda.so.0"].islnk()
    assert members["patched/libllama.so"].issym()
    parts = sorted(tmp_path.glob("libs.tar.xz.part*"))
    assert len(parts) >= 2 and b"".join(p.read_bytes() for p in parts) == archive.read_bytes()
    assert (tmp_path / "libs.cpuflags").read_text().split() == this_cpu_flags()
    unpacked = tmp_path / "unpacked"
    unpacked.mkdir()
    with tarfile.open(archive) as tar:
        tar.extractall(unpacked)
    for variant in ("patched", "vanilla"):
        assert (unpacked / variant / "libggml-cuda.so.0").read_bytes() == cuda
        assert (unpacked / variant / "libllama.so").is_symlink()
        assert (unpacked / variant / "libllama.so").read_text() == variant
