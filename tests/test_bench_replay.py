"""Trace replay in the benchmark (llamapack/bench/replay.py): the token mapping on hand-built traces, the
shape check, and a real bench run on CPU whose replayed runs' cache counters equal the default policy's
replay of the same trace: the provider cached, read and computed the trace's experts, not the router's."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from llamapack.bench.replay import ReplayError, RoutingReplay, check_trace_fits, priming_requests
from llamapack.cache_policy import DEFAULT_POLICY, simulate
from llamapack.routing.trace import RoutingTrace, save_trace

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def hand_trace(rows_per_request, n_prefill, n_layers=2, n_experts=16, top_k=4, seed=0) -> RoutingTrace:
    """Requests of ``rows_per_request`` tokens each, the first ``n_prefill`` of each a prompt token; every
    token's top-k drawn without repeats."""
    rng = np.random.default_rng(seed)
    experts, request, prefill = [], [], []
    for index, n_rows in enumerate(rows_per_request):
        for token in range(n_rows):
            experts.append([rng.choice(n_experts, top_k, replace=False) for _ in range(n_layers)])
            request.append(index)
            prefill.append(token < n_prefill)
    return RoutingTrace(np.array(experts, dtype=np.int16), np.array(request, dtype=np.int32),
                        np.array(prefill), n_experts)


def test_requests_take_their_prefill_then_decode_rows_cycled():
    trace = hand_trace([5, 4], n_prefill=2)  # request 0: rows 0-1 prefill, 2-4 decode; request 1: 5-6, 7-8
    replay = RoutingReplay(trace, layers=[1, 2])  # MoE layers 1 and 2 (a dense layer 0, as deepseek2 has)
    replay.start_request(0, n_prompt=3)  # 3 prompt tokens: prefill rows 0, 1, then 0 again (cycled)
    first = replay.experts_for(1, 3).reshape(3, 4)
    assert (first == trace.experts[[0, 1, 0], 0]).all()
    assert (replay.experts_for(2, 1) == trace.experts[0, 1]).all()  # a last layer computing only the last token
    decoded = [replay.experts_for(1, 1) for _ in range(1)]
    replay.experts_for(2, 1)
    assert (decoded[0] == trace.experts[2, 0]).all()  # the first decode token takes the first decode row
    for expected in (3, 4, 2):  # then cycles through the decode rows
        assert (replay.experts_for(1, 1) == trace.experts[expected, 0]).all()
        assert (replay.experts_for(2, 1) == trace.experts[expected, 1]).all()
    replay.start_request(3, n_prompt=1)  # bench request 3 replays trace request 3 mod 2 = 1
    assert (replay.experts_for(1, 1) == trace.experts[5, 0]).all()
    assert (replay.experts_for(1, 1) == trace.experts[7, 0]).all()
    assert replay.substituted == 4 * (4 + 2 * 4 + 2)


def test_a_trace_of_another_shape_is_refused():
    trace = hand_trace([3], n_prefill=1)
    check_trace_fits(trace, 2, 16, 4, "m.gguf")
    for shape in ((3, 16, 4), (2, 32, 4), (2, 16, 8)):
        with pytest.raises(ReplayError, match="cannot replay on m.gguf"):
            check_trace_fits(trace, *shape, "m.gguf")
    with pytest.raises(ReplayError, match="start_request"):
        RoutingReplay(trace, [0, 1]).experts_for(0, 1)


def test_priming_takes_the_requests_no_measured_prompt_replays():
    trace = hand_trace([9, 7, 8, 4], n_prefill=3)  # decode rows: 6, 4, 5, 1
    assert priming_requests(trace, 2, max_requests=5, prompt_tokens=32, decode_tokens=100) == [
        dict(request=2, n_prompt=3, decode_tokens=5), dict(request=3, n_prompt=3, decode_tokens=1)]
    assert priming_requests(trace, 2, 1, prompt_tokens=2, decode_tokens=3) == [dict(request=2, n_prompt=2, decode_tokens=3)]
    # 5 measured prompts replay requests 0, 1, 2, 3, 0: nothing is left, unless the priming trace is another one (0)
    with pytest.raises(ReplayError, match="all replayed by the 5 measured prompts.*--warm-routing"):
        priming_requests(trace, 5, 2, 32, 100)
    assert [r["request"] for r in priming_requests(trace, 0, 2, 32, 100)] == [0, 1]
    with pytest.raises(ReplayError, match="at least one"):
        priming_requests(trace, 0, 0, 32, 100)


