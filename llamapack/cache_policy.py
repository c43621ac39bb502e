"""Cache policy of the expert slot pool: which (layer, expert) keys stay resident in a fixed number of slots.

Pure bookkeeping, no I/O. Per MoE layer and step the provider calls ``plan = policy.acquire(keys)``; the plan
says, for each distinct key, "hit at slot s" or "miss: load into slot s", and which resident keys were
evicted to make room. Weights are read-only, so an eviction never writes anything back: the victim's slot is
simply overwritten by the next load. The provider then loads every miss; if a load fails it calls
``policy.abandon(key)`` (for that key and every miss of the plan not loaded yet), which frees the slot and
forgets the mapping, so no slot ever claims to hold bytes it does not hold.

Rules shared by every policy here:
  * keys of the current step are pinned: never victims, neither the hits nor the keys this same acquire
    already loaded;
  * a step needing more distinct keys than there are slots raises ``CapacityError`` and changes nothing;
  * free slots are used first, lowest slot id first; a victim is evicted only when no slot is free.

The default, ``DEFAULT_POLICY``, is ``NextUsePolicy`` (``policy_next_use``): an online estimate of Belady's
rule that knows the provider visits the layers in a cycle (docs/cache_policy.md has the measurements). The
plan types and the protocol are in ``policy_plan``; the two older policies below stay for comparison.

``LruPolicy``: the victim is the least recently used resident key.

``LfuLruPolicy`` (frequency first, recency among similar frequency):
  * every key (resident or not; at most n_layers * n_experts of them) has a decayed access count ``f``:
    each access adds 1, and all counts halve every ``half_life`` accesses (an access = one distinct key
    requested by one acquire; the epoch ``e = accesses_before_this_step // half_life`` is the same for
    every key of a step). Counts persist across eviction, so a popular expert that was pushed out comes
    back with its popularity, and old popularity fades geometrically;
  * keys are grouped in frequency buckets ``b = floor(resolution * log2(f))`` (``resolution`` buckets per
    doubling; ``f`` taken at the current epoch);
  * the victim is the resident, unpinned key with the lowest bucket; among equal buckets the least
    recently used one.
  Defaults: ``half_life = 8 * n_slots`` accesses, ``resolution = 4`` (a bucket spans a factor 2**0.25).
  Counts are stored as (count at its last access, epoch of that access); the bucket relative to the current
  epoch E is ``floor(resolution * log2(count)) + resolution * (epoch - E)``, so ranking by
  ``floor(resolution * log2(count)) + resolution * epoch`` ranks by bucket at every E and a key's rank only
  changes when it is accessed. That is what lets both policies keep their candidates in one lazy heap.

``belady_hits`` is the offline optimum (Belady's MIN with the same pinning rule: on a miss with no free slot
evict the unpinned resident key whose next use is farthest away) and ``simulate`` replays a trace through a
policy; both are for measuring a policy, not for serving.
"""
from __future__ import annotations

import heapq
import math
from typing import Callable, Sequence

from .errors import CapacityError
from .policy_next_use import NextUsePolicy  # noqa: F401 - the default, re-exported
from .policy_plan import (AcquirePlan, CachePolicy, Eviction, Key, SlotAssignment, Trace,  # noqa: F401 - re-exported
                          check_step_fits, distinct_keys)


