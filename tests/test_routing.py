"""Routing traces, counts, hit-rate replay and ``llamapack trace`` (the routing model: test_routing_model.py)."""
import json
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from llamapack import cache_policy
from llamapack.cli import main
from llamapack.routing import (RoutingCounts, RoutingModel, RoutingTrace, TraceError, counts_from_trace, hit_rates,
                               load_counts, load_trace, save_counts, save_trace)
from llamapack.routing.counts import resolve_shipped
from llamapack.routing.hitrate import POLICIES, slots_for

GRANITE = "granite-3.0-1b-a400m"


def hand_trace(rows, n_experts, request=None, prefill=None) -> RoutingTrace:
    """``rows[token][layer]`` = top-k ids."""
    experts = np.array(rows, dtype=np.int16)
    n = len(experts)
    return RoutingTrace(experts, np.array(request if request is not None else [0] * n, dtype=np.int32),
                        np.array(prefill if prefill is not None else [False] * n), n_experts)


def write_npz(path: Path, **fields) -> Path:
    base = dict(experts=np.array([[[0, 1]], [[1, 2]]], dtype=np.int16), request=np.array([0, 0], dtype=np.int32),
                prefill=np.array([True, False]), n_experts=np.int64(4))
    base.update(fields)
    np.savez(path, **base)
    return path


# -- trace format
def test_trace_round_trips(tmp_path):
    trace = load_trace(resolve_shipped(GRANITE))
    assert (trace.n_tokens, trace.n_layers, trace.top_k, trace.n_experts, trace.n_requests) == (304, 24, 8, 32, 3)
    save_trace(trace, tmp_path / "copy.npz")
    again = load_trace(tmp_path / "copy.npz")
    for name in ("experts", "request", "prefill"):
        assert np.array_equal(getattr(trace, name), getattr(again, name))
        assert getattr(trace, name).dtype == getattr(again, name).dtype
    assert (again.n_experts, again.source) == (trace.n_experts, trace.source)


@pytest.mark.parametrize("fields, words", [
    (dict(experts=np.array([[[0, 1]], [[1, 2]]], dtype=np.int32)), ["experts", "int16", "int32"]),
    (dict(experts=np.array([[[0, 1]], [[1, 4]]], dtype=np.int16)), ["token 1 layer 0", "expert id outside [0, 4)"]),
    (dict(experts=np.array([[[0, 1]], [[2, 2]]], dtype=np.int16)), ["token 1 layer 0", "expert twice"]),
    (dict(request=np.array([0, 1], dtype=np.int64)), ["request", "int32"]),
    (dict(prefill=np.array([True, False, True])), ["prefill", "one per token"]),
    (dict(n_experts=np.float64(4)), ["n_experts", "integer"]),
])
def test_loader_names_file_and_field(tmp_path, fields, words):
    path = write_npz(tmp_path / "bad.npz", **fields)
    with pytest.raises(TraceError) as info:
        load_trace(path)
    message = str(info.value)
    assert str(path) in message
    for word in words:
        assert word in message


def test_loader_refuses_non_consecutive_requests(tmp_path):
    experts = np.array([[[0]], [[1]], [[2]]], dtype=np.int16)
    path = write_npz(tmp_path / "split.npz", experts=experts, request=np.array([0, 1, 0], dtype=np.int32),
                     prefill=np.zeros(3, dtype=bool))
    with pytest.raises(TraceError, match="consecutive") as info:
        load_trace(path)
    assert str(path) in str(info.value)


@pytest.mark.parametrize("content, words", [
    (b"not a zip archive at all", ["cannot read"]),
    (None, ["an .npy array, not an .npz"]),  # a plain .npy
    (b"truncated", ["cannot read"]),  # the first bytes of a real .npz
])
def test_loader_refuses_what_is_not_an_npz(tmp_path, content, words):
    path = tmp_path / "trace.npz"
    if content is None:
        with open(path, "wb") as handle:
            np.save(handle, np.arange(3))
    elif content == b"truncated":
        path.write_bytes(Path(resolve_shipped(GRANITE)).read_bytes()[:5000])
    else:
        path.write_bytes(content)
    with pytest.raises(TraceError) as info:
        load_trace(path)
    assert str(path) in str(info.value)
    for word in words:
        assert word in str(info.value)