def bench_steps(trace, plan, layers=(1, 2)):
    """The cache steps of requests ``plan`` = [(trace request, n_prompt, decode tokens)] served at n_ubatch 1:
    each prompt token a step per layer (the last layer only for the last prompt token: llama.cpp computes
    only the tokens whose outputs are wanted there), then each decode token; rows as RoutingReplay hands them out."""
    steps = []
    for index, n_prompt, n_decoded in plan:
        first, end = trace.request_bounds()[index % trace.n_requests]
        prefill = trace.experts[first:end][trace.prefill[first:end]]
        decode = trace.experts[first:end][~trace.prefill[first:end]]
        tokens = [prefill[t % len(prefill)] for t in range(n_prompt)] + [decode[t % len(decode)] for t in range(n_decoded)]
        for t, token in enumerate(tokens):
            steps += [[(layer, int(e)) for e in token[position]] for position, layer in enumerate(layers)
                      if position < len(layers) - 1 or t >= n_prompt - 1]
    return steps


def test_bench_replays_the_trace_through_the_real_provider(tmp_path):
    """deepseek2-tiny (a dense layer, then 2 MoE layers x 16 experts, top-4), n_ubatch 1: every (token, layer)
    is one acquire, so the replayed runs' hits and misses must equal DEFAULT_POLICY's replay of exactly the rows
    the bench consumed. The +ownrouting twin keeps the router and stays bit-exact."""
    from llamapack.pack import build_pack
    from llamapack.synth import write_model

    model = write_model(tmp_path / "tiny.gguf", "deepseek2-tiny", seed=0)
    build_pack(model, progress=False, safety_margin_mib=0)
    trace = hand_trace([9, 7], n_prefill=3, seed=1)
    save_trace(trace, tmp_path / "trace.npz")
    out, n_decode, prompts = tmp_path / "results", 6, (5, 4)
    proc = subprocess.run(
        [sys.executable, "-m", "llamapack", "bench", str(model), "-o", str(out), "-n", str(n_decode),
         "--prompt-lengths", ",".join(map(str, prompts)), "-ub", "1", "--routing", str(tmp_path / "trace.npz"),
         "--configs", "vanilla,pack-25%,pack-25%+ram50%,pack-25%+ownrouting"],
        capture_output=True, text=True, timeout=600, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-3000:]
    data = json.loads((out / "bench.json").read_text())
    rows = {row["name"]: row for row in data["summaries"]}
    assert rows["pack-25%"]["bit_exact"] == "n/a (replayed routing)" and rows["pack-25%"]["routing"] == "replayed"
    assert rows["pack-25%+ownrouting"]["bit_exact"].startswith("yes") and rows["vanilla"]["routing"] == "own"
    # the rows the bench consumed: first the warm-up prompt (16 tokens, nothing decoded) of the trace request
    # after the measured ones (2 mod 2: request 0), as upstream's; then per request, its prompt's prefill rows,
    # then n_decode - 1 decode rows, cycled
    warmup = bench_steps(trace, [(len(prompts), 16, 0)])
    steps = warmup + bench_steps(trace, [(index, n_prompt, n_decode - 1) for index, n_prompt in enumerate(prompts)])
    assert data["workload"]["warmup_tokens"] == 16
    for name in ("pack-25%", "pack-25%+ram50%"):
        run = next(r for r in data["runs"] if r["config"]["name"] == name)
        assert run["warmup"]["n_tokens"] == 16
        warm = simulate(DEFAULT_POLICY, warmup, run["provider"]["n_slots"])  # from an empty cache, as the run started
        assert (run["warmup"]["counters"]["cache_hits"], run["warmup"]["counters"]["cache_misses"]) == (warm["hits"], warm["misses"])
        counted = {k: run["warmup"]["counters"][k] + sum(r[phase].get(k, 0) for r in run["requests"]
                                                        for phase in ("prefill_counters", "decode_counters"))
                   for k in ("cache_hits", "cache_misses")}
        expected = simulate(DEFAULT_POLICY, steps, run["provider"]["n_slots"])
        assert (counted["cache_hits"], counted["cache_misses"]) == (expected["hits"], expected["misses"]), name
    markdown = (out / "bench.md").read_text()
    assert "Routing: runs marked *replayed* serve the experts of `trace.npz`" in markdown
    assert "| pack-25% | **replayed** |" in markdown and "| vanilla | own (synthetic) |" in markdown


