"""The host-RAM tier of the streaming provider: its bookkeeping, its blocks and events (fake CuPy), and on CPU
through llama.cpp with a host pool smaller than the experts and the tier in between: bit-exact logits,
counters against a replayed trace, read faults and hung reads.

The llama.cpp runs reuse tests/test_provider_streaming.py's workers and fixtures (its ``provider_worker``
reports the tier's residency after a failed request).
"""
import re
import sys
from pathlib import Path

import numpy as np
import pytest
from test_provider_streaming import (N_DECODE, N_PROMPT, PRESETS, expected_read_bytes, fake_cupy,  # noqa: F401
                                     models, run_self, source_spec, spec_for, vanilla)
from hookutil import flip_byte, smallest_pool as small_pool

from llamapack.cache_policy import DEFAULT_POLICY
from llamapack.errors import CapacityError
from llamapack.provider.host_tier import HostTier, chunked_blocks, preload_keys, tier_blocks
from llamapack.provider.settings import MIB, StreamingSettings
from llamapack.provider.slots import aligned_empty


# ---------------------------------------------------------------- pure parts
def test_tier_plan_hits_misses_evictions_and_abandon():
    tier = HostTier(3)
    plan = tier.plan([(0, 1), (0, 2)])
    assert plan.hits == () and plan.misses == (((0, 1), 0), ((0, 2), 1)) and plan.evictions == 0
    plan = tier.plan([(0, 1), (0, 3)])
    assert plan.hits == (((0, 1), 0),) and plan.misses == (((0, 3), 2),) and plan.evictions == 0
    plan = tier.plan([(1, 0), (0, 3)])  # full: one of (0, 1), (0, 2) goes (the default policy's choice)
    victim, = {(0, 1), (0, 2)} - set(tier.resident())
    block = 0 if victim == (0, 1) else 1
    assert plan.misses == (((1, 0), block),) and plan.hits == (((0, 3), 2),) and plan.evictions == 1
    assert tier.block_of(victim) is None and tier.block_of((1, 0)) == block and len(tier.resident()) == 3
    assert tier.abandon((1, 0)) and not tier.abandon((1, 0))  # a failed read: the block is mapped to nothing
    plan = tier.plan([(2, 5)])
    assert plan.misses == (((2, 5), block),) and plan.evictions == 0  # the freed block, no eviction
    with pytest.raises(CapacityError):
        tier.plan([(3, e) for e in range(4)])


def test_a_tier_of_every_key_plans_as_the_policy_does():
    """A tier that holds every key skips its policy on all-hit steps: the plans stay those of the plain tier."""
    rng = np.random.default_rng(0)
    n_layers, n_experts = 3, 8
    plain, every = HostTier(n_layers * n_experts), HostTier(n_layers * n_experts, n_keys=n_layers * n_experts)
    assert every.holds_every_key and not plain.holds_every_key
    for step in range(300):
        layer = step % n_layers
        keys = [(layer, int(e)) for e in rng.choice(n_experts, 3, replace=False)]
        keys += keys[:1]  # a repeat, as a caller might pass
        expected = plain.plan(keys, n_tokens=1)
        assert every.plan(keys, n_tokens=1) == expected and expected.evictions == 0
        if step % 7 == 0 and expected.misses:  # a failed read
            assert plain.abandon(expected.misses[0][0]) and every.abandon(expected.misses[0][0])
        assert every.resident() == plain.resident()


def test_tier_blocks_budget_and_setting():
    stride = 3 * MIB
    host = dict(block_bytes=stride, n_expert=16, n_moe_layers=4, n_expert_used=4, n_ubatch=7)
    assert tier_blocks(StreamingSettings(), **host) == 0
    assert tier_blocks(StreamingSettings(ram_cache_mib=100), **host) == 33
    assert tier_blocks(StreamingSettings(ram_cache_mib=1e6), **host) == 64  # never more than every expert
    with pytest.raises(CapacityError, match=r"RAM tier holds 10 experts \(ram_cache_mib=30; 3.00 MiB per expert "
                                            r"block\) but one ubatch of 7 tokens may use 16 experts .*48.00 MiB"):
        tier_blocks(StreamingSettings(ram_cache_mib=30), **host)
    for bad in (0, -1.0):
        with pytest.raises(ValueError, match="ram_cache_mib must be > 0"):
            StreamingSettings(ram_cache_mib=bad)


