"""Predicted vs measured (issue #26): `llamapack plan`'s prediction for every llamapack run of a bench results file,
at that run's exact budgets and policy, beside what the run measured; a table in markdown and JSON.

    python bench/plan_vs_measured.py RESULTS/bench.json --model MODEL.gguf [--pack PACK] [--reprobe] [--out DIR]
    python bench/plan_vs_measured.py bench/results/gpu_routing_q30b.json --probe-file PROBE.json   # offline
    python bench/plan_vs_measured.py bench/results/gpu_hotpath_q30b.json \
        --machine-from bench/results/plan_vs_measured_q30b.json --stem plan_vs_measured_q30b_calibrated  # offline

With --model, the model's shape comes from its GGUF and the machine's figures from the plan's probe run here
(cached per machine under ~/.cache/llamapack/probe; --reprobe measures again): run it on the machine that ran the
bench, right after it (bench/device_bench.sh plan, or PLAN=1 with bench). Without --model, the shape comes from
the results file and the figures from --probe-file (a probe cache JSON) or --machine-from (those an earlier
comparison's JSON recorded, e.g. the device's), --disk-gbps and --h2d-gbps.
--costs FILE.json replaces fields of plan.model.Costs (the device calibration). Writes DIR/plan_vs_measured.md
and .json (default: the results file's folder) and prints the markdown. Method: llamapack/bench/plan_check.py.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from llamapack.bench.plan_check import check, costs_from, write  # noqa: E402
from llamapack.errors import LlamapackError  # noqa: E402


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("results", help="bench.json written by `llamapack bench`")
    parser.add_argument("--model", help="the benchmarked GGUF (shape from its header; the probe reads its pack)")
    parser.add_argument("--pack", help="its expert pack (default: beside the model)")
    parser.add_argument("--probe-file", help="machine figures from this probe cache JSON instead of probing here")
    parser.add_argument("--machine-from", help="machine figures recorded in an earlier plan_vs_measured JSON")
    parser.add_argument("--disk-gbps", type=float, help="use this disk rate (GB/s) instead of the probe's")
    parser.add_argument("--h2d-gbps", type=float, help="use this host-to-device copy rate (GB/s)")
    parser.add_argument("--top-k", type=int, help="experts per token and layer, for results that do not record it")
    parser.add_argument("--costs", help="JSON of plan.model.Costs fields to replace")
    parser.add_argument("--reprobe", action="store_true", help="measure the machine's rates again")
    parser.add_argument("--out", type=Path, help="folder for plan_vs_measured.md/.json (default: beside RESULTS)")
    parser.add_argument("--stem", default="plan_vs_measured", help="file name stem of the outputs")
    args = parser.parse_args(argv)
    try:
        table, meta = check(args.results, model=args.model, pack=args.pack, probe_file=args.probe_file,
                            disk_gbps=args.disk_gbps, h2d_gbps=args.h2d_gbps, top_k=args.top_k,
                            costs=costs_from(args.costs), reprobe=args.reprobe,
                            machine_from=args.machine_from)
    except (LlamapackError, OSError, ValueError) as exc:
        print(f"Error: {exc}", file=sys.stderr)
        return 1
    md, js = write(table, meta, args.out or Path(args.results).parent, args.stem)
    print(md.read_text())
    print(f"wrote {md} and {js}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
