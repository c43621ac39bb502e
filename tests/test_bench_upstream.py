"""llamapack.bench.upstream: upstream llama.cpp b11549's batched-bench as a bench baseline.

No binary runs here. The output samples below were constructed by hand from the format strings of the b11549
sources (../shared/baselines/llama.cpp-b11549-trimmed.tar.gz), not captured from a run:
  tools/batched-bench/batched-bench.cpp  the table row LOG("|%6d | %6d | %4d | %6d | %8.3f | %8.2f | ... |\\n")
                                         and the --output-format jsonl LOG("{\\"n_kv_max\\": %d, ...}")
  src/llama-moe-cache.cpp                "%s: %10s MoE cache size = %8.2f MiB for %.2f MiB of host experts",
                                         "%s: %2zu layers, %s: %5d slots (%.1f%%)", "llama_moe_cache: %s: hits = %zu,
                                         misses = %zu, hit rate = %.2f%%, uploaded = %.2f MiB", "llama_moe_cache:
                                         large batches: %zu experts copied from the cache, %.2f MiB"
  src/llama-context.cpp                  llama_perf_context_print's "load time" and "graphs reused" lines
  common/log.cpp                         the stderr prefix "M.SS.mmm.uuu I " (timestamps on, as common_init sets)
"""
from __future__ import annotations

import numpy as np
import pytest

from llamapack.bench import upstream as up
from llamapack.routing.trace import RoutingTrace


def md_row(pp, tg, pl, t_pp, t_tg):
    n_kv, t = pp + tg, t_pp + t_tg
    return "|%6d | %6d | %4d | %6d | %8.3f | %8.2f | %8.3f | %8.2f | %8.3f | %8.2f |" % (
        pp, tg, pl, n_kv, t_pp, pp / t_pp, t_tg, tg / t_tg, t, (pp + tg) / t)


def jsonl_row(pp, tg, pl, t_pp, t_tg):
    n_kv, t = pp + tg, t_pp + t_tg
    return ('{"n_kv_max": %d, "n_batch": %d, "n_ubatch": %d, "flash_attn": %d, "is_pp_shared": %d, "n_gpu_layers": %d, '
            '"n_threads": %u, "n_threads_batch": %u, "pp": %d, "tg": %d, "pl": %d, "n_kv": %d, "t_pp": %f, '
            '"speed_pp": %f, "t_tg": %f, "speed_tg": %f, "t": %f, "speed": %f}') % (
        1024, 512, 512, 0, 0, 99, 16, 16, pp, tg, pl, n_kv, t_pp, pp / t_pp, t_tg, tg / t_tg, t, (pp + tg) / t)


MD_STDOUT = "\n".join([
    "",
    "main: n_kv_max = 1024, n_batch = 512, n_ubatch = 512, flash_attn = 0, is_pp_shared = 0, is_tg_separate = 0, "
    "n_gpu_layers = 99, n_threads = 16, n_threads_batch = 16",
    "",
    "|%6s | %6s | %4s | %6s | %8s | %8s | %8s | %8s | %8s | %8s |" % ("PP", "TG", "B", "N_KV", "T_PP s", "S_PP t/s",
                                                                      "T_TG s", "S_TG t/s", "T s", "S t/s"),
    "|%6s-|-%6s-|-%4s-|-%6s-|-%8s-|-%8s-|-%8s-|-%8s-|-%8s-|-%8s-|" % (("------",) * 2 + ("----",) + ("------",)
                                                                      + ("--------",) * 6),
    md_row(512, 200, 1, 0.250, 4.000),
    md_row(32, 200, 1, 0.050, 3.200),
    "",
])
JSONL_STDOUT = "\n".join([jsonl_row(512, 200, 1, 0.25, 4.0), jsonl_row(32, 200, 1, 0.05, 3.2), ""])


def prefixed(text: str, level: str = "I") -> str:
    return f"0.01.234.567 {level} {text}"


CACHE_LOG = "\n".join(prefixed(line) for line in [
    "llama_model_load_from_file_impl: using device CUDA0 (NVIDIA H100 80GB HBM3) - 80000 MiB free",
    "impl: %10s MoE cache size = %8.2f MiB for %.2f MiB of host experts" % ("CUDA0", 3890.25, 15523.50),
    "impl: %2d layers, %s: %5d slots (%.1f%%)" % (48, "q4_K", 1535, 24.98),
    "llama_perf_context_print:        load time = %10.2f ms" % 5321.75,
    "llama_perf_context_print:    graphs reused = %10d" % 398,
    "llama_moe_cache: %s: hits = %d, misses = %d, hit rate = %.2f%%, uploaded = %.2f MiB"
    % ("ubatch <= 8", 140000, 13600, 91.15, 34425.00),
    "llama_moe_cache: %s: hits = %d, misses = %d, hit rate = %.2f%%, uploaded = %.2f MiB"
    % ("ubatch  > 8", 500, 9000, 5.26, 22700.00),
    "llama_moe_cache: large batches: %d experts copied from the cache, %.2f MiB" % (1200, 3036.00),
])


