"""Derived numbers, ratios, markdown and a plot from the benchmark's raw results (pure except the writes).

Per run: prefill tok/s and time to first token per prompt, decode tok/s over every request, the expert
cache's hit rate and SSD bytes per decoded token, the I/O bound ``disk_bw / miss_bytes_per_token`` and
the fraction of it reached, where decode time went (inside the provider: reads waited for, copies waited
for, the rest of its work; outside it: GPU compute, the router's readback, llama.cpp), and whether its
logits equal the reference run's bit for bit. The first request on its own (``+warm`` runs against their cold
twins): its time to first token, which includes its waits on the SSD, its hit rates, and the start-up's reads
(a warm start reads the hottest experts at load, before the first request: they are in the load time, not
in the TTFT).
"""
from __future__ import annotations

import json
import re
import statistics
from dataclasses import dataclass, replace
from pathlib import Path

MIB = 1 << 20


@dataclass(frozen=True)
class RunSummary:
    name: str
    ok: bool
    error: str = ""
    prefill_tok_s: dict | None = None        # prompt length -> tok/s
    ttft_s: dict | None = None               # prompt length -> seconds
    decode_tok_s: float | None = None
    decode_eval_tok_s: float | None = None   # the model's evaluation alone (no harness sampling): None if unknown
    n_decoded: int = 0
    hit_rate: float | None = None            # decode phase
    read_bytes_per_token: float | None = None
    io_bound_tok_s: float | None = None
    io_bound_fraction: float | None = None
    breakdown: dict | None = None            # decode seconds per token by where they went
    bit_exact: str = "n/a"
    load_s: float | None = None
    peak_mib: float | None = None
    lookahead: dict | None = None            # decode phase, runs with prefetch: accuracy, reads used and wasted
    round: int = 1                           # which round of the bench (configs.schedule)
    n_rounds: int = 1                        # a combined row (combine): how many runs it is the median of
    decode_by_round: tuple = ()              # a combined row: each run's decode tok/s, in the order run
    routing: str = "own"                     # "replayed": experts from a routing trace (bench/replay.py)
    first_request: dict | None = None        # n_prompt, ttft_s, prefill/decode/all hit rates of the first request
    load_read_bytes: float | None = None     # expert bytes read while loading (warm start, RAM preload)
    priming: dict | None = None              # +warm runs: the priming session (requests, tokens, seconds)
    hybrid: dict | None = None               # hybrid runs: the split, the measured per-expert costs, CPU rows/token

    def as_dict(self) -> dict:
        return dict(self.__dict__)


def compare_digests(run: dict, reference: dict) -> str:
    """'yes (N steps)' when every step both runs computed has the same logits bits, else where they differ."""
    steps, first_diff = 0, None
    for mine, theirs in zip(run["requests"], reference["requests"]):
        if mine["n_prompt"] != theirs["n_prompt"]:
            return "n/a (other prompts)"
        for step, (a, b) in enumerate(zip(mine["digests"], theirs["digests"])):
            if a != b and first_diff is None:
                first_diff = f"request of {mine['n_prompt']} tokens, step {step}"
            steps += 1
    return f"yes ({steps} steps)" if first_diff is None else f"NO (first at {first_diff})"


def hit_rate(*counters: dict) -> float | None:
    hits = sum(c.get("cache_hits", 0) for c in counters)
    lookups = hits + sum(c.get("cache_misses", 0) for c in counters)
    return hits / lookups if lookups else None


def first_request(run: dict) -> dict:
    """The first request of a run: prompt length, TTFT (prefill, its waits on the SSD included) and hit rates
    of its prefill, its decode and both."""
    first = run["requests"][0]
    prefill, decode = first.get("prefill_counters", {}), first.get("decode_counters", {})
    return dict(n_prompt=first["n_prompt"], ttft_s=first["ttft_s"], prefill_hit_rate=hit_rate(prefill),
                decode_hit_rate=hit_rate(decode), hit_rate=hit_rate(prefill, decode),
                read_bytes=prefill.get("pack_read_bytes", 0) + decode.get("pack_read_bytes", 0) if prefill else None)


