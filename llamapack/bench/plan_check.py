"""Predicted against measured (issue #26): ``llamapack plan``'s speed model and hit-rate replay, run for the exact
settings of each llamapack run of a ``llamapack bench`` results file, beside what that run measured.

Per run (``bench.json``'s combined rows; a config run in several rounds is its median):

* the budgets it ran with: its pool's slots and RAM tier's blocks (the provider's own counts, as the run
  recorded them, so a VRAM fraction, a RAM fraction, ``+ramauto`` under a memory limit all come out as they
  did), the bench's ``n_ubatch``, a VRAM or host pool, and its cache policy (``+lfulru``, ``+lru``);
* the plan's prediction for them (``recommend.predict``: the routing model's trace at the model's shape replayed
  through that policy, then ``plan.model``'s times with this machine's probed rates): decode tok/s, prefill tok/s
  at each prompt length the bench measured, pool and tier hit rates, SSD bytes per token;
* the same time model fed the run's own measured loads (hits, RAM-tier hits and SSD reads per decoded token):
  what is left of the error once the hit rate is right, i.e. the time model's share of it;
* the decode prediction at the bench's own disk probes (before and after its runs), as a range: the disk moves.

Machine figures: measured by ``plan.probe`` on this machine (cached per machine, ``--reprobe`` to measure again;
on the GPU machine, right after the bench), or read from a probe file (``--probe-file``: the probe cache's JSON,
for a results file from another machine), with ``--disk-gbps`` / ``--h2d-gbps`` overrides. The model's shape:
from the GGUF (``--model``), or, without it, from the results file (its model section, the pool's slot bytes
and ``top_k``, or the routing trace's top-k), so that committed results can be compared offline.

Decode and prefill are compared like with like: the plan's figures are a steady state (decode: the last of 3
requests; prefill: the second of two prompts of one length), the bench's requests run in order from an empty
cache (its first prompt is cold, the next comes after the first's prompt and decode, and a decode read is often a
block's first in the process, which costs more: ``Costs.decode_first_read_factor``), so each row predicts the
bench's own sequence (``hits.request_loads``; decode: the requests' decoded tokens over their summed predicted
time), with the plan's own figure beside it. The native hot path is on for a run whose config has
``native_hot_path`` (not ``+pyhot``; results from before it existed ran the Python provider) with the ``next-use``
policy and no lookahead, as the provider decides.

Replayed as the run did, where the plan itself does not: a RAM tier filled at load (``+preload``: the plan's tier
starts cold) and a warm start (``+warm``: its priming requests replayed, their popularity seeding and filling the
caches). Not modelled (the rows say so): router lookahead, load-ahead, hybrid, the model's own (synthetic) routing.
"""
from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

from ..cache_policy import policy_class
from ..errors import LlamapackError
from ..plan import hits, probe, recommend
from ..plan.model import (DEFAULT_COSTS, MIB, Budgets, Costs, Machine, ModelShape, StepLoads, decode_compute_s,
                          decode_time, prefill_compute_s, python_work)
from .report import combine, summaries

TOLERANCE = 0.20  # issue #26: within +-20% of the measured figure
LLAMAPACK_SOURCES = ("pack", "gguf_direct")
TRACE_FOLDERS = ("bench/results", "llamapack/routing/data")
GPU_FREE_VRAM_UNKNOWN = 1 << 40  # a GPU pool whose budgets are given: free VRAM only matters to recommend()


class PlanCheckError(LlamapackError):
    """A results file or machine figures the comparison cannot use."""


# -- inputs

def find_trace(path: str, repo: Path) -> Path | None:
    """The routing trace a results file names: its path, or a file of the same name in the repo's trace folders."""
    for candidate in (Path(path), *(repo / folder / Path(path).name for folder in TRACE_FOLDERS)):
        if candidate.is_file():
            return candidate
    return None


def results_top_k(results: dict, repo: Path) -> int | None:
    """top-k of the benchmarked model: recorded by newer benches, else the replayed trace's."""
    if results["model"].get("top_k"):
        return int(results["model"]["top_k"])
    routing = results["workload"].get("routing")
    trace = find_trace(routing["path"], repo) if routing else None
    if trace is None:
        return None
    from ..routing.trace import load_trace

    return load_trace(trace).top_k


