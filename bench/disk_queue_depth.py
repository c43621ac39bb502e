"""The disk's O_DIRECT random-read bandwidth by read size and reads in flight, over an expert pack's blocks.

    python bench/disk_queue_depth.py MODEL.expert-pack [--sizes 2.53M,640K,256K] [--threads 1,4,8,16]
                                     [--seconds 1.5] [--out FILE.json]

Each cell reads pieces of one size at random aligned offsets inside the pack's expert area, that many at
once, for ``--seconds``. It tells whether a miss read would finish sooner split into parallel pieces
(``read_splits``): a single-miss layer has one read in flight unless it is split.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from llamapack.bench.diskbw import random_read_bandwidth  # noqa: E402
from llamapack.pack import ALIGNMENT, PackReader  # noqa: E402
from llamapack.pack.layout import align_up  # noqa: E402

UNITS = {"K": 1 << 10, "M": 1 << 20}


def size_of(text: str, stride: int) -> int:
    """'2.53M' style sizes, or 'stride' for one expert block; rounded up to the O_DIRECT alignment."""
    if text == "stride":
        return stride
    scale = UNITS.get(text[-1].upper(), 1)
    return align_up(int(float(text[:-1] if scale > 1 else text) * scale))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("pack", type=Path)
    parser.add_argument("--sizes", default="stride,640K,256K")
    parser.add_argument("--threads", default="1,4,8,16")
    parser.add_argument("--seconds", type=float, default=1.5)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    with PackReader(args.pack) as reader:
        layout = reader.layout
        first = layout.block_offset(layout.layers[0].layer, 0)
        area = layout.expert_stride * layout.num_experts * len(layout.layers)
    cells = []
    for size in (size_of(s, layout.expert_stride) for s in args.sizes.split(",")):
        for threads in (int(t) for t in args.threads.split(",")):
            probe = random_read_bandwidth(str(args.pack), size, first, area // size, threads=threads,
                                          seconds=args.seconds)
            cells.append(dict(probe.as_dict(), ms_per_read=1e3 * probe.seconds * threads / max(probe.reads, 1)))
            print(f"{size / 1024:8.0f} KiB x {threads:2d} at once: {probe.bytes_per_s / 1e9:5.2f} GB/s, "
                  f"{cells[-1]['ms_per_read']:.2f} ms per read", flush=True)
    if args.out:
        args.out.write_text(json.dumps(dict(pack=str(args.pack), expert_stride=layout.expert_stride, alignment=ALIGNMENT,
                                            cells=cells), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
