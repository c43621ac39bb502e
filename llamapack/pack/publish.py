"""Where a pack build writes: the checks on the output, the writers' lock, temporary files, publication.

A build holds an exclusive ``flock`` on ``.<pack>.lock`` beside the output (the kernel drops it when the
writer dies; a second writer is refused while it is held). It writes the pack and its manifest as hidden
temporary files, ``.<pack>.tmp-<pid>`` and ``.<pack>.manifest.json.tmp-<pid>``, and publishes them by
renaming the pack, then the manifest. The pack header holds the manifest's sha256, so a reader that opens
the pair between the two renames sees that they differ and opens them again (pack_reader.PackReader).
Temporary files named for a process that is no longer alive were left by a killed writer: the next build of
the same output removes them.

The output is refused when it is a source file of the model (same inode), a device, pipe or other
non-regular file, or an existing regular file that is not a pack (its manifest path: not a manifest)
unless ``force``.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import re
import stat
from contextlib import contextmanager
from typing import Iterable, Iterator

from llamapack.errors import PackIOError

from .header import MAGIC
from .manifest import FORMAT, MANIFEST_SUFFIX


def temp_path(final: str, pid: int | None = None) -> str:
    """The hidden temporary name of ``final`` while process ``pid`` (default: this one) writes it."""
    folder, name = os.path.split(final)
    return os.path.join(folder, f".{name}.tmp-{os.getpid() if pid is None else pid}")


def lock_path(pack_path: str) -> str:
    folder, name = os.path.split(pack_path)
    return os.path.join(folder, f".{name}.lock")


def _is_pack(path: str) -> bool:
    with open(path, "rb") as f:
        return f.read(len(MAGIC)) == MAGIC


def _is_manifest(path: str) -> bool:
    try:
        with open(path, "rb") as f:
            obj = json.loads(f.read().decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError):
        return False
    return isinstance(obj, dict) and obj.get("format") == FORMAT


def check_output(pack_path: str, sources: Iterable[str], force: bool = False) -> None:
    """PackIOError unless writing ``pack_path`` and its manifest loses nothing (see the module doc)."""
    source_ids = {}
    for source in sources:
        st = os.stat(source)
        source_ids[st.st_dev, st.st_ino] = source
    for path, is_ours, what in ((pack_path, _is_pack, "an expert pack"),
                                (pack_path + MANIFEST_SUFFIX, _is_manifest, "a pack manifest")):
        try:
            st = os.stat(path)
        except FileNotFoundError:
            continue
        except OSError as exc:
            raise PackIOError(f"cannot check the output {path}: {exc.strerror}") from None
        if (st.st_dev, st.st_ino) in source_ids:
            raise PackIOError(f"refusing to write the pack over its source {source_ids[st.st_dev, st.st_ino]} "
                              f"({path} is that file); choose another output (-o)")
        if not stat.S_ISREG(st.st_mode):
            raise PackIOError(f"refusing to replace {path}: it exists and is not a regular file; choose another "
                              "output (-o)")
        try:
            ours = is_ours(path)
        except OSError as exc:
            raise PackIOError(f"cannot check the output {path}: {exc.strerror}") from None
        if not ours and not force:
            raise PackIOError(f"refusing to overwrite {path}: it exists and is not {what}; choose another "
                              "output (-o) or pass --force to replace it")


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, someone else's
        return True
    return True


def remove_stale_temps(pack_path: str) -> list[str]:
    """Remove the temporary files of ``pack_path`` (and of its manifest) left by writers no longer alive."""
    folder, name = os.path.split(pack_path)
    names = (re.escape(f".{name}"), re.escape(f".{name}{MANIFEST_SUFFIX}"), re.escape(f"{name}{MANIFEST_SUFFIX}"))
    pattern = re.compile(rf"^(?:{'|'.join(names)})\.tmp-(\d+)$")  # the last: older builds' manifest temp
    removed = []
    for entry in os.listdir(folder):
        match = pattern.match(entry)
        if match and int(match.group(1)) > 0 and not pid_alive(int(match.group(1))):
            path = os.path.join(folder, entry)
            try:
                os.unlink(path)
                removed.append(path)
            except FileNotFoundError:
                pass
    return removed


@contextmanager
def writer_lock(pack_path: str) -> Iterator[None]:
    """Hold the exclusive writers' lock of ``pack_path``; PackIOError when another process holds it.

    The lock file is removed on release; a writer that locked a file since removed locks the new one."""
    path = lock_path(pack_path)
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            holder = os.pread(fd, 32, 0).decode("ascii", "replace").strip()
            os.close(fd)
            if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
                raise PackIOError(f"another `llamapack pack` (pid {holder or '?'}) is writing {pack_path}; "
                                  "wait for it to finish") from None
            raise PackIOError(f"cannot lock {path}: {exc.strerror}") from None
        try:
            same = os.stat(path).st_ino == os.fstat(fd).st_ino
        except FileNotFoundError:
            same = False
        if same:
            break
        os.close(fd)  # the previous holder removed this file while we waited for it: lock the new one
    try:
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        yield
    finally:
        try:
            os.unlink(path)
        finally:
            os.close(fd)


def publish(pack_tmp: str, pack_path: str, manifest_tmp: str, manifest_path: str) -> None:
    """Rename the finished pack, then its manifest, into place, and make the renames durable."""
    os.replace(pack_tmp, pack_path)
    os.replace(manifest_tmp, manifest_path)
    dir_fd = os.open(os.path.dirname(pack_path) or ".", os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)
