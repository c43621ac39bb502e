#!/usr/bin/env python3
"""CUDA bit-exactness on the GPU machine: logits through the hook (slot pool in VRAM) vs vanilla CUDA.

    python bench/cuda_bitexact.py --vanilla-lib DIR --patched-lib DIR --out results.json

Runs every tiny synthetic arch, all layers offloaded (-ngl 99), for n_ubatch 1 (decode kernels), 7 and
512 (prefill kernels), with a pool smaller than the expert count where one step allows it. Writes JSON
and a markdown table. Run by bench/device_cuda.sh on the device; results are committed under
bench/results/.
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

from hookutil import logits  # noqa: E402
from llamapack.synth import PRESETS, write_model  # noqa: E402

ARCHS = ("qwen3moe-tiny", "deepseek2-tiny", "deepseek2-tiny-fused", "gpt-oss-tiny", "mixtral-tiny")


def compare(preset: str, n_ubatch: int, model: Path, vanilla_lib: Path, patched_lib: Path, tmp: Path,
            device: int = 0, n_prompt: int = 64, provider: str = "reference") -> dict:
    spec = PRESETS[preset]
    n_slots = min(spec.n_expert, spec.n_expert_used * n_ubatch)
    base = dict(model=str(model), n_ubatch=n_ubatch, n_prompt=n_prompt, n_decode=32, n_gpu_layers=99, n_threads=4)
    t0 = time.time()
    want, _ = logits(dict(base, mode="vanilla", out=str(tmp / "v.npy")), tmp, lib_dir=vanilla_lib)
    noprov, _ = logits(dict(base, mode="vanilla", out=str(tmp / "p.npy")), tmp, lib_dir=patched_lib)
    got, stats = logits(dict(base, mode="hook", device=device, n_slots=n_slots, provider=provider,
                             out=str(tmp / "h.npy")), tmp,
                        lib_dir=patched_lib)
    diff = np.abs(got.astype(np.float64) - want.astype(np.float64))
    return dict(preset=preset, provider=provider, n_ubatch=n_ubatch, n_prompt=n_prompt, n_slots=n_slots,
                n_expert=spec.n_expert,
                rows=int(want.shape[0]), bit_exact=bool(np.array_equal(got, want)),
                patched_no_provider_bit_exact=bool(np.array_equal(noprov, want)),
                max_abs_diff=float(diff.max()), rows_differing=int((diff.max(axis=1) > 0).sum()),
                argmax_agree=float((got.argmax(1) == want.argmax(1)).mean()),
                cache_misses=stats["cache_misses"], cache_evictions=stats["cache_evictions"],
                seconds=round(time.time() - t0, 1))


def markdown(results: list[dict]) -> str:
    lines = ["| arch | n_ubatch | slots/experts | bit-exact | patched, no provider | max abs diff | rows differing | misses | evictions |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        lines.append(f"| {r['preset']} | {r['n_ubatch']} | {r['n_slots']}/{r['n_expert']} | {r['bit_exact']} | "
                     f"{r['patched_no_provider_bit_exact']} | {r['max_abs_diff']:.3g} | {r['rows_differing']}/{r['rows']} | "
                     f"{r['cache_misses']} | {r['cache_evictions']} |")
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--vanilla-lib", type=Path, required=True)
    parser.add_argument("--patched-lib", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--archs", nargs="*", default=list(ARCHS))
    parser.add_argument("--ubatch", nargs="*", type=int, default=[1, 7, 512])
    parser.add_argument("--n-prompt", type=int, default=64, help="prompt tokens (n_ctx is 256)")
    parser.add_argument("--provider", choices=["reference", "streaming"], default="reference")
    parser.add_argument("--device", type=int, default=0, help="GPU for the slot pool (-1: host pool, a CPU dry run)")
    args = parser.parse_args()
    results = []
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        for preset in args.archs:
            model = write_model(tmp / f"{preset}.gguf", preset, seed=0)
            for n_ubatch in args.ubatch:
                try:
                    r = compare(preset, n_ubatch, model, args.vanilla_lib, args.patched_lib, tmp, args.device,
                                args.n_prompt, args.provider)
                except AssertionError as exc:  # a worker crashed: record it, go on with the rest
                    r = dict(preset=preset, n_ubatch=n_ubatch, error=str(exc)[-2000:])
                print(json.dumps(r), flush=True)
                results.append(r)
                write(results, args.out)  # after each case: a run cut short still leaves its results
    return 0


def write(results: list[dict], out: Path) -> None:
    out.write_text(json.dumps(results, indent=1))
    ok = [r for r in results if "error" not in r]
    out.with_suffix(".md").write_text(markdown(ok) + "".join(
        f"\nerror: {r['preset']} n_ubatch {r['n_ubatch']}: {r['error'][-300:]}\n" for r in results if "error" in r))


if __name__ == "__main__":
    sys.exit(main())
