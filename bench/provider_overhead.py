"""The streaming provider's own cost per MoE layer, on the CPU: microseconds inside ``acquire`` (and the
lookahead callback) when every expert is already resident, so no read or copy hides it.

    python bench/provider_overhead.py [--preset qwen3moe-tiny] [-n 400] [--prefetch] [--out FILE.json]

Decodes greedily from a short prompt with the pool holding every expert, ``-n`` tokens to warm up and ``-n``
measured (the decode loops, so all or nearly all hits: the misses are reported), then reports ``provide_s / acquires`` and ``lookahead_s / acquires`` from the provider's counters. This is
the per-layer Python cost that decode on a GPU pays 48 times per token for a 48-layer model (see
bench/results/gpu_bench_README.md, "rest of the provider"). Needs the patched libllama (the installed one).
"""
from __future__ import annotations

import llama_cpp  # noqa: F401  isort: skip - before numpy (see docs/hook.md: static C++ runtime)

import argparse
import json
import platform
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from llamapack.bench.worker import last_logits  # noqa: E402
from llamapack.llama import Llama  # noqa: E402
from llamapack.pack import build_pack  # noqa: E402
from llamapack.synth import write_model  # noqa: E402


def measure(model: Path, pack: Path, n_tokens: int, prefetch: bool) -> dict:
    with Llama(str(model), pack=str(pack), n_ctx=2 * n_tokens + 64, n_ubatch=8, n_batch=8, verbose=False,
               n_threads=1, prefetch=prefetch, cache_vram_mib=1 << 20) as llm:  # the pool: every expert
        llm.eval(llm.tokenize(b"The history of the printing press", add_bos=True))
        token = int(np.argmax(last_logits(llm)))
        for _ in range(n_tokens):  # warm-up: loads every expert this (looping) greedy decode uses
            llm.eval([token])
            token = int(np.argmax(last_logits(llm)))
        before = llm.pack_stats()
        started = time.perf_counter()
        for _ in range(n_tokens):
            llm.eval([token])
            token = int(np.argmax(last_logits(llm)))
        decode_s = time.perf_counter() - started
        after = llm.pack_stats()
    acquires = after["acquires"] - before["acquires"]
    misses = after["cache_misses"] - before["cache_misses"]
    return dict(prefetch=prefetch, tokens=n_tokens, acquires=acquires, decode_misses=misses,
                provide_us_per_acquire=1e6 * (after["provide_s"] - before["provide_s"]) / acquires,
                lookahead_us_per_acquire=1e6 * (after["lookahead_s"] - before["lookahead_s"]) / acquires,
                decode_ms_per_token=1e3 * decode_s / n_tokens)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="qwen3moe-tiny")
    parser.add_argument("-n", "--tokens", type=int, default=400)
    parser.add_argument("--prefetch", action="store_true", help="also measure with router lookahead on")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        model = Path(write_model(Path(folder) / f"{args.preset}.gguf", args.preset, seed=0))
        pack = Path(build_pack(model, progress=False, safety_margin_mib=0).pack_path)
        runs = [measure(model, pack, args.tokens, False)]
        if args.prefetch:
            runs.append(measure(model, pack, args.tokens, True))
    result = dict(preset=args.preset, python=platform.python_version(), machine=platform.processor() or
                  platform.machine(), runs=runs)
    for run in runs:
        print(f"prefetch={run['prefetch']!s:5}  {run['provide_us_per_acquire']:6.1f} us in acquire, "
              f"{run['lookahead_us_per_acquire']:6.1f} us in the lookahead callback per layer "
              f"({run['acquires']} acquires, {run['decode_misses']} misses, {run['decode_ms_per_token']:.2f} ms/token)")
    if args.out:
        args.out.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