def test_auto_tier_takes_half_the_spare_ram_or_none():
    stride = 3 * MIB
    host = dict(block_bytes=stride, n_expert=16, n_moe_layers=4, n_expert_used=4, n_ubatch=7)
    auto = StreamingSettings(ram_cache_mib="auto")
    assert tier_blocks(auto, **host, spare_ram=200 * MIB) == 33  # 100 MiB of 200 spare
    assert tier_blocks(auto, **host, spare_ram=1 << 40) == 64  # never more than every expert
    assert tier_blocks(auto, **host, spare_ram=90 * MIB) == 0  # 15 blocks < the 16 one ubatch needs: no tier
    with pytest.raises(ValueError, match="needs the spare RAM"):
        tier_blocks(auto, **host)
    for bad in ("lots", float("inf"), float("nan")):
        with pytest.raises(ValueError, match='ram_cache_mib must be > 0, "auto" or None'):
            StreamingSettings(ram_cache_mib=bad)


def test_spare_ram_is_memavailable_capped_by_the_cgroup_limit(tmp_path):
    from llamapack.provider.host_tier import spare_ram_bytes

    (tmp_path / "meminfo").write_text("MemTotal:       32000000 kB\nMemAvailable:   20000000 kB\n")
    (tmp_path / "cgroup").write_text("0::/bench/run\n")
    group = tmp_path / "root" / "bench" / "run"
    group.mkdir(parents=True)
    (group / "memory.max").write_text(str(8 << 30) + "\n")
    (group / "memory.current").write_text(str(3 << 30) + "\n")
    paths = dict(meminfo=str(tmp_path / "meminfo"), cgroup_list=str(tmp_path / "cgroup"),
                 cgroup_root=str(tmp_path / "root"))
    assert spare_ram_bytes(**paths) == 5 << 30  # the limit leaves 5 GiB of the 19 available
    (group / "memory.stat").write_text(f"anon {2 << 30}\nfile {1 << 30}\nactive_file {1 << 29}\n"
                                       f"inactive_file {1 << 29}\n")
    assert spare_ram_bytes(**paths) == (5 << 30) + (1 << 29)  # reclaimable page cache counts as spare
    (group / "memory.current").write_text(str(9 << 30) + "\n")
    assert spare_ram_bytes(**paths) == 0  # over the limit: nothing spare, never negative
    (group / "memory.max").write_text("max\n")
    assert spare_ram_bytes(**paths) == 20000000 << 10  # no limit: MemAvailable
    (tmp_path / "cgroup").write_text("12:memory:/legacy\n")  # cgroup v1 only: MemAvailable
    assert spare_ram_bytes(**paths) == 20000000 << 10
    assert spare_ram_bytes() > 0  # this machine


def test_preload_keys_give_every_layer_the_same_share():
    assert preload_keys([0, 1], 3, 100) == [(0, 0), (1, 0), (0, 1), (1, 1), (0, 2), (1, 2)]  # every expert
    part = preload_keys([2, 5, 7], 8, 7)
    assert len(part) == 7 and len(set(part)) == 7
    assert sorted(sum(1 for layer, _ in part if layer == want) for want in (2, 5, 7)) == [2, 2, 3]
    assert preload_keys([0], 4, 0) == []
    with pytest.raises(ValueError, match="needs ram_cache_mib"):
        StreamingSettings(ram_preload=True)


def test_chunked_blocks_are_few_aligned_allocations():
    calls = []

    def allocate(nbytes):
        calls.append(nbytes)
        return None, aligned_empty(nbytes)

    _, blocks = chunked_blocks(allocate, 10, 8192, chunk_bytes=4 * 8192)
    assert calls == [4 * 8192, 4 * 8192, 2 * 8192] and len(blocks) == 10
    assert all(b.nbytes == 8192 and b.ctypes.data % 4096 == 0 for b in blocks)
    starts = sorted(b.ctypes.data for b in blocks)
    assert len(set(starts)) == 10 and all(b - a >= 8192 for a, b in zip(starts, starts[1:]))
    _, blocks = chunked_blocks(allocate, 3, 3 << 30)  # a block larger than a chunk: one allocation each
    assert calls[3:] == [3 << 30] * 3


