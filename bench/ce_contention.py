"""Does a small host->device copy wait behind large ones queued on another stream? (device microbenchmark)

Models the prefill with load-ahead: the provider queues a layer's expert copies (pinned host memory, one
call per role and expert) on its own non-blocking stream, then ggml's scheduler copies the next split's
small input (the slot ids, pageable) with cudaMemcpyAsync on cudaStreamPerThread and synchronizes. Prints,
as JSON: the issue time per copy call, the big copies' time alone, and the small copy's latency alone and
behind the queued copies (pageable and pinned source, and while a kernel runs).
"""
from __future__ import annotations

import json
import sys
import time

import cupy
import numpy as np

PER_THREAD = 2  # cudaStreamPerThread
H2D = cupy.cuda.runtime.memcpyHostToDevice


def main(expert_bytes: int = 2654208, n_experts: int = 125, roles: int = 3) -> dict:
    rt = cupy.cuda.runtime
    total = expert_bytes * n_experts
    host = cupy.cuda.alloc_pinned_memory(total)
    host_ptr = np.frombuffer(host, dtype=np.uint8, count=total).ctypes.data
    dev = cupy.empty(total, dtype=cupy.uint8)
    small_dev = cupy.empty(16384, dtype=cupy.uint8)
    small_pageable = np.ones(16384, dtype=np.uint8)
    small_pinned_mem = cupy.cuda.alloc_pinned_memory(16384)
    small_pinned = np.frombuffer(small_pinned_mem, dtype=np.uint8, count=16384).ctypes.data
    stream = cupy.cuda.Stream(non_blocking=True)
    role_bytes = expert_bytes // roles

    def queue_big(chunks_per_expert: int = roles) -> float:
        started = time.perf_counter()
        step = expert_bytes // chunks_per_expert
        for e in range(n_experts):
            for r in range(chunks_per_expert):
                off = e * expert_bytes + r * step
                rt.memcpyAsync(dev.data.ptr + off, host_ptr + off, step, H2D, stream.ptr)
        return time.perf_counter() - started

    def small_copy(src: int) -> float:
        started = time.perf_counter()
        rt.memcpyAsync(small_dev.data.ptr, src, 16384, H2D, PER_THREAD)
        rt.streamSynchronize(PER_THREAD)
        return time.perf_counter() - started

    out = {"device": rt.getDeviceProperties(0)["name"].decode(), "expert_bytes": expert_bytes,
           "n_experts": n_experts, "calls": n_experts * roles}
    for _ in range(3):  # warm
        queue_big(); stream.synchronize(); small_copy(small_pageable.ctypes.data)
    started = time.perf_counter(); issue = queue_big(); stream.synchronize()
    out["big_alone_ms"] = (time.perf_counter() - started) * 1e3
    out["issue_us_per_call"] = issue / (n_experts * roles) * 1e6
    out["big_GBps"] = total / (out["big_alone_ms"] / 1e3) / 1e9
    out["small_pageable_alone_ms"] = small_copy(small_pageable.ctypes.data) * 1e3
    out["small_pinned_alone_ms"] = small_copy(small_pinned) * 1e3
    for name, src in (("pageable", small_pageable.ctypes.data), ("pinned", small_pinned)):
        queue_big(); latency = small_copy(src); stream.synchronize()
        out[f"small_{name}_behind_big_ms"] = latency * 1e3
    # one call per expert with 1 MiB pieces? fewer, larger calls: one per expert
    started = time.perf_counter(); issue = queue_big(1); stream.synchronize()
    out["one_call_per_expert_issue_us"] = issue / n_experts * 1e6
    out["one_call_per_expert_ms"] = (time.perf_counter() - started) * 1e3
    # a small copy on a high-priority stream behind the big copies (CUDA clamps -5 to the device's greatest)
    prio = cupy.cuda.Stream(non_blocking=True, priority=-5)
    queue_big()
    started = time.perf_counter()
    rt.memcpyAsync(small_dev.data.ptr, small_pinned, 16384, H2D, prio.ptr); prio.synchronize()
    out["small_pinned_high_priority_stream_behind_big_ms"] = (time.perf_counter() - started) * 1e3
    stream.synchronize()
    # does a kernel on another stream overlap the copies? time a matmul alone and with copies queued
    a = cupy.random.random((8192, 8192), dtype=cupy.float32)
    other = cupy.cuda.Stream(non_blocking=True)
    with other:
        a @ a; other.synchronize()
        started = time.perf_counter(); [a @ a for _ in range(5)]; other.synchronize()
        out["matmul_alone_ms"] = (time.perf_counter() - started) * 1e3
        started = time.perf_counter(); queue_big(); [a @ a for _ in range(5)]; other.synchronize()
        out["matmul_with_copies_ms"] = (time.perf_counter() - started) * 1e3
        stream.synchronize()
        out["matmul_and_copies_ms"] = (time.perf_counter() - started) * 1e3
    return out


if __name__ == "__main__":
    print(json.dumps(main(*(int(a) for a in sys.argv[1:])), indent=1))
