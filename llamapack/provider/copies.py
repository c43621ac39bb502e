"""Staging buffers and the copies from them into pool slots, for a host pool and for a GPU pool.

Both copiers hold ``buffers`` (page-aligned, one expert block each: the staging buffers, or the host-RAM
tier's blocks when there is one; carved from a few large allocations) and offer the same four steps:
``wait_until_free(i)`` before a read refills buffer i, ``copy(i, segments)`` to copy a read block into
its slot (``segments``: (pool offset, block offset, nbytes) per role), ``synchronize()`` before the
provider returns to llama.cpp (every copy complete), ``close()``; and ``swap_buffers(i, j)``, which
exchanges two buffers' memory (a finished lookahead read becomes a RAM block without a copy).
"""
from __future__ import annotations

import ctypes
import logging

import numpy as np

from ..errors import NativeError
from .host_tier import chunked_blocks
from .slots import ALIGNMENT, aligned_empty

log = logging.getLogger(__name__)


class HostCopier:
    """Host pool (CPU compute): numpy copies, complete when ``copy`` returns."""

    h2d = False

    def __init__(self, pool_bytes: int, n_buffers: int, buffer_bytes: int):
        self.pool = aligned_empty(pool_bytes)
        self.pool[:] = 0  # kernels may read past row ends: tails stay zero
        _, self.buffers = chunked_blocks(lambda nbytes: (None, aligned_empty(nbytes)), n_buffers, buffer_bytes)
        self.pageable = False

    @property
    def pool_base(self) -> int:
        return self.pool.ctypes.data

    def wait_until_free(self, index: int) -> None:
        """Copies are synchronous: a buffer is free as soon as ``copy`` returned."""

    def replace_buffer(self, index: int) -> None:
        """A fresh staging buffer i: the old one may still be written by a read that was abandoned."""
        self.buffers[index] = aligned_empty(self.buffers[index].nbytes)

    def swap_buffers(self, i: int, j: int) -> None:
        """Exchange the memory of buffers i and j (a lookahead buffer's bytes become a RAM block, no copy)."""
        self.buffers[i], self.buffers[j] = self.buffers[j], self.buffers[i]

    def copy(self, index: int, segments) -> None:
        block = self.buffers[index]
        for pool_offset, block_offset, nbytes in segments:
            self.pool[pool_offset:pool_offset + nbytes] = block[block_offset:block_offset + nbytes]

    def synchronize(self) -> None:
        pass

    def native_copy_functions(self) -> tuple[None, None, int, None]:
        """For libllama's fast path: (no h2d function, no sync function, no stream, no d2d function): it copies
        with memcpy."""
        return None, None, 0, None

    def close(self) -> None:
        self.buffers = []


def import_cupy():
    try:
        import cupy
    except ImportError as exc:
        raise NativeError(f"a GPU slot pool needs CuPy (pip install cupy-cuda12x or cupy-cuda13x): {exc}") from None
    return cupy


def pinned_buffer(cupy, nbytes: int):
    """(owner, page-aligned numpy view of ``nbytes``) in pinned host memory, or a pageable numpy buffer and
    owner None when pinning fails (copies from it still work, without overlapping the reads)."""
    try:
        memory = cupy.cuda.alloc_pinned_memory(nbytes + ALIGNMENT)
    except (cupy.cuda.runtime.CUDARuntimeError, cupy.cuda.memory.OutOfMemoryError, MemoryError) as exc:
        log.warning("pinned host buffer of %d bytes failed (%s): using pageable memory", nbytes, exc)
        return None, aligned_empty(nbytes)
    view = np.frombuffer(memory, dtype=np.uint8, count=nbytes + ALIGNMENT)
    shift = (-view.ctypes.data) % ALIGNMENT
    return memory, view[shift:shift + nbytes]