def config(**kw):
    return up.UpstreamConfig(**{"name": "upstream-cache", "cache_mib": 3891, **kw})


def test_rows_from_markdown_and_jsonl_agree():
    md, jl = up.parse_rows(MD_STDOUT), up.parse_rows(JSONL_STDOUT)
    assert [(r["pp"], r["tg"], r["pl"], r["n_kv"]) for r in md] == [(512, 200, 1, 712), (32, 200, 1, 232)]
    for a, b in zip(md, jl):
        assert a.keys() == b.keys()
        for key in a:
            assert a[key] == pytest.approx(b[key], rel=1e-3)
    assert md[0]["speed_tg"] == pytest.approx(50.0) and md[1]["speed_pp"] == pytest.approx(640.0)


def test_rows_ignore_colors_and_other_lines():
    colored = "\x1b[32m" + md_row(64, 10, 1, 0.1, 0.5) + "\x1b[0m\nllama_perf_context_print: eval time = 1 ms\n"
    assert [r["pp"] for r in up.parse_rows(colored)] == [64]


def test_log_gives_cache_size_slots_decode_stats_and_load_time():
    log = up.parse_log(CACHE_LOG)
    assert log["cache"] == dict(buffer="CUDA0", size_mib=3890.25, host_experts_mib=15523.5,
                                groups=[dict(layers=48, type="q4_K", slots=1535, percent=25.0)])
    assert log["decode"] == dict(hits=140000, misses=13600, uploaded_bytes=34425.0 * up.MIB)
    assert log["batch"]["misses"] == 9000 and log["copied"] == dict(experts=1200, bytes=3036.0 * up.MIB)
    assert log["load_s"] == pytest.approx(5.32175) and log["graphs_reused"] == 398
    assert log["problems"] == [] and log["replayed_layers"] is None


def test_run_has_the_bench_shape_with_process_counters_on_the_first_request():
    run = up.to_run(config(), up.parse_rows(JSONL_STDOUT), up.parse_log(CACHE_LOG), [512, 32], 200)
    assert run["config"]["name"] == "upstream-cache" and run["config"]["source"] == "upstream"
    first, second = run["requests"]
    assert (first["n_prompt"], first["n_decoded"]) == (512, 200)
    assert first["prefill_s"] == pytest.approx(0.25) and first["decode_s"] == pytest.approx(4.0)
    assert first["decode_counters"] == dict(cache_hits=140000, cache_misses=13600, h2d_bytes=34425.0 * up.MIB)
    assert second["decode_counters"] == {} and second["digests"] == []
    assert run["provider"]["n_slots"] == 1535 and run["routing"] == "own" and run["load_s"] == pytest.approx(5.32175)


@pytest.mark.parametrize("stdout, prompts, message", [
    (JSONL_STDOUT, [512, 32, 128], "expected"),                    # a prompt length batched-bench skipped
    (jsonl_row(512, 100, 1, 0.2, 2.0), [512], "expected"),         # another n_decode
    ("", [512, 32], "expected"),
])
def test_missing_rows_are_an_error(stdout, prompts, message):
    with pytest.raises(up.UpstreamError, match=message):
        up.to_run(config(), up.parse_rows(stdout), up.parse_log(CACHE_LOG), prompts, 200)


def test_a_disabled_or_absent_cache_or_replay_is_an_error():
    disabled = prefixed("impl: no layer has all of its experts in host memory, MoE cache is disabled", "W")
    with pytest.raises(up.UpstreamError, match="disabled"):
        up.to_run(config(), up.parse_rows(JSONL_STDOUT), up.parse_log(disabled), [512, 32], 200)
    with pytest.raises(up.UpstreamError, match="no MoE cache"):
        up.to_run(config(), up.parse_rows(JSONL_STDOUT), up.parse_log(""), [512, 32], 200)
    # the counters logged at exit may be lost (an unpatched binary does not flush its log): no hit rate, no error
    no_stats = "\n".join(line for line in CACHE_LOG.splitlines() if "hits =" not in line)
    run = up.to_run(config(), up.parse_rows(JSONL_STDOUT), up.parse_log(no_stats), [512, 32], 200)
    assert run["requests"][0]["decode_counters"] == {}
    with pytest.raises(up.UpstreamError, match="did not replay"):
        up.to_run(config(), up.parse_rows(JSONL_STDOUT), up.parse_log(CACHE_LOG), [512, 32], 200, replayed=True)
    replay_log = CACHE_LOG + "\n" + prefixed("llama_replay: layers 0..47 take their experts from the trace")
    run = up.to_run(config(), up.parse_rows(JSONL_STDOUT), up.parse_log(replay_log), [512, 32], 200, replayed=True)
    assert run["routing"] == "replayed" and run["upstream"]["replayed_layers"] == (0, 47)


