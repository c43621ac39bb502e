"""Expert reads for the streaming provider: where an expert's bytes come from, and the threads that read them.

A source splits one expert read into pieces (byte ranges of the staging block) that any read thread can
fill through its own handle. ``PackSource``: a pack block is one contiguous, aligned file range, so it
splits into ``read_splits`` aligned sub-reads. ``GgufSource``: one piece, the whole expert, read by a
``GgufDirectReader`` (its roles lie apart in the GGUF and go through the reader's scratch buffer, so they
are not split). ``ReadPool`` runs pieces on a few threads, each with a handle no other read uses meanwhile.
"""
from __future__ import annotations

import queue
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable

import numpy as np

from ..pack import ALIGNMENT, DirectFile, GgufDirectReader, PackReader, aligned_buffer
from ..pack.layout import align_up
from ..pack.odirect import ReadFn


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
        self._open_args = dict(direct_io=direct_io, read_fn=read_fn)
        stride = self.layout.expert_stride
        chunk = align_up(-(-stride // splits))
        self.pieces = tuple((start, min(start + chunk, stride)) for start in range(0, stride, chunk))

    def open_handle(self) -> DirectFile:
        return DirectFile(self.reader.pack_path, **self._open_args)

    def read(self, handle: DirectFile, layer: int, expert: int, block: np.ndarray, start: int, end: int) -> None:
        offset = self.layout.block_offset(layer, expert) + start
        handle.read_into(block[start:end], offset, where=f"layer {layer} expert {expert}")

    def check(self, layer: int, expert: int, block: np.ndarray) -> None:
        """IntegrityError naming the layer and expert when the block fails its manifest sha256."""
        if self.verify_sha256:
            self.reader.check_block(layer, expert, block)

    def read_nbytes(self, layer: int, expert: int) -> int:
        return self.layout.expert_stride

    def close(self) -> None:
        self.reader.close()


class GgufSource:
    """GGUF-direct mode: each handle is a GgufDirectReader (one scratch buffer each) over the same model."""

    def __init__(self, reader: GgufDirectReader, *, direct_io: bool, read_fn: ReadFn | None):
        self.reader, self.layout = reader, reader.layout
        self.paths = tuple(reader.model.paths)
        self._open_args = dict(direct_io=direct_io, read_fn=read_fn)
        self.pieces = ((0, self.layout.expert_stride),)

    def open_handle(self) -> GgufDirectReader:
        return GgufDirectReader(self.reader.model, **self._open_args)

    def read(self, handle: GgufDirectReader, layer: int, expert: int, block: np.ndarray, start: int,
             end: int) -> None:
        handle.read_expert(layer, expert, block)

    def check(self, layer: int, expert: int, block: np.ndarray) -> None:
        """No hashes without a manifest."""

    def read_nbytes(self, layer: int, expert: int) -> int:
        """The aligned ranges O_DIRECT transfers for the expert's roles (payload plus alignment slack)."""
        return sum(read.length for read in self.reader.plan(layer, expert))

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
    """``n_threads`` threads; ``submit(fn, *args)`` runs ``fn(handle, *args)`` with a handle of its own."""

    def __init__(self, open_handle: Callable[[], object], n_threads: int):
        self._handles: queue.SimpleQueue = queue.SimpleQueue()
        self._opened: list = []
        self._executor: ThreadPoolExecutor | None = None
        try:
            for _ in range(n_threads):
                self._opened.append(open_handle())
                self._handles.put(self._opened[-1])
        except BaseException:
            self.close()
            raise
        self._executor = ThreadPoolExecutor(n_threads, thread_name_prefix="llamapack-read")

    def submit(self, fn: Callable, *args) -> Future:
        return self._executor.submit(self._with_handle, fn, *args)

    def _with_handle(self, fn: Callable, *args) -> None:
        handle = self._handles.get()  # never waits: no more tasks run at once than there are handles
        try:
            fn(handle, *args)
        finally:
            self._handles.put(handle)

    def close(self) -> None:
        """Wait for the reads in flight, stop the threads, close the handles; idempotent."""
        if self._executor is not None:
            self._executor.shutdown(wait=True, cancel_futures=True)
            self._executor = None
        while self._opened:
            self._opened.pop().close()
