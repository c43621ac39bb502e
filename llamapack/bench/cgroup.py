"""A memory limit for a benchmark process: a cgroup whose ``memory.max`` (v2; ``memory.limit_in_bytes`` on
v1) the process joins before it execs, so page cache and anonymous memory both count, as on a machine with
that much RAM. Creating one needs root. The page cache is dropped before a limited run, so pages cached by
earlier runs (charged to another cgroup) cannot serve it for free."""
from __future__ import annotations

import os
import subprocess
from pathlib import Path

from ..errors import LlamapackError

ROOT = Path("/sys/fs/cgroup")


class CgroupError(LlamapackError):
    """No cgroup with a memory controller could be made here."""


class MemoryCage:
    """``with MemoryCage(limit_bytes) as cage: subprocess.Popen(..., preexec_fn=cage.join)``."""

    def __init__(self, limit_bytes: int, name: str = "llamapack-bench", root: Path = ROOT):
        self.limit_bytes, self.root = limit_bytes, Path(root)
        self.v2 = (self.root / "cgroup.controllers").exists()
        self.path = (self.root if self.v2 else self.root / "memory") / f"{name}-{os.getpid()}"

    def __enter__(self) -> "MemoryCage":
        try:
            if self.v2:
                if "memory" not in (self.root / "cgroup.controllers").read_text().split():
                    raise CgroupError(f"{self.root}: cgroup v2 without the memory controller")
                control = self.root / "cgroup.subtree_control"
                if "memory" not in control.read_text().split():
                    control.write_text("+memory")
            self.path.mkdir(exist_ok=True)
            if self.v2:
                (self.path / "memory.max").write_text(str(self.limit_bytes))
                if (self.path / "memory.swap.max").exists():
                    (self.path / "memory.swap.max").write_text("0")
            else:
                (self.path / "memory.limit_in_bytes").write_text(str(self.limit_bytes))
        except OSError as exc:
            raise CgroupError(f"cannot set up a memory cgroup at {self.path}: {exc}") from None
        return self

    def join(self) -> None:
        """Move the calling process into the cgroup (``preexec_fn``: the child, before exec)."""
        (self.path / "cgroup.procs").write_text(str(os.getpid()))

    def peak_bytes(self) -> int | None:
        for name in ("memory.peak", "memory.max_usage_in_bytes"):
            if (self.path / name).exists():
                return int((self.path / name).read_text().split()[0])
        return None

    def oom_kills(self) -> int:
        for name in ("memory.events", "memory.oom_control"):
            if (self.path / name).exists():
                for line in (self.path / name).read_text().splitlines():
                    key, _, value = line.partition(" ")
                    if key == "oom_kill":
                        return int(value)
        return 0

    def __exit__(self, *exc) -> None:
        try:
            self.path.rmdir()
        except OSError:
            pass  # a process still inside; the kernel removes nothing while it lives


def drop_page_cache() -> bool:
    """Write back and drop the page cache (root); False where the kernel does not let us."""
    subprocess.run(["sync"], check=False)
    try:
        Path("/proc/sys/vm/drop_caches").write_text("3")
        return True
    except OSError:
        return False
