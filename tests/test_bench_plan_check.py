"""Predicted vs measured (llamapack/bench/plan_check.py, bench/plan_vs_measured.py) on CPU: the committed H200
results with recorded probe figures (what each row takes from the run and what it predicts; no timing is
asserted), the script's files and refusals, and the device path (shape from the GGUF, the plan's probe) on a tiny
model benchmarked here."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from llamapack.bench.plan_check import PlanCheckError, check, costs_from, markdown, write
from llamapack.cache_policy import policy_class
from llamapack.plan import hits, probe
from llamapack.plan.model import DEFAULT_COSTS, decode_compute_s, decode_time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
Q30B = os.path.join(REPO, "bench", "results", "gpu_routing_q30b.json")
POLICY = os.path.join(REPO, "bench", "results", "gpu_routing_q30b_policy.json")
GRANITE = os.path.join(REPO, "bench", "results", "gpu_routing_granite.json")
STRIDE = 2654208


def probe_file(tmp_path, disk=1.1e9, h2d=20e9, block=STRIDE):
    """A probe cache file as the plan's probe writes it on a GPU machine."""
    path = tmp_path / "probe.json"
    probe.save_cache(path, {"disks": {f"2049:{block}": {"bytes_per_s": disk, "block_bytes": block, "threads": 4,
                                                         "path": "pack", "when": 0}},
                            "cpu": {"read_bytes_per_s": 20e9, "flops": 5e11},
                            **({"h2d_bytes_per_s": h2d} if h2d else {})})
    return path


@pytest.fixture(scope="module")
def q30b(tmp_path_factory):
    folder = tmp_path_factory.mktemp("pvm")
    return check(Q30B, probe_file=str(probe_file(folder)), cache_dir=folder), folder


def test_rows_take_the_runs_budgets_and_measurements(q30b):
    (table, meta), _ = q30b
    results = json.loads(open(Q30B).read())
    rows = {r["config"]: r for r in table["decode"]}
    # every llamapack run of the file, and vanilla-vram's compute term; not cpu-moe, not upstream's runs
    assert list(rows) == ["vanilla-vram", "pack-25%+ram+preload", "pack-50%+ram+preload", "pack-12.5%@8G",
                          "pack-25%@8G", "pack-50%@8G"]
    assert [(rows[n]["pool_slots"], rows[n]["tier_blocks"]) for n in list(rows)[1:]] == [
        (1536, 6144), (3072, 6144), (768, 0), (1536, 0), (3072, 0)]
    assert meta["shape"]["top_k"] == 8 and meta["shape"]["n_experts"] == 128  # top-k from the replayed trace
    run = next(r for r in results["runs"] if r["config"]["name"] == "pack-25%@8G")
    decoded = sum(r["n_decoded"] for r in run["requests"])
    row = rows["pack-25%@8G"]
    assert row["measured_decode_tok_s"] == pytest.approx(decoded / sum(r["decode_s"] for r in run["requests"]))
    assert row["measured_pool_hit_rate"] == pytest.approx(0.801, abs=0.001)  # the README's 80.1%
    assert row["ratio"] == pytest.approx(row["predicted_decode_tok_s"] / row["measured_decode_tok_s"])
    assert row["within"] == (abs(row["ratio"] - 1) <= 0.2)
    # the time model fed the run's own loads: compute + hook + its SSD reads per token at the probe's 1.1 GB/s; a
    # run from before the native hot path: every step and every miss in Python
    assert row["native_hot_path"] is False
    misses = sum(r["decode_counters"]["cache_misses"] for r in run["requests"])
    from llamapack.bench.plan_check import shape_from_results, machine_from_probe_file

    shape = shape_from_results(results, 8)
    machine, _ = machine_from_probe_file(q30b[1] / "probe.json", STRIDE)
    c = DEFAULT_COSTS
    expected = (decode_compute_s(shape, machine) + 48 * (c.gpu_hook_s_per_layer + c.python_step_s)
                + misses / decoded * (STRIDE / 1.1e9 + c.python_load_s))
    assert row["time_model_on_measured_hits_tok_s"] == pytest.approx(1 / expected)
    # the prediction: the bench's requests replayed in order through NextUse at these slots (the routing model's
    # prompt rows, then as many of its decode tokens as each request decoded), each request's decoded tokens
    # over their summed time in the same time model
    trace, prompts = hits.decode_trace(shape, q30b[1] / "plan"), hits.prompt_trace(shape, q30b[1] / "plan")
    decoded_each = [r["n_decoded"] for r in run["requests"]]
    per_request = hits.request_loads(shape, trace, [r["n_prompt"] for r in run["requests"]], decoded_each,
                                     results["workload"].get("n_ubatch", 512), 1536, 0, prompt_source=prompts)
    seconds = sum(n * decode_time(shape, machine, loads, native_hot_path=False).total
                  for n, (_, loads) in zip(decoded_each, per_request))
    assert row["predicted_decode_tok_s"] == pytest.approx(decoded / seconds)
    lookups = sum(n * loads.lookups for n, (_, loads) in zip(decoded_each, per_request))
    assert row["predicted_pool_hit_rate"] == pytest.approx(
        sum(n * loads.pool_hits for n, (_, loads) in zip(decoded_each, per_request)) / lookups)
    first_request_reads = per_request[0][1]  # mostly keys the process reads for the first time: slower reads
    assert first_request_reads.ssd_first_reads > per_request[1][1].ssd_first_reads
    # beside it, the plan's own figure: its trace's last request (a steady state), the same time model
    loads = hits.decode_loads(trace, 1536, 0)
    assert row["plan_own_pool_hit_rate"] == pytest.approx(loads.pool_hit_rate)
    assert row["plan_own_decode_tok_s"] == pytest.approx(1 / decode_time(shape, machine, loads,
                                                                         native_hot_path=False).total)
    low, high = row["predicted_at_bench_disk_tok_s"]  # the bench's probes: 0.83 and 1.78 GB/s
    assert low < row["predicted_decode_tok_s"] < high
    assert rows["vanilla-vram"]["predicted_decode_tok_s"] == pytest.approx(1 / decode_compute_s(shape, machine))
    predicted = [rows[n]["predicted_decode_tok_s"] for n in ("pack-12.5%@8G", "pack-25%@8G", "pack-50%@8G")]
    assert predicted == sorted(predicted)  # a bigger pool, faster
    assert "tier filled at load: replayed as such" in rows["pack-25%+ram+preload"]["notes"][0]
    assert rows["pack-25%+ram+preload"]["measured_tier_hit_rate"] == 1.0  # preloaded: every pool miss hit the tier
    assert rows["pack-25%+ram+preload"]["predicted_tier_hit_rate"] == 1.0  # a full tier filled at load, replayed


