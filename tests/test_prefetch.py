"""Router-lookahead prefetch: bit-exact logits with it on, its counters, the read pool's priorities, the book.

The end-to-end runs go through tests/logits_worker.py (provider="streaming", ``prefetch=True``) against an
unpatched libllama, with pools small enough that every step evicts.
"""
import threading
import time
from concurrent.futures import Future

import numpy as np
import pytest

from llamapack.provider.prefetch import PrefetchBook
from llamapack.provider.reads import ReadPool

N_PROMPT, N_DECODE, N_THREADS = 48, 24, 1
PRESETS = ("qwen3moe-tiny", "deepseek2-tiny", "gpt-oss-tiny", "mixtral-tiny")  # dense first layer; router bias


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    from hookutil import models_with_packs

    return models_with_packs(tmp_path_factory.mktemp("prefetch"), PRESETS)


@pytest.fixture(scope="module")
def vanilla(models, tmp_path_factory):
    from hookutil import cached_vanilla

    return cached_vanilla(tmp_path_factory.mktemp("prefetch-vanilla"),
                          lambda preset, n_ubatch, out: spec_for(models[preset][0], n_ubatch, out, mode="vanilla"))


def spec_for(model, n_ubatch: int, out, **extra) -> dict:
    return {**dict(model=str(model), mode="hook", n_ubatch=n_ubatch, n_prompt=N_PROMPT, n_decode=N_DECODE,
                   out=str(out), n_threads=N_THREADS), **extra}


def stride_of(pack_path) -> int:
    from llamapack.pack import PackReader

    with PackReader(pack_path) as reader:
        return reader.layout.expert_stride


@pytest.mark.parametrize("source", ["pack", "gguf"])
@pytest.mark.parametrize("n_ubatch", [1, 7])
@pytest.mark.parametrize("preset", PRESETS)
def test_prefetch_keeps_logits_bit_exact(preset, n_ubatch, source, models, vanilla, tmp_path):
    from hookutil import logits, smallest_pool

    gguf, pack = models[preset]
    serve = dict(pack=True, serve_from=str(pack)) if source == "pack" else {}
    spec = spec_for(gguf, n_ubatch, tmp_path / "p.npy", provider="streaming", n_slots=smallest_pool(preset, n_ubatch),
                    streaming=dict(stage_slots=3, read_splits=2, prefetch=True, prefetch_slots=4), **serve)
    got, stats = logits(spec, tmp_path)
    want = vanilla(preset, n_ubatch)
    assert np.array_equal(got, want), f"max |diff| = {np.abs(got - want).max()}"
    assert stats["io_errors"] == 0 and stats["prefetch_slots"] == 4
    # the lookahead ran and was used: predictions were made and some misses were read ahead of their layer
    assert stats["lookahead_keys"] > 0 and 0 < stats["lookahead_hits"] <= stats["lookahead_keys"]
    assert 0 < stats["prefetch_used"] <= stats["cache_misses"]
    assert stats["prefetch_used"] + stats["prefetch_wasted"] + stats["prefetch_cancelled"] <= stats["prefetch_reads"]
    if source == "pack":  # every miss read once (on demand or ahead), plus the wasted lookahead reads
        assert stats["pack_read_bytes"] == stats["cache_misses"] * stride_of(pack) + stats["prefetch_wasted_bytes"]
    print(f"\n{preset} ub{n_ubatch} {source}: lookahead accuracy {stats['lookahead_accuracy']:.2f}, "
          f"{stats['prefetch_used']}/{stats['cache_misses']} misses read ahead, {stats['prefetch_wasted']} wasted")


@pytest.mark.parametrize("native_reads", [True, False, None])  # None: the default, native with prefetch
@pytest.mark.parametrize("preset,n_ubatch", [("qwen3moe-tiny", 7), ("deepseek2-tiny", 1)])
def test_pack_reads_on_either_engine_with_one_lookahead_piece_in_flight(preset, n_ubatch, native_reads, models,
                                                                         vanilla, tmp_path):
    """With prefetch, pack mode reads on the native pool by default; native_reads=False puts the same reads on
    Python threads."""
    from hookutil import logits, smallest_pool

    gguf, pack = models[preset]
    spec = spec_for(gguf, n_ubatch, tmp_path / "p.npy", provider="streaming", n_slots=smallest_pool(preset, n_ubatch),
                    pack=True, serve_from=str(pack),
                    streaming=dict(stage_slots=3, read_splits=2, prefetch=True, prefetch_slots=4, prefetch_in_flight=1,
                                   native_reads=native_reads))
    got, stats = logits(spec, tmp_path)
    assert np.array_equal(got, vanilla(preset, n_ubatch)), f"max |diff| = {np.abs(got - vanilla(preset, n_ubatch)).max()}"
    assert stats["read_engine"] == ("python" if native_reads is False else "native") and stats["prefetch_in_flight"] == 1
    assert stats["io_errors"] == 0 and 0 < stats["prefetch_used"] <= stats["cache_misses"]
    assert stats["pack_read_bytes"] == stats["cache_misses"] * stride_of(pack) + stats["prefetch_wasted_bytes"]