class CudaCopier:
    """GPU pool: ``cudaMemcpyAsync`` from pinned staging buffers on the provider's own stream.

    After the copies out of buffer i the buffer's event (created on its first copy) is recorded on the
    stream; a read waits for that event before refilling buffer i. ``synchronize()`` waits for the stream:
    slots become visible to compute only after their copies are known complete.
    """

    h2d = True

    def __init__(self, device: int, pool_base: int, n_buffers: int, buffer_bytes: int):
        self._cupy = cupy = import_cupy()
        self.device, self.pool_base = device, pool_base
        with cupy.cuda.Device(device):
            self.stream = cupy.cuda.Stream(non_blocking=True)
        self.events: dict = {}  # buffer -> its event, created on the buffer's first copy
        self._owners, self.buffers = chunked_blocks(lambda nbytes: pinned_buffer(cupy, nbytes), n_buffers,
                                                    buffer_bytes)
        self._replaced: list = []  # owners of replacement memory (kept for the copier's lifetime)
        self.pageable = any(owner is None for owner in self._owners)

    def replace_buffer(self, index: int) -> None:
        """A fresh staging buffer i: the old one may still be written by a read that was abandoned (its pinned
        memory stays referenced by that read until it ends)."""
        owner, self.buffers[index] = pinned_buffer(self._cupy, self.buffers[index].nbytes)
        self._replaced.append(owner)
        self.pageable = self.pageable or owner is None

    def swap_buffers(self, i: int, j: int) -> None:
        """Exchange the memory of buffers i and j, with their events: a copy queued out of either memory
        stays tracked by the event of the index that memory now has."""
        self.buffers[i], self.buffers[j] = self.buffers[j], self.buffers[i]
        event_i, event_j = self.events.pop(i, None), self.events.pop(j, None)
        if event_i is not None:
            self.events[j] = event_i
        if event_j is not None:
            self.events[i] = event_j

    def wait_until_free(self, index: int) -> None:
        event = self.events.get(index)
        if event is None:
            return  # never copied from
        with self._cupy.cuda.Device(self.device):  # called from a read thread
            event.synchronize()

    def copy(self, index: int, segments) -> None:
        runtime = self._cupy.cuda.runtime
        source = self.buffers[index].ctypes.data
        with self._cupy.cuda.Device(self.device):
            for pool_offset, block_offset, nbytes in segments:
                runtime.memcpyAsync(self.pool_base + pool_offset, source + block_offset, nbytes,
                                    runtime.memcpyHostToDevice, self.stream.ptr)
            event = self.events.get(index)
            if event is None:
                event = self.events[index] = self._cupy.cuda.Event(disable_timing=True)
            event.record(self.stream)

    def synchronize(self) -> None:
        with self._cupy.cuda.Device(self.device):
            self.stream.synchronize()

    def native_copy_functions(self) -> tuple[int, int, int, int] | None:
        """For libllama's fast path: the addresses of the CUDA driver's cuMemcpyHtoDAsync_v2 and
        cuStreamSynchronize, this copier's stream and cuMemcpyDtoDAsync_v2 (it runs in the thread that calls llama_decode, whose
        current context is the device's primary one, as CuPy's); None when the driver library cannot be
        opened (the fast path then serves only all-hit steps)."""
        try:
            driver = ctypes.CDLL("libcuda.so.1")
            functions = (driver.cuMemcpyHtoDAsync_v2, driver.cuStreamSynchronize, driver.cuMemcpyDtoDAsync_v2)
        except (OSError, AttributeError) as exc:
            log.warning("the CUDA driver's copy functions are not available (%s): RAM-tier copies stay in Python",
                        exc)
            return None
        h2d, sync, d2d = (ctypes.cast(function, ctypes.c_void_p).value for function in functions)
        return h2d, sync, self.stream.ptr, d2d

    def close(self) -> None:
        """Wait for the copies, then give the pinned memory back to the driver."""
        self.synchronize()
        self.buffers, self._owners, self._replaced, self.events = [], [], [], {}
        self._cupy.get_default_pinned_memory_pool().free_all_blocks()
