#!/usr/bin/env python3
"""Hybrid execution's exactness endpoints on the GPU machine (issue #25), against vanilla llama.cpp:

    python bench/cuda_hybrid.py --vanilla-lib DIR --patched-lib DIR --out results.json

Per tiny arch whose layers hybrid splits, all layers offloaded (-ngl 99), pack mode with a RAM tier of every
expert, hybrid on:
- ``full``: a pool of every expert (filled by the first SSD reads): no row ever runs on the CPU, the graph
  still carries the CPU op and the merge -> must equal vanilla all-GPU bit for bit;
- ``empty``: the tier preloaded and a small pool that hybrid never copies into (``hybrid_fill_pool`` off):
  every decode row on the CPU
  -> must equal vanilla ``--cpu-moe`` (repack off) bit for bit (n_ubatch 1 and 7: a larger prompt ubatch
  runs on the pool, as --cpu-moe's op offload runs it on the GPU);
- ``mixed``: a small pool, half of each step's RAM misses copied before the GPU work and the CPU's half
  copied behind the step (``hybrid_fill_pool``, the default): rows split both ways -> twice, must be
  identical (deterministic); its distance to vanilla all-GPU and to --cpu-moe is reported.
Writes JSON and a markdown table; run by bench/device_bench.sh's hybrid stage.
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests"))
sys.path.insert(0, str(REPO))

from hookutil import logits, smallest_pool  # noqa: E402
from llamapack.pack import build_pack  # noqa: E402
from llamapack.synth import PRESETS, write_model  # noqa: E402

ARCHS = ("qwen3moe-tiny", "mixtral-tiny", "deepseek2-tiny")


def distance(got: np.ndarray, want: np.ndarray) -> dict:
    diff = np.abs(got.astype(np.float64) - want.astype(np.float64))
    return dict(bit_exact=bool(np.array_equal(got, want)), max_abs_diff=float(diff.max()),
                rows_differing=int((diff.max(axis=1) > 0).sum()), argmax_agree=float((got.argmax(1) == want.argmax(1)).mean()))


def cases(preset: str, n_ubatch: int, model: Path, libs: dict, tmp: Path, threads: int, device: int = 0) -> list[dict]:
    spec = PRESETS[preset]
    every = spec.n_expert * spec.n_layer
    base = dict(model=str(model), n_ubatch=n_ubatch, n_prompt=64, n_decode=32, n_gpu_layers=99, n_threads=4)
    gpu, _ = logits(dict(base, mode="vanilla", out=str(tmp / "v.npy")), tmp, lib_dir=libs["vanilla"])
    cpu_moe, _ = logits(dict(base, mode="vanilla", cpu_moe=True, out=str(tmp / "c.npy")), tmp, lib_dir=libs["vanilla"])
    pack = dict(pack=True, serve_from=str(model.with_suffix(".expert-pack")))
    hook = dict(base, mode="hook", device=device, provider="streaming", **pack)
    tier = dict(ram_cache_mib=1e6, hybrid_threads=threads)
    small = smallest_pool(preset, n_ubatch) + 2

    def run(name, n_slots, **streaming):
        t0 = time.time()
        got, stats = logits(dict(hook, n_slots=n_slots, streaming=dict(tier, **streaming), out=str(tmp / f"{name}.npy")),
                            tmp, lib_dir=libs["patched"])
        counts = {k: stats.get(k, 0) for k in ("cpu_experts", "cache_hits", "cache_misses", "ram_hits", "native_steps",
                                              "acquires", "h2d_bytes")}
        return got, dict(counts, hybrid=stats.get("hybrid"), seconds=round(time.time() - t0, 1))

    out = []
    got, stats = run("full", every, hybrid="on")
    out.append(dict(preset=preset, n_ubatch=n_ubatch, case="full", reference="vanilla all-GPU", n_slots=every,
                    **distance(got, gpu), **stats))
    if n_ubatch < 32:
        got, stats = run("empty", small, hybrid="on", ram_preload=True, hybrid_fill_pool=False)
        out.append(dict(preset=preset, n_ubatch=n_ubatch, case="empty", reference="vanilla --cpu-moe", n_slots=small,
                        **distance(got, cpu_moe), **stats))
    first, stats = run("mixed1", small, hybrid=0.5)
    second, _ = run("mixed2", small, hybrid=0.5)
    out.append(dict(preset=preset, n_ubatch=n_ubatch, case="mixed", reference="itself, run again", n_slots=small,
                    **distance(second, first), vs_gpu=distance(first, gpu), vs_cpu_moe=distance(first, cpu_moe),
                    **stats))
    out.append(dict(preset=preset, n_ubatch=n_ubatch, case="cpu-moe vs all-GPU", reference="vanilla all-GPU",
                    n_slots=0, **distance(cpu_moe, gpu)))
    return out


def markdown(results: list[dict]) -> str:
    lines = ["| arch | n_ubatch | case | compared with | bit-exact | max abs diff | rows differing | argmax agree | "
             "rows on the CPU | pool hits | steps in libllama |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        lines.append(f"| {r['preset']} | {r['n_ubatch']} | {r['case']} | {r['reference']} | {r['bit_exact']} | "
                     f"{r['max_abs_diff']:.3g} | {r['rows_differing']} | {r['argmax_agree']:.3f} | "
                     f"{r.get('cpu_experts', '-')} | {r.get('cache_hits', '-')} | "
                     f"{r.get('native_steps', '-')}/{r.get('acquires', '-')} |")
    for r in results:
        if r["case"] == "mixed":
            lines.append(f"\n{r['preset']} n_ubatch {r['n_ubatch']} mixed: vs all-GPU max abs diff "
                         f"{r['vs_gpu']['max_abs_diff']:.3g} (argmax {r['vs_gpu']['argmax_agree']:.3f}), vs --cpu-moe "
                         f"{r['vs_cpu_moe']['max_abs_diff']:.3g} (argmax {r['vs_cpu_moe']['argmax_agree']:.3f})")
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--vanilla-lib", type=Path, required=True)
    parser.add_argument("--patched-lib", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--archs", nargs="*", default=list(ARCHS))
    parser.add_argument("--ubatch", nargs="*", type=int, default=[1, 7, 512])
    parser.add_argument("--threads", type=int, default=8, help="hybrid's CPU threads")
    parser.add_argument("--device", type=int, default=0, help="GPU of the slot pool (-1: a host pool, a CPU dry run)")
    args = parser.parse_args()
    libs = dict(vanilla=args.vanilla_lib, patched=args.patched_lib)
    results = []
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        for preset in args.archs:
            model = write_model(tmp / f"{preset}.gguf", preset, seed=0)
            build_pack(model, progress=False, safety_margin_mib=0)
            for n_ubatch in args.ubatch:
                try:
                    new = cases(preset, n_ubatch, model, libs, tmp, args.threads, args.device)
                except AssertionError as exc:  # a worker crashed: record it, go on
                    new = [dict(preset=preset, n_ubatch=n_ubatch, error=str(exc)[-2000:])]
                for r in new:
                    print(json.dumps(r), flush=True)
                results.extend(new)
                args.out.write_text(json.dumps(results, indent=1))
                ok = [r for r in results if "error" not in r]
                args.out.with_suffix(".md").write_text(markdown(ok) + "".join(
                    f"\nerror: {r['preset']} n_ubatch {r['n_ubatch']}: {r['error'][-300:]}\n"
                    for r in results if "error" in r))
    return 0


if __name__ == "__main__":
    sys.exit(main())
