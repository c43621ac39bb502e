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

from llamapack.bench.replay import ReplayError, RoutingReplay, check_trace_fits
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
    # the rows the bench consumed: per request, its prompt's prefill rows, then n_decode - 1 decode rows, cycled
    steps = []
    for index, n_prompt in enumerate(prompts):
        first, end = trace.request_bounds()[index]
        prefill = trace.experts[first:end][trace.prefill[first:end]]
        decode = trace.experts[first:end][~trace.prefill[first:end]]
        tokens = [prefill[t % len(prefill)] for t in range(n_prompt)] + [decode[t % len(decode)] for t in range(n_decode - 1)]
        for t, token in enumerate(tokens):  # the last layer computes only tokens with an output: not the prompt's
            steps += [[(layer, int(e)) for e in token[position]] for position, layer in enumerate((1, 2))
                      if layer == 1 or t >= n_prompt - 1]
    for name in ("pack-25%", "pack-25%+ram50%"):
        run = next(r for r in data["runs"] if r["config"]["name"] == name)
        counted = {k: sum(r[phase].get(k, 0) for r in run["requests"] for phase in ("prefill_counters", "decode_counters"))
                   for k in ("cache_hits", "cache_misses")}
        expected = simulate(DEFAULT_POLICY, steps, run["provider"]["n_slots"])
        assert (counted["cache_hits"], counted["cache_misses"]) == (expected["hits"], expected["misses"]), name
    markdown = (out / "bench.md").read_text()
    assert "Routing: runs marked *replayed* serve the experts of `trace.npz`" in markdown
    assert "| pack-25% | **replayed** |" in markdown and "| vanilla | own (synthetic) |" in markdown


def test_prefetch_cannot_replay(tmp_path):
    from llamapack.pack import build_pack
    from llamapack.synth import write_model

    model = write_model(tmp_path / "tiny.gguf", "deepseek2-tiny", seed=0)
    build_pack(model, progress=False, safety_margin_mib=0)
    save_trace(hand_trace([4], n_prefill=1, n_layers=3), tmp_path / "wrong.npz")
    save_trace(hand_trace([4], n_prefill=1), tmp_path / "trace.npz")
    for trace, configs, message in (("wrong.npz", "vanilla,pack-25%", "cannot replay on"),
                                    ("trace.npz", "vanilla,pack-25%+prefetch", "prefetch runs cannot replay")):
        proc = subprocess.run([sys.executable, "-m", "llamapack", "bench", str(model), "-o", str(tmp_path / "r"),
                               "--routing", str(tmp_path / trace), "--configs", configs],
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