def test_prefetch_top_limits_the_guesses_read(models, vanilla, tmp_path):
    from hookutil import logits

    spec = spec_for(models["qwen3moe-tiny"][0], 1, tmp_path / "p.npy", provider="streaming", n_slots=4,
                    streaming=dict(stage_slots=2, prefetch=True, prefetch_top=1))
    got, stats = logits(spec, tmp_path)
    assert np.array_equal(got, vanilla("qwen3moe-tiny", 1))
    assert 0 < stats["prefetch_reads"] <= stats["acquires"]  # one guess per token and layer, one token per ubatch
    assert stats["prefetch_used"] > 0


@pytest.mark.parametrize("depth", [2, 8])
@pytest.mark.parametrize("preset,n_ubatch", [("qwen3moe-tiny", 1), ("qwen3moe-tiny", 7), ("deepseek2-tiny", 1)])
def test_deeper_lookahead_keeps_logits_bit_exact_and_guesses_each_layer_ahead(preset, n_ubatch, depth, models,
                                                                              vanilla, tmp_path):
    from hookutil import logits, smallest_pool
    from llamapack.synth import PRESETS

    gguf, pack = models[preset]
    spec = spec_for(gguf, n_ubatch, tmp_path / "p.npy", provider="streaming", n_slots=smallest_pool(preset, n_ubatch),
                    pack=True, serve_from=str(pack),
                    streaming=dict(stage_slots=2, prefetch=True, prefetch_slots=8, prefetch_depth=depth))
    got, stats = logits(spec, tmp_path)
    assert np.array_equal(got, vanilla(preset, n_ubatch)), f"max |diff| = {np.abs(got - vanilla(preset, n_ubatch)).max()}"
    # served layers: all but deepseek2-tiny's dense first one. Layer i of n guesses the next min(depth, n-1-i).
    n_served = PRESETS[preset].n_layer - (1 if preset.startswith("deepseek2") else 0)
    ubatches, rest = divmod(stats["acquires"], n_served)
    assert rest == 0 and stats["provider_calls"] == stats["acquires"]
    assert stats["prefetch_calls"] == ubatches * sum(min(depth, n_served - 1 - i) for i in range(n_served))
    assert stats["provider_call_s"] >= stats["provide_s"]  # libllama's timing holds the callback's own
    assert stats["prefetch_depth"] == depth and 0 < stats["prefetch_used"] <= stats["cache_misses"]


def test_prefetch_off_adds_no_lookahead(models, vanilla, tmp_path):
    from hookutil import logits

    spec = spec_for(models["qwen3moe-tiny"][0], 1, tmp_path / "p.npy", provider="streaming", n_slots=8,
                    streaming=dict(stage_slots=2))
    got, stats = logits(spec, tmp_path)
    assert np.array_equal(got, vanilla("qwen3moe-tiny", 1))
    assert stats["prefetch_reads"] == stats["lookahead_keys"] == 0 and stats["prefetch_slots"] == 0
    assert stats["prefetch_calls"] == 0 and stats["provider_calls"] == stats["acquires"]


# ---------------------------------------------------------------- read pool priorities
class Gate:
    """A read that blocks until released, recording when it ran."""

    def __init__(self, log: list, name: str):
        self.log, self.name, self.release, self.started = log, name, threading.Event(), threading.Event()

    def __call__(self, handle) -> None:
        self.started.set()
        self.log.append(self.name)
        assert self.release.wait(10)


class Handle:
    def close(self):
        pass


