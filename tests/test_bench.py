"""``llamapack bench`` on CPU: the matrix, the report's arithmetic on hand-built results, the cgroup and disk
probe helpers, and a real end-to-end run on a tiny model whose pack runs must equal vanilla bit for bit."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from llamapack.bench.cgroup import MemoryCage
from llamapack.bench.configs import AHEAD_MIN_TOKENS, BenchConfig, default_matrix, parse_config, schedule, select
from llamapack.bench.diskbw import random_read_bandwidth
from llamapack.bench.report import combine, compare_digests, markdown, plot, ratios, summaries

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_matrix_has_the_side_by_side_runs():
    names = [c.name for c in default_matrix(16, 8192, (0.25, 0.5), ram_tier=True)]
    assert names == ["vanilla-vram", "cpu-moe", "pack-100%", "pack-25%+ram", "pack-50%+ram", "cpu-moe@8G",
                     "pack-25%@8G", "pack-50%@8G", "gguf-direct-25%@8G", "gguf-direct-50%@8G"]
    limited = {c.name: c for c in default_matrix(16, 8192)}
    assert limited["cpu-moe@8G"].repack is False and limited["cpu-moe"].repack is True  # 8 GiB cannot hold a repack
    assert limited["cpu-moe"].n_threads == 16 and limited["pack-25%@8G"].memory_limit_mib == 8192
    cpu = default_matrix(2, None, gpu=False, gguf_direct=False)
    assert [c.name for c in cpu] == ["vanilla", "cpu-moe", "pack-100%", "pack-25%", "pack-50%"]
    assert cpu[0].reference and cpu[0].repack is False  # a host pool runs unrepacked: the reference must too
    assert BenchConfig("p", source="pack", vram_fraction=0.25).cache_slots(6144) == 1536
    with_prefetch = [c.name for c in default_matrix(16, 8192, (0.25,), gguf_direct=False, prefetch=True)]
    assert with_prefetch[-3:] == ["cpu-moe@8G", "pack-25%@8G", "pack-25%+prefetch@8G"]
    assert default_matrix(16, 8192, (0.25,), prefetch=True)[-2].prefetch  # before gguf-direct-25%@8G
    tops = default_matrix(16, 8192, (0.25,), gguf_direct=False, prefetch_tops=(1, 2))
    assert [(c.name, c.prefetch_top) for c in tops[-2:]] == [("pack-25%+prefetch-top1@8G", 1),
                                                             ("pack-25%+prefetch-top2@8G", 2)]
    variants = default_matrix(16, 8192, (0.25,), gguf_direct=False, prefetch_depths=(4,), read_splits=(4,))
    assert [(c.name, c.prefetch, c.prefetch_depth, c.read_splits) for c in variants[-2:]] == [
        ("pack-25%+prefetch-d4@8G", True, 4, None), ("pack-25%+split4@8G", False, 1, 4)]
    more = default_matrix(16, 8192, (0.25,), gguf_direct=False, prefetch_in_flights=(1,), ram_fractions=(0.25,),
                          read_engines=True)
    assert [(c.name, c.prefetch_in_flight, c.ram_fraction, c.native_reads) for c in more[-9:]] == [
        ("pack-25%@8G", None, None, None), ("pack-25%+prefetch-c1@8G", 1, None, None),
        ("pack-25%+ram25%@8G", None, 0.25, None), ("pack-25%+native@8G", None, None, True),
        ("pack-25%+prefetch-c1+native@8G", 1, None, True), ("pack-25%+ram25%+native@8G", None, 0.25, True),
        ("pack-25%+pyreads@8G", None, None, False), ("pack-25%+prefetch-c1+pyreads@8G", 1, None, False),
        ("pack-25%+ram25%+pyreads@8G", None, 0.25, False)]


@pytest.mark.parametrize("kwargs, message", [
    (dict(source="disk"), "unknown source"),
    (dict(source="pack"), "vram_fraction"),
    (dict(vram_fraction=0.5), "vram_fraction"),
    (dict(source="pack", vram_fraction=1.5), "must be in"),
    (dict(source="pack", vram_fraction=0.5, cpu_moe=True), "cpu_moe"),
    (dict(prefetch=True), "prefetch, read_splits and native_reads are llamapack settings"),
    (dict(read_splits=4), "prefetch, read_splits and native_reads are llamapack settings"),
    (dict(native_reads=False), "prefetch, read_splits and native_reads are llamapack settings"),
    (dict(source="pack", vram_fraction=0.5, prefetch=True, prefetch_depth=9), "prefetch_depth must be in"),
])
def test_bad_configs_are_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        BenchConfig("x", **kwargs)


def test_select_names_unknown_runs():
    matrix = default_matrix(2, None, gpu=False)
    assert [c.name for c in select(matrix, ["pack-25%", "vanilla"])] == ["vanilla", "pack-25%"]
    with pytest.raises(ValueError, match="unknown config.*nope.*Known: vanilla.*or any vanilla-vram"):
        select(matrix, ["nope"])


def test_every_matrix_name_parses_back_to_its_config():
    matrix = (default_matrix(16, 8192, (0.25, 0.5), ram_tier=True, prefetch=True, prefetch_tops=(1, 2),
                             prefetch_depths=(4,), read_splits=(4,), prefetch_in_flights=(1,), ram_fractions=(0.25,),
                             read_engines=True)
              + default_matrix(16, None, (0.25,), ram_tier=True) + default_matrix(16, 1536, (0.25,))
              + default_matrix(16, None, gpu=False))
    assert len(matrix) > 60
    for config in matrix:
        assert parse_config(config.name, 16) == config, config.name


def test_a_combination_outside_the_matrix_is_parsed():
    combo = parse_config("pack-25%+ram25%+prefetch-top2+prefetch-c1+native@8G", 16)
    assert (combo.source, combo.vram_fraction, combo.ram_fraction, combo.prefetch, combo.prefetch_top,
            combo.prefetch_in_flight, combo.native_reads, combo.memory_limit_mib) == (
        "pack", 0.25, 0.25, True, 2, 1, True, 8192)
    assert parse_config("gguf-direct-50%+split2@512M", 16).memory_limit_mib == 512
    auto = parse_config("pack-25%+ramauto+prefetch-top1@8G", 16)
    assert (auto.ram_auto, auto.ram_fraction, auto.ram_cache_mib(1 << 30), auto.prefetch_top) == (True, None, "auto", 1)
    assert parse_config("pack-25%+ram50%", 16).ram_cache_mib(1 << 30) == 512
    assert parse_config("pack-25%", 16).ram_cache_mib(1 << 30) is None
    assert parse_config("pack-25%+ram+preload", 16).ram_preload and parse_config("pack-25%+ramauto+preload", 16).ram_auto
    assert parse_config("pack-25%", 16).verify and not parse_config("pack-25%+noverify@8G", 16).verify
    with pytest.raises(ValueError, match="noverify"):
        parse_config("gguf-direct-25%+noverify", 16)
    assert [parse_config(n, 16).cache_policy for n in ("pack-25%@8G", "pack-25%+lfulru@8G", "pack-25%+ram+lru")] == [
        "next-use", "lfu-lru", "lru"]
    with pytest.raises(ValueError, match="cache policy is a llamapack setting"):
        parse_config("cpu-moe+lru", 16)
    for name, message in (("pack-25%+nope@8G", "unknown option 'nope'"), ("pack-x%", "unknown run"),
                          ("pack-25%@8X", "@<n>G or @<n>M"), ("cpu-moe+prefetch", "llamapack settings"),
                          ("pack-250%", "must be in"), ("pack-25%+ram50%+ramauto", "instead of ram_fraction"),
                          ("vanilla+ramauto", "llamapack setting"), ("pack-25%+preload", "needs ram_fraction")):
        with pytest.raises(ValueError, match=message):
            parse_config(name, 16)
    chosen = select(default_matrix(2, None, gpu=False), ["pack-25%+ram50%", "vanilla"], n_cores=2)
    assert [(c.name, c.ram_fraction) for c in chosen] == [("vanilla", None), ("pack-25%+ram50%", 0.5)]


def test_pyhot_and_warm_suffixes():
    hot = parse_config("pack-25%+ram+preload+pyhot", 16)
    assert (hot.native_hot_path, hot.ram_preload, hot.warm_start) == (False, True, False)
    assert parse_config("pack-25%@8G", 16).native_hot_path and parse_config("gguf-direct-25%+pyhot", 16).source == "gguf_direct"
    warm = parse_config("pack-12.5%+warm@8G", 16)
    assert (warm.warm_start, warm.native_hot_path, warm.vram_fraction, warm.memory_limit_mib) == (True, True, 0.125, 8192)
    assert parse_config("pack-25%+warm+pyhot@8G", 16) == BenchConfig(
        "pack-25%+warm+pyhot@8G", source="pack", vram_fraction=0.25, warm_start=True, native_hot_path=False,
        memory_limit_mib=8192)
    for name, message in (("vanilla-vram+pyhot", "pyhot .* is a llamapack setting"),
                          ("cpu-moe+pyhot@8G", "pyhot .* is a llamapack setting"),
                          ("cpu-moe+warm", "warm .* is a pack setting"),
                          ("gguf-direct-25%+warm", "warm .* is a pack setting"),
                          ("pack-25%+warm+lfulru", "next-use policy"),
                          ("pack-25%+warm+ownrouting", r"not \+ownrouting"),
                          ("pack-25%+pyhots", "unknown option 'pyhots'")):
        with pytest.raises(ValueError, match=message):
            parse_config(name, 16)


def test_pyhot_needs_a_llama_that_takes_the_setting():
    from llamapack.bench.worker import hot_path_option

    class Old:
        def __init__(self, model_path, *, warm_start=None, **kwargs):
            pass

    class New:
        def __init__(self, model_path, *, native_hot_path=True, **kwargs):
            pass

    default, python = parse_config("pack-25%", 2), parse_config("pack-25%+pyhot", 2)
    assert hot_path_option(Old, default) == {}  # the default needs nothing passed
    with pytest.raises(RuntimeError, match=r"pack-25%\+pyhot: \+pyhot needs llamapack.Llama to take native_hot_path"):
        hot_path_option(Old, python)  # never silently the default (llama_cpp.Llama swallows unknown keywords)
    assert hot_path_option(New, python) == {"native_hot_path": False}
    assert hot_path_option(New, default) == {"native_hot_path": True}


def test_oppath_runs_the_remap_op_instead_of_the_slot_lookup():
    from llamapack.bench.worker import lookup_option
    from llamapack.provider.settings import StreamingSettings

    op, default = parse_config("pack-25%+ram+preload+oppath", 16), parse_config("pack-25%+ram+preload", 16)
    assert (op.slot_lookup, op.ram_preload, default.slot_lookup) == (False, True, True)
    with pytest.raises(ValueError, match="oppath .* is a llamapack setting"):
        parse_config("vanilla-vram+oppath", 16)

    class Old:
        def __init__(self, model_path, **kwargs):
            pass

    class New:
        def __init__(self, model_path, *, slot_lookup_max_tokens=32, **kwargs):
            pass

    assert lookup_option(Old, default) == {} and lookup_option(New, default) == {}
    with pytest.raises(RuntimeError, match=r"\+oppath needs llamapack.Llama to take slot_lookup_max_tokens"):
        lookup_option(Old, op)  # never silently the lookup
    assert lookup_option(New, op) == {"slot_lookup_max_tokens": 0}
    with pytest.raises(ValueError, match="slot_lookup_max_tokens must be >= 0"):
        StreamingSettings(slot_lookup_max_tokens=-1)


def test_ahead_loads_ahead_with_a_ram_tier_only():
    from llamapack.bench.worker import lookup_option

    ahead = parse_config("pack-25%+ram+preload+ahead", 16)
    assert ahead.load_ahead and not parse_config("pack-25%+ram+preload", 16).load_ahead
    for name in ("pack-25%+ahead", "vanilla-vram+ahead", "pack-25%+ram+pyhot+ahead"):
        with pytest.raises(ValueError, match="ahead .* needs a RAM tier"):
            parse_config(name, 16)

    class Old:
        def __init__(self, model_path, **kwargs):
            pass

    class New:
        def __init__(self, model_path, *, load_ahead_min_tokens=0, **kwargs):
            pass
    with pytest.raises(RuntimeError, match=r"\+ahead needs llamapack.Llama to take load_ahead_min_tokens"):
        lookup_option(Old, ahead)
    assert lookup_option(New, ahead) == {"load_ahead_min_tokens": AHEAD_MIN_TOKENS}


def test_nowhole_keeps_the_lookup_when_the_pool_holds_every_expert():
    from llamapack.bench.worker import lookup_option

    nowhole = parse_config("pack-100%+ram+preload+nowhole", 16)
    assert (nowhole.whole_pool, nowhole.slot_lookup, parse_config("pack-100%", 16).whole_pool) == (False, True, True)
    with pytest.raises(ValueError, match="nowhole .* is a llamapack setting"):
        parse_config("vanilla-vram+nowhole", 16)

    class Old:
        def __init__(self, model_path, *, slot_lookup_max_tokens=32, **kwargs):
            pass

    class New(Old):
        def __init__(self, model_path, *, whole_pool_graphs=True, **kwargs):
            pass

    with pytest.raises(RuntimeError, match=r"\+nowhole needs llamapack.Llama to take whole_pool_graphs"):
        lookup_option(Old, nowhole)  # never silently whole-pool
    assert lookup_option(New, nowhole) == {"whole_pool_graphs": False}
    # the other llamapack runs keep llamapack's default (on)
    assert lookup_option(New, parse_config("pack-100%", 16)) == {}
    assert lookup_option(New, parse_config("vanilla-vram", 16)) == {} == lookup_option(Old, parse_config("pack-100%", 16))
    both = parse_config("pack-100%+oppath+nowhole", 16)
    assert lookup_option(type("Both", (), {"__init__": lambda self, m, *, slot_lookup_max_tokens=32,
                                           whole_pool_graphs=True: None}), both) == {
        "slot_lookup_max_tokens": 0, "whole_pool_graphs": False}


def test_hot_path_and_warm_start_tables():
    results = results_by_hand()
    pyhot = dict(config=dict(name="pack-25%+pyhot@8G"), requests=[request(
        8, ["a", "b"], 1, 1.0, cache_hits=30, cache_misses=10, pack_read_bytes=100 << 20, provide_s=0.8)])
    cold = dict(config=dict(name="pack-50%@8G"), load_s=2.0, load_counters=dict(pack_read_bytes=0), requests=[
        request(8, ["a"], 4, 1.0, prefill_s=3.0, cache_hits=30, cache_misses=10)])
    cold["requests"][0]["prefill_counters"] = dict(cache_hits=0, cache_misses=16, pack_read_bytes=16 << 20)
    warm = dict(config=dict(name="pack-50%+warm@8G"), load_s=2.5, load_counters=dict(pack_read_bytes=8 << 20),
                requests=[request(8, ["a"], 4, 1.0, prefill_s=1.5, cache_hits=35, cache_misses=5)],
                priming=dict(phase="prime", load_s=2.0, wall_s=9.0, layers_saved=2, saved=["x.json"],
                             requests=[dict(request=2, n_prompt=3, prefill_s=0.5, n_decoded=5, decode_s=1.0)]))
    warm["requests"][0]["prefill_counters"] = dict(cache_hits=12, cache_misses=4, pack_read_bytes=4 << 20)
    results["runs"] += [pyhot, cold, warm]
    results["workload"]["warm"] = dict(routing="/x/prime.npz", same_trace=False, cap_s=8.0,
                                       requests=[dict(request=2, n_prompt=3, decode_tokens=5)])
    rows = {row.name: row for row in summaries(results)}
    assert rows["pack-50%+warm@8G"].first_request == dict(n_prompt=8, ttft_s=1.5, prefill_hit_rate=0.75,
                                                          decode_hit_rate=35 / 40, hit_rate=47 / 56, read_bytes=4 << 20)
    assert rows["pack-50%+warm@8G"].load_read_bytes == 8 << 20 and rows["pack-50%@8G"].priming is None
    assert rows["pack-50%+warm@8G"].priming == dict(requests=1, prompt_tokens=3, decoded=5, load_s=2.0, serve_s=1.5,
                                                    wall_s=9.0, layers_saved=2)
    text = markdown(results)
    # native 2 tok/s (pack-25%@8G) against 1 through Python; the same 75% hit rate
    assert "| pack-25%@8G | 2.00 | 1.00 | 2.00x | 75.0% / 75.0% |" in text.split("## Native hot path")[1]
    section = text.split("## Warm start: the first request")[1]
    assert "**while loading**" in section
    assert "| pack-50%@8G | 2.00 | 0 | 8 | 3.00 | 0.0% / 75.0% / 53.6% | 16 | – |" in section
    assert "| pack-50%+warm@8G | 2.50 | 8 | 8 | 1.50 | 75.0% / 87.5% / 83.9% | 4 | 1, 5, 9.0 |" in section
    assert "served requests 2 (3 prompt + up to 5 decode tokens) of `prime.npz` (a trace of other requests)" in text
    assert "warm-up prompt" not in section
    results["workload"]["warmup_tokens"] = 16  # said: the cold twin's caches were warmed by it
    assert "Each run evaluated a 16-token warm-up prompt before it" in markdown(results).split("## Warm start")[1]
    results["runs"].remove(cold)
    assert "| pack-50%@8G | not run (the cold twin) |" in markdown(results)


def test_hybrid_table_reports_the_split_and_the_cpu_rows():
    results = results_by_hand()
    hybrid = dict(config=dict(name="pack-25%+ram+hybridauto"),
                  provider=dict(hybrid=dict(mode="auto", upload_share=0.5, threads=15, cpu_s_per_expert=67e-6,
                                            copy_s_per_expert=62e-6)),
                  requests=[request(8, ["a", "b"], 4, 1.0, cache_hits=30, cache_misses=10, cpu_experts=6, cpu_s=0.002)])
    results["runs"].append(hybrid)
    rows = {row.name: row for row in summaries(results)}
    assert rows["pack-25%+ram+hybridauto"].hybrid["cpu_rows_per_token"] == 1.5
    assert rows["pack-25%@8G"].hybrid is None
    section = markdown(results).split("## Hybrid: RAM-tier misses computed on the CPU")[1]
    assert "| pack-25%+ram+hybridauto | auto | 0.500 | 15 | 67.0 | 62.0 | 1.5 | 0.50 | 75.0% |" in section
    assert "pack-25%@8G" not in section.split("## ")[0]


def test_schedule_runs_the_reference_once_and_shuffles_each_round():
    configs = [BenchConfig("ref", reference=True)] + [BenchConfig(f"c{i}") for i in range(8)]
    assert [(r, c.name) for r, c in schedule(configs[:3], 2)] == [(1, "ref"), (1, "c0"), (1, "c1"), (2, "c0"),
                                                                   (2, "c1")]
    order = schedule(configs, 3, shuffle_seed=7)
    assert order == schedule(configs, 3, shuffle_seed=7)  # seeded: the same order every time
    assert order[0] == (1, configs[0]) and sum(c.reference for _, c in order) == 1
    rounds = [[c.name for r, c in order[1:] if r == n] for n in (1, 2, 3)]
    assert all(sorted(names) == [f"c{i}" for i in range(8)] for names in rounds)
    assert len({tuple(names) for names in rounds}) == 3  # a fresh shuffle each round
    with pytest.raises(ValueError, match="rounds must be >= 1"):
        schedule(configs, 0)


def test_rounds_are_combined_into_medians():
    results = results_by_hand()
    again = [dict(run, round=2) for run in results["runs"][1:3]]
    again[1] = dict(again[1], requests=[request(8, ["a", "b"], 3, 0.5, cache_hits=30, cache_misses=10,
                                                pack_read_bytes=300 << 20, provide_s=0.4)])  # 6 tok/s
    third = dict(results["runs"][2], round=3, requests=[request(8, ["a", "z"], 1, 0.25, cache_hits=1,
                                                                cache_misses=1, pack_read_bytes=1, provide_s=0.1)])
    results["runs"] += again + [third]
    results["workload"].update(rounds=3, shuffle_seed=5)
    rows = {row.name: row for row in combine(summaries(results))}
    pack = rows["pack-25%@8G"]
    assert pack.n_rounds == 3 and pack.decode_by_round == (2.0, 6.0, 4.0) and pack.decode_tok_s == 4.0
    assert pack.bit_exact == "round 3: NO (first at request of 8 tokens, step 1)"
    assert rows["cpu-moe@8G"].n_rounds == 2 and rows["cpu-moe@8G"].decode_tok_s == 0.5
    assert rows["pack-25%+prefetch@8G"].n_rounds == 1 and rows["pack-25%+prefetch@8G"].bit_exact == "yes (2 steps)"
    (entry,) = [r for r in ratios(list(rows.values())) if r["run"] == "pack-25%@8G"]
    assert entry["decode_ratio"] == pytest.approx(8.0)  # the medians: 4 tok/s against 0.5
    text = markdown(results)
    assert "| pack-25%@8G | 2.00 | 6.00 | 4.00 | 4.00 | 3.00x |" in text
    assert "each round shuffled (seed 5)" in text and "Round 2: cpu-moe@8G, pack-25%@8G" in text
    results["runs"][-1] = dict(third, requests=[request(8, ["a", "b"], 1, 0.25)])
    assert {row.name: row for row in combine(summaries(results))}["pack-25%@8G"].bit_exact == "yes (6 steps, 3 runs)"


def request(n_prompt, digests, n_decoded, decode_s, prefill_s=1.0, **decode_counters):
    return dict(n_prompt=n_prompt, prefill_s=prefill_s, ttft_s=prefill_s, n_decoded=n_decoded, decode_s=decode_s,
                digests=digests, tokens=[], prefill_counters={}, decode_counters=decode_counters)


def results_by_hand():
    ref = dict(config=dict(name="vanilla-vram", reference=True),
               requests=[request(8, ["a", "b", "c"], 2, 0.1, prefill_s=0.5)])
    cpu = dict(config=dict(name="cpu-moe@8G"), requests=[request(8, ["a", "x", "y"], 2, 4.0, prefill_s=8.0)])
    pack = dict(config=dict(name="pack-25%@8G"), requests=[request(
        8, ["a", "b"], 1, 0.5, prefill_s=2.0, cache_hits=30, cache_misses=10, pack_read_bytes=100 << 20,
        provide_s=0.4, read_wait_s=0.3, copy_wait_s=0.05, provider_call_s=0.42)])
    ahead = dict(config=dict(name="pack-25%+prefetch@8G"), requests=[request(
        8, ["a", "b"], 1, 0.25, cache_hits=30, cache_misses=10, pack_read_bytes=110 << 20, provide_s=0.2,
        lookahead_keys=40, lookahead_hits=30, prefetch_reads=12, prefetch_used=8, prefetch_wasted=3,
        prefetch_wasted_bytes=10 << 20)])
    python_threads = dict(config=dict(name="pack-25%+pyreads@8G"), requests=[request(
        8, ["a", "b"], 1, 1.0, cache_hits=30, cache_misses=10, pack_read_bytes=100 << 20, provide_s=0.8)])
    broken = dict(config=dict(name="gguf-direct-25%@8G"), error="worker exit -9: killed")
    return dict(command="llamapack bench m.gguf", machine=dict(cpus=2), disk=dict(nbytes=1000 << 20, seconds=2.0),
                model=dict(path="m.gguf", size_bytes=10 ** 9, expert_bytes=9 * 10 ** 8, n_moe_layers=2, n_expert=8,
                           expert_stride=4 << 20),
                workload=dict(prompt_lengths=[8], n_decode=3, decode_cap_s=5.0, n_ubatch=512),
                runs=[ref, cpu, pack, ahead, python_threads, broken])


def test_the_io_bound_uses_the_faster_disk_probe():
    results = results_by_hand()
    results["disk_after"] = dict(nbytes=1500 << 20, seconds=2.0, gb_per_s=0.79)  # 750 MiB/s, after the runs
    pack = {row.name: row for row in summaries(results)}["pack-25%@8G"]
    assert pack.io_bound_tok_s == pytest.approx(7.5) and pack.io_bound_fraction == pytest.approx(2.0 / 7.5)
    assert "GB/s after (the I/O bound uses the faster)" in markdown(results)
    results["disk_after"] = dict(nbytes=100 << 20, seconds=2.0, gb_per_s=0.05)  # slower: the first probe counts
    assert {row.name: row for row in summaries(results)}["pack-25%@8G"].io_bound_tok_s == pytest.approx(5.0)


def test_report_arithmetic_on_hand_built_results(tmp_path):
    rows = {row.name: row for row in summaries(results_by_hand())}
    pack = rows["pack-25%@8G"]
    assert pack.decode_tok_s == 2.0 and pack.hit_rate == 0.75
    assert pack.read_bytes_per_token == 100 << 20
    assert pack.io_bound_tok_s == pytest.approx(5.0)  # 500 MiB/s over 100 MiB per token
    assert pack.io_bound_fraction == pytest.approx(0.4)
    # libllama timed 0.42 s in the callback, Python 0.4 s: 0.02 s entering it, taken from "outside"
    assert pack.breakdown == pytest.approx(dict(read_wait_s=0.3, copy_wait_s=0.05, provider_other_s=0.05,
                                                lookahead_s=0.0, entering_callbacks_s=0.02, outside_provider_s=0.08))
    assert pack.bit_exact == "yes (2 steps)"
    assert rows["cpu-moe@8G"].bit_exact.startswith("NO (first at request of 8 tokens, step 1)")
    assert rows["vanilla-vram"].bit_exact == "reference" and not rows["gguf-direct-25%@8G"].ok
    (entry,) = [r for r in ratios(list(rows.values())) if r["run"] == "pack-25%@8G"]
    assert entry["baseline"] == "cpu-moe@8G" and entry["decode_ratio"] == pytest.approx(4.0)
    assert entry["prefill_ratio_8"] == pytest.approx(4.0)
    text = markdown(results_by_hand())
    assert "| pack-25%@8G | cpu-moe@8G | 4.00x | 4.00x |" in text and "failed: worker exit -9" in text
    ahead = rows["pack-25%+prefetch@8G"]
    assert pack.lookahead is None and ahead.lookahead["accuracy"] == 0.75
    assert ahead.lookahead["misses_read_ahead"] == 0.8 and ahead.lookahead["wasted_bytes_per_token"] == 10 << 20
    # decode 4 tok/s against 2 without prefetch; 75% predicted, 8 of 10 misses read ahead, 10 MiB wasted/token
    assert "| pack-25%+prefetch@8G | 2.00x | 75.0% | 80.0% | 10.00 |" in text
    # decode 2 tok/s on the native pool against 1 on Python threads
    assert "| pack-25%@8G | 2.00 | 1.00 | 2.00x |" in text


def test_a_prompt_length_given_twice_reports_its_later_prompt():
    """--prompt-lengths 512,512,32: the second 512-token prompt (first-use costs paid by the first) is the one in
    the table, in one column, and the workload line says so."""
    results = results_by_hand()
    results["workload"]["prompt_lengths"] = [8, 8, 4]
    results["workload"]["warmup_tokens"] = 16
    results["runs"] = results["runs"][:1]
    results["runs"][0]["requests"] = [request(8, ["a"], 0, 0.0, prefill_s=2.0), request(8, ["a"], 0, 0.0, prefill_s=0.5),
                                      request(4, ["b"], 0, 0.0, prefill_s=0.5)]
    (row,) = summaries(results)
    assert row.prefill_tok_s == {8: 16.0, 4: 8.0}
    text = markdown(results)
    assert text.count("prefill 8 tok/s") == 1 and "| 16.0 | 8.0 |" in text
    assert "prompts of 8, 8, 4 tokens (a length given twice: the table shows its later prompt)" in text
    assert "each run first evaluates a 16-token prompt it throws away" in text


def test_digests_of_other_prompts_are_not_compared():
    a = dict(requests=[request(8, ["a"], 0, 0.0)])
    b = dict(requests=[request(9, ["a"], 0, 0.0)])
    assert compare_digests(a, b) == "n/a (other prompts)"


def test_plot_writes_a_png(tmp_path):
    pytest.importorskip("matplotlib", reason="matplotlib is in the test extra; install it with pip install -e .[test]")
    assert plot(results_by_hand(), tmp_path / "bench.png")
    assert (tmp_path / "bench.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_memory_cage_writes_the_limit_and_reads_the_peak(tmp_path):
    root = tmp_path / "cgroup"
    root.mkdir()
    (root / "cgroup.controllers").write_text("cpu io memory pids\n")
    (root / "cgroup.subtree_control").write_text("cpu\n")
    with MemoryCage(8 << 30, root=root) as cage:
        assert (root / "cgroup.subtree_control").read_text() == "+memory"
        assert (cage.path / "memory.max").read_text() == str(8 << 30)
        cage.join()
        assert (cage.path / "cgroup.procs").read_text() == str(os.getpid())
        (cage.path / "memory.peak").write_text("123456\n")
        (cage.path / "memory.events").write_text("low 0\nhigh 0\nmax 4\noom 1\noom_kill 1\n")
        assert cage.peak_bytes() == 123456 and cage.oom_kills() == 1


def test_memory_cage_without_a_memory_controller_says_so(tmp_path):
    from llamapack.bench.cgroup import CgroupError

    (tmp_path / "cgroup.controllers").write_text("cpu io\n")
    with pytest.raises(CgroupError, match="without the memory controller"):
        MemoryCage(1 << 30, root=tmp_path).__enter__()


def test_sampling_is_greedy_at_zero_and_reproducible_above():
    from llamapack.bench.worker import next_token

    logits = np.array([0.0, 3.0, 1.0, 2.9], dtype=np.float32)
    assert next_token(logits, 0.0, np.random.default_rng(0)) == 1
    draws = [next_token(logits, 1.0, np.random.default_rng(seed)) for seed in range(40)]
    assert draws == [next_token(logits, 1.0, np.random.default_rng(seed)) for seed in range(40)]
    assert {1, 3} <= set(draws) and set(draws) <= {0, 1, 2, 3}  # sampled, not argmax


def test_disk_probe_reads_whole_blocks(tmp_path):
    path = tmp_path / "blocks.bin"
    path.write_bytes(os.urandom(16 * 65536))
    result = random_read_bandwidth(str(path), 65536, 0, 16, threads=2, seconds=0.2)
    assert result.reads > 0 and result.nbytes == result.reads * 65536 and result.bytes_per_s > 0


def test_bench_end_to_end_on_a_tiny_model(tmp_path):
    """A real run: vanilla (reference), pack caches of 25% and 100%, GGUF-direct 50%; the pack runs read
    experts and their logits equal vanilla's at every step."""
    from llamapack.pack import build_pack
    from llamapack.synth import write_model

    model = write_model(tmp_path / "tiny.gguf", "mixtral-tiny", seed=0)
    build_pack(model, progress=False, safety_margin_mib=0)
    out = tmp_path / "results"
    proc = subprocess.run(
        [sys.executable, "-m", "llamapack", "bench", str(model), "-o", str(out), "-n", "12", "--prompt-lengths",
         "8,40", "--decode-cap-s", "30", "-ub", "1", "--prefetch", "--temperature", "1.0", "--configs",
         "vanilla,pack-100%,pack-25%,pack-25%+prefetch,gguf-direct-50%"],
        capture_output=True, text=True, timeout=600, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-3000:]
    data = json.loads((out / "bench.json").read_text())
    rows = {row["name"]: row for row in data["summaries"]}
    assert [r["config"]["name"] for r in data["runs"]] == ["vanilla", "pack-100%", "pack-25%", "pack-25%+prefetch",
                                                           "gguf-direct-50%"]
    for name in ("pack-100%", "pack-25%", "pack-25%+prefetch", "gguf-direct-50%"):
        assert rows[name]["ok"] and rows[name]["bit_exact"] == "yes (24 steps)", rows[name]
    assert rows["pack-25%"]["read_bytes_per_token"] > 0 and rows["pack-25%"]["hit_rate"] < 1
    assert data["disk"]["reads"] > 0 and data["runs"][2]["provider"]["n_slots"] == 6  # 25% of 3 x 8 experts
    assert rows["pack-25%+prefetch"]["lookahead"]["used"] > 0  # the lookahead ran and read misses ahead
    sampled = [[r["tokens"] for r in run["requests"]] for run in data["runs"]]
    assert all(tokens == sampled[0] for tokens in sampled)  # same logits, same seeds: the same sampled tokens
    assert "sampled at temperature 1" in (out / "bench.md").read_text()
    assert "| pack-25% |" in (out / "bench.md").read_text()
    assert "| pack-25%+prefetch | " in (out / "bench.md").read_text().split("## Router lookahead")[1]
    for run in data["runs"]:  # the evaluation alone is timed inside the decode loop's wall time
        assert all(0 < r["decode_eval_s"] < r["decode_s"] for r in run["requests"])


