"""``llamapack plan``: the speed model's pieces on hand-built figures, the hit-rate replay, the recommender's
choices and refusals, the probe cache, and the CLI end to end on a tiny model with a recorded probe (no GPU)."""
from __future__ import annotations

import llama_cpp  # noqa: F401 - before numpy: this file also runs `llamapack run --auto` (docs/hook.md)

import json
import math
from dataclasses import replace

import numpy as np
import pytest
from click.testing import CliRunner

from llamapack.cache_dir import user_cache_dir
from llamapack.cache_policy import policy_class
from llamapack.cli import main
from llamapack.errors import CapacityError, PackIOError
from llamapack.plan import hits, probe, recommend
from llamapack.routing import RoutingTrace
from llamapack.plan.model import (DEFAULT_COSTS, MIB, REF_ACTIVE_BYTES, REF_EXPERT_BYTES, Budgets, Machine, ModelShape,
                                  StepLoads, decode_compute_s, decode_time, pool_view_s, prefill_compute_s,
                                  prefill_time, python_work, ssd_step_share)

STRIDE = 2654208  # 2.53 MiB, the Qwen3-30B-shaped model's block
QWEN30B = ModelShape("q30b", 48, 128, 8, STRIDE, STRIDE, REF_EXPERT_BYTES, int(17.46e9 - 16.31e9), 98304)
GPU = Machine(free_vram_bytes=80 << 30, spare_ram_bytes=64 << 30, disk_bytes_per_s=1.1e9, h2d_bytes_per_s=20e9,
              cpu_read_bytes_per_s=20e9, cpu_flops=5e11)
HOST = replace(GPU, free_vram_bytes=None, h2d_bytes_per_s=None)


def loads(ssd: float, ram: float = 0.0, lookups: float = 384.0) -> StepLoads:
    return StepLoads(lookups, lookups - ssd - ram, ram, ssd)


# -- the model's pieces

def test_all_hit_decode_is_compute_plus_hook_overhead():
    for machine in (GPU, HOST):
        split = decode_time(QWEN30B, machine, loads(0))
        hook = DEFAULT_COSTS.gpu_hook_s_per_layer if machine.gpu else DEFAULT_COSTS.host_hook_s_per_layer
        assert split.ssd == split.ram == split.python == 0
        assert split.total == pytest.approx(decode_compute_s(QWEN30B, machine) + 48 * hook)


def test_whole_pool_graphs_have_no_per_layer_cost(tmp_path):
    """A slot for every expert and the native hot path: whole-pool graphs, so decode and prefill are vanilla's
    compute alone; one slot short, or the setting or the hot path off, and every layer pays its cache step."""
    for machine in (GPU, HOST):
        whole = Budgets(QWEN30B.n_blocks, 0, 512, machine.gpu, whole_pool_graphs=True)
        assert whole.whole_pool(QWEN30B) and not replace(whole, whole_pool_graphs=False).whole_pool(QWEN30B)
        split = decode_time(QWEN30B, machine, loads(0), whole_pool=True)
        assert split.hook == split.python == 0 and split.total == pytest.approx(decode_compute_s(QWEN30B, machine))
        prefill = prefill_time(QWEN30B, machine, 512, 512, loads(0), whole_pool=True)
        assert prefill.total == pytest.approx(prefill_compute_s(QWEN30B, machine, 512, 512))
        for budgets in (replace(whole, pool_slots=QWEN30B.n_blocks - 1), replace(whole, whole_pool_graphs=False),
                        replace(whole, native_hot_path=False)):
            assert not budgets.whole_pool(QWEN30B)
    small = ModelShape("small", 4, 16, 4, 1 << 20, 1 << 20, 1e6, 1 << 24)
    trace = hits.decode_trace(small, tmp_path)
    every, short = (recommend.predict(small, GPU, "x", Budgets(n, 0, 64, True, whole_pool_graphs=True), trace, 0,
                                      prefill_lengths=(64,))
                    for n in (small.n_blocks, small.n_blocks - 1))
    assert every.decode.hook == every.prefill[64].hook == 0 and every.decode.total < short.decode.total
    assert short.decode.hook == pytest.approx(4 * DEFAULT_COSTS.gpu_hook_s_per_layer)


