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
from llamapack.pack import build_pack  # noqa: E402
from llamapack.synth import PRESETS, write_model  # noqa: E402

ARCHS = ("qwen3moe-tiny", "deepseek2-tiny", "deepseek2-tiny-fused", "gpt-oss-tiny", "mixtral-tiny")


def compare(preset: str, n_ubatch: int, model: Path, vanilla_lib: Path, patched_lib: Path, tmp: Path,
            device: int = 0, n_prompt: int = 64, provider: str = "reference", sources=("gguf",),
            streaming: dict | None = None, pool_layers: int = 0, rounds: int = 1) -> list[dict]:
    """One case per source (``gguf``: GGUF-direct, ``pack``: the model's expert pack), all against one
    vanilla run. ``pool_layers``: a pool of that many layers' experts (every layer's: the model's layer count)
    instead of the smallest one; a pool whose slot count differs from a layer's expert count makes the
    multi-token kernels (MMQ) see another expert count than vanilla's. ``rounds``: the request (prompt, 32 decoded
    tokens) made that many times in a row, each from an empty context (a later prompt finds the pool filled)."""
    spec = PRESETS[preset]
    n_slots = spec.n_expert * min(pool_layers, spec.n_layer) if pool_layers else \
        min(spec.n_expert, spec.n_expert_used * n_ubatch)
    base = dict(model=str(model), n_ubatch=n_ubatch, n_prompt=n_prompt, n_decode=32, n_gpu_layers=99, n_threads=4,
                rounds=rounds)
    t0 = time.time()
    want, _ = logits(dict(base, mode="vanilla", out=str(tmp / "v.npy")), tmp, lib_dir=vanilla_lib)
    noprov, _ = logits(dict(base, mode="vanilla", out=str(tmp / "p.npy")), tmp, lib_dir=patched_lib)
    cases = []
    for source in sources:
        served = dict(pack=True, serve_from=str(model.with_suffix(".expert-pack"))) if source == "pack" else {}
        got, stats = logits(dict(base, mode="hook", device=device, n_slots=n_slots, provider=provider,
                                 streaming=streaming or {}, out=str(tmp / "h.npy"), **served), tmp, lib_dir=patched_lib)
        streaming_ = streaming or {}
        depth = streaming_.get("prefetch_depth", 1)
        label = provider + ("+ram" if streaming_.get("ram_cache_mib") else "") + (
            "+preload" if streaming_.get("ram_preload") else "") + (
            ("+prefetch" + (f"-d{depth}" if depth > 1 else "")) if streaming_.get("prefetch") else "") + (
            "+ahead" if streaming_.get("load_ahead_min_tokens") else "") + (
            "+windows" if streaming_.get("layer_windows_min_tokens") else "")
        cases.append(case(preset, label, source, n_ubatch, n_prompt, n_slots, spec.n_expert, want, noprov, got,
                          stats, time.time() - t0))
    return cases


def case(preset, provider, source, n_ubatch, n_prompt, n_slots, n_expert, want, noprov, got, stats, seconds) -> dict:
    diff = np.abs(got.astype(np.float64) - want.astype(np.float64))
    return dict(preset=preset, provider=provider, source=source, n_ubatch=n_ubatch, n_prompt=n_prompt,
                n_slots=n_slots, n_expert=n_expert,
                rows=int(want.shape[0]), bit_exact=bool(np.array_equal(got, want)),
                patched_no_provider_bit_exact=bool(np.array_equal(noprov, want)),
                max_abs_diff=float(diff.max()), rows_differing=int((diff.max(axis=1) > 0).sum()),
                argmax_agree=float((got.argmax(1) == want.argmax(1)).mean()),
                cache_misses=stats["cache_misses"], cache_evictions=stats["cache_evictions"],
                prefetch_used=stats.get("prefetch_used", 0), lookahead_accuracy=stats.get("lookahead_accuracy"),
                ram_preloaded=stats.get("ram_preloaded", 0), ram_hits=stats.get("ram_hits", 0),
                read_engine=stats.get("read_engine", "-"), native_steps=stats.get("native_steps", 0),
                lookup_steps=stats.get("lookup_steps", 0), whole_pool_steps=stats.get("whole_pool_steps", 0),
                whole_pool_span=stats.get("whole_pool_span", 0), acquires=stats.get("acquires", 0),
                ahead_loads=stats.get("ahead_loads", 0), window_skipped=stats.get("window_skipped", 0),
                window_from_pool=stats.get("window_from_pool", 0), d2d_bytes=stats.get("d2d_bytes", 0),
                seconds=round(seconds, 1))