def test_bench_rounds_end_to_end(tmp_path):
    """Two shuffled rounds of a config outside the matrix (a RAM tier of half the experts): the reference runs
    once, each other config twice, every run bit-exact, and the report gives the median per config."""
    from llamapack.pack import build_pack
    from llamapack.synth import write_model

    model = write_model(tmp_path / "tiny.gguf", "mixtral-tiny", seed=0)
    build_pack(model, progress=False, safety_margin_mib=0)
    out = tmp_path / "results"
    proc = subprocess.run(
        [sys.executable, "-m", "llamapack", "bench", str(model), "-o", str(out), "-n", "6", "--prompt-lengths", "8",
         "-ub", "1", "--temperature", "1.0", "--rounds", "2", "--shuffle-seed", "1",
         "--configs", "pack-25%,pack-25%+ram50%,vanilla"], capture_output=True, text=True, timeout=600, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-3000:]
    data = json.loads((out / "bench.json").read_text())
    order = [(run["round"], run["config"]["name"]) for run in data["runs"]]
    assert order[0] == (1, "vanilla") and sorted(order[1:]) == [(1, "pack-25%"), (1, "pack-25%+ram50%"),
                                                                (2, "pack-25%"), (2, "pack-25%+ram50%")]
    assert all(row["bit_exact"].startswith("yes") for row in data["summaries"][1:])
    combined = {row["name"]: row for row in data["combined"]}
    assert combined["pack-25%+ram50%"]["n_rounds"] == 2 and combined["pack-25%+ram50%"]["bit_exact"] == "yes (12 steps, 2 runs)"
    tiers = {run["config"]["name"]: run["provider"]["ram_slots"] for run in data["runs"][1:]}
    assert tiers == {"pack-25%": 0, "pack-25%+ram50%": 12}  # half of 3 x 8 experts
    assert "## Decode in each round" in (out / "bench.md").read_text()