def test_loader_names_missing_fields(tmp_path):
    path = tmp_path / "other.npz"
    np.savez(path, experts=np.zeros((1, 1, 1), dtype=np.int16))
    with pytest.raises(TraceError, match="missing request, prefill, n_experts"):
        load_trace(path)


# -- counts
def test_counts_from_trace_by_hand():
    # one layer, 4 experts, top-2: experts 0 and 1 always together, 2 and 3 always together
    trace = hand_trace([[[0, 1]], [[2, 3]], [[1, 0]], [[3, 2]]] * 3, 4)
    counts = counts_from_trace(trace, min_count=1)
    assert counts.heat.tolist() == [[6, 6, 6, 6]]
    assert (counts.top_k, counts.n_tokens) == (2, 12)
    pairs = {(int(i), int(j)): (c, lift) for i, j, c, lift in counts.pairs[0]}
    assert pairs == {(0, 1): (6, 2.0), (2, 3): (6, 2.0)}  # P(01) = 1/2 against P(0)P(1) = 1/4
    assert counts.lift_matrix()[0, 1, 0] == 2.0 and counts.lift_matrix()[0, 0, 2] == 1.0


def test_counts_round_trip_compact_npz(tmp_path):
    counts = load_counts(GRANITE)  # measured on the shipped trace's decode tokens
    assert (counts.n_layers, counts.n_experts, counts.top_k, counts.n_tokens) == (24, 32, 8, 192)
    save_counts(counts, tmp_path / "granite.counts.npz")
    again = load_counts(tmp_path / "granite.counts.npz")
    assert np.array_equal(again.heat, counts.heat)
    for mine, theirs in zip(counts.pairs, again.pairs):
        assert np.array_equal(mine[:, :3], theirs[:, :3])
        assert np.allclose(mine[:, 3], theirs[:, 3], rtol=1e-12)  # lifts recomputed from the counts


def test_counts_json(tmp_path):
    document = {"model": "tiny", "k": 2, "n_decode_tokens": 4,
                "layers": [{"layer": "1", "heat": [4, 2, 2, 0], "pairs": []},
                           {"layer": "0", "heat": [2, 2, 2, 2], "pairs": [[0, 1, 2, 2.0]]}]}
    path = tmp_path / "tiny.counts.json"
    path.write_text(json.dumps(document))
    counts = load_counts(path)
    assert counts.heat.tolist() == [[2, 2, 2, 2], [4, 2, 2, 0]]  # layers in order
    assert counts.pairs[0].tolist() == [[0, 1, 2, 2.0]] and counts.pairs[1].shape == (0, 4)
    document["layers"][0]["heat"] = [4, 2, 2, 1]
    path.write_text(json.dumps(document))
    with pytest.raises(TraceError, match="layer 1 heat sums to 9"):
        load_counts(path)
    del document["k"]
    path.write_text(json.dumps(document))
    with pytest.raises(TraceError, match="not a routing counts JSON"):
        load_counts(path)


def test_shipped_counts():
    for name, shape, top_k, tokens in (("qwen3-30b-a3b", (48, 128), 8, 75773),
                                       ("qwen3-next-80b-a3b", (48, 512), 10, 24963)):
        counts = load_counts(name)
        assert (counts.heat.shape, counts.top_k, counts.n_tokens) == (shape, top_k, tokens)
        assert "doramirdor/mbolt" in counts.source
        assert all(len(rows) > 1000 and (rows[:, 3] >= 1.5 - 0.006).all() for rows in counts.pairs)


