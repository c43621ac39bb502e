"""The streaming provider on CPU: bit-exact logits, counters that match the trace, O_DIRECT, faults, sha256.

llama.cpp runs in subprocesses: tests/logits_worker.py (provider="streaming") for the bit-exact runs, and
this file itself as a worker (``python tests/test_provider_streaming.py SPEC.json``) where a run needs what
JSON cannot carry: a fault-injecting ``read_fn``, the acquire trace, the ``llamapack.Llama`` wrapper.
"""
if __name__ == "__main__":  # worker process: llama_cpp before numpy (see logits_worker)
    import llama_cpp  # noqa: F401  isort: skip

import ctypes
import errno
import json
import mmap
import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
from hookutil import flip_byte

from llamapack.cache_policy import DEFAULT_POLICY
from llamapack.errors import CapacityError
from llamapack.provider.settings import MIB, StreamingSettings, slot_budget

N_PROMPT, N_DECODE = 64, 32
N_THREADS = 1  # ggml's threads spin at barriers: two of them on a shared 2-core box run 10x slower at times
PRESETS = ("qwen3moe-tiny", "mixtral-tiny")


# ---------------------------------------------------------------- worker side (a subprocess that loads llama.cpp)
class FaultyRead:
    """A ``read_fn`` failing its ``at``-th call once armed: ``eio`` raises EIO, ``short`` reports 100 bytes
    fewer than it read, ``slow`` sleeps ``delay`` seconds before reading, ``einval`` (armed from the start)
    raises EINVAL as a filesystem without O_DIRECT does."""

    def __init__(self, kind: str | None = None, at: int = 1, delay: float = 0.0):
        self.kind, self.at, self.armed, self.delay = kind, at, kind == "einval", delay
        self.calls, self.failed_offsets = 0, []
        self._lock = threading.Lock()

    def __call__(self, fd: int, view: memoryview, offset: int) -> int:
        with self._lock:
            fail = False
            if self.armed and self.kind:
                self.calls += 1
                fail = self.calls == self.at
            if fail:
                self.failed_offsets.append(offset)
        if fail and self.kind == "slow":
            time.sleep(self.delay)
            return os.preadv(fd, [view], offset)
        if fail and self.kind in ("eio", "einval"):
            code = errno.EIO if self.kind == "eio" else errno.EINVAL
            raise OSError(code, os.strerror(code))
        n = os.preadv(fd, [view], offset)
        return n - 100 if fail else n


