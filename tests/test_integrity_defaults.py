"""With the defaults, ``llamapack run --pack`` refuses corrupt pack blocks and a GGUF changed since packing
(a real ``python -m llamapack`` process: one-line error, non-zero exit); ``--no-verify`` turns the block check off;
``verify --against --update-source`` records a touched GGUF that still holds the pack's experts."""
from __future__ import annotations

import llama_cpp  # noqa: F401 - before numpy (see docs/hook.md: static C++ runtime)

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from hookutil import flip_byte

from llamapack.pack import PackReader, build_pack, open_gguf
from llamapack.pack.identity import FULL
from llamapack.synth import write_model

REPO = Path(__file__).resolve().parent.parent
RUN = ["-p", "Once upon a time", "-n", "4", "--temp", "0", "-t", "2", "-c", "256"]


@pytest.fixture(scope="module")
def pristine(tmp_path_factory):
    folder = tmp_path_factory.mktemp("integrity")
    model = write_model(folder / "m.gguf", "qwen3moe-tiny", seed=0)
    build_pack(model, progress=False, safety_margin_mib=0)
    return folder


@pytest.fixture
def model(pristine, tmp_path) -> Path:
    """A copy of the model and its pack (times kept), safe to damage."""
    for name in os.listdir(pristine):
        shutil.copy2(pristine / name, tmp_path / name)
    return tmp_path / "m.gguf"


def llamapack(*args) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.run([sys.executable, "-m", "llamapack", *map(str, args)], capture_output=True, text=True,
                          env=env, timeout=300)


def error_line(proc) -> str:
    """The one ``Error:`` line (a failed decode is preceded by llama.cpp's own log line about it)."""
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr
    lines = [line for line in proc.stderr.splitlines() if not line.startswith("decode: ")]
    assert len(lines) == 1 and lines[0].startswith("Error: "), proc.stderr
    return lines[0]


def pack_of(model: Path) -> Path:
    return model.with_suffix(".expert-pack")


def damage_first_layer(model: Path, how) -> int:
    """Apply ``how(pack path, block offset)`` to every block of the first MoE layer (a prompt reads some)."""
    with PackReader(pack_of(model)) as reader:
        layout = reader.layout
    first = layout.moe_layers[0]
    for expert in range(layout.num_experts):
        how(pack_of(model), layout.block_offset(first, expert), layout.expert_stride)
    return first


def test_a_flipped_byte_fails_the_run_unless_no_verify(model):
    first = damage_first_layer(model, lambda pack, offset, stride: flip_byte(pack, offset + 777))
    error = error_line(llamapack("run", model, "--pack", *RUN))
    assert "fails its sha256 check" in error and f"layer {first} expert" in error and str(pack_of(model)) in error
    proc = llamapack("run", model, "--pack", *RUN, "--no-verify")
    assert proc.returncode == 0, proc.stderr


def test_a_pack_of_zeros_fails_the_run(model):
    def zero(pack, offset, stride):
        with open(pack, "r+b") as f:
            f.seek(offset)
            f.write(bytes(stride))

    damage_first_layer(model, zero)
    assert "fails its sha256 check" in error_line(llamapack("run", model, "--pack", *RUN))


def test_a_touched_gguf_is_refused_until_verified_and_recorded(model):
    stat = model.stat()
    os.utime(model, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))  # same bytes, another time (a copy)
    error = error_line(llamapack("run", model, "--pack", *RUN))
    assert "may have changed since the pack was built" in error and str(model) in error
    assert f"llamapack pack {model} -o {pack_of(model)}" in error
    assert f"llamapack verify {pack_of(model)} --against {model} --update-source" in error
    proc = llamapack("verify", pack_of(model), "--against", model, "--update-source", "-q")
    assert proc.returncode == 0 and "modification time is recorded" in proc.stdout, proc.stderr
    proc = llamapack("run", model, "--pack", *RUN)
    assert proc.returncode == 0, proc.stderr


@pytest.mark.parametrize("full_hash", [False, True])
def test_a_gguf_with_one_expert_byte_changed_is_refused(model, full_hash):
    if full_hash:
        build_pack(model, progress=False, safety_margin_mib=0, fingerprint_mode=FULL)
    tensor = open_gguf(model).expert_tensors[0]
    flip_byte(model, tensor.expert_offset(1) + 5)  # between the sampled fingerprint's chunks
    stat = model.stat()
    os.utime(model, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))  # the write's own time may equal the pack's
    error = error_line(llamapack("run", model, "--pack", *RUN))
    assert "may have changed since the pack was built" in error or "changed since the pack was built" in error
    error = error_line(llamapack("verify", pack_of(model), "--against", model, "--update-source", "-q"))
    assert f"differ from {model}" in error and f"layer {tensor.layer} expert 1 role {tensor.role}" in error
    assert error_line(llamapack("run", model, "--pack", *RUN))  # still refused: nothing was recorded


def test_a_gguf_of_another_size_needs_a_new_pack(model):
    with open(model, "ab") as f:
        f.write(b"\0" * 4096)
    error = error_line(llamapack("run", model, "--pack", *RUN))
    assert "changed since the pack was built" in error and "build the pack again" in error
    assert "--update-source" not in error
