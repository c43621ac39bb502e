"""Provider telemetry: counter arithmetic, derived rates, thread-safe increments, atomic periodic JSON flush."""
from __future__ import annotations

import json
import os
import threading

import pytest

from llamapack.cache_policy import LruPolicy
from llamapack.telemetry import CounterAccumulator, ProviderCounters, StatsFlusher, write_text_atomically


def test_counters_accumulate_and_derive_rates():
    counters = CounterAccumulator()
    counters.record_acquire(hits=3, misses=1, evictions=1, tokens=2)
    counters.record_acquire(hits=2, misses=2, evictions=0)
    counters.record_read(4096 * 3, wait_s=0.25)
    counters.record_copy(4096 * 2, wait_s=0.5)
    counters.record_fallback()
    counters.record_io_error()
    snap = counters.snapshot()
    assert snap == ProviderCounters(acquires=2, tokens=2, cache_hits=5, cache_misses=3, cache_evictions=1,
                                    pack_read_bytes=12288, h2d_bytes=8192, fallback_count=1, io_errors=1,
                                    read_wait_s=0.25, copy_wait_s=0.5)
    assert snap.lookups == 8 and snap.hit_rate == 5 / 8
    assert snap.read_bytes_per_token == 6144 and snap.h2d_bytes_per_token == 4096


def test_rates_are_none_before_anything_happened():
    snap = CounterAccumulator().snapshot()
    assert snap.hit_rate is None and snap.read_bytes_per_token is None and snap.h2d_bytes_per_token is None
    assert json.loads(snap.to_json())["hit_rate"] is None


def test_snapshots_are_frozen_and_independent_of_later_increments():
    counters = CounterAccumulator()
    counters.record_acquire(1, 0, 0)
    before = counters.snapshot()
    counters.record_acquire(0, 1, 0)
    assert before.acquires == 1 and counters.snapshot().acquires == 2
    with pytest.raises(AttributeError):
        before.acquires = 5  # type: ignore[misc]


def test_minus_gives_the_window_between_two_snapshots():
    counters = CounterAccumulator()
    counters.record_acquire(4, 4, 0, tokens=1)
    start = counters.snapshot()
    counters.record_acquire(3, 1, 1, tokens=1)
    counters.record_read(100)
    window = counters.snapshot().minus(start)
    assert (window.acquires, window.cache_hits, window.cache_misses, window.hit_rate) == (1, 3, 1, 0.75)
    assert window.read_bytes_per_token == 100


def test_add_rejects_unknown_names_and_negative_deltas():
    counters = CounterAccumulator()
    with pytest.raises(TypeError, match="cache_hit"):
        counters.add(cache_hit=1)
    with pytest.raises(ValueError, match="io_errors"):
        counters.add(io_errors=-1)
    assert counters.snapshot() == ProviderCounters()


def test_reset_returns_the_final_snapshot_and_zeroes():
    counters = CounterAccumulator()
    counters.record_acquire(1, 1, 0)
    assert counters.reset().acquires == 1
    assert counters.snapshot() == ProviderCounters()


def test_timing_adds_elapsed_seconds_to_the_wait_counter(monkeypatch):
    clock = iter([10.0, 10.75])
    monkeypatch.setattr("llamapack.telemetry.time.perf_counter", lambda: next(clock))
    counters = CounterAccumulator()
    with counters.timing("read_wait_s"):
        pass
    assert counters.snapshot().read_wait_s == 0.75
    with pytest.raises(TypeError):
        with counters.timing("cache_hits"):
            pass