def shape_from_results(results: dict, top_k: int) -> ModelShape:
    """The model's shape as far as a results file tells it: blocks of ``expert_stride`` (their padding counted as
    expert bytes), the rest of the file as non-expert weights, the pool's slot bytes from a run's provider."""
    model = results["model"]
    n_blocks = model["n_moe_layers"] * model["n_expert"]
    slot_bytes = next((run["provider"]["slot_bytes"] for run in results["runs"]
                       if run.get("provider", {}).get("slot_bytes")), model["expert_stride"])
    return ModelShape(name=Path(model["path"]).stem, n_moe_layers=model["n_moe_layers"], n_experts=model["n_expert"],
                      top_k=top_k, block_bytes=model["expert_stride"], slot_bytes=int(slot_bytes),
                      expert_bytes=model["expert_bytes"] / n_blocks,
                      nonexpert_bytes=max(model["size_bytes"] - model["expert_bytes"], 0))


def machine_from_probe_file(path: str | os.PathLike, block_bytes: int) -> tuple[Machine, dict]:
    """A Machine from a probe cache file (``plan.probe``'s JSON): its disk entry of this block size (else its only
    one), its CPU rates and H2D rate; no VRAM figure (budgets are given). Also the disk entry used."""
    data = probe.load_cache(Path(path))
    disks = data.get("disks", {})
    if not disks or "cpu" not in data:
        raise PlanCheckError(f"{path}: not a llamapack probe file (version {probe.CACHE_VERSION}, with disks and cpu)")
    disk = next((d for d in disks.values() if d.get("block_bytes") == block_bytes), None)
    if disk is None:
        if len(disks) > 1:
            raise PlanCheckError(f"{path}: no disk probe of {block_bytes}-byte blocks among {len(disks)}")
        disk = next(iter(disks.values()))
    h2d = data.get("h2d_bytes_per_s")
    machine = Machine(free_vram_bytes=GPU_FREE_VRAM_UNKNOWN if h2d else None, spare_ram_bytes=0,
                      disk_bytes_per_s=float(disk["bytes_per_s"]), h2d_bytes_per_s=h2d,
                      cpu_read_bytes_per_s=float(data["cpu"]["read_bytes_per_s"]), cpu_flops=float(data["cpu"]["flops"]))
    return machine, disk


def for_pool(machine: Machine, gpu: bool, name: str) -> Machine:
    """``machine`` as the plan sees it for a VRAM pool (``gpu``) or a host pool."""
    if not gpu:
        return dataclasses.replace(machine, free_vram_bytes=None)
    if not machine.h2d_bytes_per_s:
        raise PlanCheckError(f"{name} ran a VRAM pool but these machine figures have no host-to-device copy rate: run "
                             "on the GPU machine (the probe measures it), or give --h2d-gbps or a probe file with one")
    return machine if machine.gpu else dataclasses.replace(machine, free_vram_bytes=GPU_FREE_VRAM_UNKNOWN)


def bench_disk_rates(results: dict) -> list[float]:
    """The bench's own disk probes, before and after its runs (bytes/s)."""
    rates = []
    for key in ("disk", "disk_after"):
        d = results.get(key) or {}
        if d.get("seconds"):
            rates.append(d["nbytes"] / d["seconds"])
    return rates


# -- per run

def first_runs(results: dict) -> dict:
    """The first finished run of each config name (its config and provider facts; the combined row has the rest)."""
    runs = {}
    for run in results["runs"]:
        if "error" not in run:
            runs.setdefault(run["config"]["name"], run)
    return runs


def budgets_of(run: dict, shape: ModelShape, n_ubatch: int) -> Budgets:
    """The slot pool, RAM tier and ubatch the run served with (its provider's counts)."""
    provider, config = run.get("provider") or {}, run["config"]
    slots = provider.get("n_slots")
    if slots is None:
        slots = max(1, round(config["vram_fraction"] * shape.n_blocks))
    tier = provider.get("ram_slots")
    if tier is None:
        tier = round(config["ram_fraction"] * shape.n_blocks) if config.get("ram_fraction") else 0
    device = provider.get("device", 0)
    gpu = not (isinstance(device, int) and device < 0)
    return Budgets(int(slots), int(tier), n_ubatch, gpu, native_hot_path(config), whole_pool_graphs(config))