def test_provider_overhead_script_measures_an_all_hit_decode(tmp_path):
    """bench/provider_overhead.py: the pool holds every expert, so the measured window has no misses and the
    per-acquire time is the provider's own cost."""
    out = tmp_path / "overhead.json"
    proc = subprocess.run([sys.executable, os.path.join(REPO, "bench", "provider_overhead.py"), "-n", "40", "--prefetch",
                           "--out", str(out)], capture_output=True, text=True, timeout=300, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-3000:]
    runs = json.loads(out.read_text())["runs"]
    assert [run["prefetch"] for run in runs] == [False, True]
    for run in runs:
        assert run["decode_misses"] == 0 and run["acquires"] == 40 * 4  # qwen3moe-tiny: 4 MoE layers
        assert run["provide_us_per_acquire"] > 0
    assert runs[0]["lookahead_us_per_acquire"] == 0 < runs[1]["lookahead_us_per_acquire"]


def test_a_warm_run_primes_then_measures_under_the_same_limit(tmp_path, monkeypatch):
    """runner.run_config for pack-25%+warm@8G: the priming worker, then the measured one, each in its own cage of
    the config's limit with the page cache dropped before it, both pointed at the same fresh warm-start folder;
    a priming session that fails or saves nothing fails the run without measuring it."""
    import llamapack.bench.runner as runner

    events, specs = [], []

    class Cage:
        def __init__(self, limit):
            events.append(("cage", limit >> 20))

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            pass

        def join(self):
            pass

        def peak_bytes(self):
            return 1 << 30

        def oom_kills(self):
            return 0

    saves = {"file": True, "rc": 0}

    def fake_run(command, env, timeout, preexec_fn=None):
        spec = json.loads(open(command[-1]).read())
        specs.append(spec)
        events.append(("worker", spec.get("phase", "measured")))
        if spec.get("phase") == "prime":
            out = dict(phase="prime", load_s=1.0, requests=[], saved=["id.json"] if saves["file"] else [], layers_saved=2)
        else:
            out = dict(config=spec["config"], load_s=2.0, requests=[], routing="replayed", provider={})
        return subprocess.CompletedProcess(command, saves["rc"], stdout=json.dumps(out) + "\n", stderr="boom")

    monkeypatch.setattr(runner, "MemoryCage", Cage)
    monkeypatch.setattr(runner, "drop_page_cache", lambda: events.append(("drop",)) or True)
    monkeypatch.setattr(runner, "_run", fake_run)
    plan = runner.BenchPlan(model="m.gguf", out_dir=tmp_path, configs=(), routing="trace.npz")
    warm = dict(routing="/t/prime.npz", same_trace=False, requests=[dict(request=0, n_prompt=3, decode_tokens=4)], cap_s=8.0)
    config = parse_config("pack-25%+warm@8G", 2)
    run = runner.run_config(plan, config, 1 << 30, 64, "m.expert-pack", tmp_path / "spec-3.json", warm=warm)
    assert events == [("drop",), ("cage", 8192), ("worker", "prime"), ("drop",), ("cage", 8192), ("worker", "measured")]
    prime, measured = specs
    assert prime["warm"] == warm and prime["warm_start_dir"] == measured["warm_start_dir"] == str(tmp_path / "spec-3-warm")
    assert "phase" not in measured and "warm" not in measured and (tmp_path / "spec-3-warm").is_dir()
    assert run["priming"]["saved"] == ["id.json"] and run["priming"]["cgroup_peak_mib"] == 1024 and "error" not in run
    cold = runner.run_config(plan, parse_config("pack-25%@8G", 2), 1 << 30, 64, "p", tmp_path / "spec-4.json")
    assert "priming" not in cold and "warm_start_dir" not in specs[-1]
    saves["file"] = False
    events.clear()
    failed = runner.run_config(plan, config, 1 << 30, 64, "p", tmp_path / "spec-5.json", warm=warm)
    assert failed["error"].startswith("priming: the priming session saved no warm-start file")
    assert [e for e in events if e[0] == "worker"] == [("worker", "prime")]  # nothing measured
    saves.update(file=True, rc=3)
    crashed = runner.run_config(plan, config, 1 << 30, 64, "p", tmp_path / "spec-6.json", warm=warm)
    assert crashed["error"].startswith("priming: worker exit 3: boom")