def test_prefill_matmuls_walk_the_pools_slots_beyond_a_layers_experts():
    """A GPU pool's multi-token ubatches pay per slot beyond the layer's experts (pool_view_s); single-token
    ubatches, host pools, a pool no wider than a layer and whole-pool graphs do not."""
    view = lambda slots, tokens=512, ubatch=512, machine=GPU, whole=False: pool_view_s(  # noqa: E731
        QWEN30B, machine, slots, tokens, ubatch, whole_pool=whole)
    assert view(128) == view(6144, machine=HOST) == view(6144, whole=True) == view(6144, tokens=1) == 0
    assert view(1536) > 0 and view(3072) - view(1536) == pytest.approx(view(1536) * 1536 / 1408)  # linear in slots
    assert view(1536, tokens=1024) == pytest.approx(2 * view(1536))           # two ubatches of 512
    assert view(1536, tokens=513) == pytest.approx(view(1536))                # the last ubatch: one token
    split = prefill_time(QWEN30B, GPU, 512, 512, loads(0), pool_slots=1536)
    assert split.view == view(1536) and split.total == pytest.approx(prefill_compute_s(QWEN30B, GPU, 512, 512)
                                                                       + 48 * DEFAULT_COSTS.gpu_hook_s_per_layer
                                                                       + view(1536))


def test_view_and_tier_hit_costs_reproduce_the_runs_they_were_fitted_on():
    """gpu_lookup_q30b.json (H100): native RAM-tier runs' prefill, pools of 1536, 3072 and 6144 slots, within 2%
    (the model adds the vanilla prefill measured in the same run, 48 hooks, the tier hits' copies at the probed
    55.29 GB/s, the tier hits' handling and the pool view)."""
    machine = replace(GPU, h2d_bytes_per_s=55.29e9)
    c = DEFAULT_COSTS
    for tokens, slots, tier_hits, measured_ms, vanilla_ms in [
            (512, 1536, 4804, 591.2, 258.1), (512, 3072, 4804, 640.5, 258.1), (512, 6144, 4804, 759.9, 258.1),
            (32, 1536, 854, 86.3, 22.5), (32, 3072, 401, 75.2, 22.5), (32, 6144, 42, 85.8, 22.5)]:
        split = prefill_time(QWEN30B, machine, tokens, 512, loads(0, tier_hits, tier_hits), pool_slots=slots)
        predicted = vanilla_ms / 1e3 + split.total - split.compute
        assert predicted * 1e3 == pytest.approx(measured_ms, rel=0.02), (tokens, slots)
    assert c.prefill_ram_hit_s == pytest.approx(9.5e-6)


def test_reference_model_reproduces_the_measured_figures():
    """The H100 calibration (gpu_hotpath_q30b.json): vanilla, and the all-hit step native and in Python."""
    assert QWEN30B.active_bytes == pytest.approx(REF_ACTIVE_BYTES)
    assert 1 / decode_compute_s(QWEN30B, GPU) == pytest.approx(163.57)        # vanilla-vram
    assert 512 / prefill_compute_s(QWEN30B, GPU, 512, 512) == pytest.approx(2011.2)
    c = DEFAULT_COSTS
    assert decode_time(QWEN30B, GPU, loads(0)).total == pytest.approx(1 / 163.57 + 48 * c.gpu_hook_s_per_layer)
    assert decode_time(QWEN30B, GPU, loads(0), native_hot_path=False).total == pytest.approx(
        1 / 163.57 + 48 * (c.gpu_hook_s_per_layer + c.python_step_s))


def test_native_hot_path_costs_python_only_for_ssd_steps():
    c = DEFAULT_COSTS
    # counted by the replay: 3 of 48 steps read the SSD, with 5 misses between them; 20 RAM hits served natively
    counted = StepLoads(384, 359, 20, 5, ssd_steps=3, ssd_step_misses=5)
    native, python = (decode_time(QWEN30B, GPU, counted, native_hot_path=n) for n in (True, False))
    assert native.python == pytest.approx(3 * c.python_step_s + 5 * c.python_load_s)
    assert python.python == pytest.approx(48 * c.python_step_s + 25 * c.python_load_s)
    assert native.total < python.total and native.hook == python.hook and native.ssd == python.ssd
    # a RAM tier alone (no SSD read): nothing enters Python with the native path
    assert decode_time(QWEN30B, GPU, loads(0, ram=30)).python == 0
    # the host pool pays its per-step hook either way
    assert decode_time(QWEN30B, HOST, counted, native_hot_path=True).total == pytest.approx(
        decode_time(QWEN30B, HOST, counted, native_hot_path=False).total)
    # native never slower, and the gap shrinks as more steps read the SSD
    gaps = [decode_time(QWEN30B, GPU, loads(ssd), native_hot_path=False).total
            - decode_time(QWEN30B, GPU, loads(ssd)).total for ssd in (0, 5, 40, 384)]
    assert gaps == sorted(gaps, reverse=True) and gaps[-1] == pytest.approx(0, abs=1e-12)


