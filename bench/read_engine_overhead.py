"""The read engines' own cost per expert read, on the CPU: native read pool vs Python read threads.

    python bench/read_engine_overhead.py PACK [--reads 4000] [--in-flight 4] [--splits 1] [--repeats 5] [--out FILE.json]

Reads random blocks of PACK through ``NativeReads`` and ``ThreadReads`` the way the provider's acquire loop
does (``in_flight`` reads at once, each in ``splits`` pieces; wait for the first piece to finish, then look
at every piece), buffered (``direct_io=False``) after one pass that puts the pack in the page cache, so the
reads themselves take little and the engine's cost shows. Reports, per read: wall microseconds and the
calling thread's CPU microseconds (``time.thread_time``: what the compute thread spends, GIL waits excluded),
the median of ``repeats`` passes that alternate the two engines (a small shared VM is noisy).
Needs the patched libllama (the installed one) for the native pool.
"""
from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

import llama_cpp  # noqa: F401  isort: skip - the patched libllama, before numpy (see docs/hook.md)

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from llamapack.pack import PackReader, aligned_buffer  # noqa: E402
from llamapack.provider.native_reads import NativeReads  # noqa: E402
from llamapack.provider.reads import PackSource, ThreadReads  # noqa: E402


def drive(engine, source, keys, in_flight: int) -> tuple[float, float]:
    """(wall s, calling thread's CPU s) to read ``keys``, ``in_flight`` at a time, as the acquire loop does."""
    buffers = [aligned_buffer(source.layout.expert_stride) for _ in range(in_flight)]
    wall, cpu = time.perf_counter(), time.thread_time()
    waiting, running = list(keys), {}
    while waiting or running:
        while waiting and len(running) < in_flight:
            slot = next(i for i in range(in_flight) if i not in running)
            running[slot] = engine.start(waiting.pop(), buffers[slot], source.pieces)
        pending = [piece for pieces in running.values() for piece in pieces if not piece.done()]
        engine.wait_first(pending, None)
        for slot, pieces in list(running.items()):
            if all(piece.done() for piece in pieces):
                for piece in pieces:
                    piece.result()
                del running[slot]
    return time.perf_counter() - wall, time.thread_time() - cpu


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("pack", type=Path)
    parser.add_argument("--reads", type=int, default=4000)
    parser.add_argument("--in-flight", type=int, default=4)
    parser.add_argument("--splits", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    reader = PackReader(args.pack, direct_io=False)
    source = PackSource(reader, direct_io=False, read_fn=None, splits=args.splits, verify_sha256=False)
    layout = reader.layout
    every = [(entry.layer, expert) for entry in layout.layers for expert in range(layout.num_experts)]
    keys = random.Random(0).choices(every, k=args.reads)
    engines = {"native": NativeReads, "python": ThreadReads}
    passes: dict[str, list[tuple[float, float]]] = {name: [] for name in engines}
    for _ in range(args.repeats):
        for name, make in engines.items():
            engine = make(source, args.in_flight * len(source.pieces), 0)
            drive(engine, source, every, args.in_flight)  # warm: the pack in the page cache, threads started
            passes[name].append(drive(engine, source, keys, args.in_flight))
            engine.close()
    results = {}
    for name, runs in passes.items():
        results[name] = dict(wall_us_per_read=1e6 * statistics.median(w for w, _ in runs) / args.reads,
                             cpu_us_per_read=1e6 * statistics.median(c for _, c in runs) / args.reads,
                             passes=[dict(wall_s=w, cpu_s=c) for w, c in runs])
        print(f"{name}: {results[name]['wall_us_per_read']:.1f} us wall, {results[name]['cpu_us_per_read']:.1f} us "
              "of the calling thread's CPU per read (medians)", flush=True)
    reader.close()
    summary = dict(pack=str(args.pack), expert_stride=layout.expert_stride, reads=args.reads, in_flight=args.in_flight,
                   splits=args.splits, repeats=args.repeats, results=results)
    if args.out:
        args.out.write_text(json.dumps(summary, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