def test_upstream_comparison_uses_the_evaluation_alone_and_each_sides_own_baseline():
    """Upstream's batched-bench samples nothing: our side of the ratio is the evaluation-only rate; the cache's
    cost per token is taken within each harness (pack vs vanilla-vram, upstream-cache vs upstream-vram)."""
    from llamapack.bench.report import summaries, upstream_lines

    def run(name, decoded, decode_s, eval_s=None, **counters):
        r = request(8, ["a"] * (decoded + 1), decoded, decode_s, **counters)
        if eval_s is not None:
            r["decode_eval_s"] = eval_s
        return dict(config=dict(name=name, source="upstream" if name.startswith("upstream") else "pack"),
                    requests=[r])

    results = results_by_hand()
    results["runs"] = [run("vanilla-vram", 100, 1.0, eval_s=0.8), run("pack-25%", 100, 1.25, eval_s=1.05,
                                                                      cache_hits=90, cache_misses=10),
                       run("upstream-vram", 100, 0.5, eval_s=0.5), run("upstream-cache-25%", 100, 0.8, eval_s=0.8,
                                                                        cache_hits=92, cache_misses=8)]
    results["runs"][0]["config"]["reference"] = True
    text = "\n".join(upstream_lines(summaries(results)))
    assert "evaluation alone" in text
    assert "| pack-25% | 0.48x | 0.76x |" in text  # (100 / 1.05) / (100 / 0.5), / (100 / 0.8)
    assert "| pack-25% | vanilla-vram | 2.50 | 0.80x | 90.0% |" in text  # 12.5 - 10 ms, from the wall rates
    assert "| upstream-cache-25% | upstream-vram | 3.00 | 0.62x | 92.0% |" in text
    for r in results["runs"]:
        r["requests"][0].pop("decode_eval_s")  # an older run: wall rates, and the text says so
    text = "\n".join(upstream_lines(summaries(results)))
    assert "did not record the evaluation alone" in text and "| pack-25% | 0.40x | 0.64x |" in text