def test_share_of_python_steps_from_the_rates():
    # not counted: each of a step's 8 keys an SSD read with probability ssd_reads / lookups, independently
    assert ssd_step_share(loads(0), 48) == 0
    assert ssd_step_share(loads(384), 48) == pytest.approx(1)
    assert ssd_step_share(loads(38.4), 48) == pytest.approx(1 - 0.9 ** 8)
    steps, misses = python_work(loads(38.4, ram=10), 48, True)
    assert steps == pytest.approx(48 * (1 - 0.9 ** 8)) and 38.4 < misses < 48.4
    assert python_work(loads(38.4, ram=10), 48, False) == (48, pytest.approx(48.4))
    # counted wins over the estimate
    assert ssd_step_share(StepLoads(384, 374, 0, 10, ssd_steps=2, ssd_step_misses=10), 48) == pytest.approx(2 / 48)


def test_replay_counts_the_steps_that_read_the_ssd():
    # pool of 2, tier of 4: step 1 reads both from the SSD; step 2 hits; step 3 misses into the tier (RAM)
    steps = [[(0, 0), (0, 1)], [(0, 0), (0, 1)], [(0, 2), (0, 3)], [(0, 0), (0, 1)], [(0, 4), (0, 5)]]
    counted = hits.replay(steps, [True] * 5, 2, 4)
    assert counted.ssd_steps == 3 and counted.ssd_step_misses == 6      # steps 1, 3, 5
    assert counted.ram_hits == 2                                         # step 4, native with a tier
    preloaded = hits.replay(steps, [True] * 5, 2, 6, preload=[[(0, e) for e in range(6)]])
    assert preloaded.ssd_steps == preloaded.ssd_reads == 0


def test_replay_counts_a_keys_first_read_in_the_process():
    # a pool of 1: every step misses; (0, 0) is read twice, so 3 reads, 2 of them a key's first
    counted = hits.replay([[(0, 0)], [(0, 1)], [(0, 0)]], [True] * 3, 1, 0)
    assert counted.ssd_reads == 3 and counted.ssd_first_reads == 2
    # the uncounted steps still read: measured alone, the third step's read is a repeat
    assert hits.replay([[(0, 0)], [(0, 1)], [(0, 0)]], [False, False, True], 1, 0).ssd_first_reads == 0
    # a tier filled at load was read before the first step: its block, evicted from a one-block tier by (0, 1)
    # and read again, is a repeat
    again = hits.replay([[(0, 1)], [(0, 0)]], [True, True], 1, 1, preload=[[(0, 0)]])
    assert again.ssd_reads == 2 and again.ssd_first_reads == 1 and again.ram_hits == 0


def test_decode_reads_cost_by_first_or_repeated():
    costs = replace(DEFAULT_COSTS, decode_first_read_factor=2.0)
    block = STRIDE / GPU.disk_bytes_per_s
    for first, factor in ((None, 1.0), (0.0, 1.0), (10.0, 2.0), (5.0, 1.5)):
        per_token = replace(loads(10), ssd_first_reads=first)
        assert decode_time(QWEN30B, GPU, per_token, costs).ssd == pytest.approx(10 * block * factor)


def test_bench_requests_decode_loads(tmp_path):
    """request_loads: each request's decode loads per token after its prompt, the cache carried over; the first
    request's decode reads keys for the first time, the second mostly again."""
    small = ModelShape("small", 4, 16, 2, STRIDE, STRIDE, REF_EXPERT_BYTES, 10 ** 8)
    trace = hits.decode_trace(small, tmp_path)
    (p1, d1), (p2, d2) = hits.request_loads(small, trace, [8, 8], [40, 40], 64, 12, 0)
    assert p1.ssd_first_reads == p1.ssd_reads > 0                    # an empty cache: all first reads
    assert d1.ssd_reads > 0 and d2.ssd_reads > 0 and d2.ssd_first_reads < d1.ssd_first_reads
    assert d1.lookups == pytest.approx(4 * 2)                         # per decode token: top-2 in 4 layers
    assert [p1, p2] == hits.request_prefill_loads(small, trace, [8, 8], [40, 40], 64, 12, 0)
    (_, none), = hits.request_loads(small, trace, [8], [0], 64, 12, 0)
    assert none.ssd_reads == 0 and none.lookups == 0


def test_bench_requests_after_the_benchs_warm_up_prompt(tmp_path):
    """request_loads with the bench's warm-up prompt: its reads come before the first request, whose prompt then
    reads fewer keys for the first time; the requests' own draws are those of a run without it."""
    small = ModelShape("small", 4, 16, 2, STRIDE, STRIDE, REF_EXPERT_BYTES, 10 ** 8)
    trace = hits.decode_trace(small, tmp_path)
    (cold, _), = hits.request_loads(small, trace, [8], [0], 64, 12, 0)
    (warmed, _), = hits.request_loads(small, trace, [8], [0], 64, 12, 0, warmup_tokens=16)
    assert warmed.lookups == cold.lookups and warmed.ssd_first_reads < cold.ssd_first_reads
    assert hits.request_loads(small, trace, [8], [0], 64, 12, 0, warmup_tokens=0) == [(cold, _)]