def test_counts_checks():
    with pytest.raises(TraceError, match="heat must lie in"):
        RoutingCounts(np.array([[3.0, -1.0]]), (np.zeros((0, 4)),), 1, 2)
    with pytest.raises(TraceError, match="layer 0 pairs need expert ids"):
        RoutingCounts(np.array([[1.0, 1.0]]), (np.array([[1, 0, 1, 2.0]]),), 1, 2)


# -- hit rates
def test_hit_rates_by_hand():
    # one layer, 4 experts, top-1, alternating 0 1 0 1 0 1: 2 slots (50%) hit all but the two cold misses
    trace = hand_trace([[[0]], [[1]]] * 3, 4)
    result = hit_rates(trace, [0.25, 0.5])
    assert result.n_slots == (1, 2) and result.steps == 6
    assert result.rates["lru"] == (0.0, 4 / 6)
    assert result.rates["belady"] == (0.0, 4 / 6)
    # prefill tokens are left out by default
    mixed = hand_trace([[[2]], [[3]], [[0]], [[0]]], 4, prefill=[True, True, False, False])
    assert hit_rates(mixed, [0.5], ["lru"]).rates["lru"] == (0.5,)
    assert hit_rates(mixed, [0.5], ["lru"], phase="all").rates["lru"] == (0.25,)
    assert hit_rates(mixed, [0.5], ["lru"], phase="prefill").rates["lru"] == (0.0,)


def test_pool_is_shared_by_all_layers():
    # 2 layers x 2 experts, top-1, the same expert every token: 25% of 4 keys = 1 slot for both layers
    trace = hand_trace([[[0], [0]]] * 4, 2)
    assert slots_for(trace, 0.25) == 1
    assert hit_rates(trace, [0.25, 0.5], ["lru"]).rates["lru"] == (0.0, 6 / 8)


def test_granite_hit_rates_match_the_shared_readme():
    result = hit_rates(load_trace(resolve_shipped(GRANITE)), policies=["lru", "lfu-lru", "belady"])
    rounded = {name: [round(100 * r, 1) for r in rates] for name, rates in result.rates.items()}
    assert rounded == {"lru": [0.0, 42.2, 66.9], "lfu-lru": [17.2, 38.6, 74.1], "belady": [38.5, 62.5, 86.9]}


def test_default_policy_is_looked_up_at_call_time(monkeypatch):
    trace = load_trace(resolve_shipped(GRANITE))
    monkeypatch.setattr(cache_policy, "DEFAULT_POLICY", cache_policy.LruPolicy)
    assert hit_rates(trace, [0.125], ["default"]).rates["default"] == hit_rates(trace, [0.125], ["lru"]).rates["lru"]
    monkeypatch.setattr(cache_policy, "DEFAULT_POLICY", cache_policy.LfuLruPolicy)
    assert hit_rates(trace, [0.125], ["default"]).rates["default"] == hit_rates(trace, [0.125], ["lfu-lru"]).rates["lfu-lru"]


def test_belady_bounds_every_policy_on_real_and_model_traces():
    traces = [load_trace(resolve_shipped(GRANITE))]
    quick = dict(calibration_rounds=1, calibration_tokens=40)  # any routing will do for an upper bound
    traces.append(RoutingModel(load_counts(GRANITE), **quick).synthesize(120, 2, 10, seed=1))
    traces.append(RoutingModel(load_counts("qwen3-30b-a3b"), **quick).synthesize(40, 2, 0, seed=2))
    for trace, phase in zip(traces, ("decode", "all", "decode")):
        result = hit_rates(trace, [0.05, 0.2, 0.4], phase=phase)
        for name, rates in result.rates.items():
            for best, rate in zip(result.rates["belady"], rates):
                assert best >= rate, (trace.source, phase, name)
        assert result.rates["belady"] != result.rates["lru"]  # a bound that is not just equality


