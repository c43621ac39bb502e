"""O_DIRECT file I/O: page-aligned buffers, aligned preads/pwrites, clear errors.

``DirectFile`` wraps one file descriptor. Reads go through an injectable ``read_fn(fd, view, offset)``
(default ``os.preadv``) so tests can inject EIO or short reads. ``direct_io=False`` gives plain
buffered I/O with the same interface (for filesystems without O_DIRECT).
"""

from __future__ import annotations

import errno
import mmap
import os
from typing import Callable

import numpy as np

from llamapack.errors import CapacityError, PackIOError

from .layout import ALIGNMENT, align_up

ReadFn = Callable[[int, memoryview, int], int]  # (fd, writable view, file offset) -> bytes read


def _preadv(fd: int, view: memoryview, offset: int) -> int:
    return os.preadv(fd, [view], offset)


def aligned_buffer(nbytes: int) -> np.ndarray:
    """Zeroed uint8 array of ``nbytes`` whose start is page aligned (anonymous mmap)."""
    backing = mmap.mmap(-1, max(align_up(nbytes, mmap.PAGESIZE), mmap.PAGESIZE))
    return np.frombuffer(backing, dtype=np.uint8, count=nbytes)


def is_aligned(buf: np.ndarray, alignment: int = ALIGNMENT) -> bool:
    return buf.ctypes.data % alignment == 0


def _refusal(path: str, when: str) -> PackIOError:
    return PackIOError(
        f"{path}: the filesystem refuses O_DIRECT ({when} failed with EINVAL; e.g. tmpfs/procfs); "
        "move the file to a filesystem that supports O_DIRECT or use direct_io=False (--no-direct-io)"
    )


def check_direct_transfer(path: str, address: int, offset: int, nbytes: int, where: str = "") -> None:
    """PackIOError unless an O_DIRECT transfer of ``nbytes`` at ``offset`` into/from ``address`` is aligned."""
    if address % ALIGNMENT or offset % ALIGNMENT or nbytes % ALIGNMENT:
        context = f" ({where})" if where else ""
        raise PackIOError(f"{path}: O_DIRECT transfer of {nbytes} bytes at offset {offset} with buffer "
                          f"0x{address:x} is not {ALIGNMENT}-aligned{context}")


def read_error(path: str, offset: int, where: str, reason: str) -> PackIOError:
    context = f" ({where})" if where else ""
    return PackIOError(f"read error on {path} at offset {offset}{context}: {reason}")


def short_read_error(path: str, offset: int, where: str, got: int, need: int) -> PackIOError:
    context = f" ({where})" if where else ""
    return PackIOError(f"short read from {path} at offset {offset}{context}: got {got} of {need} bytes")


class DirectFile:
    """One file opened for (optionally O_DIRECT) positional reads or writes."""

    def __init__(self, path: str | os.PathLike, *, direct_io: bool = True, write: bool = False,
                 read_fn: ReadFn | None = None):
        self.path = os.fspath(path)
        self.direct_io = direct_io
        self.read_fn = read_fn or _preadv
        flags = (os.O_WRONLY | os.O_CREAT | os.O_TRUNC) if write else os.O_RDONLY
        if direct_io:
            flags |= os.O_DIRECT
        try:
            self.fd = os.open(self.path, flags | os.O_CLOEXEC, 0o644)
        except OSError as exc:
            if direct_io and exc.errno == errno.EINVAL:
                raise _refusal(self.path, "open") from None
            raise PackIOError(f"cannot open {self.path}: {exc.strerror}") from None
        self._io_done = False

    def check_direct_args(self, buf: np.ndarray, offset: int, nbytes: int) -> None:
        if self.direct_io:
            check_direct_transfer(self.path, buf.ctypes.data, offset, nbytes)

    def read_into(self, buf: np.ndarray, offset: int, *, need: int | None = None, where: str = "") -> int:
        """Fill ``buf`` from ``offset``; fewer than ``need`` bytes (default all) is a PackIOError.

        ``where`` (e.g. "layer 3 expert 7") is added to error messages.
        """
        self.check_direct_args(buf, offset, buf.nbytes)
        need = buf.nbytes if need is None else need
        view, got = memoryview(buf).cast("B"), 0
        while got < buf.nbytes:
            try:
                n = self.read_fn(self.fd, view[got:], offset + got)
            except OSError as exc:
                if self.direct_io and exc.errno == errno.EINVAL and not self._io_done:
                    raise _refusal(self.path, "first read") from None
                raise read_error(self.path, offset + got, where, exc.strerror or str(exc)) from None
            self._io_done = True
            if n <= 0 or (self.direct_io and (got + n) % ALIGNMENT):
                got += max(n, 0)
                break
            got += n
        if got < need:
            raise short_read_error(self.path, offset, where, got, need)
        return got

    def write_from(self, buf: np.ndarray, offset: int) -> None:
        """Write all of ``buf`` at ``offset``; ENOSPC is a CapacityError."""
        self.check_direct_args(buf, offset, buf.nbytes)
        view, done = memoryview(buf).cast("B"), 0
        while done < buf.nbytes:
            try:
                n = os.pwritev(self.fd, [view[done:]], offset + done)
            except OSError as exc:
                if exc.errno == errno.ENOSPC:
                    raise CapacityError(f"disk full while writing {self.path} at offset {offset + done}") from None
                if self.direct_io and exc.errno == errno.EINVAL and not self._io_done:
                    raise _refusal(self.path, "first write") from None
                raise PackIOError(f"write error on {self.path} at offset {offset + done}: {exc.strerror}") from None
            if n <= 0:
                raise PackIOError(f"short write to {self.path} at offset {offset + done}")
            self._io_done = True
            done += n

    def size(self) -> int:
        return os.fstat(self.fd).st_size

    def sync(self) -> None:
        os.fsync(self.fd)

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def __del__(self) -> None:
        if getattr(self, "fd", -1) >= 0:
            self.close()

    def __enter__(self) -> "DirectFile":
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()
