"""Where a layer-window prefill's time goes, layer by layer, from libllama's LLAMAPACK_COPY_TRACE file.

Run a bench (or anything) with LLAMAPACK_COPY_TRACE=<file> set for a +windows config, then
    python3 bench/copy_timeline.py <file> [--min-tokens 512]
Per served layer L+1 of each traced window prefill (the window ops of at least --min-tokens tokens), from the
scheduler thread's timestamps:
  launch_ms  the scheduler's copy into the GPU split after op L, to its first copy into op L+1's CPU split: the
             time launching the GPU split took (near 0 if launching is asynchronous; where the copies start at
             the first of those copies, as round 18's experiment had them, it includes issue_ms);
  issue_ms   issuing layer L+1's copies (in the copy callback, at either of those copies);
  sync_ms    from the later of those to op L+1's start: the scheduler waiting for the GPU split (its result is op
             L+1's input);
  wait_ms    op L+1 waiting for its window's copies.
The copies overlap the GPU when sync_ms is large and wait_ms small. Prints JSON: medians and sums per prefill.
"""
from __future__ import annotations

import argparse
import json
import statistics
from collections import defaultdict


def parse(path: str) -> dict[int, list[tuple[int, str, int, int]]]:
    """pid -> [(microseconds, event, layer, value)] in file order."""
    events: dict[int, list] = defaultdict(list)
    with open(path) as file:
        for line in file:
            fields = line.split()
            if len(fields) >= 5:
                events[int(fields[0])].append((int(fields[1]), fields[2], int(fields[3]), int(fields[4])))
    return events


def prefills(events: list, min_tokens: int) -> list[list]:
    """The events of each window prefill: runs of window ops of >= min_tokens tokens, with what lies between."""
    runs, current, last_layer = [], [], None
    for event in events:
        us, name, layer, value = event
        if name == "window_op" and value >= min_tokens:
            if last_layer is not None and layer <= last_layer and current:
                runs.append(current)
                current = []
            last_layer = layer
        if last_layer is not None:
            current.append(event)
    if current:
        runs.append(current)
    return runs


def layer_intervals(run: list) -> list[dict]:
    """One row per op after the first: launch, issue, sync and wait (ms) as the module docstring says."""
    rows, op_end = [], None
    gpu_in = cpu_in = issued = issue_ms = op_start = last_copy = None
    for us, name, layer, value in run:
        if name == "window_op_end":
            if None not in (op_start, gpu_in, cpu_in, issued):
                rows.append(dict(layer=layer, launch_ms=(cpu_in - gpu_in) / 1e3, issue_ms=issue_ms / 1e3,
                                 sync_ms=(op_start - max(cpu_in, issued)) / 1e3, wait_ms=(us - op_start) / 1e3))
            op_end = us
            gpu_in = cpu_in = issued = issue_ms = op_start = last_copy = None
        elif name == "window_op":
            op_start = us
        elif name == "copy_into_split" and op_end is not None:
            if value == 0 and cpu_in is None:
                gpu_in = last_copy = us  # the last copy into the GPU split before it was launched
            elif value == 1 and gpu_in is not None and cpu_in is None:
                cpu_in = last_copy = us
        elif name == "early_issued" and last_copy is not None and issued is None and value > 0:
            issued, issue_ms = us, us - last_copy
    return rows


def summary(rows: list[dict]) -> dict:
    keys = ("launch_ms", "issue_ms", "sync_ms", "wait_ms")
    return {"layers": len(rows), "median": {k: round(statistics.median(r[k] for r in rows), 3) for k in keys},
            "sum": {k: round(sum(r[k] for r in rows), 1) for k in keys}} if rows else {"layers": 0}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("trace")
    parser.add_argument("--min-tokens", type=int, default=512)
    parser.add_argument("--rows", action="store_true", help="also print every layer's row")
    args = parser.parse_args()
    out = []
    for pid, events in parse(args.trace).items():
        for index, run in enumerate(prefills(events, args.min_tokens)):
            rows = layer_intervals(run)
            out.append({"pid": pid, "prefill": index, **summary(rows), **({"rows": rows} if args.rows else {})})
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