HOTPATH = os.path.join(REPO, "bench", "results", "gpu_hotpath_q30b.json")


def test_native_runs_and_pyhot_runs(tmp_path):
    """The H100 hot-path runs: +pyhot runs every step in Python, the native ones only SSD steps; the prefill
    rows follow the bench's request order (512 first, from an empty cache), the plan's own figure beside them."""
    table, _ = check(HOTPATH, probe_file=str(probe_file(tmp_path, disk=2.29e9, h2d=55.29e9)), cache_dir=tmp_path)
    rows = {r["config"]: r for r in table["decode"]}
    assert rows["pack-100%"]["native_hot_path"] and not rows["pack-100%+pyhot"]["native_hot_path"]
    assert rows["pack-100%+pyhot"]["predicted_python_steps_per_token"] == 48
    assert 0 < rows["pack-100%"]["predicted_python_steps_per_token"] < 48
    assert rows["pack-100%"]["measured_python_steps_per_token"] == pytest.approx((316 + 172) / 398)
    for name in ("pack-100%", "pack-25%+ram+preload", "pack-50%+ram+preload"):
        assert rows[name]["predicted_decode_tok_s"] > rows[name + "+pyhot"]["predicted_decode_tok_s"]
    assert rows["pack-25%+ram+preload"]["predicted_python_steps_per_token"] == 0  # every miss in the full tier
    prefill = {(r["config"], r["n_tokens"]): r for r in table["prefill"]}
    cold, warm = prefill[("pack-100%", 512)], prefill[("pack-100%", 32)]
    assert (cold["request"], warm["request"]) == (1, 2)
    assert cold["predicted_tok_s"] < cold["plan_own_tok_s"]  # the bench's first prompt reads every expert
    assert warm["predicted_tok_s"] > warm["plan_own_tok_s"]  # after a 512-token prompt and a decode