def markdown(results: list[dict]) -> str:
    lines = ["| arch | provider | source | n_ubatch | slots/experts | bit-exact | patched, no provider | max abs diff | rows differing | misses | evictions | misses read ahead | reads on | native steps | lookup steps | whole-pool steps (widest slot view) | loaded ahead |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        lines.append(f"| {r['preset']} | {r.get('provider', 'reference')} | {r.get('source', 'gguf')} | {r['n_ubatch']} | {r['n_slots']}/{r['n_expert']} | {r['bit_exact']} | "
                     f"{r['patched_no_provider_bit_exact']} | {r['max_abs_diff']:.3g} | {r['rows_differing']}/{r['rows']} | "
                     f"{r['cache_misses']} | {r['cache_evictions']} | {r.get('prefetch_used', 0)} | {r.get('read_engine', '-')} | "
                     f"{r.get('native_steps', 0)}/{r.get('acquires', 0)} | {r.get('lookup_steps', 0)} | {r.get('whole_pool_steps', 0)} ({r.get('whole_pool_span', 0)}) | {r.get('ahead_loads', 0)} |")
    return "\n".join(lines) + "\n"


def streaming_settings(args) -> dict:
    settings = dict(ram_cache_mib=args.ram_cache_mib) if args.ram_cache_mib else {}
    if args.ram_preload:
        settings["ram_preload"] = True
    if args.prefetch_in_flight:
        settings["prefetch_in_flight"] = args.prefetch_in_flight
    settings["whole_pool_graphs"] = args.whole_pool  # each check names the path it tests
    if args.load_ahead:
        settings["load_ahead_min_tokens"] = args.load_ahead
    if args.layer_windows:
        settings["layer_windows_min_tokens"] = args.layer_windows
    if args.prefetch_depth > 1:
        return dict(settings, prefetch=True, prefetch_depth=args.prefetch_depth, prefetch_slots=4 * args.prefetch_depth)
    return dict(settings, prefetch=True) if args.prefetch else settings


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--vanilla-lib", type=Path, required=True)
    parser.add_argument("--patched-lib", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--archs", nargs="*", default=list(ARCHS))
    parser.add_argument("--ubatch", nargs="*", type=int, default=[1, 7, 512])
    parser.add_argument("--n-prompt", type=int, default=64, help="prompt tokens (n_ctx is 256)")
    parser.add_argument("--provider", choices=["reference", "streaming"], default="reference")
    parser.add_argument("--sources", nargs="*", choices=["gguf", "pack"], default=["gguf"],
                        help="where the provider reads experts: GGUF-direct, the expert pack, or both")
    parser.add_argument("--ram-cache-mib", type=float, help="streaming provider: a host-RAM tier of this size")
    parser.add_argument("--ram-preload", action="store_true",
                        help="streaming provider: fill the RAM tier (--ram-cache-mib) at start-up")
    parser.add_argument("--prefetch", action="store_true", help="streaming provider: router-lookahead prefetch")
    parser.add_argument("--prefetch-depth", type=int, default=1,
                        help="streaming provider: prefetch guessing this many layers ahead (implies --prefetch)")
    parser.add_argument("--prefetch-in-flight", type=int, help="streaming provider: lookahead pieces read at once")
    parser.add_argument("--whole-pool", action="store_true",
                        help="streaming provider: whole-pool graphs (llamapack's default; off here unless given)")
    parser.add_argument("--load-ahead", type=int, default=0,
                        help="streaming provider: load-ahead after steps of at least this many tokens (0: off)")
    parser.add_argument("--layer-windows", type=int, default=0,
                        help="streaming provider: layer windows for ubatches of at least this many tokens (0: off; "
                             "needs --ram-cache-mib for every expert and --ram-preload)")
    parser.add_argument("--device", type=int, default=0, help="GPU for the slot pool (-1: host pool, a CPU dry run)")
    parser.add_argument("--rounds", type=int, default=1,
                        help="the request made this many times in a row (later prompts find the pool filled)")
    parser.add_argument("--pool-layers", type=int, default=0,
                        help="a pool of this many layers' experts instead of the smallest (e.g. every layer's)")
    args = parser.parse_args()
    results = []
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        for preset in args.archs:
            model = write_model(tmp / f"{preset}.gguf", preset, seed=0)
            if "pack" in args.sources:
                build_pack(model, progress=False, safety_margin_mib=0)
            for n_ubatch in args.ubatch:
                try:
                    cases = compare(preset, n_ubatch, model, args.vanilla_lib, args.patched_lib, tmp, args.device,
                                    args.n_prompt, args.provider, args.sources,
                                    streaming_settings(args), args.pool_layers, args.rounds)
                except AssertionError as exc:  # a worker crashed: record it, go on with the rest
                    cases = [dict(preset=preset, n_ubatch=n_ubatch, error=str(exc)[-2000:])]
                for r in cases:
                    print(json.dumps(r), flush=True)
                results.extend(cases)
                write(results, args.out)  # after each case: a run cut short still leaves its results
    return 0


def write(results: list[dict], out: Path) -> None:
    out.write_text(json.dumps(results, indent=1))
    ok = [r for r in results if "error" not in r]
    out.with_suffix(".md").write_text(markdown(ok) + "".join(
        f"\nerror: {r['preset']} n_ubatch {r['n_ubatch']}: {r['error'][-300:]}\n" for r in results if "error" in r))


if __name__ == "__main__":
    sys.exit(main())
