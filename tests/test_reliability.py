"""Issue 8: bad inputs and injected faults never give a wrong token, through ``llamapack.Llama`` and the CLI.

What tests/test_pack_errors.py, test_pack_manifest_fuzz.py, test_provider_streaming.py, test_hook_bitexact.py
and test_cli_run.py already cover (the pack library, the provider worker, the CLI ``run``) is not repeated:
here every bad input goes through ``llamapack.Llama(...)`` (or ``llamapack pack``) and must raise a
``llamapack.errors`` error naming the file (and layer / role / field where one applies) before any token.

Not tested here: ``cache_vram_reserve_mib`` larger than the free VRAM of a GPU pool (no GPU on the test box;
``slot_budget``'s arithmetic for it is covered by test_provider_streaming.test_slot_budget).
"""
from __future__ import annotations

import llama_cpp  # noqa: F401 - before numpy where this file decides (see test_cli_run)

import dataclasses
import errno
import gc
import json
import os
import re
import shutil
import threading
import time
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner
from gguf import GGMLQuantizationType as Q

from llamapack.cli import main
from llamapack.errors import CapacityError, LlamapackError, ModelMismatchError, PackFormatError, PackIOError
from llamapack.llama import Llama
from llamapack.pack import PackReader, build_pack, odirect
from llamapack.synth import PRESETS, write_model
from llamapack.synth.spec import ExpertQuant

KW = dict(n_ctx=64, verbose=False, n_threads=1, n_threads_batch=1, seed=0)
PROMPT = "Once upon a time"
N_TOKENS = 8
PROMPT_ACQUIRES = 7  # PROMPT is 4 tokens; n_ubatch=2: layers 0-2 of ubatch 1, layers 0-3 of ubatch 2


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """name -> (gguf, pack path): the model; the same model with layer 3's experts in another quantization;
    another model (seed 1). Each in its own folder, so ``pack=True`` finds each one's own pack."""
    spec = PRESETS["qwen3moe-tiny"]
    quants = list(spec.expert_quant)
    assert quants[3] != ExpertQuant(gate_up=Q.Q8_0, down=Q.Q8_0)
    quants[3] = ExpertQuant(gate_up=Q.Q8_0, down=Q.Q8_0)  # layers cycle over 4 quants: only layer 3 differs
    out = {}
    for name, preset, seed in (("model", "qwen3moe-tiny", 0),
                               ("requant", dataclasses.replace(spec, expert_quant=tuple(quants)), 0),
                               ("other", "qwen3moe-tiny", 1)):
        folder = tmp_path_factory.mktemp(name)
        gguf = write_model(folder / "m.gguf", preset, seed=seed)
        out[name] = (Path(gguf), Path(build_pack(gguf, progress=False, safety_margin_mib=0).pack_path))
    return out


def complete(llm) -> str:
    return llm.create_completion(PROMPT, max_tokens=N_TOKENS, temperature=0)["choices"][0]["text"]


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def fails_at_init(error, model, **kwargs) -> str:
    """``Llama(model, **kwargs)`` raises ``error`` (no object, so no output) and leaves no file or thread."""
    assert issubclass(error, LlamapackError)
    before = open_fds(), threading.active_count()
    with pytest.raises(error) as info:
        Llama(str(model), **KW, **kwargs)
    assert (open_fds(), threading.active_count()) == before, "a failed Llama() left a file or thread open"
    return str(info.value)


def copy_pack(models, tmp_path) -> tuple[Path, Path]:
    """A private copy of the model's pack and manifest (safe to damage); returns (pack, manifest)."""
    pack = models["model"][1]
    for path in (pack, Path(f"{pack}.manifest.json")):
        shutil.copy(path, tmp_path / path.name)
    return tmp_path / pack.name, tmp_path / f"{pack.name}.manifest.json"


def edit_manifest(path: Path, change) -> None:
    obj = json.loads(path.read_text())
    change(obj)
    path.write_text(json.dumps(obj))


# --- 1. damaged or mismatched packs through llamapack.Llama --------------------------------------