def test_cuda_copier_waits_for_a_blocks_copies_before_its_refill(monkeypatch):
    """Fake CuPy (copies run only when the stream is synchronized or an event waited for): a refill of a RAM
    block after waiting for its event cannot overwrite bytes a queued copy has not taken yet."""
    from llamapack.provider.copies import CudaCopier

    streams: list = []
    cupy = fake_cupy(streams)
    allocations = []
    real_alloc = cupy.cuda.alloc_pinned_memory
    cupy.cuda.alloc_pinned_memory = lambda nbytes: allocations.append(nbytes) or real_alloc(nbytes)
    monkeypatch.setitem(sys.modules, "cupy", cupy)
    device = np.zeros(1 << 16, dtype=np.uint8)
    copier = CudaCopier(0, device.ctypes.data, n_buffers=64, buffer_bytes=8192)  # a 64-block tier
    assert len(allocations) == 1 and len(copier.buffers) == 64 and not copier.pageable  # one pinned allocation
    assert copier.events == {}
    copier.wait_until_free(5)  # never copied from: no event, returns at once
    copier.buffers[5][:] = 7
    copier.copy(5, [(0, 0, 4096)])  # block 5 -> slot 0, queued
    copier.buffers[6][:] = 8
    copier.copy(6, [(8192, 0, 4096)])
    assert not device.any() and set(copier.events) == {5, 6}
    copier.wait_until_free(5)  # the read refilling block 5 waits for the copies out of it...
    assert (device[:4096] == 7).all()
    copier.buffers[5][:] = 9  # ...then overwrites it
    copier.copy(5, [(4096, 0, 4096)])  # the new key, to another slot
    copier.synchronize()
    assert (device[:4096] == 7).all() and (device[4096:8192] == 9).all() and (device[8192:12288] == 8).all()
    old = copier.buffers[6]
    copier.replace_buffer(6)  # a hung read keeps writing into the old memory
    old[:] = 1
    assert copier.buffers[6] is not old and copier.buffers[6].ctypes.data % 4096 == 0 and len(allocations) == 2
    assert (copier.buffers[7] == 0).all()  # its neighbours are untouched
    copier.close()
    assert copier.buffers == [] and copier.events == {}


def test_cuda_copier_swap_moves_a_buffers_memory_with_its_event(monkeypatch):
    """A lookahead buffer whose copy is still queued swaps memory with a RAM block: the block's index now
    waits for that copy, and the lookahead index gets the block's old memory, with nothing queued from it."""
    from llamapack.provider.copies import CudaCopier

    streams: list = []
    monkeypatch.setitem(sys.modules, "cupy", fake_cupy(streams))
    device = np.zeros(1 << 15, dtype=np.uint8)
    copier = CudaCopier(0, device.ctypes.data, n_buffers=4, buffer_bytes=8192)  # blocks 0-2, lookahead 3
    read_ahead, old_block = copier.buffers[3], copier.buffers[1]
    read_ahead[:] = 5
    copier.copy(3, [(0, 0, 4096)])  # queued, not run
    copier.swap_buffers(3, 1)
    assert copier.buffers[1] is read_ahead and copier.buffers[3] is old_block
    assert set(copier.events) == {1} and not device.any()
    copier.wait_until_free(3)  # nothing was copied out of the old block: returns at once, copy still queued
    assert not device.any()
    copier.wait_until_free(1)  # refilling the RAM block waits for the copy out of its (new) memory
    assert (device[:4096] == 5).all()
    copier.close()


# ---------------------------------------------------------------- through llama.cpp (CPU)
def block_bytes(models, preset: str) -> int:
    from llamapack.pack import PackReader

    with PackReader(models[preset][1]) as reader:
        return reader.layout.expert_stride


def n_keys(preset: str) -> int:
    from llamapack.synth import PRESETS as SPECS

    return SPECS[preset].n_expert * SPECS[preset].n_layer  # every layer of these presets is MoE


def tier_mib(models, preset: str, blocks: int) -> float:
    return blocks * block_bytes(models, preset) / MIB  # exact: the stride is a multiple of 4096


def replay_with_tier(trace, n_slots: int, n_blocks: int) -> tuple[dict, list]:
    """The counters the pool's and the tier's DEFAULT_POLICY give on ``trace``, and the keys read from the SSD."""
    pool, tier = DEFAULT_POLICY(n_slots), HostTier(n_blocks)
    counts = dict.fromkeys(("cache_hits", "cache_misses", "cache_evictions", "ram_hits", "ram_misses",
                            "ram_evictions"), 0)
    read = []
    for layer, experts, n_tokens in trace:
        plan = pool.acquire([(layer, e) for e in experts], n_tokens=n_tokens)
        tier_plan = tier.plan([load.key for load in plan.loads], n_tokens=n_tokens)
        for name, value in (("cache_hits", plan.hits), ("cache_misses", plan.misses),
                            ("cache_evictions", len(plan.evictions)), ("ram_hits", len(tier_plan.hits)),
                            ("ram_misses", len(tier_plan.misses)), ("ram_evictions", tier_plan.evictions)):
            counts[name] += value
        read += [key for key, _ in tier_plan.misses]
    return counts, read


