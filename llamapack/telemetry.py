"""Provider telemetry: counters a provider accumulates, frozen snapshots of them, and a JSON stats file.

``CounterAccumulator`` is what the provider increments (thread-safe: one lock); ``snapshot()`` returns a
frozen ``ProviderCounters`` with the derived numbers (hit rate, bytes per token) and ``to_json()``.
``StatsFlusher`` rewrites a stats file atomically (temporary file in the same folder, then rename) every N
acquires, so a reader sees either the previous complete file or the new complete one, never a torn one.

Conventions: cache hits and misses count distinct (layer, expert) keys per acquire; ``tokens`` counts each
token once (the provider adds a ubatch's tokens once, not once per MoE layer); the ``*_wait_s`` fields are
seconds the provider spent waiting on pack reads and on host-to-device copies; ``provide_s`` is all of its
time inside ``acquire``. The ``ram_*`` fields count the host-RAM tier's lookups (one per slot-pool miss);
``pack_read_bytes`` counts only what was read from the SSD (lookahead reads included: a used one when it is
used, a wasted one when its buffer is reclaimed); a RAM tier preload's reads are ``ram_preload_bytes``.
"""
from __future__ import annotations

import json
import os
import tempfile
import threading
import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Callable, Iterator


@dataclass(frozen=True)
class ProviderCounters:
    """One consistent snapshot of a provider's counters."""

    acquires: int = 0
    tokens: int = 0
    cache_hits: int = 0
    cache_misses: int = 0
    cache_evictions: int = 0
    pack_read_bytes: int = 0
    h2d_bytes: int = 0
    fallback_count: int = 0  # requests served by a fallback path instead of the fast one
    io_errors: int = 0
    read_wait_s: float = 0.0
    copy_wait_s: float = 0.0
    provide_s: float = 0.0  # seconds inside acquire (policy, reads, copies): decode time minus this is compute
    lookahead_s: float = 0.0  # seconds inside the lookahead callback (starting reads; not in provide_s)
    ram_hits: int = 0       # host-RAM tier: slot-pool misses served from a RAM block (no SSD read)
    ram_misses: int = 0     # slot-pool misses read from the SSD into a RAM block (ram_hits + ram_misses ==
    ram_evictions: int = 0  # cache_misses while the tier is on); RAM blocks taken from another expert
    ram_preloaded: int = 0  # RAM blocks filled by the start-up preload (ram_preload) ...
    ram_preload_bytes: int = 0  # ... and the SSD bytes it read (not in pack_read_bytes: no token asked)
    pool_preloaded: int = 0     # slots filled at start-up, before any token (pool_preload, warm start)
    lookahead_keys: int = 0     # router lookahead: experts a layer asked for that had a prediction ...
    lookahead_hits: int = 0     # ... and how many of them were predicted (accuracy = hits / keys)
    prefetch_reads: int = 0     # lookahead reads started (predicted, in neither the pool nor the RAM tier)
    prefetch_used: int = 0      # slot-pool misses served by a lookahead read (no read on the critical path)
    prefetch_wasted: int = 0    # lookahead reads the layer did not ask for, (partly) read ...
    prefetch_wasted_bytes: int = 0  # ... and their bytes (also in pack_read_bytes)
    prefetch_cancelled: int = 0  # lookahead reads the layer did not ask for, cancelled before any piece ran
    native_steps: int = 0  # acquires served inside libllama (native hot path: no Python), counted in acquires too
    cpu_experts: int = 0   # hybrid: slot-pool misses computed on the CPU from their RAM block (in ram_hits too)
    cpu_s: float = 0.0     # hybrid: seconds computing them (the copies of the step's other misses overlap it)
    ahead_loads: int = 0   # load-ahead: misses copied in while the layer before computed (in cache_misses too) ...
    ahead_unused: int = 0  # ... and the experts loaded ahead that their step did not ask for
    ahead_early: int = 0   # ... and those whose copies started while the GPU computed the layer before (the
    ahead_early_s: float = 0.0  # scheduler's copy callback), and the seconds issuing them (in copy_wait_s)
    window_skipped: int = 0  # layer windows: experts planned into a window, never copied (their step did not use them)
    window_from_pool: int = 0  # layer windows: experts copied into a window from their pool slot (GPU: device to
    d2d_bytes: int = 0         # device), not from RAM, and those bytes (not in h2d_bytes)

    @property
    def lookups(self) -> int:
        return self.cache_hits + self.cache_misses

    @property
    def hit_rate(self) -> float | None:
        """Hits / (hits + misses); None before the first lookup."""
        return self.cache_hits / self.lookups if self.lookups else None

    @property
    def lookahead_accuracy(self) -> float | None:
        """Of the experts asked for where a prediction was made, the fraction that was predicted."""
        return self.lookahead_hits / self.lookahead_keys if self.lookahead_keys else None

    @property
    def read_bytes_per_token(self) -> float | None:
        return self.pack_read_bytes / self.tokens if self.tokens else None

    @property
    def h2d_bytes_per_token(self) -> float | None:
        return self.h2d_bytes / self.tokens if self.tokens else None

    def minus(self, earlier: ProviderCounters) -> ProviderCounters:
        """The counts between ``earlier`` and this snapshot (for a window's rates)."""
        return ProviderCounters(**{f.name: getattr(self, f.name) - getattr(earlier, f.name) for f in fields(self)})

    def as_dict(self) -> dict:
        return {**asdict(self), "hit_rate": self.hit_rate, "read_bytes_per_token": self.read_bytes_per_token,
                "h2d_bytes_per_token": self.h2d_bytes_per_token,
                "lookahead_accuracy": self.lookahead_accuracy}

    def to_json(self) -> str:
        return json.dumps(self.as_dict(), sort_keys=True)