def test_llama_on_truncated_pack(models, tmp_path):
    pack, _ = copy_pack(models, tmp_path)
    os.truncate(pack, os.path.getsize(pack) - 4096)
    message = fails_at_init(PackFormatError, models["model"][0], pack=pack)
    assert str(pack) in message and "truncated" in message


def test_llama_on_manifest_of_other_version(models, tmp_path):
    pack, manifest = copy_pack(models, tmp_path)
    edit_manifest(manifest, lambda m: m.update(version=2))
    message = fails_at_init(PackFormatError, models["model"][0], pack=pack)
    assert str(manifest) in message and "unsupported version 2" in message


@pytest.mark.parametrize("delta", [4096, -4096])
def test_llama_on_wrong_stride_in_manifest(models, tmp_path, delta):
    pack, manifest = copy_pack(models, tmp_path)
    edit_manifest(manifest, lambda m: m.update(expert_stride=m["expert_stride"] + delta))
    message = fails_at_init(PackFormatError, models["model"][0], pack=pack)
    assert str(manifest) in message
    if delta > 0:  # blocks no longer add up to the pack's size
        assert re.search(r"pack_size \d+ != data_start \+ blocks \* stride = \d+", message), message
    else:  # the last role of the largest layer no longer fits in a block
        assert re.search(r"layer \d+ role down: range \[\d+, \d+\) overlaps or leaves the block", message), message


def test_llama_on_manifest_of_other_quantization(models, tmp_path):
    """The other quantization's manifest beside this model's pack data: the pack header refuses it."""
    pack, manifest = copy_pack(models, tmp_path)
    shutil.copy(f"{models['requant'][1]}.manifest.json", manifest)
    message = fails_at_init(ModelMismatchError, models["model"][0], pack=pack)
    assert f"{pack} does not belong to this manifest" in message


def test_llama_on_pack_of_other_quantization(models):
    """A whole, consistent pack of the same model quantized differently in one layer: named layer/role/field."""
    message = fails_at_init(ModelMismatchError, models["model"][0], pack=models["requant"][1])
    assert "layer 3 role gate: ggml type is Q8_0 in the manifest but Q5_K in the GGUF" in message


def test_llama_on_pack_of_other_model(models):
    message = fails_at_init(ModelMismatchError, models["model"][0], pack=models["other"][1])
    assert "pack does not match the model" in message and "hyperparameter hash" in message


@pytest.mark.parametrize("which", ["requant", "other"])
def test_model_mismatch_names_the_pack_file(models, which):
    message = fails_at_init(ModelMismatchError, models["model"][0], pack=models[which][1])
    assert str(models[which][1]) in message


# --- 2. bad GGUF inputs: Llama(pack=True), Llama(gguf_direct=True), `llamapack pack` ---------------

def not_a_gguf(tmp_path, models) -> Path:
    path = tmp_path / "random.gguf"
    path.write_bytes(np.random.default_rng(0).bytes(100_000))
    return path