def priming_summary(priming: dict | None) -> dict | None:
    if not priming or "error" in priming:
        return None
    requests = priming.get("requests", [])
    return dict(requests=len(requests), prompt_tokens=sum(r["n_prompt"] for r in requests),
                decoded=sum(r["n_decoded"] for r in requests), load_s=priming.get("load_s"),
                serve_s=sum(r["prefill_s"] + r["decode_s"] for r in requests), wall_s=priming.get("wall_s"),
                layers_saved=priming.get("layers_saved"))


def summarize(run: dict, reference: dict | None, disk_bytes_per_s: float) -> RunSummary:
    name = run["config"]["name"]
    if "error" in run:
        return RunSummary(name, ok=False, error=run["error"], round=run.get("round", 1))
    requests = run["requests"]
    decoded = sum(r["n_decoded"] for r in requests)
    decode_s = sum(r["decode_s"] for r in requests)
    counters = {}
    for r in requests:
        for key, value in r["decode_counters"].items():
            counters[key] = counters.get(key, 0) + value
    lookups = counters.get("cache_hits", 0) + counters.get("cache_misses", 0)
    per_token = counters["pack_read_bytes"] / decoded if decoded and "pack_read_bytes" in counters else None
    io_bound = disk_bytes_per_s / per_token if per_token else None
    decode_tok_s = decoded / decode_s if decode_s > 0 else None
    eval_s = sum(r.get("decode_eval_s", 0.0) for r in requests)
    decode_eval_tok_s = decoded / eval_s if eval_s > 0 and all("decode_eval_s" in r for r in requests) else None
    breakdown = None
    if decoded and "provide_s" in counters:
        provide, read, copy, ahead = (counters.get(k, 0.0) for k in ("provide_s", "read_wait_s", "copy_wait_s",
                                                                       "lookahead_s"))
        # libllama's own timing of the callbacks (newer builds): the gap is the cost of entering them (the GIL)
        in_callbacks = counters.get("provider_call_s", 0.0) + counters.get("prefetch_call_s", 0.0)
        entering = max(in_callbacks - provide - ahead, 0.0) if in_callbacks else 0.0
        breakdown = {k: v / decoded for k, v in dict(
            read_wait_s=read, copy_wait_s=copy, provider_other_s=max(provide - read - copy, 0.0),
            lookahead_s=ahead, entering_callbacks_s=entering,
            outside_provider_s=max(decode_s - provide - ahead - entering, 0.0)).items()}
    lookahead = None
    if counters.get("lookahead_keys") and decoded:
        lookahead = dict(accuracy=counters["lookahead_hits"] / counters["lookahead_keys"],
                         misses_read_ahead=counters["prefetch_used"] / max(counters.get("cache_misses", 0), 1),
                         wasted_bytes_per_token=counters["prefetch_wasted_bytes"] / decoded,
                         reads=counters["prefetch_reads"], used=counters["prefetch_used"],
                         wasted=counters["prefetch_wasted"], cancelled=counters.get("prefetch_cancelled", 0))
    routing = run.get("routing", "own")
    exact = "reference" if run["config"].get("reference") else "n/a (replayed routing)" if routing == "replayed" else \
        "n/a (upstream: no logits)" if run["config"].get("source") == "upstream" else (
        compare_digests(run, reference) if reference is not None and "error" not in reference else "n/a")
    return RunSummary(
        name, ok=True,
        prefill_tok_s={r["n_prompt"]: r["n_prompt"] / r["prefill_s"] for r in requests},
        ttft_s={r["n_prompt"]: r["ttft_s"] for r in requests},
        decode_tok_s=decode_tok_s, decode_eval_tok_s=decode_eval_tok_s, n_decoded=decoded,
        hit_rate=counters["cache_hits"] / lookups if lookups else None,
        read_bytes_per_token=per_token, io_bound_tok_s=io_bound,
        io_bound_fraction=decode_tok_s / io_bound if io_bound and decode_tok_s else None,
        breakdown=breakdown, bit_exact=exact, load_s=run.get("load_s"),
        peak_mib=run.get("cgroup_peak_mib") or run.get("max_rss_mib"), lookahead=lookahead,
        round=run.get("round", 1), routing=routing, first_request=first_request(run) if requests else None,
        load_read_bytes=run["load_counters"].get("pack_read_bytes") if "load_counters" in run else None,
        priming=priming_summary(run.get("priming")), hybrid=hybrid_summary(run, counters, decoded))