def test_prefill_in_the_benchs_order(tmp_path):
    small = ModelShape("small", 4, 16, 2, STRIDE, STRIDE, REF_EXPERT_BYTES, 10 ** 8)
    trace = hits.decode_trace(small, tmp_path)
    first, second = hits.request_prefill_loads(small, trace, [64, 64], [40, 40], 64, 64, 0)
    assert first.ssd_reads == first.lookups > 0        # an empty cache: every key is read
    assert second.ssd_reads == 0                       # the pool holds every expert by then
    warm, = hits.request_prefill_loads(small, trace, [64], [0], 64, 16, 64, preloaded=True)
    assert warm.ssd_reads == 0 and warm.ram_hits > 0   # a full tier filled at load


def test_a_warm_start_replays_the_providers(tmp_path):
    """A priming session's popularity seeds the pool and tier and fills them with the hottest experts (the
    provider's warm_start), so the next session's first prompt reads less; LfuLru has no seed: it starts cold."""
    from llamapack.provider.warm import hottest

    small = ModelShape("small", 4, 16, 2, STRIDE, STRIDE, REF_EXPERT_BYTES, 10 ** 8)
    trace = hits.decode_trace(small, tmp_path)
    popularity = hits.priming_popularity(trace, [(0, 32, 60), (1, 32, 60)], 64, 16, 24)
    assert sorted(popularity) == list(range(4)) and all(0 < len(shares) <= 16 for shares in popularity.values())
    pool, tier = hits.new_caches(16, 24)
    hits.warm_start(pool, tier, popularity, batch=5)
    assert set(pool.resident()) == set(hottest(popularity, 16)) and set(tier.resident()) == set(hottest(popularity, 24))
    (cold,), (warm,) = (hits.request_prefill_loads(small, trace, [32], [0], 64, 16, 24, warm=w, prompt_source=trace)
                        for w in (None, popularity))
    assert cold.ssd_reads == cold.lookups - cold.pool_hits > 0 and warm.ssd_reads < cold.ssd_reads
    assert warm.pool_hits > 0 and warm.ram_hits > 0
    lfu_pool, lfu_tier = hits.new_caches(16, 24, policy_class("lfu-lru"))
    hits.warm_start(lfu_pool, lfu_tier, popularity)
    assert not lfu_pool.resident() and not lfu_tier.resident()


def test_decode_is_monotonic_in_hit_rate_and_disk_speed():
    rates = [1 / decode_time(QWEN30B, GPU, loads(ssd)).total for ssd in (0, 5, 20, 80, 200)]
    assert rates == sorted(rates, reverse=True) and len(set(rates)) == len(rates)
    disks = [1 / decode_time(QWEN30B, replace(GPU, disk_bytes_per_s=bw), loads(25)).total for bw in (0.5e9, 1e9, 4e9)]
    assert disks == sorted(disks) and len(set(disks)) == 3


def test_miss_costs_are_bytes_over_rates():
    split = decode_time(QWEN30B, GPU, loads(ssd=10, ram=30))
    assert split.ssd == pytest.approx(10 * STRIDE / 1.1e9)
    assert split.ram == pytest.approx(30 * STRIDE / 20e9)
    assert split.ram < decode_time(QWEN30B, GPU, loads(ssd=40)).ssd  # a RAM-tier hit is cheaper than a read


def test_io_overlap_hides_reads_under_compute():
    full = replace(DEFAULT_COSTS, io_overlap=1.0)
    serial, hidden = decode_time(QWEN30B, GPU, loads(25)), decode_time(QWEN30B, GPU, loads(25), full)
    assert hidden.total == pytest.approx(max(serial.ssd + serial.ram, serial.compute + serial.hook) + serial.python)


def test_prefill_ubatches_and_compute():
    one = prefill_compute_s(QWEN30B, GPU, 16, 1)
    assert one == pytest.approx(16 * decode_compute_s(QWEN30B, GPU))  # ubatch 1 is decode
    assert prefill_compute_s(QWEN30B, GPU, 4096, 512) < prefill_compute_s(QWEN30B, GPU, 4096, 64) < one * 256
    per_ubatch = loads(ssd=1000, lookups=6000)
    small, large = prefill_time(QWEN30B, GPU, 4096, 256, per_ubatch), prefill_time(QWEN30B, GPU, 4096, 512, per_ubatch)
    assert small.hook == pytest.approx(2 * large.hook) and small.ssd == pytest.approx(2 * large.ssd)
    assert large.ssd == pytest.approx(8 * 1000 * STRIDE / 1.1e9)
    cpu = prefill_compute_s(QWEN30B, HOST, 512, 512)
    assert cpu == pytest.approx(512 * 2 * QWEN30B.active_bytes * DEFAULT_COSTS.cpu_weights_per_byte / 5e11)


