"""The streaming provider's per-acquire cost on the CPU with a RAM tier holding every expert and a pool of a
fraction of them: the hit path and the miss path (policy, RAM-tier plan, copies, counters, slot map).

    python bench/provider_hotpath.py [--fractions 1,0.5,0.25] [-n 200] [--repeat 3] [--profile] [--out FILE.json]

Model: qwen3moe-tiny widened to Qwen3-30B-A3B's MoE shape (48 layers x 128 experts, top-8; n_embd 256, Q8_0
experts of 64 KiB), packed; host pool (CPU), RAM tier of every expert preloaded at start-up, no warm start.
Routing: the Qwen3-30B-A3B routing-model trace the H200 runs replayed
(bench/results/q30b_routing_model_seed0.trace.npz, request 0: 16 prompt tokens, then its decode rows, cycled),
substituted for the synthetic router's choice as ``llamapack bench --routing`` does (bench/replay.py). Per
pool fraction: ``--warmup`` decode tokens (200: every decode row once, so that the full pool then hits
everywhere), then ``-n`` measured. Each acquire (the provider's own, without
the replay's substitution) is timed and split by whether the step missed in the pool; ``provide_s / acquires``
from the counters (replay substitution included) and ``copy_wait_s / acquires`` are reported too.
``--repeat``: runs per fraction (medians reported). ``--profile``: a cProfile of one extra run per fraction,
top functions by own time. This is the per-layer Python cost a GPU decode pays 48 times per token
(bench/results/gpu_routing_README.md); CPU copies here are numpy memcpys of 64 KiB blocks.
"""
from __future__ import annotations

import llama_cpp  # noqa: F401  isort: skip - before numpy (see docs/hook.md: static C++ runtime)

import argparse
import cProfile
import dataclasses
import io
import json
import platform
import pstats
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from llamapack.bench.replay import install  # noqa: E402
from llamapack.bench.worker import last_logits  # noqa: E402
from llamapack.llama import Llama  # noqa: E402
from llamapack.pack import build_pack  # noqa: E402
from llamapack.routing.trace import load_trace  # noqa: E402
from llamapack.synth import write_model  # noqa: E402
from llamapack.synth.presets import Q8, QWEN3MOE_TINY  # noqa: E402

TRACE = REPO / "bench/results/q30b_routing_model_seed0.trace.npz"
SPEC = dataclasses.replace(QWEN3MOE_TINY, name="qwen3moe-48x128-tiny", n_layer=48, n_expert=128, n_expert_used=8,
                           n_ff_exp=64, expert_quant=(Q8,), output_type=Q8.down,
                           description="qwen3moe-tiny with Qwen3-30B-A3B's MoE shape (48 x 128 experts, top-8)")
N_PROMPT = 16
PROFILE_SORT = "tottime"


def timed_acquires(provider, samples: list) -> None:
    """Wrap ``provider.acquire`` (before the replay wraps it) to append (seconds, pool misses, copy seconds)."""
    acquire, values = provider.acquire, provider.counters._values  # a bench may peek: no lock, no snapshot

    def timed(layer, expert_ids):
        misses, copy_s = values["cache_misses"], values["copy_wait_s"]
        started = time.perf_counter()
        slots = acquire(layer, expert_ids)
        samples.append((time.perf_counter() - started, values["cache_misses"] - misses, values["copy_wait_s"] - copy_s))
        return slots

    provider.acquire = timed


