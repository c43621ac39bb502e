"""Expert reads for the streaming provider: where an expert's bytes come from, and the threads that read them.

A source splits one expert read into pieces (byte ranges of the staging block) that any read thread can
fill through its own handle. ``PackSource``: a pack block is one contiguous, aligned file range, so it
splits into ``read_splits`` aligned sub-reads (``prefetch_pieces``: smaller ones for lookahead reads).
``GgufSource``: one piece, the whole expert, read by a ``GgufDirectReader`` (its roles lie apart in the GGUF
and go through the reader's scratch buffer, so they are not split). ``ReadPool`` runs pieces on a few threads, each with its own handle, demand reads first.
``ThreadReads`` is the provider's view of a ReadPool over a source; pack mode uses the native pool instead
(native_reads.NativeReads, the same interface) unless reads go through an injected ``read_fn``.
"""
from __future__ import annotations

import threading
from collections import deque
from concurrent import futures
from concurrent.futures import Future
from typing import Callable

import numpy as np

from ..pack import ALIGNMENT, DirectFile, GgufDirectReader, PackReader, aligned_buffer
from ..pack.layout import align_up
from ..pack.odirect import ReadFn


# a lookahead read is split in pieces of at most this (pack mode): a demand read that arrives while lookahead
# reads run shares the disk with their pieces in flight only (prefetch_in_flight of them at most)
PREFETCH_PIECE_BYTES = 512 << 10


def split_range(length: int, chunk: int) -> tuple[tuple[int, int], ...]:
    """(start, end) pieces of ``chunk`` bytes (the last one shorter) covering ``[0, length)``."""
    return tuple((start, min(start + chunk, length)) for start in range(0, length, chunk))


def probe_direct_io(paths, direct_io: bool, read_fn: ReadFn | None) -> None:
    """Read the first page of each file the way experts will be read: a filesystem that refuses O_DIRECT
    (EINVAL on open or on the first read) fails here, at init, with DirectFile's explanation."""
    page = aligned_buffer(ALIGNMENT)
    for path in paths:
        with DirectFile(path, direct_io=direct_io, read_fn=read_fn) as f:
            f.read_into(page, 0, need=0, where="O_DIRECT probe")