# -- hit rates

def test_shape_counts_shipped_or_resampled():
    assert hits.shape_counts(48, 128, 8).source == hits._shipped("qwen3-30b-a3b").source
    counts = hits.shape_counts(6, 24, 3)
    inclusion = counts.inclusion()
    assert inclusion.shape == (6, 24) and np.allclose(inclusion.sum(axis=1), 3) and inclusion.max() <= 1
    assert (np.diff(inclusion, axis=1) <= 1e-12).all()  # sorted: the popularity curve, most popular first


def test_cap_shares_keeps_the_sum():
    capped = hits.cap_shares(np.array([3.0, 1.0, 0.5, 0.5, 0.4, 0.3, 0.2, 0.1]))
    assert capped.max() <= 1 and capped.sum() == pytest.approx(6.0) and capped[0] == 1
    assert (np.diff(capped) <= 1e-12).all()  # the order is kept


def test_replay_pool_and_tier():
    steps = [[(0, 1), (0, 2)], [(1, 1)], [(0, 1), (0, 3)], [(1, 1), (1, 2)]] * 3
    everything = hits.replay(steps, [False] * 4 + [True] * 8, pool_slots=16, tier_blocks=0)
    assert everything.ssd_reads == 0 and everything.pool_hit_rate == 1  # warm and big enough: all hits
    tight = hits.replay(steps, [True] * 12, pool_slots=2, tier_blocks=8)
    assert tight.ram_hits > 0 and tight.ram_hits + tight.ssd_reads + tight.pool_hits == tight.lookups


def test_decode_and_prefill_loads_on_a_small_shape(tmp_path):
    shape = ModelShape("small", 4, 16, 4, 1 << 20, 1 << 20, 1e6, 1 << 24)
    trace = hits.decode_trace(shape, tmp_path)
    assert list(tmp_path.iterdir()) and hits.decode_trace(shape, tmp_path).n_tokens == trace.n_tokens  # cached
    small, big = hits.decode_loads(trace, 16, 0), hits.decode_loads(trace, 64, 0)
    assert big.ssd_reads == 0 < small.ssd_reads and big.lookups == small.lookups == 16
    prefill = hits.prefill_loads(shape, 512, 64, 64, 0)
    assert prefill.ssd_reads == 0 and 48 < prefill.lookups <= 64  # 64 tokens x top-4: most of each layer's 16
    assert hits.prefill_loads(shape, 512, 64, 16, 0).ssd_reads > 0


# -- recommendations and refusals

def test_recommend_gpu_pool_tier_and_ubatch():
    machine = replace(GPU, free_vram_bytes=8 << 30, spare_ram_bytes=8 << 30)
    budgets = recommend.recommend(QWEN30B, machine, 4096)
    room = (8 << 30) - QWEN30B.nonexpert_bytes - 98304 * 4096 - recommend.VRAM_RESERVE_BYTES
    assert budgets.pool_slots == room // STRIDE and budgets.gpu
    assert budgets.tier_blocks == (4 << 30) // STRIDE and budgets.n_ubatch == 512
    settings = budgets.settings(QWEN30B)
    assert settings["cache_vram_mib"] == pytest.approx(budgets.pool_slots * STRIDE / MIB, abs=0.1)
    assert settings["ram_cache_mib"] == pytest.approx(budgets.tier_blocks * STRIDE / MIB, abs=0.1)


def test_recommend_whole_model_needs_no_tier_and_host_pool_has_none():
    assert recommend.recommend(QWEN30B, GPU, 4096) == Budgets(QWEN30B.n_blocks, 0, 512, True)
    host = recommend.recommend(QWEN30B, replace(HOST, spare_ram_bytes=12 << 30), 4096)
    assert not host.gpu and host.tier_blocks == 0 and 0 < host.pool_slots < QWEN30B.n_blocks


def test_fitting_ubatch_follows_the_pool():
    assert recommend.fitting_ubatch(QWEN30B, 128) == 512  # a layer's 128 experts fit: any ubatch
    assert recommend.fitting_ubatch(QWEN30B, 64) == 8     # 8 tokens x top-8 = 64
    assert recommend.fitting_ubatch(QWEN30B, 8) == 1
    assert recommend.fitting_ubatch(QWEN30B, 600, tier_blocks=40) == 4