def test_prefill_rows_and_markdown(q30b):
    (table, meta), _ = q30b
    prefill = {(r["config"], r["n_tokens"]): r for r in table["prefill"]}
    assert ("pack-25%@8G", 512) in prefill and ("pack-25%@8G", 32) in prefill
    assert prefill[("pack-25%@8G", 512)]["measured_tok_s"] == pytest.approx(512 / 12.235124155999983)
    text = markdown(table, meta)
    n_within = sum(r["within"] for r in table["decode"])
    assert f"**Decode within ±20%: {n_within} of 6**" in text
    assert "| pack-25%@8G | 1536 / 0 |" in text and "## Prefill" in text
    assert "probe file" in text and "(plan.model.DEFAULT_COSTS)" in text


def test_faster_disk_and_the_policy_of_each_run(tmp_path):
    slow, _ = check(POLICY, probe_file=str(probe_file(tmp_path)), cache_dir=tmp_path)
    fast, meta = check(POLICY, probe_file=str(probe_file(tmp_path)), disk_gbps=3.0, cache_dir=tmp_path)
    assert "disk set to 3 GB/s" in meta["machine_source"]
    by = lambda table: {r["config"]: r for r in table["decode"]}  # noqa: E731
    assert by(fast)["pack-25%@8G"]["predicted_decode_tok_s"] > by(slow)["pack-25%@8G"]["predicted_decode_tok_s"]
    rows = by(slow)
    assert rows["pack-12.5%+lfulru@8G"]["policy"] == "lfu-lru" and rows["pack-12.5%@8G"]["policy"] == "next-use"
    results = json.loads(open(POLICY).read())
    from llamapack.bench.plan_check import shape_from_results

    trace = hits.decode_trace(shape_from_results(results, 8), tmp_path / "plan")
    lfu = hits.decode_loads(trace, 768, 0, policy=policy_class("lfu-lru"))
    assert rows["pack-12.5%+lfulru@8G"]["plan_own_pool_hit_rate"] == pytest.approx(lfu.pool_hit_rate)
    assert lfu.pool_hit_rate != pytest.approx(rows["pack-12.5%@8G"]["plan_own_pool_hit_rate"])
    # the bench's sequence through each run's policy too
    assert rows["pack-12.5%+lfulru@8G"]["predicted_pool_hit_rate"] != pytest.approx(
        rows["pack-12.5%@8G"]["predicted_pool_hit_rate"])


def test_refusals(tmp_path):
    with pytest.raises(PlanCheckError, match="--model.*--probe-file or --machine-from"):
        check(Q30B, cache_dir=tmp_path)
    with pytest.raises(PlanCheckError, match="no host-to-device copy rate.*--h2d-gbps"):
        check(Q30B, probe_file=str(probe_file(tmp_path, h2d=None)), cache_dir=tmp_path)
    table, _ = check(Q30B, probe_file=str(probe_file(tmp_path, h2d=None)), h2d_gbps=25, cache_dir=tmp_path)
    assert table["decode"]
    results = json.loads(open(GRANITE).read())
    results["workload"]["routing"]["path"] = "/nowhere/unknown.npz"
    (tmp_path / "r.json").write_text(json.dumps(results))
    with pytest.raises(PlanCheckError, match="top-k not recorded.*--top-k"):
        check(tmp_path / "r.json", probe_file=str(probe_file(tmp_path)), cache_dir=tmp_path)
    table, meta = check(tmp_path / "r.json", probe_file=str(probe_file(tmp_path)), top_k=8, cache_dir=tmp_path)
    assert meta["shape"]["top_k"] == 8 and {r["config"] for r in table["decode"]} >= {"pack-25%@2G"}
    (tmp_path / "costs.json").write_text(json.dumps({"gpu_hook_s_per_layer": 1e-5, "nope": 1}))
    with pytest.raises(PlanCheckError, match="unknown Costs field.*nope"):
        costs_from(str(tmp_path / "costs.json"))