class _RankedPolicy:
    """Slot bookkeeping shared by the policies: the victim is the unpinned resident key of lowest rank.

    Subclasses keep per-key state in ``_touch`` (called on every access) and compute a key's current rank
    from it in ``_rank``. A rank must be unique (it ends with the access tick) and may only grow when the key
    is accessed. Candidates sit in a lazy min-heap of (rank, key) with at least one entry per resident key,
    pushed when the key is loaded; a hit pushes nothing (the hot path). A popped entry of a key no longer
    resident is dropped; one older than its key's rank is pushed back with the current rank. Since entries
    never exceed their key's current rank, the first popped entry that is current is the true minimum.
    """

    def __init__(self, n_slots: int):
        if n_slots < 1:
            raise CapacityError(f"a slot pool needs at least one slot (asked for {n_slots})")
        self.n_slots = n_slots
        self._slot_of: dict[Key, int] = {}
        self._free_slots: list[int] = list(range(n_slots))  # a min-heap
        self._candidates: list[tuple[tuple, Key]] = []
        self._tick = 0

    # -- the provider's API
    def acquire(self, keys: Sequence[Key], n_tokens: int = 1) -> AcquirePlan:  # n_tokens: not used here
        wanted = distinct_keys(keys)
        check_step_fits(len(wanted), self.n_slots)
        self._begin_step()
        pinned = set(wanted)
        assignments, evictions = [], []
        for key in wanted:
            slot = self._slot_of.get(key)
            hit = slot is not None
            if not hit:
                slot, eviction = self._claim_slot(pinned)
                if eviction is not None:
                    evictions.append(eviction)
                self._slot_of[key] = slot
            self._tick += 1
            self._touch(key, self._tick)
            if not hit:
                self._push_candidate(key)  # a hit needs no heap entry: its older one is re-ranked when popped
            assignments.append(SlotAssignment(key, slot, hit))
        return AcquirePlan(tuple(assignments), tuple(evictions))

    def abandon(self, key: Key) -> bool:
        slot = self._slot_of.pop(key, None)
        if slot is None:
            return False
        heapq.heappush(self._free_slots, slot)  # its heap entries are dropped when popped (not resident)
        return True

    def slot_of(self, key: Key) -> int | None:
        return self._slot_of.get(key)

    def resident(self) -> dict[Key, int]:
        return dict(self._slot_of)

    def __len__(self) -> int:
        return len(self._slot_of)

    def __contains__(self, key: Key) -> bool:
        return key in self._slot_of

    # -- internals
    def _begin_step(self) -> None:
        """Hook called once per acquire, before any key of the step is touched."""

    def _touch(self, key: Key, tick: int) -> None:
        """Record an access of ``key`` at ``tick`` (both hits and loads)."""
        raise NotImplementedError

    def _rank(self, key: Key) -> tuple:
        """The key's rank as of its last access."""
        raise NotImplementedError

    def _push_candidate(self, key: Key) -> None:
        heapq.heappush(self._candidates, (self._rank(key), key))
        if len(self._candidates) > 4 * self.n_slots + 64:
            self._candidates = [(self._rank(k), k) for k in self._slot_of]
            heapq.heapify(self._candidates)

    def _claim_slot(self, pinned: set[Key]) -> tuple[int, Eviction | None]:
        if self._free_slots:
            return heapq.heappop(self._free_slots), None
        victim = self._pop_victim(pinned)
        slot = self._slot_of.pop(victim)
        return slot, Eviction(victim, slot)

    def _pop_victim(self, pinned: set[Key]) -> Key:
        """The unpinned resident key of lowest rank (one exists: the step fits and a slot is needed)."""
        kept_pinned = []
        try:
            while True:
                rank, key = heapq.heappop(self._candidates)
                if key not in self._slot_of:
                    continue  # evicted or abandoned since
                current = self._rank(key)
                if current != rank:
                    heapq.heappush(self._candidates, (current, key))  # accessed since: re-rank lazily
                    continue
                if key in pinned:
                    kept_pinned.append((rank, key))
                    continue
                return key
        finally:
            for entry in kept_pinned:
                heapq.heappush(self._candidates, entry)


class LruPolicy(_RankedPolicy):
    """Evict the least recently used resident key outside the current step."""

    def __init__(self, n_slots: int):
        super().__init__(n_slots)
        self._last_tick: dict[Key, int] = {}

    def _touch(self, key: Key, tick: int) -> None:
        self._last_tick[key] = tick

    def _rank(self, key: Key) -> tuple:
        return (self._last_tick[key],)


class LfuLruPolicy(_RankedPolicy):
    """Frequency first, recency among similar frequency (the exact rule is in the module docstring).

    ``half_life``: accesses after which a count has halved (default 8 * n_slots);
    ``resolution``: frequency buckets per doubling of the count (default 4: floor(4 * log2 f)).
    The defaults come from Zipf decode traces (tests/test_cache_policy.py): longer half-lives win a little
    on stationary popularity and lose more when popularity drifts; finer buckets win a little (by 0.1 to
    0.5 points of hit rate over 2 per doubling).
    """

    def __init__(self, n_slots: int, half_life: int | None = None, resolution: int = 4):
        super().__init__(n_slots)
        self.half_life = half_life if half_life is not None else 8 * n_slots
        if self.half_life < 1 or resolution < 1:
            raise ValueError(f"half_life and resolution must be >= 1 (got {self.half_life}, {resolution})")
        self.resolution = resolution
        self._counts: dict[Key, tuple[float, int, int]] = {}  # key -> (count at its last access, epoch, tick)
        self._accesses = 0
        self._epoch = 0

    def frequency(self, key: Key) -> float:
        """The key's decayed access count now (0 for a key never seen)."""
        known = self._counts.get(key)
        return known[0] * 2.0 ** (known[1] - self._epoch) if known else 0.0

    def _begin_step(self) -> None:
        self._epoch = self._accesses // self.half_life

    def _touch(self, key: Key, tick: int) -> None:
        self._accesses += 1
        epoch = self._epoch
        known = self._counts.get(key)
        if known is None:
            count = 1.0
        elif known[1] == epoch:
            count = known[0] + 1.0
        else:
            count = known[0] * 2.0 ** (known[1] - epoch) + 1.0
        self._counts[key] = (count, epoch, tick)

    def _rank(self, key: Key) -> tuple:
        count, epoch, tick = self._counts[key]
        return (math.floor(self.resolution * math.log2(count)) + self.resolution * epoch, tick)