COUNTER_NAMES = tuple(f.name for f in fields(ProviderCounters))
WAIT_COUNTERS = frozenset(("read_wait_s", "copy_wait_s", "provide_s", "lookahead_s"))


class CounterAccumulator:
    """The mutable side: thread-safe increments, frozen snapshots.

    ``external``: counts kept elsewhere (libllama's native hot path), as a callable returning {counter: total};
    each snapshot adds them (less what they were at the last ``reset``)."""

    def __init__(self, external: Callable[[], dict] | None = None):
        self._lock = threading.Lock()
        self._values = asdict(ProviderCounters())
        self.external = external
        self._external_base: dict = {}

    def add(self, **deltas: float) -> None:
        """Add to counters by name, e.g. ``add(pack_read_bytes=n, read_wait_s=t)``; deltas must be >= 0."""
        for name, delta in deltas.items():
            if name not in self._values:
                raise TypeError(f"no provider counter named {name!r} (known: {', '.join(COUNTER_NAMES)})")
            if delta < 0:
                raise ValueError(f"counter {name} can only grow (got {delta})")
        with self._lock:
            for name, delta in deltas.items():
                self._values[name] += delta

    def record_acquire(self, hits: int, misses: int, evictions: int, tokens: int = 0) -> None:
        if min(hits, misses, evictions, tokens) < 0:
            raise ValueError(f"acquire counts can only grow (got {hits}, {misses}, {evictions}, {tokens})")
        with self._lock:  # once per MoE layer per token: no keyword loop
            values = self._values
            values["acquires"] += 1
            values["cache_hits"] += hits
            values["cache_misses"] += misses
            values["cache_evictions"] += evictions
            values["tokens"] += tokens

    def record_read(self, nbytes: int, wait_s: float = 0.0) -> None:
        self.add(pack_read_bytes=nbytes, read_wait_s=wait_s)

    def record_copy(self, nbytes: int, wait_s: float = 0.0) -> None:
        self.add(h2d_bytes=nbytes, copy_wait_s=wait_s)

    def record_ram(self, hits: int, misses: int, evictions: int) -> None:
        if min(hits, misses, evictions) < 0:
            raise ValueError(f"RAM tier counts can only grow (got {hits}, {misses}, {evictions})")
        with self._lock:
            values = self._values
            values["ram_hits"] += hits
            values["ram_misses"] += misses
            values["ram_evictions"] += evictions

    def add_seconds(self, wait_counter: str, seconds: float) -> None:
        """What ``timing`` adds, for a hot path that reads the clock itself (no context manager)."""
        if wait_counter not in WAIT_COUNTERS:
            raise TypeError(f"not a wait counter: {wait_counter!r}")
        with self._lock:
            self._values[wait_counter] += seconds

    def record_fallback(self) -> None:
        self.add(fallback_count=1)

    def record_io_error(self) -> None:
        self.add(io_errors=1)

    @contextmanager
    def timing(self, wait_counter: str) -> Iterator[None]:
        """Add the seconds the ``with`` body takes to ``wait_counter`` (``read_wait_s``, ``copy_wait_s`` or
        ``provide_s``)."""
        if wait_counter not in WAIT_COUNTERS:
            raise TypeError(f"not a wait counter: {wait_counter!r}")
        started = time.perf_counter()
        try:
            yield
        finally:
            self.add_seconds(wait_counter, time.perf_counter() - started)

    def snapshot(self) -> ProviderCounters:
        external = self.external() if self.external is not None else {}
        with self._lock:
            values = dict(self._values)
            for name, total in external.items():
                values[name] += total - self._external_base.get(name, 0)
            return ProviderCounters(**values)

    def reset(self) -> ProviderCounters:
        """Zero every counter; returns the snapshot taken just before."""
        external = self.external() if self.external is not None else {}
        final = self.snapshot()
        with self._lock:
            self._values = asdict(ProviderCounters())
            self._external_base = external
        return final