def test_refusal_names_the_short_vram():
    need = 8 * STRIDE
    free = QWEN30B.nonexpert_bytes + 98304 * 4096 + recommend.VRAM_RESERVE_BYTES + need - (5 << 20)
    with pytest.raises(CapacityError) as caught:
        recommend.recommend(QWEN30B, replace(GPU, free_vram_bytes=free), 4096)
    message = str(caught.value)
    assert message.startswith("VRAM is short") and "8 experts x 2.53 MiB = 20 MiB" in message
    assert "5 MiB short" in message and "1,024 MiB reserve" in message


def test_refusal_names_the_short_ram_for_a_host_pool():
    with pytest.raises(CapacityError, match=r"^RAM is short .* short$"):
        recommend.recommend(QWEN30B, replace(HOST, spare_ram_bytes=QWEN30B.nonexpert_bytes), 4096)


def test_alternatives_start_with_the_recommendation():
    chosen = Budgets(1536, 1200, 512, True)
    labels = [label for label, _ in recommend.alternatives(QWEN30B, chosen)]
    assert labels == ["recommended", "no RAM tier", "pool / 2", "pool / 4"]
    assert [label for label, _ in recommend.alternatives(QWEN30B, Budgets(12, 0, 1, True))] == ["recommended"]


# -- the probe

