"""scripts/build_llama.py and scripts/regen_patches.py: pin check, idempotent patching, clear failure, round trip.

Works on the files the patch touches, extracted from the pinned sdist in the llamapack cache (which the
README's setup step downloads and verifies).
"""
from __future__ import annotations

import re
import sys
import tarfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "scripts"))
import build_llama  # noqa: E402
import regen_patches  # noqa: E402

PATCH = REPO / "patches" / "0001-expert-provider-hook.patch"


def touched_files() -> list[str]:
    return re.findall(r"^diff --git a/(\S+) ", PATCH.read_text(), flags=re.M)


@pytest.fixture
def pristine_subset(tmp_path) -> Path:
    """The files the patch touches, as the pinned sdist has them, in a vendor/llama.cpp-shaped directory."""
    sdist = build_llama.fetch_sdist()  # verifies the sha256 pin
    prefix = f"llama_cpp_python-{build_llama.LLAMA_CPP_PYTHON_VERSION}/vendor/llama.cpp/"
    wanted = {prefix + rel for rel in touched_files()}
    with tarfile.open(sdist) as tar:
        members = [m for m in tar.getmembers() if m.name in wanted]
        tar.extractall(tmp_path / "x", members=members, filter="data")
    root = tmp_path / "x" / prefix
    assert sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file()) == sorted(touched_files())
    return root


def test_patch_applies_once_and_is_then_detected(pristine_subset, capsys):
    build_llama.apply_patches(pristine_subset)
    assert "applied 0001" in capsys.readouterr().out
    assert "llama-expert.h" in (pristine_subset / "include/llama.h").read_text()
    build_llama.apply_patches(pristine_subset)  # second run: skipped, nothing doubled
    assert "already applied: 0001" in capsys.readouterr().out
    assert (pristine_subset / "include/llama.h").read_text().count("llama-expert.h") == 1


def test_patch_that_does_not_apply_says_how_to_regenerate(pristine_subset):
    graph = pristine_subset / "src/llama-graph.cpp"
    graph.write_text(graph.read_text().replace("ggml_build_forward_expand(gf, weights);", "/* upstream moved */"))
    with pytest.raises(build_llama.BuildError, match="Regenerate it against the pinned version"):
        build_llama.apply_patches(pristine_subset)


def test_regenerating_from_a_patched_tree_gives_the_committed_patch(pristine_subset, tmp_path):
    import shutil

    edited = tmp_path / "edited"
    shutil.copytree(pristine_subset, edited)
    build_llama.apply_patches(edited)
    files = regen_patches.changed_files(pristine_subset, edited)
    assert sorted(files) == sorted(touched_files())
    assert regen_patches.diff(pristine_subset, edited, files) == PATCH.read_text()


def test_sdist_with_wrong_hash_is_refused(tmp_path, monkeypatch):
    fake_cache = tmp_path / "cache"
    (fake_cache / "sdist").mkdir(parents=True)
    (fake_cache / "sdist" / build_llama.SDIST_NAME).write_bytes(b"not the sdist")
    monkeypatch.setattr(build_llama, "CACHE", fake_cache)
    with pytest.raises(build_llama.BuildError, match="does not match the pin"):
        build_llama.fetch_sdist()


def fake_compiler(tmp_path: Path, dev_link: bool) -> Path:
    """A C++ driver that answers -print-file-name like g++: a path when it finds the file, the bare name if not."""
    runtime = tmp_path / "lib" / "libstdc++.so.6"
    runtime.parent.mkdir()
    runtime.write_bytes(b"")
    script = tmp_path / "c++"
    found = {"libstdc++.so.6": str(runtime)}
    if dev_link:
        found["libstdc++.so"] = str(runtime)
    cases = "".join(f'    -print-file-name={name}) echo "{path}";;\n' for name, path in found.items())
    script.write_text(f'#!/bin/sh\ncase "$1" in\n{cases}    -print-file-name=*) echo "${{1#-print-file-name=}}";;\nesac\n')
    script.chmod(0o755)
    return runtime


@pytest.mark.parametrize("dev_link", [True, False])
def test_the_shared_cxx_runtime_is_linked_when_only_the_static_one_is_found(tmp_path, monkeypatch, dev_link):
    runtime = fake_compiler(tmp_path, dev_link)
    monkeypatch.setenv("CXX", str(tmp_path / "c++"))
    args = build_llama.shared_cxx_runtime_args(tmp_path / "work")
    if dev_link:  # the usual toolchain: nothing to do
        assert args == [] and not (tmp_path / "work").exists()
        return
    link = tmp_path / "work" / "cxx-runtime-link" / "libstdc++.so"
    assert args == [f"-DCMAKE_SHARED_LINKER_FLAGS=-L{link.parent}"]
    assert link.is_symlink() and link.resolve() == runtime.resolve()
    assert build_llama.shared_cxx_runtime_args(tmp_path / "work") == args  # idempotent: the link is replaced


@pytest.mark.parametrize("native_amx", [True, False])
def test_amx_is_left_out_where_the_native_target_has_it(monkeypatch, native_amx):
    """-march=native with AMX: the build adds -mno-amx-* (ggml's AMX kernels died on a sandbox that reports AMX)
    unless LLAMAPACK_KEEP_AMX=1; without AMX nothing is added."""
    import subprocess

    macros = "#define __AVX512F__ 1\n" + ("#define __AMX_TILE__ 1\n" if native_amx else "")
    monkeypatch.setattr(build_llama.subprocess, "run",
                        lambda cmd, **kw: subprocess.CompletedProcess(cmd, 0, stdout=macros, stderr=""))
    monkeypatch.setattr(build_llama.sys, "platform", "linux")
    monkeypatch.delenv("LLAMAPACK_KEEP_AMX", raising=False)
    args = build_llama.amx_off_args()
    if native_amx:
        assert args == ["-DCMAKE_C_FLAGS=-mno-amx-tile -mno-amx-int8 -mno-amx-bf16",
                        "-DCMAKE_CXX_FLAGS=-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"]
    else:
        assert args == []
    monkeypatch.setenv("LLAMAPACK_KEEP_AMX", "1")
    assert build_llama.amx_off_args() == []
