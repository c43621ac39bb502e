"""The slot pool's default cache policy: evict the key whose next use is estimated farthest away.

Belady's rule (the offline optimum, ``cache_policy.belady_hits``) evicts the key used farthest in the future.
The provider acquires one MoE layer per step, the layers in a fixed cycle, so a key's next use splits into two
parts that can be estimated online:
  * when its layer comes next: the layer's latest visit plus its *period*, the steps between its two latest
    visits (in decode, the number of MoE layers). A global recency ranking gets this backwards: the least
    recently used key belongs to the layer needed next. A layer seen for the first time gets the number of
    layers seen so far as its period; no layer count or order needs to be given;
  * whether that visit will want the key, ``p``. If each visit wants it with probability p, its next use is
    1/p visits away on average:

        next_use(key) = last_visit(layer) + period(layer) / p(key)

``p`` combines how long ago the key was last used with how popular it is, both learned online:
  * **age**: a, the visits of its layer since the key's last use (1 = used at the latest visit), capped at
    ``horizon + 1`` ("older or never"). ``rate[a]``, learned over all layers, is the share of keys of age a
    at a visit that the visit used (counts decay by 2 ** (-1 / rate_half_life) per acquire);
  * **popularity**: f, the key's decayed count of uses (halved every ``half_life`` visits of its layer),
    relative to the mean f of the keys of its layer in the same age class.
  p = rate[a] * f / mean_f(layer, a) (within an age class, p averages rate[a]). Counts outlive eviction, so
  an expert that was pushed out comes back with its popularity.

Every acquire naming a layer is a *visit* of it: the layer's counts and ages and the rates are updated, and
the per-class weights of ``p`` are fixed until its next visit. The first time a victim is looked for among its
keys, ``p`` of each of its resident keys (and its latest step's) is computed, vectorized, and the keys are
ordered by next use (a step that hits everywhere ranks nothing). Between two visits of a layer nothing changes
its keys' estimates, so each layer keeps its keys in that order (evicted from the front) and the layers sit in
a lazy max-heap of their front key's next use: a victim costs a few heap operations, not a scan of the pool.
The victim is the unpinned resident key of the farthest next use (ties: the lower layer id, then the lower
expert id).

Rules shared with every policy (``cache_policy``): the step's keys are pinned, a step larger than the pool
raises ``CapacityError`` and changes nothing, free slots go first, lowest id first.
"""
from __future__ import annotations

import heapq
import math
from typing import Sequence

import numpy as np

from .errors import CapacityError
from .policy_plan import AcquirePlan, Eviction, Key, SlotAssignment, check_step_fits, distinct_keys

DEFAULT_HALF_LIFE = 32  # visits of a layer (decode tokens): how long popularity is remembered
DEFAULT_HORIZON = 32  # age classes 1..32 visits, then "older or never"
DEFAULT_RATE_HALF_LIFE = 1024  # acquires: memory of the reuse rate per age class
_RECOMPUTE = -math.inf  # a layer heap entry's -next_use that says "compute me when popped"
_new_tuple = tuple.__new__  # SlotAssignment(...) without the namedtuple's Python-level __new__ (hot path)