def test_demand_reads_start_before_queued_prefetch_reads():
    log: list = []
    pool = ReadPool(Handle, n_threads=2, max_prefetch=1)
    gates = []
    try:
        prefetch_running = Gate(log, "prefetch-1")
        gates.append(prefetch_running)
        pool.submit_prefetch(prefetch_running)
        assert prefetch_running.started.wait(5)  # an idle disk: the prefetch read starts, on its one thread
        queued = [Gate(log, f"prefetch-{i}") for i in (2, 3)]
        gates += queued
        queued_futures = [pool.submit_prefetch(g) for g in queued]
        demand = Gate(log, "demand")
        gates.append(demand)
        demand_future = pool.submit(demand)
        assert demand.started.wait(5)  # a demand read never waits for a thread behind prefetch reads
        prefetch_running.release.set()
        time.sleep(0.2)
        assert not any(g.started.is_set() for g in queued)  # a demand read runs: no prefetch read starts
        assert pool.promote(queued_futures[1]) and not pool.promote(demand_future)
        assert queued[1].started.wait(5)  # promoted: a demand read now, on the free thread
        demand.release.set()
        queued[1].release.set()
        assert queued[0].started.wait(5)  # no demand read left: prefetch-2 starts
        queued[0].release.set()
        for f in queued_futures + [demand_future]:
            f.result(timeout=5)
        assert log == ["prefetch-1", "demand", "prefetch-3", "prefetch-2"]
    finally:
        for g in gates:
            g.release.set()
        pool.close()


def test_prefetch_reads_wait_while_a_demand_read_runs_and_queued_ones_can_be_cancelled():
    log: list = []
    pool = ReadPool(Handle, n_threads=3, max_prefetch=2)
    demand, prefetch = Gate(log, "demand"), Gate(log, "prefetch")
    try:
        pool.submit(demand)
        assert demand.started.wait(5)
        future = pool.submit_prefetch(prefetch)
        unwanted = pool.submit_prefetch(Gate(log, "unwanted"))
        time.sleep(0.2)
        assert not prefetch.started.is_set()  # two threads idle, but the disk serves a demand read
        assert unwanted.cancel()  # a wrong guess's read still queued is cancelled: it never runs
        demand.release.set()
        assert prefetch.started.wait(5)  # the disk is idle now: it starts
        prefetch.release.set()
        future.result(timeout=5)
    finally:
        demand.release.set()
        prefetch.release.set()
        pool.close()
    assert log == ["demand", "prefetch"]


def test_prefetch_threads_are_bounded_and_errors_reach_the_future():
    running, peak, lock = [0], [0], threading.Lock()

    def read(handle):
        with lock:
            running[0] += 1
            peak[0] = max(peak[0], running[0])
        time.sleep(0.02)
        with lock:
            running[0] -= 1

    def fail(handle):
        raise OSError(5, "Input/output error")

    pool = ReadPool(Handle, n_threads=4, max_prefetch=2)
    try:
        done = [pool.submit_prefetch(read) for _ in range(12)]
        for f in done:
            f.result(timeout=10)
        assert peak[0] == 2
        with pytest.raises(OSError, match="Input/output"):
            pool.submit_prefetch(fail).result(timeout=5)
    finally:
        pool.close()
    with pytest.raises(ValueError):
        ReadPool(Handle, n_threads=2, max_prefetch=2)  # demand must keep a thread


# ---------------------------------------------------------------- book
def test_book_never_frees_a_buffer_a_read_may_still_write():
    book = PrefetchBook(range(10, 12))
    running, finished = Future(), Future()
    finished.set_result(None)
    a, b = book.free_buffer(), book.free_buffer()
    assert {a, b} == {10, 11} and book.free_buffer() is None
    book.add((3, 1), a, [running])
    book.add((3, 2), b, [finished])
    running.set_running_or_notify_cancel()  # its read has started: retiring cannot cancel it
    assert book.retire_layer(3, requested={(3, 2)}) == 1  # (3, 1) was a wrong guess
    assert (3, 1) not in book and (3, 2) in book
    assert book.reclaim() == [] and book.free_buffer() is None  # its read still runs
    running.set_result(None)
    assert [e.key for e in book.reclaim()] == [(3, 1)] and book.free_buffer() == a
    taken = book.take((3, 2))
    assert taken.buffer == b and taken.succeeded() and book.take((3, 2)) is None
    book.release(b)
    assert book.free_buffer() == b
    queued = Future()
    book.add((4, 7), b, [queued])
    assert book.retire_layer(4, requested=set()) == 1 and queued.cancelled()  # never started: cancelled
    assert [e.key for e in book.reclaim()] == [(4, 7)] and book.free_buffer() == b