def truncated_in_data(tmp_path, models) -> Path:
    path = tmp_path / "truncated.gguf"
    data = models["model"][0].read_bytes()
    path.write_bytes(data[:len(data) // 2])
    return path


def truncated_in_header(tmp_path, models) -> Path:
    path = tmp_path / "header.gguf"
    path.write_bytes(models["model"][0].read_bytes()[:200])
    return path


def dense(tmp_path, models) -> Path:
    """A dense llama: expert_count 0, no ffn_*_exps tensors."""
    from gguf import GGUFWriter

    path = tmp_path / "dense.gguf"
    w = GGUFWriter(str(path), "llama")
    w.add_block_count(1)
    w.add_expert_count(0)
    w.add_tensor("token_embd.weight", np.zeros((32, 64), dtype=np.float32))
    for role in ("gate", "up", "down"):
        w.add_tensor(f"blk.0.ffn_{role}.weight", np.zeros((64, 64), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


BAD_GGUFS = [
    (not_a_gguf, r"not a valid GGUF file"),
    (truncated_in_data, r"runs past the end of the file \(truncated\?\)"),
    (truncated_in_header, r"truncated"),
    (dense, r"no routed-expert tensors \(llama is dense\): pack mode does not apply"),
]


@pytest.mark.parametrize("make, expected", BAD_GGUFS, ids=[b[0].__name__ for b in BAD_GGUFS])
def test_bad_gguf(make, expected, models, tmp_path):
    path = make(tmp_path, models)
    for how in (dict(pack=True), dict(gguf_direct=True)):
        message = fails_at_init(PackFormatError, path, **how)
        assert message.startswith(f"{path}: ") and re.search(expected, message), message
    before = sorted(os.listdir(tmp_path))
    result = CliRunner().invoke(main, ["pack", str(path)])
    assert result.exit_code == 1 and isinstance(result.exception, SystemExit), result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"Error: {path}: "), result.stderr
    assert re.search(expected, lines[0]) and "Traceback" not in result.output
    assert sorted(os.listdir(tmp_path)) == before  # no pack, manifest or partial file left behind


# --- 3. budget -------------------------------------------------------------------------------------

@pytest.mark.parametrize("source", [dict(pack=True), dict(gguf_direct=True)], ids=["pack", "gguf_direct"])
def test_cache_vram_mib_below_one_step(models, source):
    """A host pool of 0.5 MiB cannot hold one 2.5 MiB expert, let alone one ubatch's 16 (cache_slots=1 is in
    test_cli_run)."""
    message = fails_at_init(CapacityError, models["model"][0], cache_vram_mib=0.5, **source)
    assert re.search(r"the expert cache holds 0 experts \(cache_vram_mib=0.5; [\d.]+ MiB per expert\) but one "
                     r"ubatch of 64 tokens may use 16 experts of one layer", message), message


# --- 4. resource hygiene -----------------------------------------------------------------------------

def usage() -> dict:
    gc.collect()
    with open("/proc/self/status") as f:
        rss_kib = next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))
    return dict(fds=open_fds(), threads=threading.active_count(), tasks=len(os.listdir("/proc/self/task")),
                rss_mib=rss_kib / 1024)


N_WARMUP = 10
CYCLES = {"close": 200, "with": 200}
RSS_BOUND_MIB = 16  # below one leaked pool (8 slots x 2.52 MiB = 20 MiB); 200 leaked staging sets would be 300 MiB


@pytest.mark.parametrize("form", list(CYCLES))
def test_create_close_cycles_do_not_leak(models, form):
    """Create/decode/close cycles of ``Llama(pack=...)`` on qwen3moe-tiny (n_ctx 64, n_ubatch 2, an 8-slot
    pool), 200 with ``close()`` (twice: idempotent) and 200 as a context manager, each decoding two tokens
    (so the read threads, staging buffers and files are used), after ``N_WARMUP`` warm-up cycles: no file
    descriptor and no thread more, RSS growth under ``RSS_BOUND_MIB``.

    Measured (2 cores, CPU build), after warm-up -> after the cycles:
    close x200: fds 10 -> 10, threading.active_count 2 -> 2, /proc/self/task 3 -> 3, VmRSS 98.6 -> 101.6 MiB; 30 s.
    with x200:  fds 10 -> 10, threads 2 -> 2, tasks 3 -> 3, VmRSS 100.06 -> 100.12 MiB; 31 s.
    (Without decoding, an earlier version measured +0.1 to +1.8 MiB over 200 close cycles.)
    RSS is read after the Llama object is gone: right after ``close()`` glibc may still hold the freed pool
    (+20 MiB) until a later free lets it trim; not a leak (``malloc_trim(0)`` returns it at once).
    CUDA pinned and device memory are not measured here (no GPU in CI).
    """
    model, pack = models["model"]

    def cycle():  # each cycle decodes two tokens: the read threads, staging and files are really used
        if form == "with":
            with Llama(str(model), pack=pack, n_ubatch=2, cache_slots=8, **KW) as llm:
                llm.eval([1, 2])
                assert llm.pack_stats()["cache_misses"] > 0
        else:
            llm = Llama(str(model), pack=pack, n_ubatch=2, cache_slots=8, **KW)
            llm.eval([1, 2])
            llm.close()
            llm.close()  # idempotent

    for _ in range(N_WARMUP):
        cycle()
    before, start = usage(), time.monotonic()
    for _ in range(CYCLES[form]):
        cycle()
    after = usage()
    print(f"{form}: {CYCLES[form]} cycles in {time.monotonic() - start:.1f} s: {before} -> {after}")
    assert (after["fds"], after["threads"], after["tasks"]) == (before["fds"], before["threads"], before["tasks"])
    assert after["rss_mib"] - before["rss_mib"] < RSS_BOUND_MIB, (before, after)


# --- 5. a read failure mid-generation ---------------------------------------------------------------

class FaultyPread:
    """Replaces ``odirect._preadv`` (what every DirectFile reads through by default): counts reads, and
    raises EIO at read number ``fail_at`` (None: never)."""

    def __init__(self, real):
        self.real, self.calls, self.fail_at, self.failed = real, 0, None, []
        self._lock = threading.Lock()

    def __call__(self, fd, view, offset):
        with self._lock:
            self.calls += 1
            fail = self.calls == self.fail_at
            if fail:
                self.failed.append(offset)
        if fail:
            raise OSError(errno.EIO, os.strerror(errno.EIO))
        return self.real(fd, view, offset)


# the fault sits in Python's pread (odirect._preadv), so pack reads go on Python threads here; the native read
# pool's failures are tested in test_native_reads and test_provider_streaming (a pack truncated under a decode)
SOURCES = {"pack": lambda models: dict(pack=models["model"][1], native_reads=False),
           "gguf_direct": lambda models: dict(gguf_direct=True)}


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
@pytest.mark.parametrize("source", list(SOURCES))
def test_eio_mid_generation_raises_then_recovers(models, monkeypatch, source, stream):
    """EIO from the read layer during a decode step (3/4 of the way through the request's reads):
    create_completion raises the provider's PackIOError naming the file, offset, layer and expert (and role
    in GGUF-direct mode) of the failed read; io_errors counts it; no token comes out of the failed step
    (streamed: only a prefix of the no-fault text came out); the next request gives the no-fault tokens."""
    model, pack = models["model"]
    fault = FaultyPread(odirect._preadv)
    monkeypatch.setattr(odirect, "_preadv", fault)
    kwargs = dict(SOURCES[source](models), n_ubatch=2, cache_slots=8, **KW)  # a small pool: misses every step
    with Llama(str(model), **kwargs) as llm:
        fault.calls = 0
        want = complete(llm)
        n_reads, acquires = fault.calls, llm.pack_stats()["acquires"]
        # 4 prompt tokens in 2 ubatches, then 7 decodes, 4 MoE layers each; the first prompt ubatch has no
        # output row, so llama.cpp prunes its last layer's FFN: 4 * 9 - 1 acquires
        assert acquires == PROMPT_ACQUIRES + 4 * (N_TOKENS - 1)

    with Llama(str(model), **kwargs) as llm:
        fault.calls, fault.fail_at = 0, n_reads * 3 // 4  # well into the decode of the generated tokens
        pieces = []
        with pytest.raises(PackIOError) as info:
            if stream:
                for chunk in llm.create_completion(PROMPT, max_tokens=N_TOKENS, temperature=0, stream=True):
                    pieces.append(chunk["choices"][0]["text"])
            else:
                pieces.append(complete(llm))
        assert want.startswith("".join(pieces)) and len("".join(pieces)) < len(want)
        assert bool(pieces) == stream  # streamed: the tokens of the steps before the fault came out
        message = str(info.value)
        if source == "pack":
            match = re.fullmatch(rf"read error on {re.escape(str(pack))} at offset (\d+) \(layer (\d+) expert "
                                 r"(\d+)\): Input/output error", message)
            assert match, message
            offset, layer, expert = map(int, match.groups())
            with PackReader(pack) as reader:
                assert reader.layout.block_offset(layer, expert) == offset
        else:
            match = re.fullmatch(rf"read error on {re.escape(str(model))} at offset (\d+) \(layer \d+ expert \d+ "
                                 r"role (gate|up|down)\): Input/output error", message)
            assert match, message
            offset = int(match.group(1))
        assert fault.failed == [offset]
        stats = llm.pack_stats()
        assert stats["io_errors"] == 1
        assert PROMPT_ACQUIRES < stats["acquires"] < acquires  # past the prompt, before the end: mid-generation
        fault.fail_at = None
        assert complete(llm) == want
        assert llm.pack_stats()["io_errors"] == 1