class _Layer:
    """One layer's state: per expert id its decayed count and age; its resident keys and their eviction order."""

    __slots__ = ("last", "period", "version", "visits", "counts", "ages", "classes", "members", "weight", "step_keys",
                 "order", "p", "front")

    def __init__(self, period: int, horizon: int):
        self.last, self.period, self.version = 0, period, 0  # last 0: never visited
        self.visits = 0.0  # decayed like the counts: counts / visits is a key's share of the layer's visits
        self.counts = np.zeros(0)
        self.ages = np.zeros(0, dtype=np.intp)  # visits since last use as of the next visit, capped at horizon + 1
        self.classes = np.zeros(horizon + 2, dtype=np.intp)  # how many experts of each age (bincount of ages)
        self.members: set[int] = set()  # resident expert ids
        self.weight = np.zeros(horizon + 2)  # p = weight[age] * count, as of the latest visit
        self.step_keys: list[int] = []  # the experts of its latest visit
        self.order: list[int] | None = []  # expert ids by p, lowest (farthest next use) first; None: not ranked yet
        self.p: list[float] = []
        self.front = 0  # order[:front] are gone (evicted or abandoned)

    def grow(self, n: int, horizon: int) -> None:
        if n > len(self.counts):
            extra = n - len(self.counts)
            self.counts = np.concatenate([self.counts, np.zeros(extra)])
            self.ages = np.concatenate([self.ages, np.full(extra, horizon + 1, dtype=np.intp)])
            self.classes[horizon + 1] += extra


def check_parameters(n_slots: int, half_life: float, horizon: int, rate_half_life: float) -> None:
    """CapacityError for a pool without a slot, ValueError for an estimate parameter out of range."""
    if n_slots < 1:
        raise CapacityError(f"a slot pool needs at least one slot (asked for {n_slots})")
    if not (half_life > 0 and rate_half_life > 0 and horizon >= 1):
        raise ValueError(f"half_life and rate_half_life must be > 0 and horizon >= 1 (got {half_life}, "
                         f"{rate_half_life}, {horizon})")