def native_hot_path(config: dict) -> bool:
    """Whether the run's provider served steps natively: asked (absent: a bench from before the native path,
    every step in Python), with ``next-use`` and no lookahead (the provider's rule)."""
    return bool(config.get("native_hot_path", False)) and config.get("cache_policy", "next-use") == "next-use" \
        and not config.get("prefetch")


def whole_pool_graphs(config: dict) -> bool:
    """Whether the run's provider could run whole-pool graphs: asked (absent: a bench from before them), with no
    hybrid and no lookahead (the hook's rule; the pool's size and the hot path are Budgets.whole_pool's part)."""
    return bool(config.get("whole_pool", False)) and config.get("hybrid", "off") == "off" and not config.get("prefetch")


def notes_of(run: dict) -> list[str]:
    config = run["config"]
    notes = []
    if config.get("ram_preload"):
        notes.append("tier filled at load: replayed as such (the plan's own tier starts cold)")
    if config.get("warm_start"):
        notes.append("warm start: replayed (the priming requests' popularity seeds and fills the caches)"
                     if run.get("priming") else "warm start: not modelled (no priming record)")
    if config.get("prefetch"):
        notes.append("router lookahead: not modelled")
    if run.get("routing", "own") != "replayed":
        notes.append("own (synthetic) routing: the plan's routing model does not describe it")
    if config.get("native_hot_path") is False:
        notes.append("Python provider (+pyhot)")
    if config.get("hybrid", "off") != "off":
        notes.append("hybrid: not modelled (predicted as off)")
    if config.get("slot_lookup") is False:
        notes.append("CPU remap op (+oppath); the plan's per-layer cost was fitted on it")
    elif config.get("slot_lookup") and config.get("source") in ("pack", "gguf_direct"):
        notes.append("slot lookup: not modelled (its per-layer cost is the op's)")
    if config.get("whole_pool") and config.get("source") in ("pack", "gguf_direct") and \
            config.get("vram_fraction") == 1.0:
        notes.append("whole-pool graphs: modelled as no per-layer cost (an assumption)")
    first = (run.get("requests") or [{}])[0]
    if first.get("prefill_counters", {}).get("cache_misses") == 0 and config.get("vram_fraction") == 1.0:
        notes.append("pool filled at start (its first request missed nothing): replayed as such")
    if config.get("load_ahead"):
        notes.append("load-ahead: not modelled (prefill copies predicted on the critical path)")
    return notes


def measured_loads(run: dict) -> StepLoads | None:
    """The run's decode loads per decoded token (all requests): lookups, pool hits, RAM-tier hits, SSD reads."""
    total: dict = {}
    decoded = 0
    for request in run["requests"]:
        decoded += request["n_decoded"]
        for key, value in request["decode_counters"].items():
            total[key] = total.get(key, 0) + value
    hits_, misses = total.get("cache_hits", 0), total.get("cache_misses", 0)
    if not decoded or not hits_ + misses:
        return None
    ram = total.get("ram_hits", 0)
    calls = total.get("provider_calls")  # the steps that entered Python; with the native path, the SSD ones
    return StepLoads((hits_ + misses) / decoded, hits_ / decoded, ram / decoded, (misses - ram) / decoded,
                     None if calls is None else calls / decoded)


