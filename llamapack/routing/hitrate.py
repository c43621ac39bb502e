"""Hit rates of the slot pool's cache policies on a routing trace (pure: no I/O).

The replay is the provider's view of decode: one cache step per (token, layer), each the layer's top-k
(layer, expert) keys (``RoutingTrace.steps``), through one pool shared by all layers of
``n_slots = max(top_k, round(fraction * n_layers * n_experts))`` slots. A hit rate is hits over distinct keys
per step, as ``cache_policy.simulate`` counts them.

``POLICIES`` maps a name to a replay ``(steps, n_slots) -> (hits, lookups)``; a new policy is one line,
``"name": replay(lambda: cache_policy.NewPolicy)``. ``default`` is ``cache_policy.DEFAULT_POLICY`` looked up
at replay time, so it follows whatever the provider uses.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

from .. import cache_policy
from .trace import RoutingTrace

Steps = list[list[tuple[int, int]]]  # one list of (layer, expert) keys per cache step


def replay(factory: Callable[[], Callable[[int], cache_policy.CachePolicy]]) -> Callable[[Steps, int], tuple[int, int]]:
    """A replay through the policy class ``factory()`` returns (looked up on every replay)."""
    def run(steps: Steps, n_slots: int) -> tuple[int, int]:
        result = cache_policy.simulate(factory(), steps, n_slots)
        return result["hits"], result["hits"] + result["misses"]
    return run


def belady(steps: Steps, n_slots: int) -> tuple[int, int]:
    """The offline optimum (``cache_policy.belady_hits``)."""
    return cache_policy.belady_hits(steps, n_slots), sum(len(set(step)) for step in steps)


POLICIES: dict[str, Callable[[Steps, int], tuple[int, int]]] = {
    "default": replay(lambda: cache_policy.DEFAULT_POLICY),
    "lru": replay(lambda: cache_policy.LruPolicy),
    "lfu-lru": replay(lambda: cache_policy.LfuLruPolicy),
    "belady": belady,
}
DEFAULT_FRACTIONS = (0.125, 0.25, 0.5)


@dataclass(frozen=True)
class HitRates:
    """Hit rates of one trace: ``rates[policy][i]`` at ``fractions[i]`` (``n_slots[i]`` slots), as fractions 0..1
    (None when the phase has no tokens); ``steps`` cache steps of ``phase`` tokens."""

    fractions: tuple[float, ...]
    n_slots: tuple[int, ...]
    rates: dict[str, tuple[float | None, ...]]
    phase: str
    steps: int

    def as_json(self) -> dict:
        """``{"fractions": [...], "policies": {name: [hit rate per fraction]}}``."""
        return {"fractions": list(self.fractions), "policies": {name: list(r) for name, r in self.rates.items()}}


def slots_for(trace: RoutingTrace, fraction: float) -> int:
    """The pool size for a cache holding ``fraction`` of all (layer, expert) keys (at least one step's top-k)."""
    return max(trace.top_k, round(fraction * trace.n_layers * trace.n_experts))


def check_request(fractions: Sequence[float], policies: Sequence[str]) -> None:
    """ValueError for a fraction outside (0, 1] or a policy not in POLICIES."""
    bad = [f for f in fractions if not 0 < f <= 1]
    if bad or not fractions:
        raise ValueError(f"cache fractions must lie in (0, 1], got {list(fractions)}")
    unknown = [name for name in policies if name not in POLICIES]
    if unknown or not policies:
        raise ValueError(f"unknown policy {', '.join(unknown) or '(none given)'}; known: {', '.join(POLICIES)}")


def hit_rates(trace: RoutingTrace, fractions: Sequence[float] = DEFAULT_FRACTIONS,
              policies: Sequence[str] = tuple(POLICIES), phase: str = "decode") -> HitRates:
    """Replay ``trace``'s ``phase`` tokens (decode, prefill or all) through each policy at each cache fraction."""
    check_request(fractions, policies)
    part = trace.select(phase)
    steps = part.steps()
    n_slots = tuple(slots_for(trace, f) for f in fractions)
    rates = {}
    for name in policies:
        row = []
        for slots in n_slots:
            hits, lookups = POLICIES[name](steps, slots)
            row.append(hits / lookups if lookups else None)
        rates[name] = tuple(row)
    return HitRates(tuple(float(f) for f in fractions), n_slots, rates, phase, len(steps))