def test_script_writes_the_table(tmp_path):
    (tmp_path / "costs.json").write_text(json.dumps({"gpu_hook_s_per_layer": 1e-5}))
    env = dict(os.environ, XDG_CACHE_HOME=str(tmp_path / "cache"))
    proc = subprocess.run([sys.executable, os.path.join(REPO, "bench", "plan_vs_measured.py"), GRANITE, "--probe-file",
                           str(probe_file(tmp_path, block=3145728)), "--costs", str(tmp_path / "costs.json"),
                           "--out", str(tmp_path / "out")], capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    data = json.loads((tmp_path / "out" / "plan_vs_measured.json").read_text())
    assert data["meta"]["costs"]["gpu_hook_s_per_layer"] == 1e-5 and data["meta"]["costs_overridden"]
    assert {r["config"] for r in data["decode"]} == {"vanilla-vram", "pack-25%+ram+preload", "pack-12.5%@2G",
                                                     "pack-25%@2G", "pack-50%@2G"}
    assert proc.stdout.startswith("# Predicted (llamapack plan) vs measured (llamapack bench): granite.gguf")
    assert (tmp_path / "out" / "plan_vs_measured.md").read_text() in proc.stdout
    bad = subprocess.run([sys.executable, os.path.join(REPO, "bench", "plan_vs_measured.py"), GRANITE],
                         capture_output=True, text=True, timeout=300, env=env)
    assert bad.returncode == 1 and bad.stderr.startswith("Error: machine figures") and "Traceback" not in bad.stderr


def test_on_the_machine_that_ran_the_bench(tmp_path):
    """The device path on a tiny model: a CPU bench (host pool), then the check with --model: the shape from the
    GGUF, the figures from the plan's probe (recorded here), each run's slots from the run."""
    from llamapack.pack import build_pack
    from llamapack.synth import write_model

    model = write_model(tmp_path / "tiny.gguf", "qwen3moe-tiny", seed=0)
    build_pack(model, progress=False, safety_margin_mib=0)
    out = tmp_path / "results"
    proc = subprocess.run(
        [sys.executable, "-m", "llamapack", "bench", str(model), "-o", str(out), "-n", "6", "--prompt-lengths", "8",
         "-ub", "1", "--temperature", "1.0", "--configs", "vanilla,pack-25%,pack-50%+lfulru"],
        capture_output=True, text=True, timeout=600, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads((out / "bench.json").read_text())["model"]["top_k"] == 4  # recorded now
    target = probe.disk_target(str(model), str(model.with_suffix(".expert-pack")))
    probe.save_cache(probe.probe_file(tmp_path / "cache" / "probe"), {
        "disks": {target.key: {"bytes_per_s": 2e9, "block_bytes": target.block_bytes, "threads": 4,
                               "path": target.path, "when": 0}}, "cpu": {"read_bytes_per_s": 20e9, "flops": 2e11}})
    table, meta = check(out / "bench.json", model=str(model), cache_dir=tmp_path / "cache")
    assert meta["shape_source"].startswith("read from") and meta["machine_source"].startswith("cached")
    rows = {r["config"]: r for r in table["decode"]}
    assert set(rows) == {"pack-25%", "pack-50%+lfulru"}  # no vanilla-vram on a CPU bench
    assert (rows["pack-25%"]["pool_slots"], rows["pack-25%"]["gpu_pool"]) == (16, False)  # 25% of 4 x 16, host pool
    assert rows["pack-50%+lfulru"]["policy"] == "lfu-lru" and rows["pack-50%+lfulru"]["pool_slots"] == 32
    assert all(r["predicted_decode_tok_s"] > 0 and r["measured_decode_tok_s"] > 0 for r in rows.values())
    md, js = write(table, meta, tmp_path / "table")
    assert json.loads(js.read_text())["decode"][0]["config"] == "pack-25%" and md.read_text().startswith("# Predicted")


def test_notes_name_what_the_plan_does_not_model():
    from llamapack.bench.plan_check import notes_of

    def notes(**config):
        return notes_of(dict(config=dict(config), routing="replayed"))

    assert notes(name="pack-25%", source="pack") == []  # results from before the slot lookup existed
    assert notes(name="pack-25%", source="pack", slot_lookup=True) == [
        "slot lookup: not modelled (its per-layer cost is the op's)"]
    assert "CPU remap op (+oppath)" in notes(name="pack-25%+oppath", source="pack", slot_lookup=False)[0]
    whole = "whole-pool graphs: modelled as no per-layer cost (an assumption)"
    assert whole in notes(name="pack-100%", source="pack", vram_fraction=1.0, whole_pool=True)
    assert whole not in notes(name="pack-100%", source="pack", vram_fraction=1.0)  # results from before them
    assert whole not in notes(name="pack-25%", source="pack", vram_fraction=0.25, whole_pool=True)
    hybrid = notes(name="pack-25%+ram+hybridauto", source="pack", hybrid="auto", slot_lookup=True)
    assert "hybrid: not modelled (predicted as off)" in hybrid


def test_budgets_follow_the_runs_whole_pool_setting():
    """A run could use whole-pool graphs when it asked for them with no hybrid and no lookahead (a bench from
    before them has no such key: it could not)."""
    from llamapack.bench.plan_check import budgets_of
    from llamapack.plan.model import ModelShape

    shape = ModelShape("small", 4, 16, 4, 1 << 20, 1 << 20, 1e6, 1 << 24)
    base = dict(source="pack", vram_fraction=1.0, native_hot_path=True)
    whole = lambda **config: budgets_of({"config": dict(base, **config)}, shape, 512).whole_pool(shape)  # noqa: E731
    assert whole(whole_pool=True)
    assert not whole() and not whole(whole_pool=False)
    assert not whole(whole_pool=True, hybrid="auto") and not whole(whole_pool=True, prefetch=True)
    assert not whole(whole_pool=True, vram_fraction=0.5)


def test_a_pool_filled_at_start_is_told_by_its_first_request():
    """pool_preload (since round 13) fills a pool of every expert before the first token: the first request then
    missed nothing, and the comparison replays it with every lookup a hit (round 14: 512-token prefill predicted
    at vanilla's speed, not after 4,804 tier copies)."""
    from llamapack.bench.plan_check import pool_filled_at_start
    from llamapack.plan.model import Budgets, ModelShape

    shape = ModelShape("small", 4, 16, 4, 1 << 20, 1 << 20, 1e6, 1 << 24)
    run = lambda misses, hits=100: {"requests": [{"prefill_counters": {"cache_hits": hits, "cache_misses": misses}}]}  # noqa: E731
    every, quarter = Budgets(shape.n_blocks, 0, 512, True), Budgets(shape.n_blocks // 4, 0, 512, True)
    assert pool_filled_at_start(run(0), every, shape)
    assert not pool_filled_at_start(run(3), every, shape) and not pool_filled_at_start(run(0, hits=0), every, shape)
    assert not pool_filled_at_start(run(0), quarter, shape) and not pool_filled_at_start({"requests": []}, every, shape)


def test_a_warm_run_replays_its_priming_session(tmp_path):
    """+warm runs: the priming requests the bench recorded (trace requests, prompts, tokens decoded) replayed from
    cold caches of the run's budgets give the popularity the measured replay starts from (notes say so); a run
    without a priming record, or whose priming trace is gone, is not modelled."""
    from pathlib import Path

    from llamapack.bench.plan_check import notes_of, warm_popularity
    from llamapack.plan.model import Budgets, ModelShape
    from llamapack.routing import save_trace

    shape = ModelShape("small", 4, 16, 2, 1 << 20, 1 << 20, 1e6, 1 << 24)
    trace = hits.decode_trace(shape, tmp_path)
    save_trace(trace, tmp_path / "prime.trace.npz")
    results = {"workload": {"warm": {"routing": "/elsewhere/prime.trace.npz", "requests": []}}}
    priming = {"requests": [{"request": 1, "n_prompt": 16, "n_decoded": 30}, {"request": 2, "n_prompt": 8, "n_decoded": 5}]}
    run = {"config": {"warm_start": True}, "priming": priming, "routing": "replayed"}
    budgets = Budgets(16, 0, 64, True)
    popularity = warm_popularity(results, run, budgets, None, Path(tmp_path))
    assert popularity is None  # the repo's trace folders do not hold it
    (tmp_path / "bench" / "results").mkdir(parents=True)
    save_trace(trace, tmp_path / "bench" / "results" / "prime.trace.npz")
    popularity = warm_popularity(results, run, budgets, None, Path(tmp_path))
    assert popularity == hits.priming_popularity(trace, [(1, 16, 30), (2, 8, 5)], 64, 16, 0)
    assert notes_of(run) == ["warm start: replayed (the priming requests' popularity seeds and fills the caches)"]
    cold = dict(run, priming=None)
    assert warm_popularity(results, cold, budgets, None, Path(tmp_path)) is None
    assert notes_of(cold) == ["warm start: not modelled (no priming record)"]
    assert warm_popularity(results, dict(run, config={}), budgets, None, Path(tmp_path)) is None
