"""Builder write rate vs ``dd if=/dev/zero bs=16M oflag=direct`` on the same disk.

    python bench/pack_throughput.py [--dir DIR] [--size-gib 2] [--repeat 3]

Makes a synthetic Qwen3-30B-A3B-shaped MoE GGUF of about --size-gib (random bytes; gate/up Q4_K
2048x768, down Q6_K 768x2048, 128 experts per layer), then alternates ``dd`` and ``build_pack`` runs
writing the same number of bytes into DIR, prints the median rates and their ratio (target >= 0.8),
and deletes everything it wrote. The GGUF was just written, so the builder reads it from the page
cache: this measures the pack's write path, which is what the ratio is about.
"""

from __future__ import annotations

import argparse
import math
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

from gguf import GGMLQuantizationType as T  # noqa: E402
from ggufgen import write_moe_gguf  # noqa: E402

from llamapack.pack import build_pack  # noqa: E402

EXPERTS = 128
ROLES = {"gate": (T.Q4_K, 2048, 768), "up": (T.Q4_K, 2048, 768), "down": (T.Q6_K, 768, 2048)}
LAYER_BYTES = EXPERTS * (2 * 768 * 8 * 144 + 2048 * 3 * 210)


def dd_rate(folder: Path, nbytes: int) -> float:
    target, count = folder / "dd.tmp", -(-nbytes // (16 << 20))
    started = time.perf_counter()
    subprocess.run(["dd", "if=/dev/zero", f"of={target}", "bs=16M", f"count={count}", "oflag=direct"],
                   check=True, capture_output=True)
    seconds = time.perf_counter() - started
    target.unlink()
    return count * (16 << 20) / seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dir", default="/work", help="folder on the disk to measure (default /work)")
    parser.add_argument("--size-gib", type=float, default=2.0)
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()

    folder = Path(tempfile.mkdtemp(prefix="pack-bench-", dir=args.dir))
    try:
        n_layers = max(1, math.ceil(args.size_gib * 2**30 / LAYER_BYTES))
        started = time.perf_counter()
        gguf = write_moe_gguf(folder / "bench.gguf", {i: ROLES for i in range(n_layers)}, n_expert=EXPERTS,
                              dense_layers=())[0]
        print(f"synthetic GGUF: {gguf.stat().st_size / 2**30:.2f} GiB, {n_layers} MoE layers x {EXPERTS} experts "
              f"({time.perf_counter() - started:.1f} s to write)")
        dd, wall, stream = [], [], []
        for i in range(args.repeat):
            pack = folder / "bench.expert-pack"
            started = time.perf_counter()
            result = build_pack(gguf, pack, progress=False, safety_margin_mib=1024)
            elapsed = time.perf_counter() - started
            size = result.manifest.layout.pack_size
            wall.append(size / elapsed)
            stream.append((size - result.manifest.layout.data_start) / result.seconds)
            pack.unlink()
            Path(result.manifest_path).unlink()
            dd.append(dd_rate(folder, size))
            print(f"run {i + 1}: build_pack {wall[-1] / 1e9:.2f} GB/s end-to-end "
                  f"({stream[-1] / 1e9:.2f} GB/s streaming), dd {dd[-1] / 1e9:.2f} GB/s")
        dd_m, wall_m, stream_m = (statistics.median(x) for x in (dd, wall, stream))
        print(f"pack size {size / 2**30:.2f} GiB, stride {result.manifest.layout.expert_stride} B")
        print(f"median: dd {dd_m / 1e9:.2f} GB/s, build_pack {wall_m / 1e9:.2f} GB/s end-to-end "
              f"(ratio {wall_m / dd_m:.2f}), streaming {stream_m / 1e9:.2f} GB/s (ratio {stream_m / dd_m:.2f})")
    finally:
        shutil.rmtree(folder)


if __name__ == "__main__":
    main()
