"""The machine's figures for ``llamapack plan`` (I/O): free VRAM and RAM, the disk's O_DIRECT random-read rate at
the expert block size and the provider's queue depth, pinned host-to-device copies, the CPU's read and matmul
rates.

Free memory is read on every plan (it changes). The rates are measured once per machine and kept in
``$XDG_CACHE_HOME/llamapack/probe/<host>.json`` (default ``~/.cache``): the disk's per (device, block size), the
others per machine; ``reprobe=True`` measures them again.
"""
from __future__ import annotations

import json
import os
import socket
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np

from ..bench.diskbw import random_read_bandwidth
from ..cache_dir import user_cache_dir
from ..errors import PackIOError
from ..provider.host_tier import spare_ram_bytes
from ..provider.settings import StreamingSettings
from .model import Machine

CACHE_VERSION = 1
DISK_PROBE_S = 2.0
DISK_THREADS = StreamingSettings().stage_slots  # reads in flight in the provider
H2D_BYTES = 256 << 20
CPU_READ_BYTES = 64 << 20
CPU_MATMUL_N = 512


def probe_file(cache_dir: Path | None = None) -> Path:
    return (cache_dir or user_cache_dir() / "probe") / f"{socket.gethostname() or 'localhost'}.json"


@dataclass(frozen=True)
class DiskTarget:
    """Where the experts are read from: ``path``, blocks of ``block_bytes`` from ``first_offset``."""

    path: str
    block_bytes: int
    first_offset: int
    n_blocks: int

    @property
    def key(self) -> str:
        return f"{os.stat(self.path).st_dev}:{self.block_bytes}"


def load_cache(path: Path) -> dict:
    try:
        data = json.loads(path.read_text())
        return data if data.get("version") == CACHE_VERSION else {}
    except (OSError, ValueError, AttributeError):
        return {}


def save_cache(path: Path, data: dict) -> None:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".tmp-{os.getpid()}")
        tmp.write_text(json.dumps({**data, "version": CACHE_VERSION}, indent=1))
        os.replace(tmp, path)
    except OSError:
        pass  # no cache: the next plan measures again


def import_cupy_device():
    """CuPy when it imports and sees a GPU, else None."""
    try:
        import cupy

        return cupy if cupy.cuda.runtime.getDeviceCount() > 0 else None
    except Exception:  # noqa: BLE001 - no CuPy, no driver, no device: a host pool
        return None


def free_vram_bytes(cupy) -> int | None:
    return None if cupy is None else int(cupy.cuda.runtime.memGetInfo()[0])


def disk_rate(target: DiskTarget) -> dict:
    """O_DIRECT random reads of one block at a time, DISK_THREADS at once; PackIOError where the filesystem
    has no O_DIRECT (the provider needs it)."""
    try:
        result = random_read_bandwidth(target.path, target.block_bytes, target.first_offset, target.n_blocks,
                                       threads=DISK_THREADS, seconds=DISK_PROBE_S)
    except PackIOError as exc:
        if "O_DIRECT" in str(exc):
            raise PackIOError(f"cannot run from {target.path}: {exc}") from None
        raise
    if result.bytes_per_s <= 0:
        raise PackIOError(f"{target.path}: the disk probe read nothing in {DISK_PROBE_S} s")
    return {"bytes_per_s": result.bytes_per_s, "block_bytes": target.block_bytes, "threads": DISK_THREADS,
            "path": target.path, "when": time.time()}


def h2d_rate(cupy) -> float:
    """Pinned host to device copies of H2D_BYTES, best of three."""
    host = cupy.cuda.alloc_pinned_memory(H2D_BYTES)
    source = np.frombuffer(host, dtype=np.uint8, count=H2D_BYTES)
    device = cupy.empty(H2D_BYTES, dtype=cupy.uint8)
    best = float("inf")
    for _ in range(3):
        start = time.perf_counter()
        device.set(source)
        cupy.cuda.runtime.deviceSynchronize()
        best = min(best, time.perf_counter() - start)
    return H2D_BYTES / best