DEFAULT_POLICY = NextUsePolicy  # what the streaming provider's slot pool and RAM tier use (docs/cache_policy.md)
# the online policies a provider can be told to use (StreamingSettings.cache_policy), by name
ONLINE_POLICIES: dict[str, Callable[[int], CachePolicy]] = {
    "next-use": NextUsePolicy, "lfu-lru": LfuLruPolicy, "lru": LruPolicy}


def policy_class(name: str) -> Callable[[int], CachePolicy]:
    """The online policy called ``name`` (a key of ``ONLINE_POLICIES``); ValueError naming the known ones."""
    try:
        return ONLINE_POLICIES[name]
    except KeyError:
        raise ValueError(f"unknown cache policy {name!r} (known: {', '.join(ONLINE_POLICIES)})") from None


def next_use_table(steps: Sequence[Sequence[Key]]) -> list[dict[Key, int]]:
    """For step i, each of its keys -> the index of the next step using it (``len(steps)`` if none)."""
    never = len(steps)
    table: list[dict[Key, int]] = [{} for _ in steps]
    seen_at: dict[Key, int] = {}
    for index in range(len(steps) - 1, -1, -1):
        table[index] = {key: seen_at.get(key, never) for key in steps[index]}
        for key in steps[index]:
            seen_at[key] = index
    return table


def belady_hits(trace: Trace, n_slots: int) -> int:
    """Hits of the optimal offline policy (MIN) on ``trace``, with the current step's keys pinned.

    Hits count distinct keys per step, as ``acquire`` does. On a miss with no free slot, MIN evicts the
    unpinned resident key used farthest in the future (or never again).
    """
    steps = [distinct_keys(step) for step in trace]
    for step in steps:
        check_step_fits(len(step), n_slots)
    next_use = next_use_table(steps)
    resident_next: dict[Key, int] = {}  # resident key -> its next use
    farthest: list[tuple[int, Key]] = []  # lazy max-heap of (-next use, key)
    hits = 0
    for index, step in enumerate(steps):
        pinned = set(step)
        for key in step:
            if key in resident_next:
                hits += 1
            elif len(resident_next) >= n_slots:
                del resident_next[_pop_farthest(farthest, resident_next, pinned)]
            resident_next.setdefault(key, index)
        for key, upcoming in next_use[index].items():
            resident_next[key] = upcoming
            heapq.heappush(farthest, (-upcoming, key))
    return hits


def _pop_farthest(farthest: list[tuple[int, Key]], resident_next: dict[Key, int], pinned: set[Key]) -> Key:
    kept_pinned = []
    try:
        while True:
            negative_next, key = heapq.heappop(farthest)
            if resident_next.get(key) != -negative_next:
                continue  # stale
            if key in pinned:
                kept_pinned.append((negative_next, key))
                continue
            return key
    finally:
        for entry in kept_pinned:
            heapq.heappush(farthest, entry)


def simulate(policy_factory: Callable[[int], CachePolicy], trace: Trace, n_slots: int) -> dict:
    """Replay ``trace`` through ``policy_factory(n_slots)``: hits, misses, evictions, hit_rate, steps.

    ``hit_rate`` is hits / (hits + misses), None for a trace without keys.
    """
    policy = policy_factory(n_slots)
    hits = misses = evictions = 0
    for step in trace:
        plan = policy.acquire(step)
        hits += plan.hits
        misses += plan.misses
        evictions += len(plan.evictions)
    lookups = hits + misses
    return {"hits": hits, "misses": misses, "evictions": evictions,
            "hit_rate": hits / lookups if lookups else None, "steps": len(trace)}
