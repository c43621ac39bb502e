"""Hybrid execution (StreamingSettings.hybrid): a step's misses in RAM blocks computed on the CPU beside the
pool's rows. On CPU both sides run llama.cpp's CPU kernels, so the logits must equal vanilla's bit for bit
whatever the split; the split itself changes from step to step (pool hits, copies, CPU rows).

The llama.cpp runs reuse tests/test_provider_streaming.py's workers and fixtures.
"""
import numpy as np
import pytest
from test_provider_streaming import run_self, source_spec, spec_for, vanilla  # noqa: F401
from test_host_tier import n_keys, tier_mib
from hookutil import smallest_pool as small_pool

from llamapack.provider import hybrid
from llamapack.provider.settings import StreamingSettings


# ---------------------------------------------------------------- pure parts
def test_modes_parse_and_bad_ones_are_refused():
    assert hybrid.parse_mode("AUTO") == "auto" and hybrid.parse_mode("off") == "off"
    assert hybrid.parse_mode("0.25") == 0.25 and hybrid.parse_mode(1) == 1.0
    for bad in ("fast", -0.1, 1.5, None):
        with pytest.raises(ValueError, match="hybrid"):
            hybrid.parse_mode(bad)
    assert StreamingSettings(hybrid="On").hybrid == "on"
    with pytest.raises(ValueError, match="hybrid_threads must be >= 1"):
        StreamingSettings(hybrid="on", hybrid_threads=0)


def test_auto_splits_so_that_copies_and_cpu_end_together_in_eighths():
    assert hybrid.upload_share(cpu_s=50e-6, copy_s=50e-6) == 0.5
    assert hybrid.upload_share(cpu_s=100e-6, copy_s=33e-6) == 0.75  # a slow CPU: copy most
    assert hybrid.upload_share(cpu_s=10e-6, copy_s=200e-6) == 0.0   # a slow bus: compute all on the CPU
    assert hybrid.upload_share(cpu_s=1.0, copy_s=1e-9) == 1.0
    assert hybrid.upload_share(cpu_s=51e-6, copy_s=49e-6) == hybrid.upload_share(cpu_s=49e-6, copy_s=51e-6)
    assert hybrid.share_for("on") == 0.0 and hybrid.share_for(0.3) == 0.3
    with pytest.raises(ValueError):
        hybrid.upload_share(cpu_s=0.0, copy_s=1e-6)


# ---------------------------------------------------------------- through llama.cpp (host pool, CPU kernels)
@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """preset -> (gguf path, pack path), built once for the module."""
    from hookutil import models_with_packs

    return models_with_packs(tmp_path_factory.mktemp("hybrid"), ("qwen3moe-tiny", "mixtral-tiny", "gpt-oss-tiny"))


def hybrid_run(models, preset, n_ubatch, tmp_path, name, tier_blocks=None, **streaming):
    n_slots = small_pool(preset, n_ubatch) + 2
    blocks = n_keys(preset) if tier_blocks is None else tier_blocks
    out = tmp_path / f"{name}.npy"
    spec = spec_for(models[preset][0], n_ubatch, out, provider="streaming", n_slots=n_slots,
                    streaming=dict(dict(stage_slots=3, ram_cache_mib=tier_mib(models, preset, blocks)), **streaming),
                    **source_spec(models, preset, "pack"))
    result = run_self(spec, tmp_path)
    assert result.get("init_error") is None and result.get("error") is None, result
    return np.load(out), result["stats"]


@pytest.mark.parametrize("preset,n_ubatch,mode", [("qwen3moe-tiny", 1, "on"), ("qwen3moe-tiny", 7, "on"),
                                                  ("qwen3moe-tiny", 1, 0.5), ("mixtral-tiny", 1, "on"),
                                                  ("mixtral-tiny", 7, "auto")])