def test_hit_rate_arguments_are_checked():
    trace = hand_trace([[[0]]], 2)
    with pytest.raises(ValueError, match="fractions"):
        hit_rates(trace, [0.0])
    with pytest.raises(ValueError, match="unknown policy nope"):
        hit_rates(trace, [0.5], ["nope"])
    assert set(POLICIES) >= {"default", "lru", "lfu-lru", "belady"}


# -- llamapack trace
def invoke(*args):
    return CliRunner().invoke(main, ["trace", *map(str, args)])


def test_cli_hitrate_json():
    result = invoke("hitrate", GRANITE, "--json", "--fractions", "0.125,0.25,0.5")
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)  # nothing else on stdout
    assert data["fractions"] == [0.125, 0.25, 0.5]
    assert list(data["policies"]) == ["default", "lru", "lfu-lru", "belady"]
    assert all(len(rates) == 3 and all(0 <= r <= 1 for r in rates) for rates in data["policies"].values())
    assert data["policies"]["lru"][1] == pytest.approx(0.422, abs=5e-4)


def test_cli_hitrate_table_and_png(tmp_path):
    result = invoke("hitrate", GRANITE, "--policies", "lru,belady", "--fractions", "0.25", "--png", tmp_path / "h.png")
    assert result.exit_code == 0, result.output
    assert "lru" in result.output and "42.2%" in result.output and "62.5%" in result.output
    assert (tmp_path / "h.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_cli_synth_show_convert(tmp_path):
    counts = tmp_path / "tiny.counts.npz"
    rng = np.random.default_rng(0)
    rows = [[rng.choice(6, size=2, replace=False) for _ in range(3)] for _ in range(50)]
    save_counts(counts_from_trace(hand_trace(rows, 6), min_count=1, min_lift=1.0), counts)
    out = tmp_path / "synth.npz"
    result = invoke("synth", "--counts", counts, "--tokens", 30, "--requests", 3, "--prefill-tokens", 4,
                    "--seed", 5, "-o", out)
    assert result.exit_code == 0, result.output
    trace = load_trace(out)
    assert (trace.n_tokens, trace.n_layers, trace.top_k, trace.n_experts, trace.n_requests) == (42, 3, 2, 6, 3)
    assert int(trace.prefill.sum()) == 12 and trace.prefill[:4].all() and not trace.prefill[4:14].any()
    shown = invoke("show", out)
    assert shown.exit_code == 0 and "12 prefill, 30 decode" in shown.output and "requests: 3" in shown.output
    source = tmp_path / "tiny.trace.json"
    source.write_text(json.dumps({"num_experts": 4, "prompts": {
        "a": {"prefill": [[[0, 1]], [[1, 2]]], "decode": [[[2, 3]]]}, "b": {"prefill": [[[3, 0]]], "decode": []}}}))
    converted = invoke("convert", source, "-o", tmp_path / "c.npz")
    assert converted.exit_code == 0, converted.output
    trace = load_trace(tmp_path / "c.npz")
    assert trace.request.tolist() == [0, 0, 0, 1] and trace.prefill.tolist() == [True, True, False, True]


@pytest.mark.parametrize("args, words", [
    (["hitrate", "missing.npz"], ["missing.npz", "cannot read"]),
    (["hitrate", GRANITE, "--fractions", "0.5,2"], ["--fractions"]),
    (["hitrate", GRANITE, "--policies", "lru,mru"], ["unknown policy mru"]),
    (["show", "README.md"], ["README.md", "cannot read"]),
    (["synth", "--counts", "nope", "--tokens", "5", "-o", "x.npz"], ["nope"]),
    (["convert", "README.md", "-o", "x.npz"], ["README.md", "not a per-token router trace"]),
])
def test_cli_bad_input_is_one_error_line(tmp_path, monkeypatch, args, words):
    monkeypatch.chdir(Path(__file__).resolve().parent.parent)
    result = invoke(*args)
    assert result.exit_code == 1, result.output
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("Error: ")
    for word in words:
        assert word in lines[0]
    assert not isinstance(result.exception, Exception) or isinstance(result.exception, SystemExit)