def test_command_for_the_cache_run():
    cmd = up.batched_bench_command("bb", "m.gguf", config(n_threads=16), [512, 32], 200)
    joined = " ".join(cmd)
    for piece in ("-m m.gguf", "-ngl 99", "-c 1024", "-b 512", "-ub 512", "-fa off", "-t 16", "-tb 16",
                  "-npp 512,32", "-ntg 200", "-npl 1", "--output-format jsonl", "-cmoe", "--load-mode none",
                  "--moe-cache-mib 3891", "--no-repack"):
        assert piece in joined, piece
    vram = up.batched_bench_command("bb", "m.gguf", up.UpstreamConfig("upstream-vram", cpu_moe=False), [32], 200)
    assert "-cmoe" not in vram and "--moe-cache-mib" not in vram
    plain = up.batched_bench_command("bb", "m.gguf", config(cache_mib=0, load_mode="mmap"), [32], 200)
    assert "--load-mode" in plain and "mmap" in plain and "--no-repack" not in plain


def test_configs_that_cannot_run_are_refused():
    with pytest.raises(ValueError, match="needs cpu_moe"):
        up.UpstreamConfig("x", cpu_moe=False, cache_mib=100)
    with pytest.raises(ValueError, match="mmapped"):
        up.UpstreamConfig("x", memory_limit_mib=8192)
    up.UpstreamConfig("x", memory_limit_mib=8192, load_mode="mmap")
    with pytest.raises(ValueError, match="n_ctx"):
        up.batched_bench_command("bb", "m", config(), [1000], 200, n_ctx=1024)