def cpu_rates() -> dict:
    """float32 matrix-vector (memory read rate) and matmul (FLOP rate) with numpy, best of three."""
    rows = CPU_READ_BYTES // 4 // 4096
    matrix, vector = np.ones((rows, 4096), dtype=np.float32), np.ones(4096, dtype=np.float32)
    a = np.ones((CPU_MATMUL_N, CPU_MATMUL_N), dtype=np.float32)
    read = flops = float("inf")
    for _ in range(3):
        start = time.perf_counter()
        matrix @ vector
        read = min(read, time.perf_counter() - start)
        start = time.perf_counter()
        a @ a
        flops = min(flops, time.perf_counter() - start)
    return {"read_bytes_per_s": matrix.nbytes / read, "flops": 2 * CPU_MATMUL_N ** 3 / flops}


@dataclass(frozen=True)
class ProbeReport:
    """The machine's figures and where the rates came from (``measured``: names measured now, else cached)."""

    machine: Machine
    cache_path: str
    measured: tuple[str, ...]
    disk: dict
    total_ram_bytes: int


def meminfo_total(path: str = "/proc/meminfo") -> int:
    with open(path) as lines:
        return next(int(line.split()[1]) << 10 for line in lines if line.startswith("MemTotal:"))


def probe(target: DiskTarget, *, reprobe: bool = False, cache_dir: Path | None = None, use_gpu: bool = True,
          step: Callable[[str], None] = lambda name: None) -> ProbeReport:
    """The machine's figures; rates from the cache unless missing or ``reprobe`` (``step(name)`` is called
    before each measurement, for a progress bar). ``use_gpu=False``: plan a host pool even with a GPU."""
    path = probe_file(cache_dir)
    data = {} if reprobe else load_cache(path)
    cupy = import_cupy_device() if use_gpu else None
    measured = []
    disks = data.setdefault("disks", {})
    if target.key not in disks:
        step("disk")
        disks[target.key] = disk_rate(target)
        measured.append("disk")
    if "cpu" not in data:
        step("cpu")
        data["cpu"] = cpu_rates()
        measured.append("cpu")
    if cupy is not None and not data.get("h2d_bytes_per_s"):
        step("h2d")
        data["h2d_bytes_per_s"] = h2d_rate(cupy)
        measured.append("h2d")
    if measured:
        save_cache(path, data)
    disk = disks[target.key]
    machine = Machine(free_vram_bytes=free_vram_bytes(cupy), spare_ram_bytes=spare_ram_bytes(),
                      disk_bytes_per_s=float(disk["bytes_per_s"]),
                      h2d_bytes_per_s=data.get("h2d_bytes_per_s") if cupy is not None else None,
                      cpu_read_bytes_per_s=float(data["cpu"]["read_bytes_per_s"]), cpu_flops=float(data["cpu"]["flops"]))
    return ProbeReport(machine, str(path), tuple(measured), disk, meminfo_total())


def disk_target(model_path: str, pack: str | None) -> DiskTarget:
    """The file the provider will read experts from: the pack (checked against the model) or the GGUF's expert
    tensors (GGUF-direct), as blocks of the pack's stride."""
    from ..pack import PackReader, open_gguf
    from ..pack.layout import ALIGNMENT, align_down

    model = open_gguf(model_path)
    layout = model.layout
    if pack is not None:
        reader = PackReader(pack, model=model, direct_io=False)
        try:
            return DiskTarget(reader.pack_path, layout.expert_stride, reader.layout.data_start, reader.layout.num_blocks)
        finally:
            reader.close()
    path = model.expert_tensors[0].path
    tensors = [t for t in model.expert_tensors if t.path == path]
    first = align_down(min(t.data_offset for t in tensors), ALIGNMENT)
    end = max(t.data_offset + t.nbytes for t in tensors)
    return DiskTarget(path, layout.expert_stride, first, max((end - first) // layout.expert_stride, 1))
