"""Pack reads on libllama's native read pool (``llama_expert_read_*``, native/llama-expert-io.cpp).

The threads are C++ threads that never take Python's GIL: the provider queues a pread per piece and waits
for them in C with the GIL released. With Python read threads, the compute thread's provider callback
waited for the GIL while lookahead reads ran (~28 ms per token, bench/results/gpu_prefetch_README.md).

``NativeReads`` offers what the provider uses of ``reads.ThreadReads``: ``start`` a read's pieces,
``promote`` a lookahead piece to demand priority, ``wait_first``/``wait_all``, ``close``. Its pieces,
``NativeRead``, answer the ``concurrent.futures.Future`` methods the provider calls. Pack mode only: a
piece is one aligned byte range of the pack file (GGUF-direct reads go through a reader's scratch buffer).
Which engine the provider takes: StreamingSettings.native_reads.
"""
from __future__ import annotations

import os
from concurrent.futures import CancelledError

import numpy as np

from .. import native
from ..errors import NativeError, PackIOError
from ..pack import ALIGNMENT
from ..pack.odirect import check_direct_transfer, read_error, short_read_error

QUEUED, RUNNING, DONE, FAILED, CANCELLED = range(5)  # enum llama_expert_read_state


class NativeRead:
    """One queued pread into ``target`` (kept alive, with its memory, until the read has finished)."""

    __slots__ = ("_reads", "id", "_target", "_offset", "_nbytes", "_where", "_state", "_error", "_bytes")

    def __init__(self, reads: "NativeReads", read_id: int, target: np.ndarray, offset: int, nbytes: int, where: str):
        self._reads, self.id, self._target, self._offset, self._where = reads, read_id, target, offset, where
        self._nbytes = nbytes
        self._state, self._error, self._bytes = QUEUED, 0, 0

    def _refresh(self) -> int:
        if self._state < DONE:
            status = self._reads.status(self.id)
            # None: the pool was closed (queued reads cancelled, running ones waited for): nothing uses it now
            self._state, self._error, self._bytes = status or (CANCELLED, 0, 0)
            if self._state >= DONE:  # finished: the C record and the target can go
                self._reads.release(self.id)
                self._target = None
        return self._state

    def done(self) -> bool:
        return self._refresh() >= DONE

    def running(self) -> bool:
        return self._refresh() == RUNNING

    def cancel(self) -> bool:
        """True when the read is cancelled (it was still queued, or cancelled before)."""
        if self._state == CANCELLED or self._reads.cancel(self.id):
            self._refresh()
            return True
        return False

    def cancelled(self) -> bool:
        return self._refresh() == CANCELLED

    def exception(self) -> PackIOError | None:
        """The read's error, waiting for it to finish (as Future.exception); a short read is an error."""
        while not self.done():
            self._reads.wait_first([self], None)
        if self._state == CANCELLED:
            raise CancelledError()
        if self._state == FAILED:
            return read_error(self._reads.path, self._offset, self._where, os.strerror(self._error))
        if self._bytes < self._nbytes:
            return short_read_error(self._reads.path, self._offset, self._where, self._bytes, self._nbytes)
        return None

    def result(self) -> None:
        error = self.exception()
        if error is not None:
            raise error

    def __del__(self) -> None:
        if self._state < DONE:  # maybe still reading into target: its memory must outlive the read
            self._reads.release(self.id)  # C forgets it once finished (at once when still queued)
            self._reads.orphan(self.id, self._target)


class NativeReads:
    """A native read pool over one pack file descriptor (pread is safe to share between threads)."""

    def __init__(self, source, n_threads: int, max_prefetch: int):
        self.source, self.path = source, source.paths[0]
        self._lib, self._pool = native.lib(), None
        self._file = source.open_handle()
        self._align = ALIGNMENT if self._file.direct_io else 0
        self._orphans: list[tuple[int, object]] = []  # (id, target) of reads dropped before they finished
        self._status = native.ffi.new("struct llama_expert_read_status *")  # the compute thread's only
        self._pool = self._lib.llama_expert_read_pool_new(n_threads, max_prefetch)
        if self._pool == native.ffi.NULL:
            self._pool = None
            self._file.close()
            raise NativeError(f"could not start a native read pool of {n_threads} threads "
                              f"({max_prefetch} for prefetch reads)")

    def start(self, key: tuple[int, int], target: np.ndarray, spans, prefetch: bool = False) -> list[NativeRead]:
        """Queue the pieces ``spans`` ((start, end) in the block) of block ``key``'s read into ``target``."""
        layer, expert = key
        where = f"layer {layer} expert {expert}"
        base = self.source.layout.block_offset(layer, expert)
        address = target.ctypes.data  # once: numpy's ctypes attribute costs microseconds
        self._sweep_orphans()
        pieces = []
        for start, end in spans:
            offset, nbytes = base + start, end - start
            if self._align:
                check_direct_transfer(self.path, address + start, offset, nbytes, where)
            read_id = -1 if self._pool is None else self._lib.llama_expert_read_submit(
                self._pool, self._file.fd, native.ffi.cast("void *", address + start), offset, nbytes, self._align,
                prefetch)
            if read_id < 0:
                raise PackIOError(f"{self.path}: the read pool is closed ({where})")
            pieces.append(NativeRead(self, read_id, target, offset, nbytes, where))
        return pieces

    def promote(self, piece: NativeRead) -> bool:
        return self._pool is not None and bool(self._lib.llama_expert_read_promote(self._pool, piece.id))

    def cancel(self, read_id: int) -> bool:
        return self._pool is not None and bool(self._lib.llama_expert_read_cancel(self._pool, read_id))

    def status(self, read_id: int) -> tuple[int, int, int] | None:
        """(state, errno, bytes read), or None once the pool forgot the read (released and finished, or closed)."""
        out = self._status
        if self._pool is None or self._lib.llama_expert_read_get_status(self._pool, read_id, out) != 0:
            return None
        return out.state, out.error, out.bytes

    def release(self, read_id: int) -> None:
        if self._pool is not None:
            self._lib.llama_expert_read_release(self._pool, read_id)

    def orphan(self, read_id: int, target) -> None:
        self._orphans.append((read_id, target))

    def _sweep_orphans(self) -> None:
        """Drop the orphans' memory once their (released) reads are forgotten, i.e. finished."""
        if self._orphans:
            self._orphans = [(i, t) for i, t in self._orphans if self.status(i) is not None]

    def wait_first(self, pieces, timeout: float | None) -> bool:
        """Wait (GIL released) until one of ``pieces`` has finished; False after ``timeout`` seconds."""
        if not pieces or self._pool is None:
            return True
        ids = native.ffi.new("int64_t[]", [piece.id for piece in pieces])
        waited = -1.0 if timeout is None else float(timeout)
        return self._lib.llama_expert_read_wait_any(self._pool, ids, len(pieces), waited) > 0

    def wait_all(self, pieces) -> None:
        for piece in pieces:
            while not piece.done():
                self.wait_first([piece], None)

    def close(self) -> None:
        """Cancel the queued reads, wait for the running ones, stop the threads, close the file; idempotent."""
        if self._pool is not None:
            pool, self._pool = self._pool, None
            self._lib.llama_expert_read_pool_free(pool)
            self._orphans = []
            self._file.close()