def hybrid_summary(run: dict, counters: dict, decoded: int) -> dict | None:
    """A hybrid run's split and the costs ``auto`` measured at start, with its decode CPU rows and seconds per token."""
    split = (run.get("provider") or {}).get("hybrid")
    if not split:
        return None
    per_token = {k: counters.get(k, 0) / decoded if decoded else None for k in ("cpu_experts", "cpu_s")}
    return dict(split, cpu_rows_per_token=per_token["cpu_experts"], cpu_s_per_token=per_token["cpu_s"])


def probe_bytes_per_s(probe: dict) -> float:
    return probe.get("nbytes", 0) / max(probe.get("seconds", 0), 1e-9)


def disk_bytes_per_s(results: dict) -> float:
    """The disk's speed for the I/O bound: the faster of the probes before and after the runs (the disk
    varies; the faster one gives the stricter bound)."""
    return max(probe_bytes_per_s(results.get(name, {})) for name in ("disk", "disk_after"))


def summaries(results: dict) -> list[RunSummary]:
    reference = next((r for r in results["runs"] if r["config"].get("reference")), None)
    return [summarize(run, reference, disk_bytes_per_s(results)) for run in results["runs"]]


def _median(values):
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def _median_dicts(dicts: list[dict | None]) -> dict | None:
    """Key by key, the median of the dicts' numbers (None where no dict has one)."""
    dicts = [d for d in dicts if d]
    if not dicts:
        return None
    return {key: _median(d.get(key) for d in dicts) for key in dicts[0]}