def bench_request_loads(run: dict, shape: ModelShape, trace, budgets: Budgets, policy, preloaded: bool,
                        prompt_source=None, warm: dict | None = None) -> tuple[dict, list[tuple[int, StepLoads]]]:
    """The run's requests replayed in the bench's order, after its warm-up prompt if it made one (the first from
    an empty cache, or one warm-started from ``warm``; its prompts the routing model's prompt rows,
    ``prompt_source``; its decode the routing model's trace, as many tokens as the run decoded): (loads per ubatch
    of each prompt length, [(tokens decoded, loads per decode token)] of each request)."""
    requests = run["requests"]
    prompts, decoded = [r["n_prompt"] for r in requests], [r["n_decoded"] for r in requests]
    loads = hits.request_loads(shape, trace, prompts, decoded, budgets.n_ubatch, budgets.pool_slots,
                               budgets.tier_blocks, policy=policy, preloaded=preloaded, prompt_source=prompt_source,
                               warm=warm, warmup_tokens=(run.get("warmup") or {}).get("n_tokens", 0))
    if pool_filled_at_start(run, budgets, shape):  # no request misses: every lookup a pool hit
        loads = [tuple(dataclasses.replace(l, pool_hits=l.lookups, ram_hits=0.0, ssd_reads=0.0, ssd_steps=0.0,
                                           ssd_step_misses=0.0, ssd_first_reads=0.0) for l in pair) for pair in loads]
    prefill: dict = {}
    for n, (per_ubatch, _) in zip(prompts, loads):
        prefill[n] = per_ubatch  # a length given twice: its later prompt's, the one the report shows
    return prefill, [(n, per_token) for n, (_, per_token) in zip(decoded, loads)]


def mean_loads(requests: list[tuple[int, StepLoads]]) -> StepLoads | None:
    """The loads per decode token over the bench's requests (each weighted by its tokens); None: none decoded."""
    tokens = sum(n for n, _ in requests)
    if not tokens:
        return None
    fields = [f.name for f in dataclasses.fields(StepLoads)]
    return StepLoads(*(sum(n * (getattr(loads, name) or 0.0) for n, loads in requests) / tokens for name in fields))


def bench_decode_tok_s(shape: ModelShape, machine: Machine, requests: list[tuple[int, StepLoads]], costs: Costs,
                       native: bool, whole: bool) -> float | None:
    """Decode tok/s over the bench's requests as it measures them: every request's decoded tokens over their
    summed predicted time."""
    tokens = sum(n for n, _ in requests)
    seconds = sum(n * decode_time(shape, machine, loads, costs, native, whole).total for n, loads in requests if n)
    return tokens / seconds if seconds else None


def warm_popularity(results: dict, run: dict, budgets: Budgets, policy, repo: Path) -> dict | None:
    """A ``+warm`` run's starting popularity: its priming session's requests (the bench's record: which trace
    requests, their prompts and the tokens the priming process decoded) replayed from cold caches of the run's
    budgets; None for another run, or when the priming trace or record is missing."""
    warm = results["workload"].get("warm") or {}
    priming = (run.get("priming") or {}).get("requests") or []
    if not run["config"].get("warm_start") or not priming or not warm.get("routing"):
        return None
    path = find_trace(warm["routing"], repo)
    if path is None:
        return None
    from ..routing.trace import load_trace

    requests = [(r["request"], r["n_prompt"], r["n_decoded"]) for r in priming]
    return hits.priming_popularity(load_trace(path), requests, budgets.n_ubatch, budgets.pool_slots,
                                   budgets.tier_blocks, policy)


def pool_filled_at_start(run: dict, budgets: Budgets, shape: ModelShape) -> bool:
    """A pool of every expert filled before the first token (StreamingSettings.pool_preload, since round 13),
    told by the run's first request: lookups, and not one miss."""
    first = run["requests"][0]["prefill_counters"] if run["requests"] else {}
    return budgets.pool_slots >= shape.n_blocks and first.get("cache_hits", 0) > 0 and first.get("cache_misses") == 0


def tier_hit_rate(run: dict) -> float | None:
    ram = sum(r["decode_counters"].get("ram_hits", 0) for r in run["requests"])
    missed = sum(r["decode_counters"].get("ram_misses", 0) for r in run["requests"])
    return ram / (ram + missed) if ram + missed else None


def ratio(predicted: float | None, measured: float | None) -> float | None:
    return predicted / measured if predicted and measured else None


def within(r: float | None) -> bool | None:
    return None if r is None else abs(r - 1) <= TOLERANCE


