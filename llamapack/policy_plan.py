"""What every cache policy of the slot pool answers, and the protocol the provider relies on.

A policy maps (layer, expert) keys to slot ids. Per step the provider calls ``acquire(keys)`` and gets an
``AcquirePlan``: per distinct key "hit at slot s" or "miss: load into slot s", and the resident keys evicted
to make room. The rules every policy keeps are in ``cache_policy``'s docstring.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, NamedTuple, Protocol, Sequence

from .errors import CapacityError

Key = tuple[int, int]  # (layer, expert)
Trace = Sequence[Sequence[Key]]  # one list of keys per step (one layer's top-k for one token or ubatch)


class SlotAssignment(NamedTuple):  # a tuple: built for every key of every step
    """Where one key of a step lives: ``hit`` False means the provider must load ``key`` into ``slot``."""

    key: Key
    slot: int
    hit: bool


@dataclass(frozen=True)
class Eviction:
    """A resident key that lost its slot (no write-back: the weights are read-only)."""

    key: Key
    slot: int


@dataclass(frozen=True)
class AcquirePlan:
    """The answer to one ``acquire``: one assignment per distinct key, in first-seen order."""

    assignments: tuple[SlotAssignment, ...]
    evictions: tuple[Eviction, ...]

    @property
    def hits(self) -> int:
        return sum(1 for a in self.assignments if a.hit)

    @property
    def misses(self) -> int:
        return len(self.assignments) - self.hits

    @property
    def loads(self) -> tuple[SlotAssignment, ...]:
        """The assignments the provider must load, in plan order."""
        return tuple(a for a in self.assignments if not a.hit)

    def slot_of(self, key: Key) -> int:
        for assignment in self.assignments:
            if assignment.key == key:
                return assignment.slot
        raise KeyError(key)


class CachePolicy(Protocol):
    """What a provider needs from a cache policy."""

    n_slots: int

    def acquire(self, keys: Sequence[Key], n_tokens: int = 1) -> AcquirePlan:
        """Make every key resident (pinned for this step); raise CapacityError if they cannot all fit.
        ``n_tokens``: the tokens whose experts the keys are (1 in decode; a prefill ubatch's size; 0 for a
        preload, which no token uses), which a policy may use to tell decode steps from the others."""

    def abandon(self, key: Key) -> bool:
        """A load failed: free the key's slot and forget it; False if the key was not resident."""

    def slot_of(self, key: Key) -> int | None:
        """The key's slot, or None when it is not resident."""

    def resident(self) -> dict[Key, int]:
        """A copy of the key -> slot mapping."""


def distinct_keys(keys: Iterable[Key]) -> list[Key]:
    """The keys without repeats, in first-seen order."""
    return list(dict.fromkeys(keys))


def check_step_fits(n_keys: int, n_slots: int) -> None:
    if n_keys > n_slots:
        raise CapacityError(
            f"one step needs {n_keys} distinct experts resident at once but the pool has {n_slots} slots")