def test_what_cannot_replay_is_refused_before_any_run(tmp_path):
    from llamapack.pack import build_pack
    from llamapack.synth import write_model

    model = write_model(tmp_path / "tiny.gguf", "deepseek2-tiny", seed=0)
    build_pack(model, progress=False, safety_margin_mib=0)
    save_trace(hand_trace([4], n_prefill=1, n_layers=3), tmp_path / "wrong.npz")
    save_trace(hand_trace([4], n_prefill=1), tmp_path / "trace.npz")
    save_trace(hand_trace([4, 5], n_prefill=1), tmp_path / "two.npz")
    for args, message in ((["--routing", str(tmp_path / "wrong.npz"), "--configs", "vanilla,pack-25%"], "cannot replay on"),
                          (["--routing", str(tmp_path / "trace.npz"), "--configs", "vanilla,pack-25%+prefetch"],
                           "prefetch runs cannot replay"),
                          (["--configs", "pack-25%,pack-25%+warm"], "+warm runs prime on trace requests the measured "
                                                                    "prompts do not replay: they need --routing"),
                          (["--routing", str(tmp_path / "two.npz"), "--configs", "pack-25%+warm"],
                           "all replayed by the 2 measured prompts"),
                          (["--routing", str(tmp_path / "two.npz"), "--warm-routing", str(tmp_path / "wrong.npz"),
                            "--configs", "pack-25%+warm"], "cannot replay on")):
        proc = subprocess.run([sys.executable, "-m", "llamapack", "bench", str(model), "-o", str(tmp_path / "r"), *args],
                              capture_output=True, text=True, timeout=300, cwd=REPO)
        assert proc.returncode == 1 and message in proc.stderr and "Traceback" not in proc.stderr, proc.stderr


def test_upstream_runs_join_the_report(tmp_path):
    """An upstream run (batched-bench's shape, from upstream.to_run) sits in the same tables: no bit-exact
    column, and the decode ratios of every other run against it."""
    from llamapack.bench.report import markdown, summaries

    def request(n_prompt, decode_s):
        return dict(n_prompt=n_prompt, prefill_s=0.5, ttft_s=0.5, n_decoded=100, decode_s=decode_s, tokens=[],
                    digests=[], prefill_counters={}, decode_counters={})

    results = dict(command="c", machine={}, workload=dict(prompt_lengths=[512], n_decode=101, decode_cap_s=20,
                                                          n_ubatch=512, temperature=0),
                   model=dict(path="m.gguf", size_bytes=1, expert_bytes=1, n_moe_layers=1, n_expert=8, expert_stride=1),
                   runs=[dict(config=dict(name="vanilla-vram", reference=True), requests=[request(512, 1.0)]),
                         dict(config=dict(name="pack-25%+ram"), requests=[request(512, 2.0)], routing="replayed"),
                         dict(config=dict(name="upstream-cache-25%", source="upstream"), requests=[request(512, 4.0)],
                              routing="replayed")])
    rows = {row.name: row for row in summaries(results)}
    assert rows["upstream-cache-25%"].bit_exact == "n/a (replayed routing)"
    results["runs"][2]["routing"] = "own"
    assert summaries(results)[2].bit_exact == "n/a (upstream: no logits)"
    text = markdown(results)
    assert "| pack-25%+ram | 2.00x |" in text and "| vanilla-vram | 4.00x |" in text