def test_hybrid_rows_on_the_cpu_give_vanillas_logits(preset, n_ubatch, mode, models, vanilla, tmp_path):
    """Rows split between the pool and the CPU, differently at each step, give vanilla's logits exactly; the
    counters say both sides ran."""
    logits, stats = hybrid_run(models, preset, n_ubatch, tmp_path, "hybrid", hybrid=mode, hybrid_threads=2)
    assert np.array_equal(logits, vanilla(preset, n_ubatch))
    assert stats["hybrid"]["mode"] == mode and stats["hybrid"]["threads"] == 2
    if mode == "auto":  # the split follows the costs measured at start (a loaded CPU may make it copy all)
        assert stats["hybrid"]["cpu_s_per_expert"] > 0 and stats["hybrid"]["copy_s_per_expert"] > 0
        assert stats["hybrid"]["upload_share"] == hybrid.upload_share(stats["hybrid"]["cpu_s_per_expert"],
                                                                      stats["hybrid"]["copy_s_per_expert"])
        share = stats["hybrid"]["upload_share"]
        assert stats["cpu_experts"] == 0 if share == 1 else share > 0.5 or stats["cpu_experts"] > 0
    else:
        assert stats["cpu_experts"] > 0 and stats["cpu_s"] > 0   # rows on the CPU ...
    assert stats["cache_hits"] > 0 and stats["native_steps"] > 0  # ... beside the pool's
    assert stats["cpu_experts"] < stats["ram_hits"]  # steps with an SSD read (Python's) copy their RAM hits


def test_an_empty_pool_with_every_expert_in_ram_computes_every_row_on_the_cpu(models, vanilla, tmp_path):
    """hybrid="on" without filling the pool, the RAM tier preloaded: no step ever copies, the pool stays empty,
    every row of every decode step is the CPU's (the --cpu-moe endpoint), and the logits are vanilla's."""
    preset, n_ubatch = "qwen3moe-tiny", 1
    logits, stats = hybrid_run(models, preset, n_ubatch, tmp_path, "empty", hybrid="on", ram_preload=True,
                               hybrid_fill_pool=False)
    assert np.array_equal(logits, vanilla(preset, n_ubatch))
    assert stats["cache_hits"] == 0 and stats["h2d_bytes"] == 0 and stats["pack_read_bytes"] == 0
    assert stats["cpu_experts"] == stats["cache_misses"] == stats["ram_hits"] > 0


@pytest.mark.parametrize("mode", ["on", 0.5])
def test_filling_the_pool_keeps_the_pools_decisions(mode, models, vanilla, tmp_path):
    """With hybrid_fill_pool (the default) the CPU's experts are still copied into the pool, behind the step:
    the pool's policy sees the same keys as without hybrid, so hits, misses and evictions are the same counts
    as a run with hybrid off, and the logits stay vanilla's."""
    preset, n_ubatch = "qwen3moe-tiny", 1
    _, plain = hybrid_run(models, preset, n_ubatch, tmp_path, "plain", ram_preload=True)
    logits, stats = hybrid_run(models, preset, n_ubatch, tmp_path, "fill", hybrid=mode, ram_preload=True)
    assert np.array_equal(logits, vanilla(preset, n_ubatch))
    assert stats["hybrid"]["fill_pool"] is True and stats["cpu_experts"] > 0
    assert [stats[k] for k in ("cache_hits", "cache_misses", "cache_evictions")] == \
        [plain[k] for k in ("cache_hits", "cache_misses", "cache_evictions")]
    if mode == "on":  # every miss (all in RAM, every step split at n_ubatch 1) on the CPU, and loaded all the same
        assert stats["cpu_experts"] == stats["cache_misses"] > 0
    else:
        assert 0 < stats["cpu_experts"] < stats["cache_misses"]


def test_large_ubatches_and_unsplittable_layers_stay_on_the_pool(models, vanilla, tmp_path):
    """A prompt ubatch above hybrid.MAX_TOKENS runs every row on the pool (as without hybrid), and so does a
    model whose layers the CPU side cannot take (gpt-oss: expert biases)."""
    logits, stats = hybrid_run(models, "qwen3moe-tiny", 64, tmp_path, "prompt", hybrid="on")
    assert np.array_equal(logits, vanilla("qwen3moe-tiny", 64))
    decode_only = stats["cpu_experts"]
    assert decode_only > 0  # the decode tokens (one per ubatch) split
    logits, stats = hybrid_run(models, "gpt-oss-tiny", 1, tmp_path, "gptoss", hybrid="on")
    assert np.array_equal(logits, vanilla("gpt-oss-tiny", 1))
    assert stats["cpu_experts"] == 0 and stats["ram_hits"] > 0


def test_hybrid_without_a_ram_tier_is_refused_clearly(models, tmp_path):
    preset = "qwen3moe-tiny"
    out = tmp_path / "x.npy"
    spec = spec_for(models[preset][0], 1, out, provider="streaming", n_slots=small_pool(preset, 1) + 2,
                    streaming=dict(hybrid="on"), **source_spec(models, preset, "pack"))
    result = run_self(spec, tmp_path)
    assert result["init_error"].startswith("InputError") and "hybrid needs a RAM tier" in result["init_error"]