@pytest.mark.parametrize("source", ["pack", "gguf"])
@pytest.mark.parametrize("preset", PRESETS)
def test_logits_equal_vanilla_with_a_ram_tier(preset, source, models, vanilla, tmp_path):
    from hookutil import logits

    n_slots = small_pool(preset, 7)
    blocks = (n_slots + n_keys(preset)) // 2  # more than the pool, fewer than the experts
    spec = spec_for(models[preset][0], 7, tmp_path / "r.npy", provider="streaming", n_slots=n_slots,
                    streaming=dict(stage_slots=3, read_splits=2, ram_cache_mib=tier_mib(models, preset, blocks)),
                    **source_spec(models, preset, source))
    got, stats = logits(spec, tmp_path)
    want = vanilla(preset, 7)
    assert np.array_equal(got, want), f"max |diff| = {np.abs(got - want).max()}"
    print(f"\n{preset} {source}: pool {n_slots}, tier {blocks}: misses {stats['cache_misses']}, ram hits "
          f"{stats['ram_hits']}, ram misses {stats['ram_misses']}, ram evictions {stats['ram_evictions']}")
    assert stats["ram_slots"] == blocks and stats["n_slots"] == n_slots and stats["io_errors"] == 0
    assert stats["ram_hits"] + stats["ram_misses"] == stats["cache_misses"]
    assert stats["ram_hits"] > 0 and stats["ram_evictions"] > 0  # both levels really stream
    assert stats["ram_evictions"] == stats["ram_misses"] - blocks
    assert stats["h2d_bytes"] == 0 and stats["tokens"] == N_PROMPT + N_DECODE
    assert stats["read_engine"] == ("native" if source == "pack" else "python")  # the default with a RAM tier


@pytest.mark.parametrize("source", ["pack", "gguf"])
@pytest.mark.parametrize("preset,n_ubatch", [("qwen3moe-tiny", 7), ("mixtral-tiny", 1)])
def test_lookahead_keeps_the_ram_tier_as_it_is_without(preset, n_ubatch, source, models, vanilla, tmp_path):
    """A RAM tier and lookahead at once: bit-exact, and the tier plans every miss whether it was read ahead or
    not (a used lookahead read becomes its RAM block by a buffer swap), so RAM hits and misses are those of the
    same decode without lookahead, and the SSD bytes are that run's plus the wasted lookahead bytes."""
    from hookutil import logits

    n_slots = small_pool(preset, n_ubatch)
    blocks = (n_slots + n_keys(preset)) // 2
    tier = dict(stage_slots=3, read_splits=2, ram_cache_mib=tier_mib(models, preset, blocks))
    runs = {}
    for name, extra in (("tier", {}), ("tier+lookahead", dict(prefetch=True, prefetch_slots=4, prefetch_top=2))):
        spec = spec_for(models[preset][0], n_ubatch, tmp_path / f"{name}.npy", provider="streaming", n_slots=n_slots,
                        streaming=dict(tier, **extra), **source_spec(models, preset, source))
        got, runs[name] = logits(spec, tmp_path)
        assert np.array_equal(got, vanilla(preset, n_ubatch)), f"{name}: max |diff| = {np.abs(got - vanilla(preset, n_ubatch)).max()}"
    alone, ahead = runs["tier"], runs["tier+lookahead"]
    assert ahead["prefetch_used"] > 0 and ahead["io_errors"] == 0 and ahead["ram_slots"] == blocks
    for counter in ("cache_misses", "ram_hits", "ram_misses", "ram_evictions"):
        assert ahead[counter] == alone[counter], counter
    assert ahead["cache_misses"] == ahead["ram_hits"] + ahead["ram_misses"]
    assert ahead["pack_read_bytes"] == alone["pack_read_bytes"] + ahead["prefetch_wasted_bytes"]


