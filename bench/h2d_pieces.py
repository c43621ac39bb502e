"""Pinned host-to-device copy rate by how a layer window's bytes are cut (a device diagnostic; needs CuPy and a GPU).

Round 18 (H100) measured a window's 128 experts (340 MB) copied at 46.6 GB/s, one cudaMemcpyAsync per role and
expert (0.88 MiB each for the Qwen3-30B shape), where the plan's probe, one 64 MiB copy, gets 55.3 GB/s. This
times the same bytes three ways on one non-blocking stream, best of ``--repeats``:

- ``pieces``: one copy per role and expert, as the fast path issues them (RAM block -> pool slot);
- ``per_role_2d``: one cudaMemcpy2DAsync per role (source pitch: the RAM block's stride, destination pitch: the
  slot's stride, one row per expert), what a run of consecutive experts could be copied as;
- ``contiguous``: one copy of the same total bytes (the probe's way).

    python bench/h2d_pieces.py [--experts 128] [--role-mib 0.84 0.84 0.84] [--repeats 5] > h2d_pieces.json
"""
from __future__ import annotations

import argparse
import json
import sys
import time

MIB = 1 << 20


def pieces(n_experts: int, role_bytes: list[int], block_stride: int, slot_stride: int) -> list[tuple[int, int, int]]:
    """(source offset, destination offset, bytes) of every role of every expert: expert e's block starts at
    e * block_stride (its roles one after another), role r's slots at r * n_experts * slot_stride."""
    out = []
    for e in range(n_experts):
        offset = e * block_stride
        for r, nbytes in enumerate(role_bytes):
            out.append((offset, r * n_experts * slot_stride + e * slot_stride, nbytes))
            offset += nbytes
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--experts", type=int, default=128)
    parser.add_argument("--role-mib", type=float, nargs="+", default=[0.84375, 0.84375, 0.84375])
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    import cupy
    import numpy as np

    roles = [int(m * MIB) for m in args.role_mib]
    block = sum(roles)
    slot = max(roles)
    total = args.experts * block
    host_mem = cupy.cuda.alloc_pinned_memory(total)
    host = np.frombuffer(host_mem, dtype=np.uint8, count=total)
    host[:] = 1
    device = cupy.empty(len(roles) * args.experts * slot, dtype=cupy.uint8)
    stream = cupy.cuda.Stream(non_blocking=True)
    runtime = cupy.cuda.runtime
    h2d = runtime.memcpyHostToDevice
    src0, dst0 = host.ctypes.data, device.data.ptr
    plan = pieces(args.experts, roles, block, slot)

    def by_pieces():
        for src, dst, nbytes in plan:
            runtime.memcpyAsync(dst0 + dst, src0 + src, nbytes, h2d, stream.ptr)

    def per_role_2d():
        offset = 0
        for r, nbytes in enumerate(roles):
            runtime.memcpy2DAsync(dst0 + r * args.experts * slot, slot, src0 + offset, block, nbytes, args.experts,
                                  h2d, stream.ptr)
            offset += nbytes

    def contiguous():
        runtime.memcpyAsync(dst0, src0, total, h2d, stream.ptr)

    gpu = runtime.getDeviceProperties(0)["name"]
    results = {"experts": args.experts, "role_bytes": roles, "bytes": total,
               "gpu": gpu.decode() if isinstance(gpu, bytes) else str(gpu)}
    for name, issue in (("pieces", by_pieces), ("per_role_2d", per_role_2d), ("contiguous", contiguous)):
        best_s, issue_s = float("inf"), float("inf")
        for _ in range(args.repeats):
            stream.synchronize()
            start = time.perf_counter()
            issue()
            issued = time.perf_counter()
            stream.synchronize()
            done = time.perf_counter()
            best_s, issue_s = min(best_s, done - start), min(issue_s, issued - start)
        results[name] = {"gb_per_s": total / best_s / 1e9, "seconds": best_s, "issue_s": issue_s,
                         "calls": {"pieces": len(plan), "per_role_2d": len(roles), "contiguous": 1}[name]}
    print(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