def compare(results: dict, shape: ModelShape, machine: Machine, costs: Costs = DEFAULT_COSTS,
            cache_dir: Path | None = None, repo: Path | None = None) -> dict:
    """Rows of predicted against measured, decode and prefill, for every finished llamapack run of ``results``
    (and vanilla-vram's compute term against its measurement)."""
    repo = repo or Path(__file__).resolve().parents[2]
    trace = hits.decode_trace(shape, cache_dir)
    prompts = hits.prompt_trace(shape, cache_dir)
    runs, rows = first_runs(results), combine(summaries(results))
    n_ubatch = results["workload"].get("n_ubatch", 512)
    lengths = list(dict.fromkeys(results["workload"]["prompt_lengths"]))  # a repeated length: its last prompt
    disks = bench_disk_rates(results)
    decode_rows, prefill_rows = [], []
    for row in rows:
        run = runs.get(row.name)
        if not row.ok or run is None:
            continue
        config = run["config"]
        if config.get("source") not in LLAMAPACK_SOURCES:
            if row.name == "vanilla-vram":  # every expert in VRAM: the plan's compute term
                decode_rows.append(compute_row(row, shape, for_pool(machine, True, row.name), costs))
                prefill_rows += [prefill_row(row.name, n, n / prefill_compute_s(shape, for_pool(machine, True, row.name),
                                                                                n, n_ubatch, costs), row)
                                 for n in lengths if (row.prefill_tok_s or {}).get(n)]
            continue
        budgets = budgets_of(run, shape, n_ubatch)
        here = for_pool(machine, budgets.gpu, row.name)
        policy = policy_class(config.get("cache_policy", "next-use"))
        measured_lengths = [n for n in lengths if (row.prefill_tok_s or {}).get(n)]
        plan_own = recommend.predict(shape, here, row.name, budgets, trace, 0, costs, prefill_lengths=measured_lengths,
                                     policy=policy, prompt_source=prompts)
        preloaded = bool(config.get("ram_preload"))
        all_lengths = [r["n_prompt"] for r in run["requests"]]
        first = all_lengths[:1] if all_lengths and all_lengths.count(all_lengths[0]) == 1 else []  # cold: measured first
        bench_prefill, bench_decode = bench_request_loads(run, shape, trace, budgets, policy, preloaded, prompts,
                                                          warm_popularity(results, run, budgets, policy, repo))
        prediction = recommend.predict(shape, here, row.name, budgets, trace, 0, costs, prefill_lengths=measured_lengths,
                                       policy=policy, tier_preloaded=preloaded, prompt_source=prompts,
                                       prefill_loads=bench_prefill, cold_lengths=first)
        native, whole = budgets.native_hot_path, budgets.whole_pool(shape)
        predicted = bench_decode_tok_s(shape, here, bench_decode, costs, native, whole) or prediction.decode_tok_s
        loads = measured_loads(run)
        on_measured = 1 / decode_time(shape, here, loads, costs, native, whole).total if loads else None
        at_disks = [bench_decode_tok_s(shape, dataclasses.replace(here, disk_bytes_per_s=rate), bench_decode, costs,
                                       native, whole) or prediction.decode_tok_s for rate in disks]
        bench_loads = mean_loads(bench_decode) or prediction.decode_loads
        r = ratio(predicted, row.decode_tok_s)
        decode_rows.append(dict(
            config=row.name, pool_slots=budgets.pool_slots, tier_blocks=budgets.tier_blocks, n_ubatch=n_ubatch,
            gpu_pool=budgets.gpu, policy=config.get("cache_policy", "next-use"), native_hot_path=native,
            memory_limit_mib=config.get("memory_limit_mib"),
            predicted_decode_tok_s=predicted, measured_decode_tok_s=row.decode_tok_s, ratio=r,
            within=within(r), plan_own_decode_tok_s=prediction.decode_tok_s,
            plan_own_pool_hit_rate=prediction.decode_loads.pool_hit_rate,
            time_model_on_measured_hits_tok_s=on_measured, time_model_ratio=ratio(on_measured, row.decode_tok_s),
            predicted_at_bench_disk_tok_s=[min(at_disks), max(at_disks)] if at_disks else None,
            predicted_pool_hit_rate=bench_loads.pool_hit_rate, measured_pool_hit_rate=row.hit_rate,
            predicted_tier_hit_rate=bench_loads.tier_hit_rate if budgets.tier_blocks else None,
            measured_tier_hit_rate=tier_hit_rate(run) if budgets.tier_blocks else None,
            predicted_ssd_bytes_per_token=bench_loads.ssd_reads * shape.block_bytes,
            measured_ssd_bytes_per_token=row.read_bytes_per_token,
            predicted_python_steps_per_token=python_steps_per_token(shape, bench_loads, here, native),
            measured_python_steps_per_token=loads.ssd_steps if loads else None,
            predicted_decode_ms=split_ms(prediction.decode), notes=notes_of(run), rounds=row.n_rounds))
        order = [r["n_prompt"] for r in run["requests"]]
        prefill_rows += [prefill_row(row.name, n, prediction.prefill_tok_s(n), row, plan_own.prefill_tok_s(n),
                                     order.index(n) + 1 if n in order else None) for n in prediction.prefill]
    return dict(decode=decode_rows, prefill=prefill_rows)