@pytest.mark.parametrize("source, tier", [("pack", "all"), ("gguf", "all"), ("pack", 24)])
def test_counters_match_a_replayed_trace_with_a_ram_tier(source, tier, models, tmp_path):
    """The prompt twice (the second time after llm.reset): with every expert fitting in RAM, the second pass
    misses the pool as much as the first, and reads nothing from the SSD."""
    preset = "qwen3moe-tiny"
    blocks = n_keys(preset) if tier == "all" else tier
    ram_cache_mib = 1e6 if tier == "all" else tier_mib(models, preset, blocks)
    spec = spec_for(models[preset][0], 7, tmp_path / "c.npy", provider="streaming", n_slots=16, n_decode=0,
                    eval_first=True, streaming=dict(stage_slots=4, read_splits=3, ram_cache_mib=ram_cache_mib,
                                                    native_hot_path=False),  # every step in the (Python) trace
                    **source_spec(models, preset, source))
    result = run_self(spec, tmp_path)
    assert result["decode_error"] is None
    first, stats, trace = result["stats_after_failure"], result["stats"], result["trace"]
    counts, read = replay_with_tier(trace, 16, blocks)
    assert stats["ram_slots"] == blocks
    assert {name: stats[name] for name in counts} == counts
    assert stats["ram_hits"] + stats["ram_misses"] == stats["cache_misses"]
    assert stats["pack_read_bytes"] == expected_read_bytes(read, models, preset, source)
    print(f"\n{source} tier {blocks}: pass 1 misses {first['cache_misses']} read {first['pack_read_bytes']} B; "
          f"both passes misses {stats['cache_misses']} read {stats['pack_read_bytes']} B, ram hits "
          f"{stats['ram_hits']}")
    if tier == "all":
        cut = result["trace_after_failure"]
        seen = {(layer, e) for layer, experts, _ in trace[:cut] for e in experts}
        assert {(layer, e) for layer, experts, _ in trace[cut:] for e in experts} <= seen  # same routing
        assert stats["cache_misses"] > first["cache_misses"]  # the pool still misses...
        assert stats["pack_read_bytes"] == first["pack_read_bytes"]  # ...but nothing more comes from the SSD
        assert stats["ram_misses"] == first["ram_misses"] == len(seen) and stats["ram_evictions"] == 0
        assert stats["ram_hits"] - first["ram_hits"] == stats["cache_misses"] - first["cache_misses"]


@pytest.mark.parametrize("kind, source", [("eio", "gguf"), ("short", "pack"), ("slow", "pack")])
def test_read_fault_with_a_ram_tier_fails_the_decode_then_recovers(kind, source, models, vanilla, tmp_path):
    gguf, pack = models["qwen3moe-tiny"]
    fault = dict(kind=kind, at=40, delay=2.0) if kind == "slow" else dict(kind=kind, at=40)
    streaming = dict(stage_slots=4, read_splits=2, ram_cache_mib=tier_mib(models, "qwen3moe-tiny", 40),
                     **(dict(read_timeout_s=0.3) if kind == "slow" else {}))
    spec = spec_for(gguf, 7, tmp_path / "f.npy", n_slots=16, provider="streaming", streaming=streaming,
                    fault=fault, eval_first=True, **source_spec(models, "qwen3moe-tiny", source))
    result = run_self(spec, tmp_path)
    assert result["decode_error"] == "llama_decode returned -3"
    error = result["provider_error"]
    want = {"eio": "read error", "short": "short read", "slow": "did not finish within 0.3 s"}[kind]
    assert error.startswith("PackIOError") and want in error and str(gguf if source == "gguf" else pack) in error
    layer, expert = map(int, re.search(r"layer (\d+) expert (\d+)", error).groups())
    assert [layer, expert] not in result["resident"]  # neither in the pool...
    assert [layer, expert] not in result["ram_resident"]  # ...nor in a RAM block
    after = result["stats_after_failure"]
    assert after["io_errors"] >= 1 and after["ram_hits"] + after["ram_misses"] == after["cache_misses"]
    if kind != "slow":
        assert after["io_errors"] == 1 and result["stats"]["io_errors"] == 1
    assert np.array_equal(np.load(tmp_path / "f.npy"), vanilla("qwen3moe-tiny", 7))  # the next request


def test_llama_wrapper_passes_ram_cache_mib(models, vanilla, tmp_path):
    gguf, _ = models["qwen3moe-tiny"]
    spec = dict(mode="llama", model=str(gguf), n_ubatch=7, n_prompt=N_PROMPT, n_decode=N_DECODE,
                out=str(tmp_path / "l.npy"), too_few_slots=3,
                llama=dict(cache_slots=16, ram_cache_mib=tier_mib(models, "qwen3moe-tiny", 48)))
    result = run_self(spec, tmp_path)
    assert "holds 3 experts" in result["capacity_error"]
    assert np.array_equal(np.load(tmp_path / "l.npy"), vanilla("qwen3moe-tiny", 7))
    stats = result["stats"]
    assert stats["ram_slots"] == 48 and stats["ram_hits"] > 0
    assert stats["ram_hits"] + stats["ram_misses"] == stats["cache_misses"]