class PackSource:
    """Pack mode: block (layer, expert) is ``expert_stride`` bytes at ``block_offset``; pieces are aligned."""

    def __init__(self, reader: PackReader, *, direct_io: bool, read_fn: ReadFn | None, splits: int,
                 verify_sha256: bool):
        self.reader, self.layout = reader, reader.layout
        self.paths = (reader.pack_path,)
        self.verify_sha256 = verify_sha256
        self._checked: set[tuple[int, int]] = set()  # blocks whose sha256 passed (set.add is atomic)
        self._open_args = dict(direct_io=direct_io, read_fn=read_fn)
        stride = self.layout.expert_stride
        chunk = align_up(-(-stride // splits))
        self.pieces = split_range(stride, chunk)
        self.prefetch_pieces = split_range(stride, min(chunk, PREFETCH_PIECE_BYTES))

    def open_handle(self) -> DirectFile:
        return DirectFile(self.reader.pack_path, **self._open_args)

    def read(self, handle: DirectFile, layer: int, expert: int, block: np.ndarray, start: int, end: int) -> None:
        offset = self.layout.block_offset(layer, expert) + start
        handle.read_into(block[start:end], offset, where=f"layer {layer} expert {expert}")

    def needs_check(self, layer: int, expert: int) -> bool:
        """Whether a read of this block is still to be checked: verifying, and not checked in this process yet."""
        return self.verify_sha256 and (layer, expert) not in self._checked

    def check(self, layer: int, expert: int, block: np.ndarray) -> None:
        """IntegrityError naming the layer and expert when the block fails its manifest sha256; a block that
        passed once is not hashed again (the first read of each block in the process is checked)."""
        if self.needs_check(layer, expert):
            self.reader.check_block(layer, expert, block[:self.layout.expert_stride])
            self._checked.add((layer, expert))

    def read_nbytes(self, layer: int, expert: int) -> int:
        return self.layout.expert_stride

    def piece_nbytes(self, layer: int, expert: int, start: int, end: int) -> int:
        return end - start

    def close(self) -> None:
        self.reader.close()


class GgufSource:
    """GGUF-direct mode: each handle is a GgufDirectReader (one scratch buffer each) over the same model."""

    def __init__(self, reader: GgufDirectReader, *, direct_io: bool, read_fn: ReadFn | None):
        self.reader, self.layout = reader, reader.layout
        self.paths = tuple(reader.model.paths)
        self._open_args = dict(direct_io=direct_io, read_fn=read_fn)
        self.pieces = self.prefetch_pieces = ((0, self.layout.expert_stride),)

    def open_handle(self) -> GgufDirectReader:
        return GgufDirectReader(self.reader.model, **self._open_args)

    def read(self, handle: GgufDirectReader, layer: int, expert: int, block: np.ndarray, start: int,
             end: int) -> None:
        handle.read_expert(layer, expert, block)

    def needs_check(self, layer: int, expert: int) -> bool:
        return False

    def check(self, layer: int, expert: int, block: np.ndarray) -> None:
        """No hashes without a manifest."""

    def read_nbytes(self, layer: int, expert: int) -> int:
        """The aligned ranges O_DIRECT transfers for the expert's roles (payload plus alignment slack)."""
        return sum(read.length for read in self.reader.plan(layer, expert))

    def piece_nbytes(self, layer: int, expert: int, start: int, end: int) -> int:
        return self.read_nbytes(layer, expert)  # one piece: the whole expert

    def close(self) -> None:
        self.reader.close()


def open_source(reader, *, direct_io: bool, read_fn: ReadFn | None, read_splits: int, verify_sha256: bool):
    """The source for an opened reader, after probing its files for O_DIRECT."""
    if isinstance(reader, PackReader):
        source = PackSource(reader, direct_io=direct_io, read_fn=read_fn, splits=read_splits,
                            verify_sha256=verify_sha256)
    elif isinstance(reader, GgufDirectReader):
        source = GgufSource(reader, direct_io=direct_io, read_fn=read_fn)
    else:
        raise TypeError(f"the streaming provider reads a PackReader or a GgufDirectReader, not {type(reader).__name__}")
    probe_direct_io(source.paths, direct_io, read_fn)
    return source


class ReadPool:
    """``n_threads`` threads, each with a handle of its own; ``submit(fn, *args)`` runs ``fn(handle, *args)``.

    Two queues: demand reads (``submit``) always start before queued prefetch reads (``submit_prefetch``). A
    prefetch read starts only while the disk has no demand read, queued or running (it uses idle time only,
    never bandwidth a demand read could use), and prefetch reads never hold more than ``max_prefetch``
    threads at once, so ``n_threads - max_prefetch`` threads are always there for demand reads. A demand read
    that arrives while prefetch reads run shares the disk only with those (keep their pieces small).
    ``promote(future)`` moves a queued prefetch read to the demand queue (it became needed now). A running
    read is never preempted; a queued one can be cancelled through its future.
    """

    def __init__(self, open_handle: Callable[[], object], n_threads: int, max_prefetch: int = 0):
        if not 0 <= max_prefetch < n_threads:
            raise ValueError(f"max_prefetch must be in [0, {n_threads}) (got {max_prefetch})")
        self._max_prefetch = max_prefetch
        self._cond = threading.Condition()
        self._demand: deque = deque()    # (future, fn, args)
        self._prefetch: deque = deque()
        self._running_prefetch = 0
        self._running_demand = 0
        self._closing = False
        self._handles: list = []
        self._threads: list[threading.Thread] = []
        try:
            for _ in range(n_threads):
                self._handles.append(open_handle())
        except BaseException:
            self.close()
            raise
        for i, handle in enumerate(self._handles):
            thread = threading.Thread(target=self._work, args=(handle,), name=f"llamapack-read-{i}", daemon=True)
            thread.start()
            self._threads.append(thread)

    def submit(self, fn: Callable, *args) -> Future:
        return self._enqueue(self._demand, fn, args)

    def submit_prefetch(self, fn: Callable, *args) -> Future:
        if self._max_prefetch == 0:
            raise RuntimeError("this read pool has no prefetch threads")
        return self._enqueue(self._prefetch, fn, args)

    def promote(self, future: Future) -> bool:
        """Move ``future``'s read from the prefetch queue to the end of the demand queue; False when it is not
        queued as a prefetch (already running, done, or a demand read)."""
        with self._cond:
            for job in self._prefetch:
                if job[0] is future:
                    self._prefetch.remove(job)
                    self._demand.append(job)
                    self._cond.notify()
                    return True
        return False

    def _enqueue(self, queue_: deque, fn: Callable, args: tuple) -> Future:
        future: Future = Future()
        with self._cond:
            if self._closing:
                raise RuntimeError("the read pool is closed")
            queue_.append((future, fn, args))
            self._cond.notify()
        return future

    def _next_job(self) -> tuple | None:
        """(job, is_prefetch) by priority, waiting for one; None when the pool closes."""
        with self._cond:
            while True:
                if self._closing:
                    return None
                if self._demand:
                    self._running_demand += 1
                    return self._demand.popleft(), False
                if self._prefetch and self._running_prefetch < self._max_prefetch and not self._running_demand:
                    self._running_prefetch += 1
                    return self._prefetch.popleft(), True
                self._cond.wait()

    def _work(self, handle) -> None:
        while (picked := self._next_job()) is not None:
            (future, fn, args), is_prefetch = picked
            try:
                if future.set_running_or_notify_cancel():
                    try:
                        fn(handle, *args)
                    except BaseException as exc:  # noqa: BLE001 - handed to whoever waits on the future
                        future.set_exception(exc)
                    else:
                        future.set_result(None)
            finally:
                with self._cond:
                    if is_prefetch:
                        self._running_prefetch -= 1
                    else:
                        self._running_demand -= 1
                    if self._prefetch:
                        self._cond.notify_all()  # a prefetch read may start now

    def close(self) -> None:
        """Cancel the queued reads, wait for the running ones, stop the threads, close the handles; idempotent."""
        with self._cond:
            self._closing = True
            for queue_ in (self._demand, self._prefetch):
                while queue_:
                    queue_.popleft()[0].cancel()
            self._cond.notify_all()
        for thread in self._threads:
            thread.join()
        self._threads = []
        while self._handles:
            self._handles.pop().close()


class BlockCheck:
    """One block's read in pieces on read threads; the thread that reads the last piece checks the block."""

    def __init__(self, source, key: tuple[int, int], target: np.ndarray, n_pieces: int):
        self.source, self.key, self.target = source, key, target
        self._left, self._lock = n_pieces, threading.Lock()

    def read(self, handle, start: int, end: int) -> None:
        self.source.read(handle, *self.key, self.target, start, end)
        with self._lock:
            self._left -= 1
            last = self._left == 0
        if last:
            self.source.check(*self.key, self.target)


class ThreadReads:
    """A source's reads on a ReadPool of Python threads: ``start`` queues a read's pieces (futures)."""

    def __init__(self, source, n_threads: int, max_prefetch: int):
        self.source = source
        self._pool = ReadPool(source.open_handle, n_threads, max_prefetch)

    def start(self, key: tuple[int, int], target: np.ndarray, spans, prefetch: bool = False) -> list[Future]:
        """Queue the pieces ``spans`` ((start, end) in the block) of block ``key``'s read into ``target``. A
        block still to be checked is hashed by the read thread that reads its last piece (hashlib releases the
        GIL: the compute thread does not wait on it), whose future then carries a failed check."""
        submit = self._pool.submit_prefetch if prefetch else self._pool.submit
        if not self.source.needs_check(*key):
            return [submit(self.source.read, *key, target, start, end) for start, end in spans]
        check = BlockCheck(self.source, key, target, len(spans))
        return [submit(check.read, start, end) for start, end in spans]

    def promote(self, piece: Future) -> bool:
        return self._pool.promote(piece)

    def wait_first(self, pieces, timeout: float | None) -> bool:
        """Wait until one of ``pieces`` has finished; False after ``timeout`` seconds."""
        done, _ = futures.wait(pieces, timeout=timeout, return_when=futures.FIRST_COMPLETED)
        return bool(done) or not pieces

    def wait_all(self, pieces) -> None:
        futures.wait(pieces)

    def close(self) -> None:
        self._pool.close()