def compute_row(row, shape: ModelShape, machine: Machine, costs: Costs) -> dict:
    """vanilla-vram: the plan's compute term (every expert resident) against the measured decode."""
    predicted = 1 / decode_compute_s(shape, machine, costs)
    r = ratio(predicted, row.decode_tok_s)
    return dict(config=row.name, pool_slots=None, tier_blocks=None, predicted_decode_tok_s=predicted,
                measured_decode_tok_s=row.decode_tok_s, ratio=r, within=within(r),
                notes=["vanilla llama.cpp: the plan's compute term alone (own routing)"], rounds=row.n_rounds)


def python_steps_per_token(shape: ModelShape, loads: StepLoads, machine: Machine, native: bool) -> float | None:
    """Predicted decode steps per token that enter the Python provider (GPU pool)."""
    return python_work(loads, shape.n_moe_layers, native)[0] if machine.gpu else None


def prefill_row(name: str, n_tokens: int, predicted: float, row, plan_own: float | None = None,
                request: int | None = None) -> dict:
    """``predicted``: the bench's sequence (its request ``request``, 1 = the first, from an empty cache);
    ``plan_own``: the plan's prefill (the second of two prompts of ``n_tokens``)."""
    measured = (row.prefill_tok_s or {}).get(n_tokens)
    r = ratio(predicted, measured)
    return dict(config=name, n_tokens=n_tokens, request=request, predicted_tok_s=predicted, plan_own_tok_s=plan_own,
                measured_tok_s=measured, ratio=r, within=within(r))


def split_ms(split) -> dict:
    return {k: 1e3 * getattr(split, k) for k in ("compute", "hook", "python", "ssd", "ram", "view", "overlap")} | \
        {"total": 1e3 * split.total}


# -- output

def _f(value, spec: str = ".2f", scale: float = 1.0) -> str:
    return "–" if value is None else format(value * scale, spec)


def _yes(flag) -> str:
    return "–" if flag is None else "yes" if flag else "**no**"