def test_cache_budget_matches_a_llamapack_pool():
    assert up.cache_mib_for_slots(1536, 2_654_208) == -(-1536 * 2_654_208 // up.MIB)
    assert up.cache_mib_for_slots(1, 10) == 1


def small_trace():
    # two requests: 3 prefill + 2 decode tokens, then 2 prefill + 1 decode; 2 layers, top-2 of 8 experts
    rng = np.random.default_rng(0)
    experts = np.stack([np.stack([rng.choice(8, 2, replace=False) for _ in range(2)]) for _ in range(8)])
    return RoutingTrace(experts.astype(np.int16), np.array([0, 0, 0, 0, 0, 1, 1, 1], np.int32),
                        np.array([1, 1, 1, 0, 0, 1, 1, 0], bool), 8)


def test_replay_rows_take_prefill_rows_then_decode_rows_cycled():
    trace = small_trace()
    rows = up.replay_rows(trace, 0, n_prompt=4, n_tokens=7)
    e = trace.experts
    expected = [e[0], e[1], e[2], e[0], e[3], e[4], e[3]]  # 4 prompt rows from 3 prefill rows, then decode cycled
    assert rows.dtype == np.int32 and rows.shape == (7, 2, 2)
    assert np.array_equal(rows, np.stack(expected))
    assert np.array_equal(up.replay_rows(trace, 3, 1, 2), np.stack([e[5], e[7]]))  # request 3 mod 2 = 1


def test_replay_file_round_trips_and_has_the_warmup_segment_first():
    trace = small_trace()
    segments = up.replay_segments(trace, [4, 2], n_decode=3)
    assert [len(s) for s in segments] == [up.BATCHED_BENCH_WARMUP_TOKENS, 7, 5]
    assert np.array_equal(segments[0][0], trace.experts[0])  # warm-up: the request after the bench's (2 mod 2)
    data = up.encode_replay(segments, first_layer=0)
    head = np.frombuffer(data[:32], "<i4")
    assert list(head) == [up.REPLAY_MAGIC, 3, 2, 2, 0, 16, 7, 5]
    back, first_layer = up.decode_replay(data)
    assert first_layer == 0 and all(np.array_equal(a, b) for a, b in zip(back, segments))
    with pytest.raises(ValueError):
        up.decode_replay(data[:-4])
    with pytest.raises(ValueError):
        up.encode_replay([np.zeros((2, 2, 2), np.int32), np.zeros((2, 3, 2), np.int32)])


# Captured (not constructed): the patched b11549 llama-batched-bench, CPU build, on `llamapack synth qwen3moe-tiny`
# with LLAMA_REPLAY_TRACE set (-npp 64,16 -ntg 20 -npl 1 --output-format jsonl -lv 4; stdout, then stderr lines).
CAPTURED_STDOUT = """\
{"n_kv_max": 1024, "n_batch": 512, "n_ubatch": 512, "flash_attn": 0, "is_pp_shared": 0, "n_gpu_layers": -1, \
"n_threads": 2, "n_threads_batch": 2, "pp": 64, "tg": 20, "pl": 1, "n_kv": 84, "t_pp": 0.008170, \
"speed_pp": 7833.537109, "t_tg": 0.014438, "speed_tg": 1385.233398, "t": 0.022608, "speed": 3715.498779}
{"n_kv_max": 1024, "n_batch": 512, "n_ubatch": 512, "flash_attn": 0, "is_pp_shared": 0, "n_gpu_layers": -1, \
"n_threads": 2, "n_threads_batch": 2, "pp": 16, "tg": 20, "pl": 1, "n_kv": 36, "t_pp": 0.003073, \
"speed_pp": 5206.638184, "t_tg": 0.016573, "speed_tg": 1206.782104, "t": 0.019646, "speed": 1832.434082}
"""
CAPTURED_STDERR = """\
0.00.096.937 I llama_replay: /tmp/up/tiny.i32: 3 segments, 4 layers from layer 0, top-4
0.00.096.950 I llama_replay: layers 0..3 take their experts from the trace
0.00.145.696 I llama_perf_context_print:        load time =      71.20 ms
0.00.145.701 I llama_perf_context_print:    graphs reused =         38
"""


def test_captured_replay_run_parses():
    cfg = up.UpstreamConfig("upstream-cpu", cpu_moe=False)
    run = up.to_run(cfg, up.parse_rows(CAPTURED_STDOUT), up.parse_log(CAPTURED_STDERR), [64, 16], 20, replayed=True)
    assert [(r["n_prompt"], r["n_decoded"]) for r in run["requests"]] == [(64, 20), (16, 20)]
    assert run["requests"][1]["decode_s"] == pytest.approx(0.016573)
    assert run["upstream"]["replayed_layers"] == (0, 3) and run["upstream"]["graphs_reused"] == 38
    assert run["load_s"] == pytest.approx(0.0712)


def test_upstream_runs_include_its_cache_under_the_memory_limit(monkeypatch):
    """All-VRAM (upstream's base), RAM-rich -cmoe and cache runs at each fraction; with a limit, its cache at the smallest fraction under it
    (mmapped experts), decoding fewer tokens within a shorter timeout, since such a run pages experts in."""
    import types

    import llamapack.pack
    from llamapack.bench.command import LIMITED_UPSTREAM_DECODE, upstream_configs

    layout = types.SimpleNamespace(num_blocks=1000, expert_stride=1 << 20)
    monkeypatch.setattr(llamapack.pack, "open_gguf", lambda path: types.SimpleNamespace(layout=layout))
    rich = upstream_configs("m.gguf", None, (0.25, 0.5))
    assert [(c.name, c.cache_mib, c.memory_limit_mib) for c in rich] == [
        ("upstream-vram", 0, None), ("upstream-cmoe", 0, None), ("upstream-cache-25%", 250, None), ("upstream-cache-50%", 500, None)]
    limited = upstream_configs("m.gguf", None, (0.5, 0.25), memory_limit_mib=8192)[-1]
    assert (limited.name, limited.cache_mib, limited.load_mode, limited.memory_limit_mib, limited.n_decode) == (
        "upstream-cache-25%@8G", 250, "mmap", 8192, LIMITED_UPSTREAM_DECODE)
    assert limited.timeout_s and limited.timeout_s < 1800
    with pytest.raises(ValueError, match="n_decode"):
        up.UpstreamConfig("x", n_decode=0)


def test_bench_lists_and_picks_upstream_runs(tmp_path, monkeypatch):
    import types

    from click.testing import CliRunner

    import llamapack.pack
    from llamapack.bench.command import bench_command

    layout = types.SimpleNamespace(num_blocks=1000, expert_stride=1 << 20)
    monkeypatch.setattr(llamapack.pack, "open_gguf", lambda path: types.SimpleNamespace(layout=layout))
    monkeypatch.setattr("llamapack.bench.command.has_gpu", lambda: True)
    model = tmp_path / "m.gguf"
    model.write_bytes(b"x")
    args = [str(model), "--upstream-bin", str(tmp_path), "--memory-limit-mib", "8192", "--configs", "pack-25%@8G",
            "--list"]
    listed = CliRunner().invoke(bench_command, args + ["--upstream-runs", "upstream-cmoe,upstream-cache-25%@8G"])
    assert listed.exit_code == 0 and listed.output.split()[-2:] == ["upstream-cmoe", "upstream-cache-25%@8G"]
    assert "upstream-cache-50%" not in listed.output
    bad = CliRunner().invoke(bench_command, args + ["--upstream-runs", "upstream-nope"])
    assert bad.exit_code != 0 and "unknown upstream run(s) upstream-nope" in bad.output