def provider_worker(spec: dict) -> dict:
    from logits_worker import greedy_logits, load, prompt_tokens, streaming_provider

    llm, _ = load(dict(spec, mode="lazy_no_provider"))
    fault = FaultyRead(**spec.get("fault", {}))
    try:
        provider = streaming_provider(llm, spec, spec.get("serve_from", spec["model"]),
                                      read_fn=None if spec.get("native_reads") else fault)
    except Exception as exc:  # noqa: BLE001 - reported to the test
        llm.close()
        return {"init_error": f"{type(exc).__name__}: {exc}"}
    trace, acquire = [], provider.acquire

    def traced(layer, ids):
        trace.append([layer, list(dict.fromkeys(ids.tolist())), len(ids) // provider.n_expert_used])
        return acquire(layer, ids)

    provider.acquire = traced
    fault.armed = True
    if "truncate_at" in spec:  # the file shrinks under the running provider: a real short read
        os.truncate(spec["serve_from"], spec["truncate_at"])
    prompt = prompt_tokens(llm, spec["n_prompt"])
    result: dict = {}
    if spec.get("eval_first"):  # a first request that may fail, then what it left behind
        try:
            llm.eval(prompt)
            result["decode_error"] = None
        except RuntimeError as exc:
            result.update(decode_error=str(exc), provider_error=f"{type(provider.error).__name__}: {provider.error}")
            provider.error = None
        result.update(failed_offsets=fault.failed_offsets, stats_after_failure=provider.stats(),
                      resident=[list(key) for key in provider.policy.resident()],
                      ram_resident=[list(key) for key in provider.tier.resident()] if provider.tier else [],
                      trace_after_failure=len(trace))
    if "truncate_at" in spec:
        with open(spec["serve_from"], "r+b") as f, open(spec["restore_from"], "rb") as original:
            f.seek(spec["truncate_at"])
            original.seek(spec["truncate_at"])
            f.write(original.read())
    if spec.get("n_decode") is not None:
        np.save(spec["out"], np.concatenate([greedy_logits(llm, prompt, spec["n_decode"])  # rounds: the same request again
                                             for _ in range(spec.get("rounds", 1))]))
    result.update(stats=provider.stats(), trace=trace, final_resident=sorted(provider.policy.resident().items()),
                  final_ram_resident=sorted(provider.tier.resident().items()) if provider.tier else [])
    provider.close()
    provider.close()  # idempotent
    llm.close()
    return result


def llama_worker(spec: dict) -> dict:
    """Through ``llamapack.Llama``: a budget too small for the ubatch fails at init (with ``too_few_slots``),
    then a real run."""
    from logits_worker import greedy_logits, prompt_tokens

    from llamapack import native
    from llamapack.errors import NativeError
    from llamapack.llama import Llama

    kwargs = dict(n_ctx=256, n_batch=512, n_ubatch=spec["n_ubatch"], logits_all=True, n_threads=N_THREADS,
                  n_threads_batch=N_THREADS, verbose=False, seed=0, gguf_direct=True)
    result: dict = {}
    try:
        if "too_few_slots" in spec:
            Llama(spec["model"], cache_slots=spec["too_few_slots"], **kwargs)
    except CapacityError as exc:
        result["capacity_error"] = str(exc)
    with Llama(spec["model"], **spec["llama"], **kwargs) as llm:
        prompt = prompt_tokens(llm, spec["n_prompt"])
        np.save(spec["out"], greedy_logits(llm, prompt, spec["n_decode"]))
        result["stats"] = llm.pack_stats()
        try:  # a negative ubatch bound for the slot lookup is refused with libllama's message
            native.set_slot_lookup(native.context_ptr(llm._ctx), -1)
        except NativeError as exc:
            result["slot_lookup_error"] = str(exc)
        stats_path = Path(spec["llama"].get("stats_path", ""))
        result["written_while_open"] = json.loads(stats_path.read_text()) if stats_path.is_file() else None
    return result


# ---------------------------------------------------------------- test side
def run_self(spec: dict, tmp_path: Path) -> dict:
    """Run this file as a worker on ``spec`` with the patched library; returns its JSON result."""
    from hookutil import REPO

    spec_path = tmp_path / f"self-spec-{len(list(tmp_path.glob('self-spec-*')))}.json"
    spec_path.write_text(json.dumps(spec))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p))
    env.pop("LLAMA_CPP_LIB_PATH", None)
    proc = subprocess.run([sys.executable, __file__, str(spec_path)], capture_output=True, text=True, env=env,
                          timeout=600)
    if proc.returncode != 0:
        raise AssertionError(f"worker failed ({proc.returncode}):\n{proc.stderr[-4000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """preset -> (gguf path, pack path), built once for the module."""
    from hookutil import models_with_packs

    return models_with_packs(tmp_path_factory.mktemp("streaming"), PRESETS)


@pytest.fixture(scope="module")
def vanilla(models, tmp_path_factory):
    """(preset, n_ubatch) -> vanilla logits, computed on first use."""
    from hookutil import cached_vanilla

    return cached_vanilla(tmp_path_factory.mktemp("vanilla"),
                          lambda preset, n_ubatch, out: spec_for(models[preset][0], n_ubatch, out, mode="vanilla"))


def spec_for(model, n_ubatch: int, out, **extra) -> dict:
    return {**dict(model=str(model), mode="hook", n_ubatch=n_ubatch, n_prompt=N_PROMPT, n_decode=N_DECODE,
                   out=str(out), n_threads=N_THREADS), **extra}


def source_spec(models, preset: str, source: str) -> dict:
    return dict(pack=True, serve_from=str(models[preset][1])) if source == "pack" else {}


@pytest.mark.parametrize("source", ["pack", "pack-native", "gguf"])
@pytest.mark.parametrize("n_ubatch", [1, 7])
@pytest.mark.parametrize("preset", PRESETS)
def test_streaming_logits_equal_vanilla(preset, n_ubatch, source, models, vanilla, tmp_path):
    from hookutil import logits, smallest_pool

    n_slots = smallest_pool(preset, n_ubatch)
    native = source == "pack-native"  # the native read pool (the default for plain pack reads is Python threads)
    spec = spec_for(models[preset][0], n_ubatch, tmp_path / "s.npy", provider="streaming", n_slots=n_slots,
                    streaming=dict(stage_slots=3, read_splits=2, **(dict(native_reads=True) if native else {})),
                    **source_spec(models, preset, "pack" if native else source))
    got, stats = logits(spec, tmp_path)
    want = vanilla(preset, n_ubatch)
    assert np.array_equal(got, want), f"max |diff| = {np.abs(got - want).max()}"
    assert stats["read_engine"] == ("native" if native else "python")
    assert stats["n_slots"] == n_slots and stats["io_errors"] == 0
    assert stats["cache_evictions"] >= stats["acquires"] // 2  # every step evicts: the cache really streams
    assert stats["tokens"] == N_PROMPT + N_DECODE and stats["h2d_bytes"] == 0 and stats["read_wait_s"] > 0


def expected_read_bytes(loaded, models, preset: str, source: str) -> int:
    from llamapack.pack import GgufDirectReader, PackReader

    if source == "pack":
        with PackReader(models[preset][1]) as reader:
            return len(loaded) * reader.layout.expert_stride
    with GgufDirectReader(models[preset][0]) as reader:  # the aligned ranges O_DIRECT transfers per role
        return sum(read.length for key in loaded for read in reader.plan(*key))


def replay(trace, n_slots: int, policy_class=DEFAULT_POLICY) -> tuple[int, list, int]:
    """(hits, the keys loaded in order, evictions) of ``policy_class`` (the provider's default) replaying ``trace``."""
    policy, hits, loaded, evictions = policy_class(n_slots), 0, [], 0
    for layer, experts, n_tokens in trace:
        plan = policy.acquire([(layer, e) for e in experts], n_tokens=n_tokens)
        hits, evictions = hits + plan.hits, evictions + len(plan.evictions)
        loaded += [load.key for load in plan.loads]
    return hits, loaded, evictions


@pytest.fixture(scope="module")
def traced_runs(models, tmp_path_factory):
    """source -> (worker result with the acquire trace, logits): qwen3moe-tiny, n_ubatch 7, 16 slots; the
    pack run reads on the native pool, the GGUF run on Python threads."""
    folder, runs = tmp_path_factory.mktemp("traced"), {}
    for source in ("pack", "gguf"):
        out = folder / f"{source}.npy"
        result = run_self(spec_for(models["qwen3moe-tiny"][0], 7, out, n_slots=16, provider="streaming",
                                   # the trace is of the Python acquires: keep every step there (the native
                                   # hot path's decisions: test_host_tier's test_the_native_hot_path_...)
                                   streaming=dict(stage_slots=4, read_splits=3, native_reads=source == "pack",
                                                  native_hot_path=False),
                                   native_reads=source == "pack",
                                   **source_spec(models, "qwen3moe-tiny", source)), folder)
        runs[source] = result, np.load(out)
    return runs


@pytest.mark.parametrize("source", ["pack", "gguf"])
def test_counters_match_the_trace(source, traced_runs, models, vanilla):
    result, got = traced_runs[source]
    stats, trace = result["stats"], result["trace"]
    assert stats["read_engine"] == ("native" if source == "pack" else "python")
    assert np.array_equal(got, vanilla("qwen3moe-tiny", 7))
    n_slots = stats["n_slots"]
    hits, loaded, evictions = replay(trace, n_slots)
    distinct = sum(len(experts) for _, experts, _ in trace)
    print(f"\n{source}: {len(trace)} acquires, {distinct} keys, hits {stats['cache_hits']}, misses "
          f"{stats['cache_misses']}, evictions {stats['cache_evictions']}, read {stats['pack_read_bytes']} B")
    assert stats["acquires"] == len(trace) == (N_PROMPT // 7 + 1 + N_DECODE) * 4
    assert stats["cache_hits"] + stats["cache_misses"] == distinct
    assert (stats["cache_hits"], stats["cache_misses"], stats["cache_evictions"]) == (hits, len(loaded), evictions)
    assert stats["cache_evictions"] == stats["cache_misses"] - n_slots  # no read failed: slots only fill up
    assert stats["pack_read_bytes"] == expected_read_bytes(loaded, models, "qwen3moe-tiny", source)


def test_a_named_cache_policy_is_the_one_the_pool_follows(models, vanilla, tmp_path):
    """``cache_policy="lfu-lru"`` (what the bench's +lfulru runs use): the counters are that policy's replay of
    the acquire trace, not the default's, and the logits stay vanilla's."""
    from llamapack.cache_policy import LfuLruPolicy

    out = tmp_path / "lfu.npy"
    result = run_self(spec_for(models["qwen3moe-tiny"][0], 7, out, n_slots=16, provider="streaming",
                               streaming=dict(stage_slots=4, cache_policy="lfu-lru"),
                               **source_spec(models, "qwen3moe-tiny", "pack")), tmp_path)
    stats, trace = result["stats"], result["trace"]
    assert np.array_equal(np.load(out), vanilla("qwen3moe-tiny", 7))
    hits, loaded, evictions = replay(trace, stats["n_slots"], LfuLruPolicy)
    assert (stats["cache_hits"], stats["cache_misses"], stats["cache_evictions"]) == (hits, len(loaded), evictions)
    assert replay(trace, stats["n_slots"])[0] != hits  # the default would have decided otherwise on this trace
    with pytest.raises(ValueError, match="unknown cache policy 'mru'.*next-use, lfu-lru, lru"):
        StreamingSettings(cache_policy="mru")


# ---------------------------------------------------------------- page cache
def resident_pages(path: Path) -> tuple[int, int]:
    """(pages of ``path`` in the page cache, pages of the file), by mincore on a shared mapping."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    size = path.stat().st_size
    pages = -(-size // mmap.PAGESIZE)
    fd = os.open(path, os.O_RDONLY)
    try:
        address = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
        if address in (None, ctypes.c_void_p(-1).value):
            raise OSError(ctypes.get_errno(), "mmap failed")
        try:
            vector = (ctypes.c_ubyte * pages)()
            if libc.mincore(address, size, vector) != 0:
                raise OSError(ctypes.get_errno(), "mincore failed")
        finally:
            libc.munmap(address, size)
    finally:
        os.close(fd)
    return sum(v & 1 for v in vector), pages


def drop_page_cache(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def test_direct_io_keeps_pack_reads_out_of_the_page_cache(models, traced_runs, tmp_path):
    from hookutil import run_worker

    gguf, pack = models["qwen3moe-tiny"]
    trace = traced_runs["pack"][0]["trace"]  # the same run: same routing, so the same blocks are read
    blocks_read = len(set(replay(trace, 16)[1]))
    cached = {}
    for direct_io in (True, False):
        drop_page_cache(pack)
        before, pages = resident_pages(pack)
        assert before <= 1, f"{before} pages of the pack still cached after POSIX_FADV_DONTNEED"
        spec = spec_for(gguf, 7, tmp_path / f"{direct_io}.npy", provider="streaming", n_slots=16,
                        streaming=dict(direct_io=direct_io), **source_spec(models, "qwen3moe-tiny", "pack"))
        result = run_worker(spec, tmp_path)
        cached[direct_io] = resident_pages(pack)[0]
    stride = result["pack_read_bytes"] // result["cache_misses"]
    pages_read = blocks_read * stride // mmap.PAGESIZE  # distinct pages the run read
    print(f"\npack {pages} pages, {pages_read} distinct pages read ({blocks_read} blocks, "
          f"{result['pack_read_bytes'] // mmap.PAGESIZE} pages with repeats); in the page cache after the run: "
          f"direct_io=True {cached[True]}, direct_io=False {cached[False]}")
    assert cached[True] <= pages_read // 100
    assert cached[False] >= pages_read  # buffered reads cache what they read (readahead may add more)


# ---------------------------------------------------------------- faults
@pytest.mark.parametrize("kind, source", [("eio", "pack"), ("short", "pack"), ("eio", "gguf")])
def test_read_fault_fails_the_decode_then_recovers(kind, source, models, vanilla, tmp_path):
    gguf, pack = models["qwen3moe-tiny"]
    spec = spec_for(gguf, 7, tmp_path / "f.npy", n_slots=16, provider="streaming",
                    streaming=dict(stage_slots=4, read_splits=2), fault=dict(kind=kind, at=40), eval_first=True,
                    **source_spec(models, "qwen3moe-tiny", source))
    result = run_self(spec, tmp_path)
    assert result["decode_error"] == "llama_decode returned -3"
    error = result["provider_error"]
    assert error.startswith("PackIOError") and ("read error" if kind == "eio" else "short read") in error
    (offset,) = result["failed_offsets"]
    assert str(gguf if source == "gguf" else pack) in error and f"offset {offset}" in error
    layer, expert = map(int, re.search(r"layer (\d+) expert (\d+)", error).groups())
    if source == "pack":
        from llamapack.pack import PackReader

        with PackReader(pack) as reader:
            block = (offset - reader.layout.data_start) // reader.layout.expert_stride
            assert reader.layout.block_at(block) == (layer, expert)
    assert [layer, expert] not in result["resident"]  # no slot claims the expert that failed
    assert result["stats_after_failure"]["io_errors"] == 1 and result["stats"]["io_errors"] == 1
    # the same request afterwards is served again, bit-exact
    assert np.array_equal(np.load(tmp_path / "f.npy"), vanilla("qwen3moe-tiny", 7))


@pytest.mark.parametrize("splits", [1, 2])  # 2: a split read's finished piece must not keep the wait from timing out
def test_read_past_the_timeout_fails_the_decode_then_recovers(splits, models, vanilla, tmp_path):
    gguf, pack = models["qwen3moe-tiny"]
    spec = spec_for(gguf, 7, tmp_path / "t.npy", n_slots=16, provider="streaming",
                    streaming=dict(stage_slots=4, read_timeout_s=0.3, read_splits=splits),
                    fault=dict(kind="slow", at=40, delay=2.0),
                    eval_first=True, **source_spec(models, "qwen3moe-tiny", "pack"))
    result = run_self(spec, tmp_path)
    assert result["decode_error"] == "llama_decode returned -3"
    error = result["provider_error"]
    assert error.startswith("PackIOError") and "did not finish within 0.3 s" in error and str(pack) in error
    layer, expert = map(int, re.search(r"layer (\d+) expert (\d+)", error).groups())
    assert [layer, expert] not in result["resident"]
    assert result["stats_after_failure"]["io_errors"] >= 1
    assert np.array_equal(np.load(tmp_path / "t.npy"), vanilla("qwen3moe-tiny", 7))


def test_native_short_read_fails_the_decode_then_recovers(models, traced_runs, vanilla, tmp_path):
    """The native read pool (no injected read_fn): the pack is truncated under the running provider, inside
    the first block the prompt loads; that read comes back short and fails the decode, naming the block."""
    from llamapack.pack import PackReader, build_pack

    gguf, pack = models["qwen3moe-tiny"]
    serving = Path(build_pack(gguf, tmp_path / "serving.expert-pack", progress=False, safety_margin_mib=0).pack_path)
    layer, experts, _ = traced_runs["pack"][0]["trace"][0]
    with PackReader(pack) as reader:
        offset = reader.layout.block_offset(layer, experts[0])
    spec = spec_for(gguf, 7, tmp_path / "n.npy", n_slots=16, provider="streaming", eval_first=True,
                    native_reads=True, truncate_at=offset + 4096, restore_from=str(pack), pack=True,
                    serve_from=str(serving), streaming=dict(stage_slots=4, read_splits=1, native_reads=True))
    result = run_self(spec, tmp_path)
    assert "init_error" not in result, result["init_error"]
    assert result["stats"]["read_engine"] == "native"
    assert result["decode_error"] == "llama_decode returned -3"
    error = result["provider_error"]
    assert error.startswith(f"PackIOError: short read from {serving} at offset {offset} "
                            f"(layer {layer} expert {experts[0]}): got 4096 of"), error
    assert [layer, experts[0]] not in result["resident"] and result["stats_after_failure"]["io_errors"] >= 1
    # the file restored, the same request is served again, bit-exact
    assert np.array_equal(np.load(tmp_path / "n.npy"), vanilla("qwen3moe-tiny", 7))


def test_filesystem_without_o_direct_is_refused_at_init(models, tmp_path):
    gguf, _ = models["qwen3moe-tiny"]
    result = run_self(spec_for(gguf, 7, tmp_path / "x.npy", n_slots=16, provider="streaming",
                               fault=dict(kind="einval")), tmp_path)
    assert result["init_error"].startswith("PackIOError") and "refuses O_DIRECT" in result["init_error"]
    assert str(gguf) in result["init_error"] and "direct_io=False" in result["init_error"]


def test_sha256_mismatch_names_layer_and_expert(models, traced_runs, tmp_path):
    from llamapack.pack import PackReader, build_pack

    gguf, _ = models["qwen3moe-tiny"]
    pack = Path(build_pack(gguf, tmp_path / "bad.expert-pack", progress=False, safety_margin_mib=0).pack_path)
    layer, experts, _ = traced_runs["pack"][0]["trace"][0]  # the first expert the prompt loads
    with PackReader(pack) as reader:
        offset = reader.layout.block_offset(layer, experts[0]) + 123
    flip_byte(pack, offset)
    spec = spec_for(gguf, 7, tmp_path / "x.npy", n_slots=16, provider="streaming", n_decode=None, eval_first=True,
                    streaming=dict(verify_pack_sha256=True), pack=True, serve_from=str(pack))
    result = run_self(spec, tmp_path)
    assert result["decode_error"] == "llama_decode returned -3"
    assert result["provider_error"].startswith("IntegrityError")
    assert f"layer {layer} expert {experts[0]}" in result["provider_error"]
    assert [layer, experts[0]] not in result["resident"] and result["stats"]["io_errors"] == 1


# ---------------------------------------------------------------- the Llama wrapper
def test_llama_wrapper_serves_through_the_streaming_provider(models, vanilla, tmp_path):
    gguf, _ = models["qwen3moe-tiny"]
    stats_path = tmp_path / "stats.json"
    spec = dict(mode="llama", model=str(gguf), n_ubatch=1, n_prompt=N_PROMPT, n_decode=N_DECODE,
                out=str(tmp_path / "l.npy"), too_few_slots=3,
                llama=dict(cache_mib=30, stats_path=str(stats_path), stats_flush_interval=50, stage_slots=2))
    result = run_self(spec, tmp_path)
    assert "holds 3 experts" in result["capacity_error"] and "may use 4 experts" in result["capacity_error"]
    assert np.array_equal(np.load(tmp_path / "l.npy"), vanilla("qwen3moe-tiny", 1))
    stats = result["stats"]
    assert stats["n_slots"] == 30 * MIB // stats["slot_bytes"] and stats["gguf_direct"] is True
    assert stats["lookup_steps"] == 0  # a host pool: every step through the remap op (the lookup is for GPU pools)
    assert result["slot_lookup_error"] == "slot lookup: max_tokens -1 is negative"
    assert stats["cache_misses"] > stats["n_slots"] and stats["acquires"] == (N_PROMPT + N_DECODE) * 4
    written = json.loads(stats_path.read_text())  # closed: the last write has the final counters
    assert written["acquires"] == stats["acquires"] and written["cache_misses"] == stats["cache_misses"]


def test_native_steps_count_towards_the_stats_files_interval(models, vanilla, tmp_path):
    """A pool of every expert: after the prompt nearly every step is served by libllama (no Python acquire),
    yet the stats file keeps being rewritten every stats_flush_interval acquires while the model is open."""
    from llamapack.synth import PRESETS as SPECS

    gguf, _ = models["qwen3moe-tiny"]
    stats_path = tmp_path / "stats.json"
    every_expert = SPECS["qwen3moe-tiny"].n_expert * SPECS["qwen3moe-tiny"].n_layer
    spec = dict(mode="llama", model=str(gguf), n_ubatch=1, n_prompt=N_PROMPT, n_decode=N_DECODE,
                out=str(tmp_path / "n.npy"),
                llama=dict(cache_slots=every_expert, stats_path=str(stats_path), stats_flush_interval=50))
    result = run_self(spec, tmp_path)
    assert np.array_equal(np.load(tmp_path / "n.npy"), vanilla("qwen3moe-tiny", 1))
    stats, while_open = result["stats"], result["written_while_open"]
    assert stats["native_steps"] > stats["acquires"] // 2
    assert while_open is not None and while_open["native_steps"] > 0
    assert stats["acquires"] - 50 < while_open["acquires"] <= stats["acquires"]  # at most one interval behind


@pytest.mark.parametrize("pool_preload", [True, False])
def test_a_pool_of_every_expert_is_filled_at_start(pool_preload, models, vanilla, tmp_path):
    """pool_preload (the default): a pool with a slot for every expert loads them all before the first token, so
    no step misses and every step is native, and from the first ubatch on the graphs are whole-pool (static
    maps, the steps served after each ubatch); off, the pool fills as tokens ask. Logits equal vanilla's."""
    from llamapack.synth import PRESETS as SPECS

    gguf, _ = models["qwen3moe-tiny"]
    every_expert = SPECS["qwen3moe-tiny"].n_expert * SPECS["qwen3moe-tiny"].n_layer
    spec = dict(mode="llama", model=str(gguf), n_ubatch=1, n_prompt=N_PROMPT, n_decode=N_DECODE,
                out=str(tmp_path / "f.npy"), llama=dict(cache_slots=every_expert, pool_preload=pool_preload,
                                                         whole_pool_graphs=True))
    stats = run_self(spec, tmp_path)["stats"]
    assert np.array_equal(np.load(tmp_path / "f.npy"), vanilla("qwen3moe-tiny", 1))
    if pool_preload:
        assert stats["pool_preloaded"] == every_expert and stats["cache_misses"] == 0
        assert stats["native_steps"] == stats["acquires"] == (N_PROMPT + N_DECODE) * 4
        assert stats["whole_pool_steps"] == stats["acquires"]  # the first ubatch's 4 layers too
        assert stats["cache_hits"] == stats["acquires"] * 4  # top-4 of one token: 4 distinct experts a step
        # filled layer by layer: each layer's matmuls see a view of its own experts' slots alone
        assert stats["whole_pool_span"] == SPECS["qwen3moe-tiny"].n_expert
    else:
        assert stats["pool_preloaded"] == 0 and 0 < stats["cache_misses"] <= every_expert
        assert stats["native_steps"] < stats["acquires"]
        assert 0 < stats["whole_pool_steps"] < stats["acquires"] - 4  # only once every expert was asked for
        # filled as tokens asked: layers interleave in the pool, so a layer's view spans others' slots too
        assert SPECS["qwen3moe-tiny"].n_expert < stats["whole_pool_span"] <= every_expert


@pytest.mark.parametrize("n_ubatch", [1, 7])
def test_whole_pool_graphs_serve_the_same_steps_as_the_remap_op(n_ubatch, models, vanilla, tmp_path):
    """The same run with whole-pool graphs and without (every step through the remap op): the same logits
    (vanilla's), and the same counters and final residents (the policy saw the same steps in the same order)."""
    from llamapack.synth import PRESETS as SPECS

    gguf, _ = models["qwen3moe-tiny"]
    every_expert = SPECS["qwen3moe-tiny"].n_expert * SPECS["qwen3moe-tiny"].n_layer
    runs = {}
    for whole in (True, False):
        spec = dict(mode="llama", model=str(gguf), n_ubatch=n_ubatch, n_prompt=N_PROMPT, n_decode=N_DECODE,
                    out=str(tmp_path / f"w{whole}.npy"), llama=dict(cache_slots=every_expert, whole_pool_graphs=whole))
        runs[whole] = run_self(spec, tmp_path)["stats"]
        assert np.array_equal(np.load(tmp_path / f"w{whole}.npy"), vanilla("qwen3moe-tiny", n_ubatch))
    assert runs[True]["whole_pool_steps"] > 0 and runs[False]["whole_pool_steps"] == 0
    same = ("acquires", "native_steps", "tokens", "cache_hits", "cache_misses", "cache_evictions")
    assert {k: runs[True][k] for k in same} == {k: runs[False][k] for k in same}


def test_a_pool_short_of_one_expert_is_not_filled_at_start(models, tmp_path):
    from llamapack.synth import PRESETS as SPECS

    gguf, _ = models["qwen3moe-tiny"]
    every_expert = SPECS["qwen3moe-tiny"].n_expert * SPECS["qwen3moe-tiny"].n_layer
    spec = dict(mode="llama", model=str(gguf), n_ubatch=1, n_prompt=4, n_decode=2, out=str(tmp_path / "s.npy"),
                llama=dict(cache_slots=every_expert - 1))
    stats = run_self(spec, tmp_path)["stats"]
    assert stats["pool_preloaded"] == 0 and stats["cache_misses"] > 0


# ---------------------------------------------------------------- pure parts (no llama.cpp)
def test_slot_budget():
    one = 3 * MIB
    host = dict(slot_bytes=one, n_expert=16, n_moe_layers=4, n_expert_used=4, n_ubatch=1)
    assert slot_budget(StreamingSettings(), **host) == 16  # host default: one layer's experts
    assert slot_budget(StreamingSettings(cache_vram_mib=100), **host) == 33
    assert slot_budget(StreamingSettings(cache_vram_mib=10_000), **host) == 64  # never more than all experts
    assert slot_budget(StreamingSettings(n_slots=5), **host) == 5
    gpu = dict(host, n_moe_layers=60, free_vram=2048 * MIB)
    assert slot_budget(StreamingSettings(cache_vram_reserve_mib=1024), **gpu) == 1024 // 3
    assert slot_budget(StreamingSettings(cache_vram_mib=30, cache_vram_reserve_mib=1024), **gpu) == 10
    with pytest.raises(CapacityError, match=r"holds 0 experts .*2000 MiB VRAM free - 1024 MiB reserve.*may use 16"):
        slot_budget(StreamingSettings(cache_vram_mib=2), **dict(host, n_ubatch=7, free_vram=2000 * MIB))
    with pytest.raises(CapacityError, match="holds 3 experts"):
        slot_budget(StreamingSettings(n_slots=3), **host)
    # a reserve larger than the free VRAM leaves no slot: refused with the numbers, never a negative budget
    with pytest.raises(CapacityError, match=r"holds 0 experts .*2048 MiB VRAM free - 4096 MiB reserve"):
        slot_budget(StreamingSettings(cache_vram_reserve_mib=4096), **gpu)
    with pytest.raises(ValueError, match="stage_slots"):
        StreamingSettings(stage_slots=0)
    # a slot count beyond the model's experts is capped; a pool larger than the memory free is refused up front
    assert slot_budget(StreamingSettings(n_slots=100_000_000), **host, free_ram=1 << 40) == 64
    with pytest.raises(CapacityError, match=r"cache of 64 experts .*needs 192 MiB but 100 MiB of RAM is free"):
        slot_budget(StreamingSettings(n_slots=100_000_000), **host, free_ram=100 * MIB)
    with pytest.raises(CapacityError, match=r"needs 30 MiB but 20 MiB of VRAM is free"):
        slot_budget(StreamingSettings(n_slots=10), **dict(gpu, free_vram=20 * MIB))
    for bad in (float("inf"), float("nan"), -1.0):
        with pytest.raises(ValueError, match="cache_vram_mib must be a finite number > 0"):
            StreamingSettings(cache_vram_mib=bad)


@pytest.mark.parametrize("splits", [1, 3, 64])
def test_pack_source_pieces_rebuild_the_block(splits, moe_pack):
    from llamapack.pack import PackReader, aligned_buffer
    from llamapack.provider.reads import ReadPool, open_source

    reader = PackReader(moe_pack.pack_path)
    source = open_source(reader, direct_io=True, read_fn=None, read_splits=splits, verify_sha256=True)
    stride = reader.layout.expert_stride
    assert len(source.pieces) == min(splits, stride // 4096)
    assert all(start % 4096 == 0 for start, _ in source.pieces) and source.pieces[-1][1] == stride
    pool = ReadPool(source.open_handle, 4)
    try:
        want, got = aligned_buffer(stride), aligned_buffer(stride)
        for layer in reader.layout.moe_layers:
            for expert in range(reader.layout.num_experts):
                for piece in [pool.submit(source.read, layer, expert, got, *p) for p in source.pieces]:
                    piece.result()
                source.check(layer, expert, got)
                assert np.array_equal(got, reader.read_expert(layer, expert, want))
    finally:
        pool.close()
        pool.close()
        source.close()


class FakeStream:
    """A CUDA stream as far as CudaCopier uses one: copies are queued and happen only when synchronized."""

    def __init__(self, null=False, non_blocking=False):
        self.ptr, self.pending, self.done = id(self), [], 0

    def run_until(self, count: int) -> None:
        while self.done < count:
            dst, src, size = self.pending[self.done]
            ctypes.memmove(dst, src, size)
            self.done += 1

    def synchronize(self) -> None:
        self.run_until(len(self.pending))


class FakeEvent:
    def __init__(self, block=False, disable_timing=False, interprocess=False):
        self.stream, self.mark = None, 0

    def record(self, stream=None) -> None:
        self.stream, self.mark = stream, len(stream.pending)

    def synchronize(self) -> None:
        if self.stream is not None:
            self.stream.run_until(self.mark)


def fake_cupy(streams: list, pin_fails: bool = False):
    """What CudaCopier and free_vram call of CuPy, with the real signatures, in host memory."""
    import contextlib
    from types import SimpleNamespace

    def memcpy_async(dst, src, size, kind, stream_ptr):
        assert kind == 1 and size > 0
        (stream,) = [s for s in streams if s.ptr == stream_ptr]
        stream.pending.append((dst, src, size))

    def make_stream(**kwargs):
        streams.append(FakeStream(**kwargs))
        return streams[-1]

    def alloc_pinned(nbytes):
        if pin_fails:
            raise MemoryError("pinned memory exhausted")
        return bytearray(nbytes)

    runtime = SimpleNamespace(memcpyAsync=memcpy_async, memcpyHostToDevice=1, CUDARuntimeError=RuntimeError,
                              memGetInfo=lambda: (5 << 30, 8 << 30))
    cuda = SimpleNamespace(Device=lambda device: contextlib.nullcontext(), Stream=make_stream, Event=FakeEvent,
                           alloc_pinned_memory=alloc_pinned, runtime=runtime,
                           memory=SimpleNamespace(OutOfMemoryError=RuntimeError))
    pinned_pool = SimpleNamespace(free_all_blocks=lambda: None)
    return SimpleNamespace(cuda=cuda, get_default_pinned_memory_pool=lambda: pinned_pool)


@pytest.mark.parametrize("pin_fails", [False, True])
def test_cuda_copier_logic_with_a_fake_cupy(pin_fails, monkeypatch):
    """Not CUDA: checks CudaCopier's own logic (aligned staging, offsets, event per buffer, sync before use)."""
    from llamapack.provider.copies import CudaCopier
    from llamapack.provider.streaming import free_vram

    streams: list = []
    monkeypatch.setitem(sys.modules, "cupy", fake_cupy(streams, pin_fails))
    assert free_vram(0) == 5 << 30
    device_memory = np.zeros(1 << 16, dtype=np.uint8)
    copier = CudaCopier(0, device_memory.ctypes.data, n_buffers=2, buffer_bytes=8192)
    assert copier.pageable == pin_fails and copier.h2d
    assert all(b.ctypes.data % 4096 == 0 and b.nbytes == 8192 and b.flags.writeable for b in copier.buffers)
    copier.buffers[0][:] = 7
    copier.copy(0, [(100, 0, 300), (5000, 4096, 10)])
    assert not device_memory.any()  # queued on the stream, not done yet
    copier.wait_until_free(0)  # a read waiting to refill buffer 0 waits for its copies
    assert (device_memory[100:400] == 7).all() and (device_memory[5000:5010] == 7).all()
    copier.buffers[1][:] = 9
    copier.copy(1, [(20000, 0, 8192)])
    copier.wait_until_free(0)  # buffer 0's copies are older: buffer 1's may still be pending
    copier.synchronize()
    assert (device_memory[20000:28192] == 9).all() and device_memory.sum() == 7 * 310 + 9 * 8192
    abandoned = copier.buffers[1]
    copier.replace_buffer(1)  # after a read timeout: the late read keeps writing into the old buffer
    assert copier.buffers[1] is not abandoned and copier.buffers[1].nbytes == 8192
    assert copier.buffers[1].ctypes.data % 4096 == 0
    copier.close()
    assert copier.buffers == []


if __name__ == "__main__":
    worker_spec = json.loads(Path(sys.argv[1]).read_text())
    worker = llama_worker if worker_spec["mode"] == "llama" else provider_worker
    print(json.dumps(worker(worker_spec)))


def test_read_fault_with_prefetch_fails_closed(models, vanilla, tmp_path):
    """The failing read may be a lookahead read (needed by the next layer, or a wrong guess) or a demand read:
    either it fails the decode naming its layer and expert, or it was a guess nobody used; it is counted
    either way, nothing computes on it, and the next request is bit-exact."""
    gguf, pack = models["qwen3moe-tiny"]
    spec = spec_for(gguf, 7, tmp_path / "f.npy", n_slots=16, provider="streaming",
                    streaming=dict(stage_slots=4, read_splits=2, prefetch=True, prefetch_slots=4),
                    fault=dict(kind="eio", at=40), eval_first=True, **source_spec(models, "qwen3moe-tiny", "pack"))
    result = run_self(spec, tmp_path)
    assert len(result["failed_offsets"]) == 1 and result["stats"]["io_errors"] == 1
    if result["decode_error"] is not None:
        assert result["decode_error"] == "llama_decode returned -3"
        error = result["provider_error"]
        assert error.startswith("PackIOError") and "read error" in error and str(pack) in error
        layer, expert = map(int, re.search(r"layer (\d+) expert (\d+)", error).groups())
        assert [layer, expert] not in result["resident"]
    else:  # a wrong guess: dropped, its failure counted
        assert result["stats"]["prefetch_wasted"] >= 1
    assert np.array_equal(np.load(tmp_path / "f.npy"), vanilla("qwen3moe-tiny", 7))


def test_thread_reads_check_each_block_once_on_a_read_thread(moe_pack, monkeypatch):
    """The first read of a block in the process is hashed by the read thread that reads its last piece; later
    reads of it are not hashed again; a block that fails fails its read's future, naming layer and expert."""
    import threading

    from llamapack.errors import IntegrityError
    from llamapack.pack import PackReader, aligned_buffer
    from llamapack.provider.reads import ThreadReads, open_source

    reader = PackReader(moe_pack.pack_path)
    hashed = []
    check_block = reader.check_block
    monkeypatch.setattr(reader, "check_block",
                        lambda *a: (hashed.append((a[:2], threading.current_thread().name)), check_block(*a)))
    source = open_source(reader, direct_io=True, read_fn=None, read_splits=3, verify_sha256=True)
    reads = ThreadReads(source, n_threads=4, max_prefetch=1)
    keys = [(entry.layer, expert) for entry in reader.layout.layers for expert in range(reader.layout.num_experts)]
    try:
        block = aligned_buffer(reader.layout.expert_stride)
        for _ in range(2):
            for i, key in enumerate(keys):
                pieces = reads.start(key, block, source.pieces if i % 2 else source.prefetch_pieces, i % 2 == 0)
                for piece in pieces:
                    piece.result()
                source.check(*key, block)  # what the provider does after a read: already checked, not hashed
        assert sorted(key for key, _ in hashed) == sorted(keys)  # each block once
        assert all(name.startswith("llamapack-read-") for _, name in hashed)
    finally:
        reads.close()
        reader.close()

    layer, expert = keys[5]
    flip_byte(moe_pack.pack_path, reader.layout.block_offset(layer, expert) + 4096 + 7)
    reader = PackReader(moe_pack.pack_path)
    source = open_source(reader, direct_io=True, read_fn=None, read_splits=3, verify_sha256=True)
    reads = ThreadReads(source, n_threads=2, max_prefetch=0)
    try:
        pieces = reads.start((layer, expert), aligned_buffer(reader.layout.expert_stride), source.pieces)
        with pytest.raises(IntegrityError, match=f"layer {layer} expert {expert} .*fails its sha256 check"):
            for piece in pieces:
                piece.result()
        assert source.needs_check(layer, expert)  # a failed block is checked again on its next read
    finally:
        reads.close()
        reader.close()