def markdown(table: dict, meta: dict) -> str:
    decode, prefill = table["decode"], table["prefill"]
    m = meta["machine"]
    done = [r for r in decode if r["within"] is not None]
    lines = [f"# Predicted (llamapack plan) vs measured (llamapack bench): {meta['model']}", "",
             f"Results: `{meta['results']}` ({meta.get('results_machine') or 'machine not recorded'}; "
             f"{meta.get('results_date') or ''})",
             f"Machine figures ({meta['machine_source']}): disk {m['disk_bytes_per_s'] / 1e9:.2f} GB/s (O_DIRECT, "
             f"{meta['shape']['block_bytes'] / MIB:.2f} MiB blocks)"
             + (f"; H2D {m['h2d_bytes_per_s'] / 1e9:.2f} GB/s" if m.get("h2d_bytes_per_s") else "")
             + f"; CPU {m['cpu_read_bytes_per_s'] / 1e9:.2f} GB/s read, {m['cpu_flops'] / 1e9:.0f} GFLOP/s"
             + (f". The bench's own disk probes: {', '.join(f'{r / 1e9:.2f}' for r in meta['bench_disk'])} GB/s"
                if meta.get("bench_disk") else ""),
             f"Costs: {', '.join(f'{k}={v:.4g}' for k, v in meta['costs'].items())}"
             + (" (overridden)" if meta.get("costs_overridden") else " (plan.model.DEFAULT_COSTS)"),
             f"Model shape: {meta['shape']['n_moe_layers']} MoE layers x {meta['shape']['n_experts']} experts, "
             f"top-{meta['shape']['top_k']} ({meta['shape_source']})", "",
             f"**Decode within ±{TOLERANCE:.0%}: {sum(r['within'] for r in done)} of {len(done)}**"
             + (f"; prefill: {sum(r['within'] for r in prefill if r['within'] is not None)} of "
                f"{sum(r['within'] is not None for r in prefill)}" if prefill else ""), "",
             "## Decode", "",
             "Like with like: predicted for the bench's own requests in order (the first from an empty cache, each "
             "request's decode after its prompt), their decoded tokens over their summed predicted time, as the bench "
             "measures it. The plan's own figure, a steady state (the last of 3 requests), is beside it.", "",
             "| config | pool slots / tier blocks | predicted tok/s | measured tok/s | predicted / measured | within ±20% "
             "| the plan's own (last of 3 requests) | time model on the run's hits tok/s (ratio) | predicted at the "
             "bench's disk probes | pool hit predicted / measured | tier hit predicted / measured | SSD MiB/token "
             "predicted / measured | notes |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in decode:
        budgets = "–" if r["pool_slots"] is None else f"{r['pool_slots']} / {r['tier_blocks']}"
        at_disk = r.get("predicted_at_bench_disk_tok_s")
        lines.append(
            f"| {r['config']} | {budgets} | {_f(r['predicted_decode_tok_s'])} | {_f(r['measured_decode_tok_s'])} | "
            f"{_f(r['ratio'])} | {_yes(r['within'])} | {_f(r.get('plan_own_decode_tok_s'))} | "
            + (f"{_f(r['time_model_on_measured_hits_tok_s'])} ({_f(r['time_model_ratio'])})"
               if r.get("time_model_on_measured_hits_tok_s") else "–")
            + f" | {_f(at_disk[0]) + '–' + _f(at_disk[1]) if at_disk else '–'} | "
            f"{_f(r.get('predicted_pool_hit_rate'), '.1%')} / {_f(r.get('measured_pool_hit_rate'), '.1%')} | "
            f"{_f(r.get('predicted_tier_hit_rate'), '.1%')} / {_f(r.get('measured_tier_hit_rate'), '.1%')} | "
            f"{_f(r.get('predicted_ssd_bytes_per_token'), '.1f', 1 / MIB)} / "
            f"{_f(r.get('measured_ssd_bytes_per_token'), '.1f', 1 / MIB)} | {'; '.join(r['notes'])} |")
    if prefill:
        lines += ["", "## Prefill", "", "Like with like: predicted for the bench's own sequence of requests (the first "
                  "from an empty cache, the next after the first's prompt and decode). The plan's own figure, the "
                  "second of two prompts of that length, is beside it.", "",
                  "| config | prompt tokens | bench request | predicted tok/s | measured tok/s | predicted / measured | "
                  "within ±20% | the plan's own (second of two such prompts) |",
                  "|---|---|---|---|---|---|---|---|"]
        lines += [f"| {r['config']} | {r['n_tokens']} | {r.get('request') or '–'} | {_f(r['predicted_tok_s'], '.1f')} | "
                  f"{_f(r['measured_tok_s'], '.1f')} | {_f(r['ratio'])} | {_yes(r['within'])} | "
                  f"{_f(r.get('plan_own_tok_s'), '.1f')} |" for r in prefill]
    lines += ["", "Predicted: `llamapack plan`'s model (docs/plan.md) for the run's exact budgets and policy, its hit "
              "rates from the routing model's trace at this shape replayed as the bench's requests (the plan's own: "
              "the last of 3 requests of 32 + 160 tokens). Time model on the run's hits: the same times fed the loads "
              "the run measured per decoded token (what is left of the error once the hit rate is right; the run does "
              "not count which reads were a block's first, so they all cost the probed block time). Predicted / "
              "measured: 1.00 is exact; within ±20% means 0.80-1.20."]
    return "\n".join(lines) + "\n"


def check(results_path: str | os.PathLike, *, model: str | None = None, pack: str | None = None,
          probe_file: str | None = None, disk_gbps: float | None = None, h2d_gbps: float | None = None,
          top_k: int | None = None, costs: Costs | None = None, reprobe: bool = False,
          cache_dir: Path | None = None, repo: Path | None = None,
          machine_from: str | None = None) -> tuple[dict, dict]:
    """(table, meta) for ``results_path``; see the module docstring. ``machine_from``: the machine figures an
    earlier comparison's JSON recorded (its ``meta.machine``), to redo it offline."""
    from ..cache_dir import user_cache_dir

    results = json.loads(Path(results_path).read_text())
    repo = repo or Path(__file__).resolve().parents[2]
    root = cache_dir or user_cache_dir()
    if model is not None:
        from ..plan.shape import read_shape

        shape, shape_source = read_shape(model), f"read from {model}"
    else:
        k = top_k or results_top_k(results, repo)
        if not k:
            raise PlanCheckError(f"{results_path}: top-k not recorded and its routing trace not found: give --top-k "
                                 "or --model")
        shape, shape_source = shape_from_results(results, k), "from the results file"
    if machine_from is not None:
        earlier = json.loads(Path(machine_from).read_text())["meta"]
        machine, disk = Machine(**earlier["machine"]), earlier.get("disk")
        machine_source = f"recorded in {machine_from} ({earlier['machine_source']})"
    elif probe_file is not None:
        machine, disk = machine_from_probe_file(probe_file, shape.block_bytes)
        machine_source = f"probe file {probe_file}"
    elif model is not None:
        from ..pack import default_pack_path, open_gguf

        pack = pack or default_pack_path(open_gguf(model))
        report = probe.probe(probe.disk_target(model, pack), reprobe=reprobe, cache_dir=root / "probe")
        machine, disk = report.machine, report.disk
        machine_source = ("measured now: " + ", ".join(report.measured) if report.measured else "cached") + \
            f" by the plan's probe ({report.cache_path})"
    else:
        raise PlanCheckError("machine figures: give --model (the plan's probe runs here), --probe-file or --machine-from")
    if disk_gbps:
        machine, machine_source = dataclasses.replace(machine, disk_bytes_per_s=disk_gbps * 1e9), machine_source + \
            f"; disk set to {disk_gbps:g} GB/s"
    if h2d_gbps:
        machine, machine_source = dataclasses.replace(machine, h2d_bytes_per_s=h2d_gbps * 1e9), machine_source + \
            f"; H2D set to {h2d_gbps:g} GB/s"
    costs = costs or DEFAULT_COSTS
    table = compare(results, shape, machine, costs, root / "plan", repo)
    meta = dict(results=str(results_path), model=Path(results["model"]["path"]).name,
                results_machine=results.get("machine", {}).get("gpus") or f"no GPU, {results.get('machine', {}).get('cpus')} CPUs",
                results_date=results.get("machine", {}).get("date"),
                machine=dataclasses.asdict(machine), machine_source=machine_source, disk=disk,
                bench_disk=bench_disk_rates(results), costs=dataclasses.asdict(costs), costs_overridden=costs != DEFAULT_COSTS,
                shape=dataclasses.asdict(shape), shape_source=shape_source, tolerance=TOLERANCE)
    return table, meta


def write(table: dict, meta: dict, out_dir: Path, stem: str = "plan_vs_measured") -> tuple[Path, Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    md, js = out_dir / f"{stem}.md", out_dir / f"{stem}.json"
    md.write_text(markdown(table, meta))
    js.write_text(json.dumps(dict(meta=meta, **table), indent=1))
    return md, js


def costs_from(path: str | None) -> Costs | None:
    """Costs with the fields a JSON file sets (the rest DEFAULT_COSTS'); None without a file."""
    if path is None:
        return None
    fields = json.loads(Path(path).read_text())
    known = {f.name for f in dataclasses.fields(Costs)}
    unknown = sorted(set(fields) - known)
    if unknown:
        raise PlanCheckError(f"{path}: unknown Costs field(s) {', '.join(unknown)} (known: {', '.join(sorted(known))})")
    return dataclasses.replace(DEFAULT_COSTS, **fields)
