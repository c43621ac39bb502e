"""The disk's bandwidth for the provider's access pattern: O_DIRECT reads of one expert block at random
block offsets, ``threads`` at once, for ``seconds``. The benchmark's I/O bound is this bandwidth divided
by the expert bytes a token misses."""
from __future__ import annotations

import random
import threading
import time
from dataclasses import dataclass

from ..pack import DirectFile, aligned_buffer


@dataclass(frozen=True)
class DiskBandwidth:
    path: str
    block_bytes: int
    threads: int
    reads: int
    nbytes: int
    seconds: float

    @property
    def bytes_per_s(self) -> float:
        return self.nbytes / self.seconds if self.seconds > 0 else 0.0

    def as_dict(self) -> dict:
        return dict(path=self.path, block_bytes=self.block_bytes, threads=self.threads, reads=self.reads,
                    nbytes=self.nbytes, seconds=self.seconds, gb_per_s=self.bytes_per_s / 1e9)


def random_read_bandwidth(path: str, block_bytes: int, first_offset: int, n_blocks: int, *, threads: int = 4,
                          seconds: float = 3.0, direct_io: bool = True, seed: int = 0) -> DiskBandwidth:
    """Read blocks ``first_offset + k * block_bytes`` (k random in [0, n_blocks)) for about ``seconds``."""
    if n_blocks < 1 or block_bytes < 1:
        raise ValueError("need at least one block of at least one byte")
    counts = [0] * threads
    deadline = time.perf_counter() + seconds
    errors: list[BaseException] = []

    def reader(index: int) -> None:
        rng = random.Random(seed + index)
        buffer = aligned_buffer(block_bytes)
        try:
            with DirectFile(path, direct_io=direct_io) as f:
                while time.perf_counter() < deadline:
                    f.read_into(buffer, first_offset + rng.randrange(n_blocks) * block_bytes, where="bandwidth probe")
                    counts[index] += 1
        except BaseException as exc:  # noqa: BLE001 - re-raised in the caller's thread
            errors.append(exc)

    started = time.perf_counter()
    workers = [threading.Thread(target=reader, args=(i,)) for i in range(threads)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()
    elapsed = time.perf_counter() - started
    if errors:
        raise errors[0]
    reads = sum(counts)
    return DiskBandwidth(str(path), block_bytes, threads, reads, reads * block_bytes, elapsed)