def test_warm_run_starts_from_its_priming_session(tmp_path):
    """``pack-25%+warm``: a priming process serves trace request 2 (the prompts replay requests 0 and 1), saves its
    popularity; the measured process loads the hottest experts at start-up. Its counters must equal NextUse's
    replay of exactly that: the priming steps, the popularity saved (rounded as the file rounds it), a fresh policy
    seeded with it and preloaded with the hottest keys, then the measured steps. Its cold twin reads nothing at load.
    No warm-up prompt (``--warmup-tokens 0``): the first measured request is the process's first."""
    from llamapack.cache_policy import DEFAULT_POLICY
    from llamapack.pack import build_pack
    from llamapack.provider.warm import hottest
    from llamapack.synth import write_model

    model = write_model(tmp_path / "tiny.gguf", "deepseek2-tiny", seed=0)
    build_pack(model, progress=False, safety_margin_mib=0)
    trace = hand_trace([9, 7, 10], n_prefill=3, seed=2)
    save_trace(trace, tmp_path / "trace.npz")
    out, n_decode, prompts = tmp_path / "results", 6, (5, 4)
    proc = subprocess.run(
        [sys.executable, "-m", "llamapack", "bench", str(model), "-o", str(out), "-n", str(n_decode),
         "--prompt-lengths", ",".join(map(str, prompts)), "-ub", "1", "--routing", str(tmp_path / "trace.npz"),
         "--warm-tokens", "6", "--warmup-tokens", "0", "--configs", "pack-25%,pack-25%+warm"],
        capture_output=True, text=True, timeout=600, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-3000:]
    data = json.loads((out / "bench.json").read_text())
    assert data["workload"]["warm"]["requests"] == [dict(request=2, n_prompt=3, decode_tokens=6)]
    cold, warm = (next(r for r in data["runs"] if r["config"]["name"] == name) for name in ("pack-25%", "pack-25%+warm"))
    assert "priming" not in cold and cold["load_counters"]["pack_read_bytes"] == 0
    priming = warm["priming"]
    assert [(r["request"], r["n_prompt"], r["n_decoded"]) for r in priming["requests"]] == [(2, 3, 6)]
    assert len(priming["saved"]) == 1 and priming["layers_saved"] == 2
    n_slots = warm["provider"]["n_slots"]
    assert n_slots == cold["provider"]["n_slots"] == 8  # 25% of 2 x 16 experts

    primer = DEFAULT_POLICY(n_slots)
    for step in bench_steps(trace, [(2, 3, 6)]):
        primer.acquire(step)
    popularity = {layer: [round(x, 6) for x in shares] for layer, shares in primer.popularity().items()}
    seeded = DEFAULT_POLICY(n_slots)
    seeded.seed(popularity)
    preloaded = seeded.preload(hottest(popularity, n_slots))
    assert warm["load_counters"]["pack_read_bytes"] == len(preloaded) * data["model"]["expert_stride"] > 0
    measured = bench_steps(trace, [(i, n, n_decode - 1) for i, n in enumerate(prompts)])
    expected = simulate(lambda n: seeded, measured, n_slots)
    counted = {k: sum(r[phase].get(k, 0) for r in warm["requests"] for phase in ("prefill_counters", "decode_counters"))
               for k in ("cache_hits", "cache_misses")}
    assert (counted["cache_hits"], counted["cache_misses"]) == (expected["hits"], expected["misses"])
    cold_expected = simulate(DEFAULT_POLICY, measured, n_slots)
    assert expected["hits"] > cold_expected["hits"]  # the warm start paid off on this trace
    markdown = (out / "bench.md").read_text()
    section = markdown.split("## Warm start: the first request")[1]
    assert "| pack-25% | " in section and "| pack-25%+warm | " in section
    assert "served requests 2 (3 prompt + up to 6 decode tokens) of `trace.npz` (requests no measured prompt replays)" in markdown


def test_pyhot_twin_serves_the_same_steps_through_python(tmp_path):
    """``+pyhot``: the same config with the native hot path off. Both replay the same trace through the same
    NextUse decisions, so their counters match; the provider reports which path each ran."""
    import inspect

    from llamapack.llama import Llama
    from llamapack.pack import build_pack
    from llamapack.synth import write_model

    if "native_hot_path" not in inspect.signature(Llama.__init__).parameters:
        pytest.skip("llamapack.Llama does not take native_hot_path yet: +pyhot refuses to run (test_bench.py checks)")
    model = write_model(tmp_path / "tiny.gguf", "deepseek2-tiny", seed=0)
    build_pack(model, progress=False, safety_margin_mib=0)
    save_trace(hand_trace([9, 7], n_prefill=3, seed=3), tmp_path / "trace.npz")
    out = tmp_path / "results"
    proc = subprocess.run(
        [sys.executable, "-m", "llamapack", "bench", str(model), "-o", str(out), "-n", "8", "--prompt-lengths", "5,4",
         "-ub", "1", "--routing", str(tmp_path / "trace.npz"),
         "--configs", "pack-25%,pack-25%+pyhot,pack-25%+ram50%,pack-25%+ram50%+pyhot"],
        capture_output=True, text=True, timeout=600, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-3000:]
    runs = {run["config"]["name"]: run for run in json.loads((out / "bench.json").read_text())["runs"]}
    assert all("error" not in run for run in runs.values()), {n: r.get("error") for n, r in runs.items()}
    for native in ("pack-25%", "pack-25%+ram50%"):
        python = runs[native + "+pyhot"]
        assert runs[native]["provider"]["native_hot_path"] is True and python["provider"]["native_hot_path"] is False
        counts = [{k: sum(r[phase].get(k, 0) for r in run["requests"] for phase in ("prefill_counters", "decode_counters"))
                   for k in ("cache_hits", "cache_misses", "ram_hits")} for run in (runs[native], python)]
        assert counts[0] == counts[1], native
    assert "## Native hot path vs the Python provider (+pyhot)" in (out / "bench.md").read_text()