def test_cache_root_follows_xdg(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert user_cache_dir() == tmp_path / "llamapack"
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert str(user_cache_dir()).endswith(".cache/llamapack")


def recorded_probe(cache_dir, target: probe.DiskTarget, disk_bytes_per_s: float = 1.1e9) -> None:
    """A probe file as a machine without a GPU records it."""
    probe.save_cache(probe.probe_file(cache_dir), {
        "disks": {target.key: {"bytes_per_s": disk_bytes_per_s, "block_bytes": target.block_bytes, "threads": 4,
                               "path": target.path, "when": 0}},
        "cpu": {"read_bytes_per_s": 20e9, "flops": 2e11}})


def test_probe_uses_the_recorded_figures(tmp_path):
    data = tmp_path / "blocks.bin"
    data.write_bytes(bytes(1 << 16))
    target = probe.DiskTarget(str(data), 4096, 0, 16)
    recorded_probe(tmp_path, target, 2.5e9)
    steps = []
    report = probe.probe(target, cache_dir=tmp_path, use_gpu=False, step=steps.append)
    assert steps == [] and report.measured == ()
    assert report.machine.disk_bytes_per_s == 2.5e9 and report.machine.free_vram_bytes is None
    assert report.machine.spare_ram_bytes > 0


def test_reprobe_measures_the_disk_again(tmp_path):
    data = tmp_path / "blocks.bin"
    data.write_bytes(bytes(1 << 16))
    target = probe.DiskTarget(str(data), 4096, 0, 16)
    recorded_probe(tmp_path, target, 2.5e9)
    try:
        report = probe.probe(target, cache_dir=tmp_path, use_gpu=False, reprobe=True)
    except PackIOError as exc:  # this filesystem has no O_DIRECT: the refusal is what the plan says then
        assert "O_DIRECT" in str(exc)
        return
    assert report.measured == ("disk", "cpu") and report.machine.disk_bytes_per_s != 2.5e9
    assert json.loads(probe.probe_file(tmp_path).read_text())["disks"][target.key]["bytes_per_s"] != 2.5e9


def test_disk_without_o_direct_is_refused(monkeypatch, tmp_path):
    def no_direct(path, *args, **kwargs):
        raise PackIOError(f"{path}: the filesystem refuses O_DIRECT (open failed with EINVAL; e.g. tmpfs/procfs)")

    monkeypatch.setattr(probe, "random_read_bandwidth", no_direct)
    data = tmp_path / "blocks.bin"
    data.write_bytes(bytes(8192))
    with pytest.raises(PackIOError, match="cannot run from .*refuses O_DIRECT"):
        probe.probe(probe.DiskTarget(str(data), 4096, 0, 2), cache_dir=tmp_path, use_gpu=False)


# -- the CLI, end to end on a tiny synthetic model

@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    folder = tmp_path_factory.mktemp("plan")
    model = folder / "tiny.gguf"
    runner = CliRunner()
    assert runner.invoke(main, ["synth", "qwen3moe-tiny", "-o", str(model)]).exit_code == 0
    result = runner.invoke(main, ["pack", str(model), "-q", "--safety-margin-mib", "0"])
    assert result.exit_code == 0, result.output
    return model


@pytest.fixture
def recorded(tiny, tmp_path, monkeypatch):
    """XDG_CACHE_HOME in tmp_path with a recorded probe of the tiny pack's disk; no GPU seen."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setattr(probe, "import_cupy_device", lambda: None)
    target = probe.disk_target(str(tiny), str(tiny.with_suffix(".expert-pack")))
    recorded_probe(user_cache_dir() / "probe", target)
    return tiny


def test_plan_table(recorded):
    result = CliRunner().invoke(main, ["plan", str(recorded), "--pack", "-q"])
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    assert lines[0].startswith("model: tiny: 4 MoE layers x 16 experts, top-4")
    assert "no GPU (host pool)" in lines[1] and "disk 1.10 GB/s" in lines[1] and "cached" in lines[2]
    header = next(line for line in lines if line.startswith("config"))
    assert "decode tok/s" in header and "prefill 4096" in header
    assert any(line.startswith("recommended ") for line in lines)
    assert any("hybrid mode" in line and "not modelled, the plan keeps it off" in line for line in lines)


def test_plan_json_has_decode_predictions(recorded):
    result = CliRunner().invoke(main, ["plan", str(recorded), "--pack", "-q", "--json"])
    assert result.exit_code == 0, result.output
    plan = json.loads(result.output)
    first = plan["predictions"][0]
    assert first["label"] == "recommended" and first["settings"] == plan["recommended"]
    decode_keys = [key for key in first if "decode" in key]
    assert {"decode_tok_s", "decode_pool_hit_rate", "decode_ssd_bytes_per_token"} <= set(decode_keys)
    assert first["decode_tok_s"] > 0 and math.isfinite(first["prefill_512_tok_s"])
    assert plan["machine"]["free_vram_bytes"] is None and plan["machine"]["measured_now"] == []
    assert plan["recommended"]["ram_cache_mib"] is None  # host pool: no tier
    rates = [p["decode_tok_s"] for p in plan["predictions"]]
    assert rates == sorted(rates, reverse=True)  # smaller pools, slower


def test_plan_gguf_direct_and_refusal(recorded, monkeypatch):
    result = CliRunner().invoke(main, ["plan", str(recorded), "-q"])
    assert result.exit_code == 0, result.output
    monkeypatch.setattr(probe, "spare_ram_bytes", lambda: 30 << 20)
    result = CliRunner().invoke(main, ["plan", str(recorded), "--pack", "-q"])
    assert result.exit_code == 1
    assert result.output.startswith("Error: RAM is short for tiny") and result.output.rstrip().endswith("short")
    assert len(result.output.strip().splitlines()) == 1


def test_run_auto_prints_and_applies_the_plan(recorded):
    args = ["run", str(recorded), "--pack", "--auto", "-p", "Once upon a time", "-n", "4", "--temp", "0", "-t", "2",
            "-c", "256", "--no-warm-start"]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.output
    said = next(line for line in result.stderr.splitlines() if line.startswith("--auto (llamapack plan): "))
    assert "cache_vram_mib=" in said and "ram_cache_mib=None" in said and "n_ubatch=512" in said
    assert "64 slots" in result.stderr  # the tiny model's 4 x 16 experts all fit the chosen cache
    clash = CliRunner().invoke(main, [*args, "--cache-slots", "8"])
    assert clash.exit_code == 1 and "--auto chooses --cache-slots" in clash.output


def test_serve_auto_prints_and_applies_the_plan(recorded, monkeypatch):
    import llamapack.server.wsgi as wsgi

    class NoServer:
        port = 0

        def run(self):
            pass

    monkeypatch.setattr(wsgi, "make_server", lambda *args, **kwargs: NoServer())
    result = CliRunner().invoke(main, ["serve", str(recorded), "--pack", "--auto", "-c", "256", "-t", "2"])
    assert result.exit_code == 0, result.output
    assert any(line.startswith("--auto (llamapack plan): cache_vram_mib=") for line in result.stderr.splitlines())
    refused = CliRunner().invoke(main, ["serve", str(recorded), "--auto"])
    assert refused.exit_code == 1 and "--auto sizes the expert cache: give --pack or --gguf-direct" in refused.output


def test_settings_give_back_the_same_slot_counts():
    shape = ModelShape("odd", 3, 7, 2, 4096 * 97, 4096 * 131, 3e5, 1 << 20)
    for slots, blocks in ((7, 0), (13, 9), (21, 21)):
        settings = Budgets(slots, blocks, 1, True).settings(shape)
        assert int(settings["cache_vram_mib"] * MIB) // shape.slot_bytes == slots
        if blocks:
            assert int(settings["ram_cache_mib"] * MIB) // shape.block_bytes == blocks


def test_predict_takes_the_policy_and_prefill_lengths(tmp_path):
    """What bench/plan_vs_measured.py asks of the planner: a run's own policy, prefill at the bench's lengths."""
    from llamapack.cache_policy import policy_class

    shape = ModelShape("small", 4, 16, 4, 1 << 20, 1 << 20, 1e6, 1 << 24)
    trace = hits.decode_trace(shape, tmp_path)
    budgets = Budgets(12, 0, 1, True)
    default = recommend.predict(shape, GPU, "x", budgets, trace, 256)
    assert sorted(default.prefill) == [512, 4096]
    lfu = recommend.predict(shape, GPU, "x", budgets, trace, 256, prefill_lengths=(32,), policy=policy_class("lfu-lru"))
    assert list(lfu.prefill) == [32]
    assert lfu.decode_loads == hits.decode_loads(trace, 12, 0, policy=policy_class("lfu-lru"))
    assert default.decode_loads == hits.decode_loads(trace, 12, 0)
    assert lfu.decode_loads != default.decode_loads  # another policy, other hits


def skewed_prompts(n_layers: int, n_experts: int, top_k: int, n_tokens: int, seed: int = 0) -> RoutingTrace:
    """Prompt rows whose tokens keep reusing a few experts per layer (top_k + 2 of them), one decode row each."""
    rng = np.random.default_rng(seed)
    rows = np.empty((2 * (n_tokens + 1), n_layers, top_k), dtype=np.int16)
    for t in range(len(rows)):
        for layer in range(n_layers):
            rows[t, layer] = rng.choice(top_k + 2, top_k, replace=False)
    request = np.repeat(np.arange(2, dtype=np.int32), n_tokens + 1)
    prefill = np.tile(np.r_[np.ones(n_tokens, bool), False], 2)
    return RoutingTrace(rows, request, prefill, n_experts)


def test_prompt_rows_count_fewer_distinct_experts_than_independent_draws():
    small = ModelShape("small", 4, 16, 2, STRIDE, STRIDE, REF_EXPERT_BYTES, 10 ** 8)
    prompts = skewed_prompts(4, 16, 2, 32)
    steps = hits.prompt_steps(hits.prompt_rows(prompts, 0), 32, 32)
    assert len(steps) == 4 and all(len(step) <= 4 for step in steps)    # top_k + 2 reused experts per layer
    real = hits.prefill_loads(small, 32, 32, 64, 0, prompt_source=prompts)
    drawn = hits.prefill_loads(small, 32, 32, 64, 0)                      # the fallback: tokens independent
    assert real.lookups <= 16 < drawn.lookups
    # the bench's order: prompt i takes request i's rows, cycled past their end
    first, second = hits.request_prefill_loads(small, hits.decode_trace(small, None), [64, 32], [0, 0], 32, 64, 0,
                                               prompt_source=prompts)
    # 64 tokens of 32 rows: the second ubatch repeats the first's rows, all hits; an empty cache reads the first's
    assert first.lookups <= 16 and first.ssd_reads == first.lookups / 2 and first.ssd_steps == 2
    with pytest.raises(ValueError):
        hits.prefill_loads(replace(small, n_experts=32), 32, 32, 64, 0, prompt_source=prompts)


def test_prompt_trace_is_the_routing_models_prompt_rows(tmp_path):
    small = ModelShape("small", 4, 16, 2, STRIDE, STRIDE, REF_EXPERT_BYTES, 10 ** 8)
    prompts = hits.prompt_trace(small, tmp_path)
    assert prompts.n_requests == hits.PROMPT_TRACE_REQUESTS
    assert int(prompts.prefill.sum()) == hits.PROMPT_TRACE_REQUESTS * hits.PROMPT_TRACE_TOKENS
    assert hits.prompt_trace(small, tmp_path).n_tokens == prompts.n_tokens   # cached
    assert len(hits.prompt_rows(prompts, 3)) == hits.PROMPT_TRACE_TOKENS      # request 3 is request 1's rows


def test_prefill_costs_cold_reads_and_batched_python_loads():
    per_ubatch = StepLoads(4800, 0, 0, 4800, 48, 4800)
    warm = prefill_time(QWEN30B, GPU, 512, 512, per_ubatch)
    cold = prefill_time(QWEN30B, GPU, 512, 512, per_ubatch, cold=True)
    assert cold.ssd == pytest.approx(warm.ssd * DEFAULT_COSTS.cold_read_factor) and cold.total > warm.total
    # a prefill step's Python loads cost python_prefill_load_s, not the decode-fitted python_load_s
    python = prefill_time(QWEN30B, GPU, 512, 512, per_ubatch, native_hot_path=False).python
    assert python == pytest.approx(48 * DEFAULT_COSTS.python_step_s + 4800 * DEFAULT_COSTS.python_prefill_load_s)
    assert DEFAULT_COSTS.python_prefill_load_s < DEFAULT_COSTS.python_load_s
    # a RAM-tier hit in prefill costs its copy and its handling (GPU pool)
    tier = prefill_time(QWEN30B, GPU, 512, 512, StepLoads(4800, 0, 4800, 0, 0, 0))
    assert tier.ram == pytest.approx(4800 * (QWEN30B.block_bytes / GPU.h2d_bytes_per_s + DEFAULT_COSTS.prefill_ram_hit_s))