def measure(model: Path, pack: Path, fraction: float, n_tokens: int, warmup: int, profile: bool = False,
            native: bool = False) -> dict:
    n_slots = round(fraction * SPEC.n_layer * SPEC.n_expert)
    with Llama(str(model), pack=str(pack), cache_slots=n_slots, ram_cache_mib=1 << 20, ram_preload=True,
               warm_start=False, native_hot_path=native, n_ctx=N_PROMPT + warmup + n_tokens + 16, n_ubatch=8, n_batch=8, verbose=False,
               n_threads=1) as llm:
        provider, samples = llm._provider, []
        timed_acquires(provider, samples)
        replay = install(provider, load_trace(TRACE))
        replay.start_request(0, N_PROMPT)
        llm.eval(llm.tokenize(b"The history of the printing press and of the books it made", add_bos=True)[:N_PROMPT])
        token = int(np.argmax(last_logits(llm)))
        for _ in range(warmup):
            llm.eval([token])
            token = int(np.argmax(last_logits(llm)))
        before, samples[:] = llm.pack_stats(), []
        profiler = cProfile.Profile() if profile else None
        started = time.perf_counter()
        if profiler:
            profiler.enable()
        for _ in range(n_tokens):
            llm.eval([token])
            token = int(np.argmax(last_logits(llm)))
        if profiler:
            profiler.disable()
        decode_s = time.perf_counter() - started
        after = llm.pack_stats()
    delta = {name: after[name] - before[name] for name in ("acquires", "cache_hits", "cache_misses", "provide_s",
                                                            "copy_wait_s", "ram_hits", "ram_misses")}
    hit_steps = [s for s, misses, _ in samples if misses == 0]
    miss_steps = [(s, misses, copy) for s, misses, copy in samples if misses]
    us = lambda seconds: 1e6 * seconds  # noqa: E731
    result = dict(
        fraction=fraction, n_slots=n_slots, tokens=n_tokens, acquires=delta["acquires"],
        pool_hit_rate=delta["cache_hits"] / (delta["cache_hits"] + delta["cache_misses"]),
        ram_hits=delta["ram_hits"], ram_misses=delta["ram_misses"],
        provide_us_per_acquire=us(delta["provide_s"]) / delta["acquires"],
        acquire_us_mean=us(sum(s for s, _, _ in samples)) / len(samples) if samples else None,
        python_acquires=len(samples), native_steps=after.get("native_steps", 0) - before.get("native_steps", 0),
        all_hit_steps=len(hit_steps),
        all_hit_us_median=us(statistics.median(hit_steps)) if hit_steps else None,
        all_hit_us_mean=us(statistics.fmean(hit_steps)) if hit_steps else None,
        miss_steps=len(miss_steps),
        misses_per_miss_step=statistics.fmean(m for _, m, _ in miss_steps) if miss_steps else None,
        miss_step_us_median=us(statistics.median(s for s, _, _ in miss_steps)) if miss_steps else None,
        miss_step_us_mean=us(statistics.fmean(s for s, _, _ in miss_steps)) if miss_steps else None,
        miss_step_copy_us_mean=us(statistics.fmean(c for _, _, c in miss_steps)) if miss_steps else None,
        copy_us_per_acquire=us(delta["copy_wait_s"]) / delta["acquires"],
        provider_ms_per_token=1e3 * delta["provide_s"] / n_tokens,
        decode_ms_per_token=1e3 * decode_s / n_tokens)
    if profiler:
        text = io.StringIO()
        pstats.Stats(profiler, stream=text).sort_stats(PROFILE_SORT).print_stats(30)
        result["profile"] = text.getvalue()
    return result


MEDIAN_KEYS = ("provide_us_per_acquire", "acquire_us_mean", "all_hit_us_median", "all_hit_us_mean",
               "miss_step_us_median", "miss_step_us_mean", "miss_step_copy_us_mean", "copy_us_per_acquire",
               "provider_ms_per_token", "decode_ms_per_token")


def summarize(runs: list[dict]) -> dict:
    """The runs' medians of the timings; the counts (the same in every run: deterministic) from the first."""
    summary = {key: value for key, value in runs[0].items() if key not in MEDIAN_KEYS and key != "profile"}
    for key in MEDIAN_KEYS:
        values = [run[key] for run in runs if run[key] is not None]
        summary[key] = statistics.median(values) if values else None
    return summary


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--fractions", default="1,0.5,0.25", help="pool sizes, shares of all experts")
    parser.add_argument("-n", "--tokens", type=int, default=200)
    parser.add_argument("--warmup", type=int, default=200)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--profile", action="store_true", help="also one profiled run per fraction (printed)")
    parser.add_argument("--native", action="store_true",
                        help="with the native hot path (steps needing no SSD read served in libllama; the timed "
                             "Python acquires are then only the others); default: every step through Python")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    fractions = [float(f) for f in args.fractions.split(",")]
    results = []
    with tempfile.TemporaryDirectory() as folder:
        model = Path(write_model(Path(folder) / f"{SPEC.name}.gguf", SPEC, seed=0))
        pack = Path(build_pack(model, progress=False, safety_margin_mib=0).pack_path)
        for fraction in fractions:
            runs = [measure(model, pack, fraction, args.tokens, args.warmup, native=args.native)
                    for _ in range(args.repeat)]
            summary = dict(summarize(runs), runs=runs)
            if args.profile:
                summary["profile"] = measure(model, pack, fraction, args.tokens, args.warmup, profile=True,
                                             native=args.native)["profile"]
                print(f"--- profile, pool {fraction:g}\n{summary['profile']}")
            results.append(summary)
    def us(value) -> str:
        return "-" if value is None else f"{value:.1f}"

    for r in results:
        miss = (f"{r['miss_steps']} miss steps ({r['misses_per_miss_step']:.2f} misses each) "
                f"{us(r['miss_step_us_median'])} us median, {us(r['miss_step_us_mean'])} mean "
                f"(copies {us(r['miss_step_copy_us_mean'])})" if r["miss_steps"] else "no miss step")
        print(f"pool {r['fraction']:5.3g} ({r['n_slots']} slots, {100 * r['pool_hit_rate']:.1f}% hits): "
              f"{us(r['acquire_us_mean'])} us/Python acquire ({r['python_acquires']} of them, "
              f"{r['native_steps']} native steps; provide_s/acquires {us(r['provide_us_per_acquire'])}); "
              f"{r['all_hit_steps']} all-hit Python steps {us(r['all_hit_us_median'])} us median; {miss}; "
              f"{r['provider_ms_per_token']:.2f} ms/token in the provider, {r['decode_ms_per_token']:.2f} decode")
    if args.out:
        result = dict(command=" ".join(["python", "bench/provider_hotpath.py", *sys.argv[1:]]), model=SPEC.description,
                      trace=str(TRACE.relative_to(REPO)), python=platform.python_version(),
                      machine=platform.processor() or platform.machine(), fractions=results)
        args.out.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