def test_an_auto_tier_holds_every_expert_of_a_tiny_model(models, vanilla, tmp_path):
    """ram_cache_mib="auto" through the drop-in Llama: this machine's spare RAM holds every expert."""
    gguf, _ = models["qwen3moe-tiny"]
    spec = dict(mode="llama", model=str(gguf), n_ubatch=7, n_prompt=N_PROMPT, n_decode=N_DECODE,
                out=str(tmp_path / "a.npy"), llama=dict(cache_slots=16, ram_cache_mib="auto"))
    result = run_self(spec, tmp_path)
    assert np.array_equal(np.load(tmp_path / "a.npy"), vanilla("qwen3moe-tiny", 7))
    assert result["stats"]["ram_slots"] == n_keys("qwen3moe-tiny") and result["stats"]["ram_hits"] > 0


@pytest.mark.parametrize("source", ["pack", "gguf"])
def test_a_preloaded_tier_serves_every_miss_from_ram(source, models, vanilla, tmp_path):
    """ram_preload with a tier of every expert: filled at start-up, bit-exact, and the decode reads nothing."""
    preset = "qwen3moe-tiny"
    spec = spec_for(models[preset][0], 7, tmp_path / "p.npy", provider="streaming", n_slots=16,
                    streaming=dict(stage_slots=3, read_splits=2, ram_cache_mib=1e6, ram_preload=True),
                    **source_spec(models, preset, source))
    result = run_self(spec, tmp_path)
    assert np.array_equal(np.load(tmp_path / "p.npy"), vanilla(preset, 7))
    stats = result["stats"]
    from llamapack.synth import PRESETS as SPECS

    keys = preload_keys(range(SPECS[preset].n_layer), SPECS[preset].n_expert, n_keys(preset))
    assert stats["ram_preloaded"] == stats["ram_slots"] == n_keys(preset) == len(keys)
    assert stats["ram_preload_bytes"] == expected_read_bytes(keys, models, preset, source)
    assert stats["pack_read_bytes"] == 0 and stats["ram_misses"] == 0 and stats["io_errors"] == 0
    assert stats["ram_hits"] == stats["cache_misses"] > 0


def test_a_preload_read_failing_its_sha256_refuses_to_start(models, tmp_path):
    from llamapack.pack import PackReader, build_pack

    gguf, _ = models["qwen3moe-tiny"]
    pack = Path(build_pack(gguf, tmp_path / "bad.expert-pack", progress=False, safety_margin_mib=0).pack_path)
    layer, expert = 1, 2
    with PackReader(pack) as reader:
        offset = reader.layout.block_offset(layer, expert) + 4097
    flip_byte(pack, offset)
    spec = spec_for(gguf, 7, tmp_path / "x.npy", n_slots=16, provider="streaming", n_decode=None, pack=True,
                    serve_from=str(pack), streaming=dict(verify_pack_sha256=True, ram_cache_mib=1e6, ram_preload=True))
    result = run_self(spec, tmp_path)
    assert result["init_error"].startswith("IntegrityError") and f"layer {layer} expert {expert}" in result["init_error"]


# ---------------------------------------------------------------- the native hot path
@pytest.mark.parametrize("preset,n_ubatch,tier", [("qwen3moe-tiny", 1, None), ("qwen3moe-tiny", 7, "all"),
                                                  ("mixtral-tiny", 1, "all"), ("qwen3moe-tiny", 1, "half")])