def write_text_atomically(path: Path, text: str) -> None:
    """Write ``text`` to a temporary file next to ``path``, then rename it over ``path``."""
    handle = tempfile.NamedTemporaryFile("w", dir=path.parent, prefix=f".{path.name}.", suffix=".tmp",
                                         delete=False, encoding="utf-8")
    try:
        with handle:
            handle.write(text)
        os.replace(handle.name, path)
    except BaseException:
        Path(handle.name).unlink(missing_ok=True)
        raise


class StatsFlusher:
    """Writes ``counters`` as JSON to ``path`` every ``every_acquires`` acquires; does nothing without a path.

    The provider calls ``maybe_flush()`` after each acquire and ``flush()`` when it closes. Write errors
    (disk full, folder gone) propagate to the caller.
    """

    def __init__(self, counters: CounterAccumulator, path: str | os.PathLike | None, every_acquires: int = 256):
        if every_acquires < 1:
            raise ValueError(f"every_acquires must be >= 1 (got {every_acquires})")
        self.counters = counters
        self.path = Path(path) if path is not None else None
        self.every_acquires = every_acquires
        self.writes = 0
        self._lock = threading.Lock()
        self._calls = 0  # maybe_flush calls since the last write (one per acquire; a snapshot costs more)

    def maybe_flush(self, acquires: int = 1) -> bool:
        """Count ``acquires`` more acquires (one per call from the provider; libllama's native steps in bulk) and
        write if ``every_acquires`` have passed since the last write; True if it wrote."""
        if self.path is None:
            return False
        with self._lock:
            self._calls += acquires
            if self._calls < self.every_acquires:
                return False
            self._write(self.counters.snapshot())
            return True

    def flush(self) -> bool:
        """Write now; True if there is a path to write to."""
        if self.path is None:
            return False
        with self._lock:
            self._write(self.counters.snapshot())
            return True

    def _write(self, snapshot: ProviderCounters) -> None:
        write_text_atomically(self.path, snapshot.to_json() + "\n")
        self._calls = 0
        self.writes += 1