def test_increments_from_several_threads_are_not_lost():
    counters = CounterAccumulator()

    def work():
        for _ in range(5000):
            counters.record_acquire(1, 2, 0)
            counters.record_read(3)

    threads = [threading.Thread(target=work) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    snap = counters.snapshot()
    assert (snap.acquires, snap.cache_hits, snap.cache_misses, snap.pack_read_bytes) == (20000, 20000, 40000, 60000)


def test_json_has_every_counter_and_the_derived_numbers():
    snap = ProviderCounters(acquires=2, tokens=4, cache_hits=1, cache_misses=3, pack_read_bytes=40)
    data = json.loads(snap.to_json())
    assert data["acquires"] == 2 and data["hit_rate"] == 0.25 and data["read_bytes_per_token"] == 10
    assert set(data) == {"acquires", "tokens", "cache_hits", "cache_misses", "cache_evictions", "pack_read_bytes",
                         "h2d_bytes", "fallback_count", "io_errors", "read_wait_s", "copy_wait_s", "provide_s",
                         "ram_hits", "ram_misses", "ram_evictions", "lookahead_s", "lookahead_keys", "lookahead_hits",
                         "prefetch_reads", "prefetch_used", "prefetch_wasted", "prefetch_wasted_bytes",
                         "prefetch_cancelled", "ram_preloaded", "ram_preload_bytes", "native_steps",
                         "cpu_experts", "cpu_s", "ahead_loads", "ahead_unused", "ahead_early", "ahead_early_s",
                         "window_skipped", "window_from_pool", "d2d_bytes",
                         "pool_preloaded", "hit_rate", "read_bytes_per_token",
                         "h2d_bytes_per_token", "lookahead_accuracy"}


def test_ram_tier_counters():
    counters = CounterAccumulator()
    counters.record_acquire(hits=1, misses=6, evictions=2)
    counters.record_ram(hits=3, misses=2, evictions=1)
    counters.record_ram(hits=0, misses=1, evictions=0)
    snap = counters.snapshot()
    assert (snap.ram_hits, snap.ram_misses, snap.ram_evictions) == (3, 3, 1)
    assert snap.ram_hits + snap.ram_misses == snap.cache_misses
    assert snap.minus(ProviderCounters(ram_hits=1)).ram_hits == 2
    with pytest.raises(ValueError, match="can only grow"):
        counters.record_ram(hits=-1, misses=0, evictions=0)


def test_flusher_writes_every_n_acquires(tmp_path):
    path = tmp_path / "stats.json"
    counters = CounterAccumulator()
    flusher = StatsFlusher(counters, path, every_acquires=4)
    written_at = []
    for step in range(1, 11):
        counters.record_acquire(1, 0, 0)
        if flusher.maybe_flush():
            written_at.append(step)
            assert json.loads(path.read_text())["acquires"] == step
    assert written_at == [4, 8] and flusher.writes == 2
    assert flusher.flush() and json.loads(path.read_text())["acquires"] == 10
    assert [p.name for p in tmp_path.iterdir()] == ["stats.json"]  # no temporary file left behind


def test_flusher_keeps_its_period_after_a_reset(tmp_path):
    counters = CounterAccumulator()
    flusher = StatsFlusher(counters, tmp_path / "s.json", every_acquires=2)
    for _ in range(4):
        counters.record_acquire(0, 1, 0)
        flusher.maybe_flush()
    counters.reset()
    counters.record_acquire(0, 1, 0)
    assert not flusher.maybe_flush()
    counters.record_acquire(0, 1, 0)
    assert flusher.maybe_flush()


def test_flusher_without_a_path_does_nothing(tmp_path):
    counters = CounterAccumulator()
    flusher = StatsFlusher(counters, None, every_acquires=1)
    counters.record_acquire(1, 0, 0)
    assert not flusher.maybe_flush() and not flusher.flush() and flusher.writes == 0
    with pytest.raises(ValueError):
        StatsFlusher(counters, tmp_path / "x.json", every_acquires=0)


def test_a_failed_write_keeps_the_old_file_and_leaves_no_temporary(tmp_path, monkeypatch):
    path = tmp_path / "stats.json"
    write_text_atomically(path, '{"old": true}\n')

    def failing_replace(src, dst):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr("llamapack.telemetry.os.replace", failing_replace)
    with pytest.raises(OSError):
        write_text_atomically(path, '{"new": true}\n')
    assert json.loads(path.read_text()) == {"old": True}
    assert [p.name for p in tmp_path.iterdir()] == ["stats.json"]


def test_the_temporary_file_is_complete_and_in_the_same_folder(tmp_path, monkeypatch):
    path = tmp_path / "stats.json"
    renamed = []
    real_replace = os.replace

    def spying_replace(src, dst):
        renamed.append((os.path.dirname(src), open(src).read(), os.fspath(dst)))
        real_replace(src, dst)

    monkeypatch.setattr("llamapack.telemetry.os.replace", spying_replace)
    write_text_atomically(path, "complete\n")
    assert renamed == [(str(tmp_path), "complete\n", str(path))]


def test_readers_never_see_a_torn_stats_file(tmp_path):
    path = tmp_path / "stats.json"
    counters = CounterAccumulator()
    flusher = StatsFlusher(counters, path, every_acquires=1)
    flusher.flush()
    stop = threading.Event()
    seen, bad = [], []

    def read_continuously():
        while not stop.is_set():
            try:
                seen.append(json.loads(path.read_text())["acquires"])
            except (ValueError, KeyError) as exc:  # a torn or empty file
                bad.append(exc)

    reader = threading.Thread(target=read_continuously)
    reader.start()
    for _ in range(300):
        counters.add(acquires=1, pack_read_bytes=10 ** 12)  # long numbers: a torn write would show
        flusher.maybe_flush()
    stop.set()
    reader.join()
    assert not bad and seen and seen == sorted(seen)
    assert json.loads(path.read_text())["acquires"] == 300


def test_counters_follow_a_policy_driven_provider_loop(tmp_path):
    """How a provider wires both modules: plan -> loads -> counters -> periodic flush."""
    policy, counters = LruPolicy(2), CounterAccumulator()
    flusher = StatsFlusher(counters, tmp_path / "stats.json", every_acquires=3)
    expert_bytes = 4096
    for step in ([(0, 0), (0, 1)], [(0, 0), (0, 2)], [(0, 1)], [(0, 1)]):
        plan = policy.acquire(step)
        for _load in plan.loads:
            counters.record_read(expert_bytes)
        counters.record_acquire(plan.hits, plan.misses, len(plan.evictions), tokens=1)
        flusher.maybe_flush()
    data = json.loads((tmp_path / "stats.json").read_text())
    assert (data["acquires"], data["cache_hits"], data["cache_misses"], data["cache_evictions"]) == (3, 1, 4, 2)
    assert data["pack_read_bytes"] == 4 * expert_bytes and data["read_bytes_per_token"] == 4 * expert_bytes / 3


def test_external_counts_join_every_snapshot_and_reset_from_where_they_were():
    """The native hot path's counts (kept in libllama) are added to the provider's own in each snapshot."""
    native = {"acquires": 10, "native_steps": 10, "cache_hits": 70, "provide_s": 0.5}
    counters = CounterAccumulator(external=lambda: dict(native))
    counters.record_acquire(hits=3, misses=5, evictions=1, tokens=1)
    snap = counters.snapshot()
    assert (snap.acquires, snap.native_steps, snap.cache_hits, snap.cache_misses) == (11, 10, 73, 5)
    assert snap.provide_s == 0.5
    assert counters.reset().acquires == 11
    assert counters.snapshot().acquires == 0  # external totals taken as the new zero
    native.update(acquires=14, native_steps=14, cache_hits=100)
    snap = counters.snapshot()
    assert (snap.acquires, snap.native_steps, snap.cache_hits) == (4, 4, 30)