class NextUsePolicy:
    """Evict the key with the farthest estimated next use (the estimate is in the module docstring).

    ``half_life``: visits of a layer after which a popularity count has halved; ``horizon``: age classes
    (visits since last use) told apart; ``rate_half_life``: acquires after which the learned reuse rates
    have halved. The defaults were chosen on the granite trace and routing-model traces
    (docs/cache_policy.md).
    """

    def __init__(self, n_slots: int, half_life: float = DEFAULT_HALF_LIFE, horizon: int = DEFAULT_HORIZON,
                 rate_half_life: float = DEFAULT_RATE_HALF_LIFE):
        check_parameters(n_slots, half_life, horizon, rate_half_life)
        self.n_slots, self.half_life, self.horizon = n_slots, half_life, horizon
        self._decay = 2.0 ** (-1.0 / half_life)
        self._rate_decay = 2.0 ** (-1.0 / rate_half_life)
        # keys used / keys seen per age class (index 1..horizon + 1; 0 unused): a weak prior of 1 in 4; two rows
        # of one array, so that one multiplication decays both
        self._tally = np.array([np.full(horizon + 2, 0.25), np.ones(horizon + 2)])
        self._used, self._seen = self._tally  # views: updated in place only
        self._older = np.minimum(np.arange(horizon + 2) + 1, horizon + 1)  # age -> age one visit later (capped)
        # the constants of the per-visit updates as arrays: numpy multiplies array by array faster than by a float
        self._rate_decays = np.full((2, horizon + 2), self._rate_decay)
        self._decays = np.zeros(0)  # self._decay per expert id (as long as the longest layer's counts)
        self._tiny = np.full(horizon + 2, 1e-300)
        self._slot_of: dict[Key, int] = {}
        self._free_slots: list[int] = list(range(n_slots))  # a min-heap
        self._layers: dict[int, _Layer] = {}
        self._by_next_use: list[tuple[float, int, int]] = []  # (-next use of the layer's front key, layer, version)
        self._step = 0

    # -- the provider's API
    def acquire(self, keys: Sequence[Key], n_tokens: int = 1) -> AcquirePlan:
        """``n_tokens``: the tokens whose experts ``keys`` are (a prefill ubatch names many; 0: a preload): only
        single-token steps teach the estimate, which is one of decode visits (a prefill visit uses most of a
        layer's experts; learning from it cost 13 points of hit rate after a 512-token prompt:
        docs/cache_policy.md)."""
        wanted = distinct_keys(keys)
        check_step_fits(len(wanted), self.n_slots)
        self._step += 1
        by_layer: dict[int, list[int]] = {}
        for layer, expert in wanted:
            by_layer.setdefault(layer, []).append(expert)
        visited = [(number, self._visit(number, experts, learn=n_tokens == 1)) for number, experts in by_layer.items()]
        slot_of = self._slot_of
        pinned = None  # the step's keys, as a set once a victim is looked for
        assignments, evictions = [], []
        try:
            for key in wanted:
                slot = slot_of.get(key)
                hit = slot is not None
                if not hit:
                    if self._free_slots:
                        slot = heapq.heappop(self._free_slots)
                    else:
                        victim = self._pop_victim(pinned if pinned is not None else (pinned := set(wanted)))
                        slot = slot_of.pop(victim)
                        self._layers[victim[0]].members.discard(victim[1])
                        evictions.append(Eviction(victim, slot))
                    slot_of[key] = slot
                    self._layers[key[0]].members.add(key[1])
                assignments.append(_new_tuple(SlotAssignment, (key, slot, hit)))  # SlotAssignment(key, slot, hit)
        finally:
            for number, layer in visited:  # its pins are released: its front may be a pinned key now
                self._queue(number, layer)
        return AcquirePlan(tuple(assignments), tuple(evictions))

    def abandon(self, key: Key) -> bool:
        slot = self._slot_of.pop(key, None)
        if slot is None:
            return False
        self._layers[key[0]].members.discard(key[1])  # skipped when it reaches its layer's front
        heapq.heappush(self._free_slots, slot)
        return True

    def slot_of(self, key: Key) -> int | None:
        return self._slot_of.get(key)

    def resident(self) -> dict[Key, int]:
        return dict(self._slot_of)

    def __len__(self) -> int:
        return len(self._slot_of)

    def __contains__(self, key: Key) -> bool:
        return key in self._slot_of

    # -- the estimate (tests, warm start)
    def frequency(self, key: Key) -> float:
        """The key's decayed count of uses now (f in the module docstring; 0 for a key never seen)."""
        layer = self._layers.get(key[0])
        return float(layer.counts[key[1]]) if layer is not None and key[1] < len(layer.counts) else 0.0

    def reuse_rates(self) -> np.ndarray:
        """rate[a] for a = 1..horizon + 1 (the share of keys of age a that a visit uses)."""
        return (self._used / self._seen)[1:]

    def next_use(self, key: Key) -> float:
        """The key's next use (in acquires) as estimated at its layer's latest visit (inf: not ranked there)."""
        layer = self._layers.get(key[0])
        if layer is not None and layer.order is None:
            self._rank(layer)
        if layer is not None and key[1] in layer.order:
            p = layer.p[layer.order.index(key[1])]
            return layer.last + layer.period / p if p > 0 else math.inf
        return math.inf

    # -- warm start (provider.warm)
    def popularity(self) -> dict[int, list[float]]:
        """Per layer, each expert's decayed share of the layer's visits (index = expert id), for the layers seen."""
        return {number: (layer.counts / layer.visits).tolist() for number, layer in self._layers.items()
                if layer.visits > 0}

    def seed(self, popularity: dict[int, Sequence[float]]) -> None:
        """Start from the shares of an earlier session (``popularity``'s format): each key's count is set to
        its share of the visits a layer has in steady state (1 / (1 - decay)), as if it had been used at that
        rate long ago (age: "older"). Only before the first acquire; layers already seen are left alone."""
        steady = 1.0 / (1.0 - self._decay)
        for number, shares in popularity.items():
            if number in self._layers or not len(shares):
                continue
            layer = self._layers[number] = _Layer(len(popularity), self.horizon)
            layer.grow(len(shares), self.horizon)
            layer.counts[:] = np.asarray(shares, dtype=float) * steady
            layer.visits = steady
            layer.weight = self._weights(layer)

    def preload(self, keys: Sequence[Key]) -> tuple[SlotAssignment, ...]:
        """Give free slots (lowest first) to ``keys`` not resident, while slots are free: the provider loads
        them before the first token (a failed load is ``abandon``-ed). Nothing is evicted, nothing counted as a
        use; the keys are ranked by their layers' latest estimate (seeded or visited)."""
        loads = []
        for key in distinct_keys(keys):
            if not self._free_slots:
                break
            if key in self._slot_of:
                continue
            layer = self._layers.get(key[0])
            if layer is None:
                layer = self._layers[key[0]] = _Layer(len(self._layers) + 1, self.horizon)
                layer.weight = self._weights(layer)
            layer.grow(key[1] + 1, self.horizon)
            slot = heapq.heappop(self._free_slots)
            self._slot_of[key] = slot
            layer.members.add(key[1])
            layer.order = None  # ranked again, with its new members, when a victim is looked for
            loads.append(SlotAssignment(key, slot, False))
        for number in dict.fromkeys(load.key[0] for load in loads):
            self._queue(number, self._layers[number])
        return tuple(loads)

    def load_ahead(self, keys: Sequence[Key], pinned: Sequence[Key]) -> AcquirePlan:
        """Give ``keys`` (those not resident) slots before the step that wants them: the provider copies them while
        the current step computes (a prefill ubatch's next layer). Victims are found as ``acquire`` finds them,
        but the current step's keys (``pinned``: their kernels still read their slots) and ``keys`` are never
        evicted; it stops when nothing else is left to evict. Not a visit: nothing is learned, no period
        changes; the keys are ranked by their layers' latest estimate (as ``preload`` does). The plan's
        assignments are the loads (hit False), in first-seen order."""
        wanted = distinct_keys(keys)
        named = distinct_keys([*pinned, *wanted])
        pins = set(named)  # _pop_victim passes them over
        n_pins = sum(key in self._slot_of for key in named)
        loads, evictions = [], []
        try:
            for key in wanted:
                if key in self._slot_of:
                    continue
                if n_pins >= self.n_slots:
                    break
                n_pins += 1
                layer = self._layers.get(key[0])
                if layer is None:
                    layer = self._layers[key[0]] = _Layer(len(self._layers) + 1, self.horizon)
                    layer.weight = self._weights(layer)
                layer.grow(key[1] + 1, self.horizon)
                if self._free_slots:
                    slot = heapq.heappop(self._free_slots)
                else:
                    victim = self._pop_victim(pins)
                    slot = self._slot_of.pop(victim)
                    self._layers[victim[0]].members.discard(victim[1])
                    evictions.append(Eviction(victim, slot))
                self._slot_of[key] = slot
                layer.members.add(key[1])
                layer.order = None  # ranked again, with its new members, when a victim is looked for
                loads.append(SlotAssignment(key, slot, False))
        finally:  # pinned fronts were skipped: the layers of the resident keys named here are queued again
            for number in dict.fromkeys(key[0] for key in named if key in self._slot_of):
                self._queue(number, self._layers[number])
        return AcquirePlan(tuple(loads), tuple(evictions))

    def _weights(self, layer: _Layer) -> np.ndarray:
        """weight[a] = rate[a] / mean count of the layer's keys of age a (p = weight[age] * count)."""
        return self._used * layer.classes / np.maximum(
            self._seen * np.bincount(layer.ages, layer.counts, self.horizon + 2), self._tiny)

    # -- internals
    def _visit(self, number: int, experts: list[int], learn: bool = True) -> _Layer:
        """A step names ``experts`` of layer ``number``: learn from it (unless ``learn`` is False: then only the
        layer's period and its pinned keys change), then rank the layer's keys."""
        layer = self._layers.get(number)
        if layer is None:
            layer = self._layers[number] = _Layer(len(self._layers) + 1, self.horizon)
        elif layer.last:
            layer.period = self._step - layer.last
        layer.last = self._step
        cap = self.horizon + 1
        layer.grow(max(experts) + 1, self.horizon)
        if not learn:
            layer.weight = self._weights(layer)  # grow may have added keys of the oldest class
            layer.step_keys, layer.order = experts, None
            self._queue(number, layer)
            return layer
        layer.visits = layer.visits * self._decay + 1.0
        ids = np.array(experts, dtype=np.intp)
        counts = layer.counts
        # what this visit teaches: the share of each age class that it used (classes: integer counts)
        self._tally *= self._rate_decays  # _used and _seen
        self._seen += layer.classes
        self._used += np.bincount(layer.ages[ids], minlength=cap + 1)
        if len(self._decays) < len(counts):
            self._decays = np.full(len(counts), self._decay)
        counts *= self._decays if len(self._decays) == len(counts) else self._decays[:len(counts)]
        counts[ids] += 1.0
        layer.ages = ages = self._older[layer.ages]  # one visit older, capped at horizon + 1
        ages[ids] = 1
        layer.classes = np.bincount(ages, minlength=cap + 1)
        # p = weight[a] * f with weight[a] = rate[a] / mean f of class a; the keys are ranked when a victim is
        # first looked for among them (often never before the next visit: an all-hit step costs no ranking)
        layer.weight = self._weights(layer)
        layer.step_keys, layer.order = experts, None
        self._queue(number, layer)
        return layer

    def _rank(self, layer: _Layer) -> None:
        """Order the layer's resident keys and its latest step's by p as of its latest visit, lowest first."""
        ranked = layer.members.union(layer.step_keys)
        candidates = np.fromiter(ranked, dtype=np.intp, count=len(ranked))
        p = layer.weight[layer.ages[candidates]] * layer.counts[candidates]
        order = np.lexsort((candidates, p))
        layer.order = candidates[order].tolist()
        layer.p = p[order].tolist()
        layer.front = 0

    def _queue(self, number: int, layer: _Layer) -> None:
        """Invalidate the layer's entry in the layer heap and queue a fresh one, computed when popped."""
        layer.version += 1
        heapq.heappush(self._by_next_use, (_RECOMPUTE, number, layer.version))
        if len(self._by_next_use) > 4 * len(self._layers) + 64:  # drop the invalidated entries
            self._by_next_use = [entry for entry in self._by_next_use if entry[2] == self._layers[entry[1]].version]
            heapq.heapify(self._by_next_use)

    def _front(self, number: int, layer: _Layer, pinned: set[Key]) -> int | None:
        """Index in ``layer.order`` of its farthest unpinned resident key, or None."""
        if layer.order is None:
            self._rank(layer)
        order, members = layer.order, layer.members
        while (layer.front < len(order) and order[layer.front] not in members
               and (number, order[layer.front]) not in pinned):
            layer.front += 1  # evicted or abandoned since the visit (a pinned one may be loading now)
        index = layer.front
        while index < len(order) and (order[index] not in members or (number, order[index]) in pinned):
            index += 1
        return index if index < len(order) else None

    def _pop_victim(self, pinned: set[Key]) -> Key:
        """The unpinned resident key of farthest next use (one exists: the step fits and a slot is needed)."""
        queue = self._by_next_use
        while True:
            negative, number, version = heapq.heappop(queue)
            layer = self._layers[number]
            if version != layer.version:
                continue  # invalidated by a visit
            index = self._front(number, layer, pinned)
            if index is None:  # no key, or only pinned ones (a layer of this step: queued again at its end)
                continue
            p = layer.p[index]
            upcoming = layer.last + layer.period / p if p > 0 else math.inf  # p 0: preloaded, never counted
            if -negative > upcoming:  # computed before an eviction (or "compute me"): re-rank
                heapq.heappush(queue, (-upcoming, number, version))
                continue
            heapq.heappush(queue, (negative, number, version))  # an upper bound for the next front
            return number, layer.order[index]