def test_the_native_hot_path_decides_as_the_python_provider(preset, n_ubatch, tier, models, vanilla, tmp_path):
    """StreamingSettings.native_hot_path: libllama serves the steps that need no SSD read (all hits, or every
    miss in RAM) from the same policy objects. Same logits (vanilla's), same counters and the same final
    residency as the Python provider with its Python policy, while most steps never reach Python."""
    # no tier: a pool of most experts, so that steps hit everywhere; a tier: a small pool, so that steps miss
    n_slots = 3 * n_keys(preset) // 4 if tier is None else small_pool(preset, n_ubatch) + 2
    blocks = {None: 0, "all": n_keys(preset), "half": (n_slots + n_keys(preset)) // 2}[tier]
    streaming = dict(stage_slots=3, **(dict(ram_cache_mib=tier_mib(models, preset, blocks)) if blocks else {}))
    runs = {}
    for hot in (True, False):
        out = tmp_path / f"{hot}.npy"
        spec = spec_for(models[preset][0], n_ubatch, out, provider="streaming", n_slots=n_slots,
                        streaming=dict(streaming, native_hot_path=hot), **source_spec(models, preset, "pack"))
        runs[hot] = run_self(spec, tmp_path)
        assert np.array_equal(np.load(out), vanilla(preset, n_ubatch)), f"native_hot_path={hot}"
    native, python = runs[True], runs[False]
    for counter in ("acquires", "tokens", "cache_hits", "cache_misses", "cache_evictions", "ram_hits", "ram_misses",
                    "ram_evictions", "pack_read_bytes", "io_errors"):
        assert native["stats"][counter] == python["stats"][counter], counter
    assert native["final_resident"] == python["final_resident"]
    assert native["final_ram_resident"] == python["final_ram_resident"]
    steps, in_python = native["stats"]["native_steps"], len(native["trace"])
    assert python["stats"]["native_steps"] == 0 and len(python["trace"]) == python["stats"]["acquires"]
    assert steps + in_python == native["stats"]["acquires"] and steps > 0
    assert native["stats"]["provider_calls"] == in_python  # a native step never called the provider
    if tier == "all":  # after the first reads every miss is a RAM hit: almost nothing reaches Python
        assert steps > 3 * in_python and native["stats"]["cache_misses"] > native["stats"]["ram_misses"]


@pytest.mark.parametrize("preset", ["qwen3moe-tiny", "mixtral-tiny"])
def test_load_ahead_keeps_the_logits_and_the_steps(preset, models, vanilla, tmp_path):
    """StreamingSettings.load_ahead_min_tokens: after each multi-token step the next layer's experts that wait
    in the RAM tier are loaded ahead (here with memcpy into a host pool; on a GPU the copies overlap the layer's
    matmuls). The kernels see the same experts: vanilla's logits. The steps and their lookups are the same, the
    keys loaded ahead count as their step's misses, and most of them are used."""
    n_ubatch, n_slots = 7, 2 * small_pool(preset, 7) + 2
    streaming = dict(stage_slots=3, ram_cache_mib=tier_mib(models, preset, n_keys(preset)))
    runs = {}
    for min_tokens in (0, 2):
        out = tmp_path / f"{min_tokens}.npy"
        spec = spec_for(models[preset][0], n_ubatch, out, provider="streaming", n_slots=n_slots,
                        streaming=dict(streaming, load_ahead_min_tokens=min_tokens), **source_spec(models, preset, "pack"))
        runs[min_tokens] = run_self(spec, tmp_path)
        assert np.array_equal(np.load(out), vanilla(preset, n_ubatch)), f"load_ahead_min_tokens={min_tokens}"
    off, on = runs[0]["stats"], runs[2]["stats"]
    assert off["ahead_loads"] == 0 and on["ahead_loads"] > 0
    assert 0 <= on["ahead_unused"] < on["ahead_loads"]
    for counter in ("acquires", "tokens"):
        assert on[counter] == off[counter], counter
    assert on["cache_hits"] + on["cache_misses"] == off["cache_hits"] + off["cache_misses"]
    assert on["cache_misses"] >= on["ahead_loads"] - on["ahead_unused"]


@pytest.mark.parametrize("preset", ["qwen3moe-tiny", "mixtral-tiny"])
def test_layer_windows_keep_the_logits_and_count_every_step(preset, models, vanilla, tmp_path):
    """StreamingSettings.layer_windows_min_tokens: prefill ubatches (7 tokens) read each layer's experts from one of
    two windows of the pool (a host pool here: memcpy), loaded a layer ahead from the RAM tier; decode steps use the
    pool as before. Vanilla's logits. Every step is counted as without windows (same lookups), each layer's whole
    expert set but the first served layer's is loaded ahead. A pool smaller than two layers leaves windows off."""
    from llamapack.synth import PRESETS as SPECS

    n_ubatch, n_expert, n_layer = 7, SPECS[preset].n_expert, SPECS[preset].n_layer
    streaming = dict(stage_slots=3, ram_cache_mib=tier_mib(models, preset, n_keys(preset)), ram_preload=True)
    n_window_ubatches = N_PROMPT // n_ubatch  # the last, 1-token ubatch takes the pool
    runs = {}
    for name, min_tokens, n_slots in (("off", 0, 2 * n_expert + 1), ("on", 2, 2 * n_expert + 1),
                                      ("small pool", 2, 2 * n_expert - 1)):
        out = tmp_path / f"{name}.npy"
        spec = spec_for(models[preset][0], n_ubatch, out, provider="streaming", n_slots=n_slots,
                        streaming=dict(streaming, layer_windows_min_tokens=min_tokens), **source_spec(models, preset, "pack"))
        runs[name] = run_self(spec, tmp_path)
        assert np.array_equal(np.load(out), vanilla(preset, n_ubatch)), name
    off, on, small = runs["off"]["stats"], runs["on"]["stats"], runs["small pool"]["stats"]
    assert off["ahead_loads"] == 0 and small["ahead_loads"] == 0
    assert on["ahead_loads"] == n_window_ubatches * (n_layer - 1) * n_expert
    assert 0 < on["ahead_unused"] < on["ahead_loads"]
    # a host pool's loads ahead wait for their step (no copy callback starts them), which copies only the experts
    # it uses: those it does not are never copied (a wrong skip would leave another layer's bytes in the window)
    assert on["window_skipped"] == on["ahead_unused"] and off["window_skipped"] == 0
    for counter in ("acquires", "tokens"):
        assert on[counter] == off[counter], counter
    assert on["cache_hits"] + on["cache_misses"] == off["cache_hits"] + off["cache_misses"]
    assert on["cache_misses"] >= on["ahead_loads"] - on["ahead_unused"]
    assert on["cache_misses"] == on["ram_hits"] + on["ram_misses"]


def test_layer_windows_load_nothing_for_a_last_layer_that_takes_no_window(models, tmp_path):
    """Without logits for every token, the last layer of a prompt's ubatch computes its output rows only (none, or
    the prompt's last token): fewer tokens than the windows' minimum, so it takes the pool. The layer before it
    loads nothing ahead (round 18: that load was 340 MB wasted per ubatch on the Qwen3-30B shape). Vanilla's
    logits, with the same last-rows-only outputs."""
    from hookutil import logits
    from llamapack.synth import PRESETS as SPECS

    preset, n_ubatch = "qwen3moe-tiny", 7
    n_expert, n_layer = SPECS[preset].n_expert, SPECS[preset].n_layer
    model = models[preset][0]
    want, _ = logits(spec_for(model, n_ubatch, tmp_path / "vanilla.npy", mode="vanilla", logits_all=False), tmp_path,
                     vanilla=True)
    streaming = dict(stage_slots=3, ram_cache_mib=tier_mib(models, preset, n_keys(preset)), ram_preload=True,
                     layer_windows_min_tokens=2)
    out = tmp_path / "windows.npy"
    spec = spec_for(model, n_ubatch, out, provider="streaming", n_slots=2 * n_expert + 1, streaming=streaming,
                    logits_all=False, **source_spec(models, preset, "pack"))
    stats = run_self(spec, tmp_path)["stats"]
    assert np.array_equal(np.load(out), want)
    n_window_ubatches = N_PROMPT // n_ubatch
    assert stats["ahead_loads"] == n_window_ubatches * (n_layer - 2) * n_expert  # every layer but the first and last
    assert stats["window_skipped"] == stats["ahead_unused"]


def test_layer_windows_copy_the_experts_the_pool_holds_from_their_slots(models, tmp_path):
    """The same request twice (prompt in 7-token ubatches, then decode): by the second prompt the pool (three
    layers' experts) holds experts outside the windows' slots, and a window load of such an expert copies it from its slot (a host pool: memcpy;
    a GPU pool: device to device) instead of from the RAM tier. Vanilla's logits for the same two requests: a
    copy from a wrong slot would change them."""
    from hookutil import logits
    from llamapack.synth import PRESETS as SPECS

    preset, n_ubatch = "qwen3moe-tiny", 7
    n_expert, model = SPECS[preset].n_expert, models[preset][0]
    want, _ = logits(spec_for(model, n_ubatch, tmp_path / "vanilla.npy", mode="vanilla", rounds=2), tmp_path,
                     vanilla=True)
    streaming = dict(stage_slots=3, ram_cache_mib=tier_mib(models, preset, n_keys(preset)), ram_preload=True,
                     layer_windows_min_tokens=2)
    out = tmp_path / "windows.npy"
    spec = spec_for(model, n_ubatch, out, provider="streaming", n_slots=3 * n_expert,  # decode fills it past them
                    streaming=streaming, rounds=2, **source_spec(models, preset, "pack"))
    stats = run_self(spec, tmp_path)["stats"]
    assert np.array_equal(np.load(out), want)
    assert stats["window_from_pool"] > 0 and stats["d2d_bytes"] == 0  # host pool: memcpy, no device copies