def combine(rows: list[RunSummary]) -> list[RunSummary]:
    """One row per config name, in first-run order: a config run in several rounds becomes the median of its
    runs that finished (decode, prefill, TTFT, hit rate, SSD bytes, I/O bound, each share of decode time;
    the lookahead counters of the median-decode run); bit-exact only when every run was. A config whose
    every run failed keeps its first failure."""
    groups: dict[str, list[RunSummary]] = {}
    for row in rows:
        groups.setdefault(row.name, []).append(row)
    combined = []
    for name, group in groups.items():
        ok = [row for row in group if row.ok]
        if len(group) == 1 or not ok:
            combined.append(group[0])
            continue
        middle = sorted(ok, key=lambda row: row.decode_tok_s or 0.0)[(len(ok) - 1) // 2]
        decode, io_bound = _median(r.decode_tok_s for r in ok), _median(r.io_bound_tok_s for r in ok)
        lengths = ok[0].prefill_tok_s.keys()
        not_exact = [f"round {r.round}: {r.bit_exact}" for r in ok if not r.bit_exact.startswith(("yes", "reference"))]
        steps = sum(int(m[1]) for r in ok if (m := re.match(r"yes \((\d+) steps\)", r.bit_exact)))
        failed = len(group) - len(ok)
        combined.append(replace(
            middle, n_rounds=len(ok), decode_by_round=tuple(r.decode_tok_s for r in group), decode_tok_s=decode,
            n_decoded=sum(r.n_decoded for r in ok), decode_eval_tok_s=_median(r.decode_eval_tok_s for r in ok),
            prefill_tok_s={n: _median(r.prefill_tok_s.get(n) for r in ok) for n in lengths},
            ttft_s={n: _median(r.ttft_s.get(n) for r in ok) for n in lengths},
            hit_rate=_median(r.hit_rate for r in ok), read_bytes_per_token=_median(r.read_bytes_per_token for r in ok),
            io_bound_tok_s=io_bound, io_bound_fraction=decode / io_bound if decode and io_bound else None,
            breakdown={k: _median((r.breakdown or {}).get(k) for r in ok) for k in middle.breakdown} if middle.breakdown else None,
            bit_exact=(middle.bit_exact if middle.routing == "replayed" else not_exact[0] if not_exact
                       else middle.bit_exact if middle.bit_exact == "reference"
                       else f"yes ({steps} steps, {len(ok)} runs)") + (f"; {failed} run(s) failed" if failed else ""),
            load_s=_median(r.load_s for r in ok), peak_mib=max((r.peak_mib or 0) for r in ok) or None,
            first_request=_median_dicts([r.first_request for r in ok]),
            load_read_bytes=_median(r.load_read_bytes for r in ok),
            priming=_median_dicts([r.priming for r in ok])))
    return combined


def ratios(rows: list[RunSummary]) -> list[dict]:
    """Decode and prefill of each run against the --cpu-moe baseline of its memory setting (the same name
    suffix: ``@8G`` runs against ``cpu-moe@8G``, others against ``cpu-moe``)."""
    by_name = {row.name: row for row in rows if row.ok}
    out = []
    for row in rows:
        if not row.ok or row.name.startswith("cpu-moe"):
            continue
        suffix = row.name[row.name.index("@"):] if "@" in row.name else ""
        base = by_name.get(f"cpu-moe{suffix}")
        if base is None:
            continue
        entry = dict(run=row.name, baseline=base.name)
        if row.decode_tok_s and base.decode_tok_s:
            entry["decode_ratio"] = row.decode_tok_s / base.decode_tok_s
        for n_prompt, rate in (row.prefill_tok_s or {}).items():
            if base.prefill_tok_s and base.prefill_tok_s.get(n_prompt):
                entry[f"prefill_ratio_{n_prompt}"] = rate / base.prefill_tok_s[n_prompt]
        out.append(entry)
    return out


def _workload_kind(workload: dict) -> str:
    temperature = workload.get("temperature") or 0.0
    return "greedy" if temperature == 0 else f"sampled at temperature {temperature:g} (seeded)"


def routing_label(routing: str) -> str:
    return "**replayed**" if routing == "replayed" else "own (synthetic)"


def routing_line(workload: dict) -> str:
    """What routing the runs saw: the synthetic model's own router, or a replayed trace (llamapack runs)."""
    trace = workload.get("routing")
    if not trace:
        return "Routing: every run uses the model's own router (synthetic routing: a random-weights model)"
    return (f"Routing: runs marked *replayed* serve the experts of `{Path(trace['path']).name}` "
            f"({trace.get('source') or 'no source recorded'}; {trace['n_requests']} requests, "
            f"{trace['n_decode_tokens']} decode tokens, request r replays trace request r mod {trace['n_requests']}, "
            f"cycled) in place of the router's choice; the others (vanilla llama.cpp) use the model's own "
            f"router (synthetic routing)")


def warm_line(workload: dict) -> list[str]:
    """How the +warm runs were primed (none: no line)."""
    warm = workload.get("warm")
    if not warm:
        return []
    requests = ", ".join(f"{r['request']} ({r['n_prompt']} prompt + up to {r['decode_tokens']} decode tokens)"
                         for r in warm["requests"])
    return [f"Warm start (+warm runs): a priming process with the run's settings served requests {requests} of "
            f"`{Path(warm['routing']).name}`" + (" (requests no measured prompt replays)" if warm.get("same_trace")
                                                 else " (a trace of other requests)")
            + f", decode cut after {warm['cap_s']:g} s each, and saved its popularity at close; the measured "
            "process started from it"]


def _f(value, spec: str = ".2f", scale: float = 1.0) -> str:
    return "–" if value is None else format(value * scale, spec)


def markdown(results: dict) -> str:
    runs = summaries(results)
    rows = combine(runs)
    n_rounds = results["workload"].get("rounds", 1)
    given = results["workload"]["prompt_lengths"]
    lengths = list(dict.fromkeys(given))  # a length given twice: the figures of its later prompt
    disk = results.get("disk", {})
    lines = [f"# llamapack bench: {Path(results['model']['path']).name}", "",
             f"Command: `{results.get('command', '')}`", "",
             f"Machine: {results['machine'].get('gpus') or 'no GPU'}; {results['machine'].get('cpus')} CPUs; "
             f"{_f(results['machine'].get('mem_total_kib'), '.0f', 1 / 2**20)} GiB RAM; {results['machine'].get('date')}",
             f"Model: {results['model']['size_bytes'] / 1e9:.2f} GB, experts {results['model']['expert_bytes'] / 1e9:.2f} GB "
             f"({results['model']['n_moe_layers']} MoE layers x {results['model']['n_expert']} experts, "
             f"{results['model']['expert_stride'] / MIB:.2f} MiB each)",
             f"Disk: {_f(disk.get('gb_per_s'))} GB/s before the runs"
             + (f", {_f(results['disk_after'].get('gb_per_s'))} GB/s after (the I/O bound uses the faster)"
                if results.get("disk_after") else "")
             + f" (O_DIRECT random reads of one expert block, {disk.get('threads')} at once, "
             f"{_f(disk.get('seconds'), '.1f')} s)",
             f"Workload: {_workload_kind(results['workload'])}, prompts of {', '.join(map(str, given))} tokens"
             + (" (a length given twice: the table shows its later prompt)" if len(given) > len(lengths) else "")
             + f", up to "
             f"{results['workload']['n_decode']} tokens each (decode stops after {results['workload']['decode_cap_s']:g} s), "
             f"n_ubatch {results['workload']['n_ubatch']}"
             + (f"; each run first evaluates a {results['workload']['warmup_tokens']}-token prompt it throws away "
                "(upstream's batched-bench likewise)" if results["workload"].get("warmup_tokens")
                else "; no warm-up prompt (each run's first prompt carries its first-use costs)")
             + (f"; the reference once, then every other run in each of {n_rounds} rounds"
                + (f", each round shuffled (seed {results['workload']['shuffle_seed']})"
                   if results["workload"].get("shuffle_seed") is not None else "")
                + "; each line is the median of its runs (the rounds table below)" if n_rounds > 1 else ""),
             routing_line(results["workload"]), *warm_line(results["workload"]), "",
             "| run | routing | " + " | ".join(f"prefill {n} tok/s" for n in lengths) + " | TTFT " + f"{lengths[-1]} s"
             + " | decode tok/s | decode tok/s, evaluation only | tokens | hit rate | SSD MiB/token | I/O bound tok/s | of bound "
             "| bit-exact vs reference | peak MiB |",
             "|---|---|" + "---|" * (len(lengths) + 10)]
    for row in rows:
        if not row.ok:
            lines.append(f"| {row.name} | failed: {' '.join(row.error.split())[-200:]} |")
            continue
        lines.append(
            f"| {row.name} | {routing_label(row.routing)} | " + " | ".join(_f(row.prefill_tok_s.get(n), ".1f") for n in lengths)
            + f" | {_f(row.ttft_s.get(lengths[-1]))} | {_f(row.decode_tok_s)} | {_f(row.decode_eval_tok_s)} | {row.n_decoded} | "
            f"{_f(row.hit_rate, '.1%')} | {_f(row.read_bytes_per_token, '.1f', 1 / MIB)} | {_f(row.io_bound_tok_s)} | "
            f"{_f(row.io_bound_fraction, '.0%')} | {row.bit_exact} | {_f(row.peak_mib, '.0f')} |")
    lines += ["", "Decode tok/s: the whole decode loop, the bench's own sampling in Python included; evaluation only: "
              "the model's evaluation (llama-cpp-python's eval and the logits) alone, as llama-batched-bench times it."]
    if n_rounds > 1:
        lines += ["", "## Decode in each round (tok/s, in the order run)", "",
                  "| run | " + " | ".join(f"round {r}" for r in range(1, n_rounds + 1)) + " | median | max / min |",
                  "|---|" + "---|" * (n_rounds + 2)]
        for row in rows:
            if row.n_rounds > 1:
                done = [v for v in row.decode_by_round if v]
                lines.append(f"| {row.name} | " + " | ".join(_f(v) for v in row.decode_by_round)
                             + f" | {_f(row.decode_tok_s)} | {_f(max(done) / min(done))}x |")
        for round_ in range(1, n_rounds + 1):
            lines.append(f"\nRound {round_}: " + ", ".join(run.name for run in runs if run.round == round_))
    lines += ["", "## Ratios against --cpu-moe (same memory setting)", "",
              "| run | baseline | decode ratio | " + " | ".join(f"prefill {n} ratio" for n in lengths) + " |",
              "|---|---|---|" + "---|" * len(lengths)]
    for entry in ratios(rows):
        lines.append(f"| {entry['run']} | {entry['baseline']} | {_f(entry.get('decode_ratio'))}x | "
                     + " | ".join(f"{_f(entry.get(f'prefill_ratio_{n}'))}x" for n in lengths) + " |")
    lines += upstream_lines(rows)
    by_name = {row.name: row for row in rows if row.ok}
    with_lookahead = [row for row in rows if row.ok and row.lookahead]
    if with_lookahead:
        lines += ["", "## Router lookahead (decode)", "",
                  "| run | decode vs without prefetch | prediction accuracy | misses read ahead | wasted SSD MiB/token "
                  "| lookahead reads: used / started / cancelled unread |",
                  "|---|---|---|---|---|---|"]
        for row in with_lookahead:
            base = by_name.get(re.sub(r"\+prefetch(-top\d+|-d\d+|-c\d+)?", "", row.name))
            speedup = row.decode_tok_s / base.decode_tok_s if base and base.decode_tok_s and row.decode_tok_s else None
            la = row.lookahead
            lines.append(f"| {row.name} | {_f(speedup)}x | {_f(la['accuracy'], '.1%')} | "
                         f"{_f(la['misses_read_ahead'], '.1%')} | {_f(la['wasted_bytes_per_token'], '.2f', 1 / MIB)} | "
                         f"{la['used']} / {la['reads']} / {la.get('cancelled', 0)} |")
    python_twins = [row for row in rows if row.ok and "+pyreads" in row.name]
    if python_twins:  # against the +native twin (or, in results from before the twins, the run without a suffix)
        lines += ["", "## Native read pool vs Python read threads (decode)", "",
                  "| run | native tok/s | Python threads tok/s | native vs Python |", "|---|---|---|---|"]
        for row in python_twins:
            native_row = by_name.get(row.name.replace("+pyreads", "+native")) or by_name.get(row.name.replace("+pyreads", ""))
            speedup = (native_row.decode_tok_s / row.decode_tok_s
                       if native_row and native_row.decode_tok_s and row.decode_tok_s else None)
            lines.append(f"| {row.name.replace('+pyreads', '')} | {_f(native_row.decode_tok_s if native_row else None)} "
                         f"| {_f(row.decode_tok_s)} | {_f(speedup)}x |")
    lines += hot_path_lines(rows, by_name) + warm_start_lines(rows, by_name, results["workload"].get("warmup_tokens", 0))
    lines += hybrid_lines(rows)
    lines += ["", "## Where decode time went (ms per token)", "",
              "| run | waiting on reads | waiting on copies | rest of the provider | lookahead callback "
              "| entering the callbacks | outside the provider |",
              "|---|---|---|---|---|---|---|"]
    for row in rows:
        if row.ok and row.breakdown:
            b = row.breakdown
            lines.append(f"| {row.name} | {b['read_wait_s'] * 1e3:.1f} | {b['copy_wait_s'] * 1e3:.1f} | "
                         f"{b['provider_other_s'] * 1e3:.1f} | {b.get('lookahead_s', 0) * 1e3:.1f} | "
                         f"{b.get('entering_callbacks_s', 0) * 1e3:.2f} | {b['outside_provider_s'] * 1e3:.1f} |")
    lines += ["", "Entering the callbacks: libllama's timing of the provider and lookahead callbacks minus their own "
              "(Python) timing: cffi's entry and exit and the wait for the GIL while read threads hold it. "
              "Outside the provider: GPU compute, the router ids' readback to the CPU and llama.cpp's own work "
              "(compare with pack-100%, which reads nothing)."]
    return "\n".join(lines) + "\n"


def upstream_lines(rows: list[RunSummary]) -> list[str]:
    """Decode against upstream's runs, and each side's cost of serving experts from a VRAM cache measured against
    its own all-VRAM run (vanilla-vram for ours, upstream-vram for upstream's). Upstream's batched-bench samples
    nothing, while our bench samples each token in Python: ratios use our evaluation-only rate where the run
    recorded it; the per-token costs are differences within one harness, so its overhead cancels."""
    upstream = [row for row in rows if row.ok and row.name.startswith("upstream-") and row.decode_tok_s]
    if not upstream:
        return []
    ours = [row for row in rows if row.ok and row.decode_tok_s and not row.name.startswith("upstream-")]
    rate = {row.name: row.decode_eval_tok_s or row.decode_tok_s for row in [*ours, *upstream]}
    evaluated = all(row.decode_eval_tok_s for row in ours)
    lines = ["", "## Decode against upstream llama.cpp b11549 (its runs: experts in pinned RAM, same VRAM)", "",
             ("Our rates here are the model's evaluation alone (llama-cpp-python's eval and the logits), without "
              "the bench's own sampling and digests, as upstream's llama-batched-bench samples nothing."
              if evaluated else "Our rates include the bench's own sampling and digests per token (this run did not "
              "record the evaluation alone); upstream's llama-batched-bench samples nothing."), "",
             "| run | " + " | ".join(f"vs {u.name}" for u in upstream) + " |", "|---|" + "---|" * len(upstream)]
    for row in ours:
        lines.append(f"| {row.name} | " + " | ".join(f"{rate[row.name] / rate[u.name]:.2f}x" for u in upstream) + " |")
    base = {"ours": next((row for row in ours if row.name == "vanilla-vram"), None),
            "upstream": next((row for row in upstream if row.name == "upstream-vram"), None)}
    costs = [(row, base["upstream" if row.name.startswith("upstream-") else "ours"]) for row in [*ours, *upstream]
             if row.name not in ("vanilla-vram", "upstream-vram") and row.hit_rate is not None]
    costs = [(row, b) for row, b in costs if b is not None]
    if costs:
        lines += ["", "### Cost of the expert cache, each against its own all-VRAM run (same harness, same run)", "",
                  "| run | baseline | ms per token over the baseline | decode vs the baseline | hit rate |",
                  "|---|---|---|---|---|"]
        for row, b in costs:
            extra_ms = 1000 / row.decode_tok_s - 1000 / b.decode_tok_s
            lines.append(f"| {row.name} | {b.name} | {extra_ms:.2f} | {row.decode_tok_s / b.decode_tok_s:.2f}x | "
                         f"{_f(row.hit_rate, '.1%')} |")
    return lines


def hot_path_lines(rows: list[RunSummary], by_name: dict) -> list[str]:
    """``+pyhot`` runs (every step through the Python provider) against their twin without it (the native hot
    path): decode, and the hit rates, which should match (same policy, same steps)."""
    twins = [row for row in rows if row.ok and "+pyhot" in row.name]
    if not twins:
        return []
    lines = ["", "## Native hot path vs the Python provider (+pyhot)", "",
             "| run | native hot path tok/s | Python provider tok/s | native vs Python | hit rate native / Python |",
             "|---|---|---|---|---|"]
    for row in twins:
        native = by_name.get(row.name.replace("+pyhot", ""))
        speedup = native.decode_tok_s / row.decode_tok_s if native and native.decode_tok_s and row.decode_tok_s else None
        lines.append(f"| {row.name.replace('+pyhot', '')} | {_f(native.decode_tok_s if native else None)} | "
                     f"{_f(row.decode_tok_s)} | {_f(speedup)}x | {_f(native.hit_rate if native else None, '.1%')} / "
                     f"{_f(row.hit_rate, '.1%')} |")
    return lines


def warm_start_lines(rows: list[RunSummary], by_name: dict, warmup_tokens: int = 0) -> list[str]:
    """``+warm`` runs and their cold twins (the same name without ``+warm``): the first request's TTFT and hit
    rates, and the start-up, where the warm start's reads happen. ``warmup_tokens``: the warm-up prompt each run
    evaluated before its first request (it warms the cold twin's caches too)."""
    warm = [row for row in rows if row.ok and "+warm" in row.name]
    if not warm:
        return []
    lines = ["", "## Warm start: the first request (+warm against its cold twin)", "",
             "A +warm run starts from the popularity a priming session saved (trace requests the measured prompts do "
             "not replay) and reads its hottest experts into the pool (and RAM tier) **while loading**, before the "
             "first request: those reads are in *load s* and *MiB read at load*, not in the TTFT. TTFT: the first "
             "request's prefill, its waits on the SSD included; hit rates: the first request's pool hits."
             + (f" Each run evaluated a {warmup_tokens}-token warm-up prompt before it (`--warmup-tokens`): the cold "
                "twin's caches were not empty at its first request (`--warmup-tokens 0` measures a process's first)."
                if warmup_tokens else ""), "",
             "| run | load s | MiB read at load | first prompt tokens | first-request TTFT s | first-request hit rate: "
             "prefill / decode / all | SSD MiB read in the first request | priming: requests, tokens decoded, s |",
             "|---|---|---|---|---|---|---|---|"]
    for row in warm:
        for each in (by_name.get(row.name.replace("+warm", "")), row):
            if each is None:
                lines.append(f"| {row.name.replace('+warm', '')} | not run (the cold twin) |")
                continue
            first = each.first_request or {}
            prime = each.priming
            lines.append(
                f"| {each.name} | {_f(each.load_s)} | {_f(each.load_read_bytes, '.0f', 1 / MIB)} | "
                f"{_f(first.get('n_prompt'), '.0f')} | {_f(first.get('ttft_s'))} | "
                f"{_f(first.get('prefill_hit_rate'), '.1%')} / {_f(first.get('decode_hit_rate'), '.1%')} / "
                f"{_f(first.get('hit_rate'), '.1%')} | {_f(first.get('read_bytes'), '.0f', 1 / MIB)} | "
                + (f"{prime['requests']:.0f}, {prime['decoded']:.0f}, {_f(prime.get('wall_s'), '.1f')} |" if prime
                   else "– |"))
    return lines


def hybrid_lines(rows: list[RunSummary]) -> list[str]:
    """Hybrid runs: the upload share, the per-expert CPU and copy costs measured at start (``auto`` splits by
    them), and the decode's CPU rows."""
    hybrid = [row for row in rows if row.ok and row.hybrid]
    if not hybrid:
        return []
    lines = ["", "## Hybrid: RAM-tier misses computed on the CPU (decode)", "",
             "| run | mode | upload share | CPU threads | CPU us per expert row (probe) | copy us per expert (probe) "
             "| CPU rows per token | CPU ms per token | hit rate |", "|---|---|---|---|---|---|---|---|---|"]
    for row in hybrid:
        h = row.hybrid
        lines.append(f"| {row.name} | {h.get('mode')} | {_f(h.get('upload_share'), '.3f')} | {h.get('threads')} | "
                     f"{_f(h.get('cpu_s_per_expert'), '.1f', 1e6)} | {_f(h.get('copy_s_per_expert'), '.1f', 1e6)} | "
                     f"{_f(h.get('cpu_rows_per_token'), '.1f')} | {_f(h.get('cpu_s_per_token'), '.2f', 1e3)} | "
                     f"{_f(row.hit_rate, '.1%')} |")
    return lines


def plot(results: dict, path: Path) -> bool:
    """A bar chart of decode and prefill tok/s per run (log scale); False when matplotlib is missing."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    rows = [row for row in combine(summaries(results)) if row.ok]
    longest = results["workload"]["prompt_lengths"][-1]
    figure, axes = plt.subplots(1, 2, figsize=(12, 0.45 * len(rows) + 1.8), sharey=True)
    names = [row.name for row in rows]
    for axis, values, title in (
            (axes[0], [row.decode_tok_s or 0 for row in rows], "decode tok/s"),
            (axes[1], [(row.prefill_tok_s or {}).get(longest, 0) for row in rows], f"prefill tok/s ({longest}-token prompt)")):
        axis.barh(names, values, color=["#4c72b0" if n.startswith(("pack", "gguf")) else "#999999" for n in names])
        axis.set_xscale("log")
        axis.set_title(title)
        for y, value in enumerate(values):
            axis.text(value, y, f" {value:.3g}", va="center", fontsize=8)
    axes[0].invert_yaxis()
    figure.suptitle(Path(results["model"]["path"]).name)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return True


def write_report(results: dict, out_dir: Path) -> None:
    """bench.json (raw results plus summaries), bench.md, bench.png."""
    out_dir = Path(out_dir)
    runs = summaries(results)
    data = dict(results, summaries=[row.as_dict() for row in runs], combined=[row.as_dict() for row in combine(runs)],
                ratios=ratios(combine(runs)))
    (out_dir / "bench.json").write_text(json.dumps(data, indent=1))
    (out_dir / "bench.md").write_text(markdown(results))
    plot(results, out_dir / "bench.png")
