"""A calibrated, seeded routing model: routing traces for model shapes that have counts but no real trace.

What it reproduces, and from where:
  * **popularity** per layer: each expert's share of tokens (``RoutingCounts.heat``), from real counts;
  * **co-activation** within a layer: the counts' pairs; once an expert is chosen, the weights of the rest of
    that token's picks in that layer are multiplied by their lift with it (``coactivation`` is the exponent);
  * **temporal reuse** (``ReuseProfile``, fitted on the real granite trace by ``fit_reuse``): the share of a
    token's experts, per layer, whose last use in that layer was 1, 2, ..., 8 tokens ago, or longer ago.
    Real tokens come in regimes: some keep most of the previous token's experts in every layer at once,
    some change most of them in every layer at once (the granite trace's per-token share of experts kept
    from the previous token has a standard deviation of 0.2 across tokens, where independent layers would
    give 0.04). Which experts a layer picks is nearly independent of the other layers
    (``shared/routing/README.md``), but how much it reuses is not: a shared pool of all layers sees the
    bursts. A profile is one age distribution per regime; the model draws a regime per token, shared by all
    layers (tokens' regimes are drawn independently: the granite trace's lag-1 autocorrelation is 0.09).

Per request (each starts with no history), token by token, and per layer, the top-k are drawn one at a time
without repeats: first an age class (1..8 tokens ago, or older/never) with the token's regime
probabilities, among the classes that still hold an expert not yet chosen, then an expert of that class with
probability proportional to its base weight times its co-activation tilt. Layers are drawn independently,
vectorized. Prefill tokens (``prefill_tokens``) use the same process and come first in their request, so
decode starts with the prompt's history, as in the real trace (whose prefill and decode tokens have the same
age profile).

Calibration (by measurement, once per model, cached): masking classes that hold no candidate shifts the age
profile, and drawing without repeats and through age classes changes popularity (a chosen expert tends to
be chosen again for many tokens, so its long-run share grows faster than its weight), so over a few pilot
runs (one request of ``calibration_tokens`` tokens, fixed seeds) the class probabilities are scaled per
regime and class, and the base weights per popularity bin, until the pilot's age profile and its inclusion
per bin match the targets. Pilot numbers are expectations (every candidate's probability at every draw,
summed), not sampled counts. Bursts make one expert's share in a short trace vary widely around its
long-run share; only the long-run share is calibrated.

``reuse=None`` draws tokens independently (popularity and co-activation only): a lower bound on temporal
locality. The granite profile is an absolute one (share of experts reused), applied as is to shapes with
more experts per layer, where it means far more locality than chance: that transfer is an assumption
(docs/routing.md shows both bounds).
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import Sequence

import numpy as np

from .counts import RoutingCounts
from .trace import RoutingTrace, TraceError

MAX_DISTANCE = 8  # the reuse profile's horizon, in tokens
N_CLASSES = MAX_DISTANCE + 1  # ages 1..MAX_DISTANCE, then "older or never"


@dataclass(frozen=True)
class ReuseProfile:
    """Temporal reuse: ``shares[r][d - 1]`` is, for tokens of regime r, the share of their (layer, expert)
    picks last used in that layer ``d`` tokens earlier (d = 1..8); ``shares[r][8]`` the share used earlier than
    that or never. ``weights[r]``: the share of tokens in regime r."""

    weights: tuple[float, ...]
    shares: tuple[tuple[float, ...], ...]
    source: str = ""

    def __post_init__(self):
        weights, shares = np.asarray(self.weights, dtype=float), np.asarray(self.shares, dtype=float)
        if weights.ndim != 1 or shares.shape != (len(weights), N_CLASSES) or (weights <= 0).any() \
                or (shares < 0).any() or abs(weights.sum() - 1) > 1e-3 or (abs(shares.sum(axis=1) - 1) > 1e-3).any():
            raise ValueError(f"a reuse profile needs positive regime weights summing to 1 and, per regime, "
                             f"{N_CLASSES} non-negative shares summing to 1")

    def mean(self) -> np.ndarray:
        """The age shares over all tokens: ``[N_CLASSES]``."""
        return np.asarray(self.weights) @ np.asarray(self.shares)

    def cumulative(self) -> np.ndarray:
        """``[MAX_DISTANCE]``: the share of a token's experts (per layer) used in the previous 1..8 tokens."""
        return np.cumsum(self.mean()[:MAX_DISTANCE])


def token_ages(trace: RoutingTrace, phase: str = "decode") -> np.ndarray:
    """``[n, N_CLASSES]``: for each ``phase`` token with at least MAX_DISTANCE earlier tokens in its request, the
    share of its (layer, expert) picks by age class (tokens since the expert's last use in that layer)."""
    if phase not in ("decode", "prefill", "all"):
        raise ValueError(f"phase must be decode, prefill or all, not {phase!r}")
    rows, layers = [], np.arange(trace.n_layers)[:, None]
    for start, end in trace.request_bounds():
        last = np.full((trace.n_layers, trace.n_experts), -(1 << 30), dtype=np.int64)
        for i in range(end - start):
            picks = trace.experts[start + i].astype(np.intp)
            wanted = phase == "all" or trace.prefill[start + i] == (phase == "prefill")
            if i >= MAX_DISTANCE and wanted:
                ages = np.minimum(i - last[layers, picks], N_CLASSES) - 1
                rows.append(np.bincount(ages.ravel(), minlength=N_CLASSES) / ages.size)
            last[layers, picks] = i
    return np.array(rows).reshape(-1, N_CLASSES)


def fit_reuse(trace: RoutingTrace, n_regimes: int = 2, phase: str = "decode") -> ReuseProfile:
    """Measure a ReuseProfile: ``token_ages`` of ``phase`` tokens, split into ``n_regimes`` equal groups by the
    share of experts kept from the previous token, each group's mean age shares."""
    ages = token_ages(trace, phase)
    if len(ages) < n_regimes:
        raise TraceError(f"{trace.origin}: {len(ages)} {phase} tokens with {MAX_DISTANCE} tokens of history, "
                         f"too few to fit {n_regimes} reuse regimes")
    groups = np.array_split(np.argsort(ages[:, 0], kind="stable"), n_regimes)
    return ReuseProfile(tuple(len(g) / len(ages) for g in groups),
                        tuple(tuple(ages[g].mean(axis=0).tolist()) for g in groups),
                        f"fit_reuse({n_regimes} regimes) of the {phase} tokens of: {trace.source or trace.origin}")


# fit_reuse(load_trace("llamapack/routing/data/granite-3.0-1b-a400m.npz")), rounded to 4 decimals
# (tests/test_routing_model.py checks that a new fit gives the same numbers).
GRANITE_REUSE = ReuseProfile(
    weights=(0.5, 0.5),
    shares=((0.2447, 0.3088, 0.1150, 0.1010, 0.0566, 0.0335, 0.0293, 0.0283, 0.0828),
            (0.6109, 0.0930, 0.0634, 0.0472, 0.0336, 0.0288, 0.0239, 0.0188, 0.0803)),
    source="fit_reuse (2 regimes) of the 192 decode tokens of the granite-3.0-1b-a400m trace")


@dataclass(frozen=True)
class Calibration:
    """What the sampler draws with: ``base`` ``[n_layers, n_experts]`` expert weights, ``classes``
    ``[n_regimes, N_CLASSES]`` age-class probabilities per regime; ``error`` the last pilot's largest gaps
    (``ages``: absolute, per regime and class; ``inclusion_bins``: relative, per popularity bin)."""

    base: np.ndarray
    classes: np.ndarray
    error: dict


@dataclass(frozen=True, eq=False)
class RoutingModel:
    """A routing model of ``counts``' shape (module docstring). ``synthesize`` writes seeded traces."""

    counts: RoutingCounts
    reuse: ReuseProfile | None = GRANITE_REUSE  # None: no temporal reuse (tokens drawn independently)
    coactivation: float = 1.0
    calibration_tokens: int = 400
    calibration_rounds: int = 6
    calibration_bins: int = 10
    calibration_seed: int = 0x5EED

    @cached_property
    def tilt(self) -> "_Tilt | None":
        return _Tilt(self.counts, self.coactivation) if self.coactivation else None

    @cached_property
    def calibration(self) -> Calibration:
        target_ages = np.asarray(_regimes(self.reuse)[1])
        target = self.counts.inclusion()
        eligible = target > 0
        # start from the weights whose draws without repeats would give ``inclusion`` with no reuse at all (the
        # Poisson approximation of successive sampling: P(e in top-k) ~ 1 - exp(-w_e)); then scale them by one
        # factor per popularity bin (experts of all layers by inclusion, each bin holding an equal share of all
        # inclusion): an expert's long-run inclusion depends on its weight through bursts of reuse many tokens
        # long, so a short pilot measures it per expert with large noise but per bin closely
        start = -np.log1p(-np.minimum(target, 0.97)) * eligible
        order = np.argsort(target, axis=None, kind="stable")
        rank = np.arange(1, target.size + 1) / target.size
        mass = np.cumsum(target.ravel()[order]) / target.sum()
        bins = np.empty(target.size, dtype=np.intp)
        n = self.calibration_bins
        bins[order] = np.minimum((mass * n).astype(np.intp), n - 1) + np.minimum((rank * n).astype(np.intp), n - 1)
        bins = bins.reshape(target.shape)
        target_bins = np.bincount(bins[eligible], target[eligible], 2 * n)
        filled = target_bins > 0
        scale, classes, error = np.ones(2 * n), target_ages.copy(), {}
        for round_ in range(self.calibration_rounds + 1):
            base = start * scale[bins]
            if round_ == self.calibration_rounds:
                break
            pilot = _Sampler(self, Calibration(base, classes, {}), np.random.default_rng(self.calibration_seed + round_),
                             track=True)
            pilot.request(self.calibration_tokens, 0)
            ages = pilot.age_sums / np.maximum(pilot.age_sums.sum(axis=1, keepdims=True), 1e-12)
            got_bins = np.bincount(bins[eligible], pilot.inclusion_sums[eligible], 2 * n)
            got_bins /= self.calibration_tokens
            error = {"ages": float(np.abs(ages - target_ages).max()),
                     "inclusion_bins": float(np.abs(got_bins[filled] / target_bins[filled] - 1).max())}
            if self.reuse is not None:
                classes = classes * np.where(ages > 0, target_ages / np.maximum(ages, 1e-12), 1.0)
                classes /= classes.sum(axis=1, keepdims=True)
            scale *= (np.where(got_bins > 0, target_bins / np.maximum(got_bins, 1e-12), 1.0))
        return Calibration(base, classes, error)

    def synthesize(self, n_tokens: int, n_requests: int = 1, prefill_tokens: int | Sequence[int] = 0,
                   seed: int = 0) -> RoutingTrace:
        """A trace of ``n_requests`` requests, each ``prefill_tokens`` prompt tokens (an int, or one per request)
        then its share of ``n_tokens`` decode tokens (split as evenly as possible, earlier requests first)."""
        if n_requests < 1 or n_tokens < n_requests:
            raise ValueError(f"need n_tokens >= n_requests >= 1, got {n_tokens} tokens, {n_requests} requests")
        prefill = [prefill_tokens] * n_requests if np.ndim(prefill_tokens) == 0 else list(prefill_tokens)
        if len(prefill) != n_requests or min(prefill) < 0:
            raise ValueError(f"prefill_tokens must be >= 0, one value or one per request, got {prefill_tokens!r}")
        sampler = _Sampler(self, self.calibration, np.random.default_rng(seed))
        experts, request, is_prefill = [], [], []
        for index in range(n_requests):
            decode = n_tokens // n_requests + (index < n_tokens % n_requests)
            experts.append(sampler.request(decode, prefill[index]))
            request += [index] * (prefill[index] + decode)
            is_prefill += [True] * prefill[index] + [False] * decode
        reuse = self.reuse.source if self.reuse is not None else "none (tokens drawn independently)"
        source = f"routing model (llamapack.routing.model, seed {seed}) of: {self.counts.source}; reuse: {reuse}"
        return RoutingTrace(np.concatenate(experts), np.array(request, dtype=np.int32), np.array(is_prefill),
                            self.counts.n_experts, source)


def _regimes(reuse: ReuseProfile | None) -> tuple[tuple[float, ...], tuple[tuple[float, ...], ...]]:
    """The profile's regime weights and age shares; without one, one regime that only draws "older or never"."""
    if reuse is None:
        return (1.0,), ((0.0,) * MAX_DISTANCE + (1.0,),)
    return reuse.weights, reuse.shares


class _Tilt:
    """The co-activation tilt, sparse: for a chosen (layer, expert), the flat indices ``layer * n_experts + j``
    of the experts it is paired with and their ``lift ** exponent`` (CSR rows over flat keys)."""

    def __init__(self, counts: RoutingCounts, exponent: float):
        n_experts = counts.n_experts
        rows, cols, values = [], [], []
        for layer, pairs in enumerate(counts.pairs):
            i, j = pairs[:, 0].astype(np.intp), pairs[:, 1].astype(np.intp)
            factor = pairs[:, 3] ** exponent
            rows += [layer * n_experts + i, layer * n_experts + j]
            cols += [layer * n_experts + j, layer * n_experts + i]
            values += [factor, factor]
        rows, cols, values = (np.concatenate([*parts, np.zeros(0)]) for parts in (rows, cols, values))
        order = np.argsort(rows, kind="stable")
        self.cols, self.values = cols[order].astype(np.intp), values[order]
        self.indptr = np.searchsorted(rows[order], np.arange(counts.n_layers * n_experts + 1))

    def apply(self, weight: np.ndarray, chosen: np.ndarray) -> None:
        """Multiply ``weight`` ([layers, experts], in place) by the lifts of ``chosen`` (one flat key per layer)."""
        starts, ends = self.indptr[chosen], self.indptr[chosen + 1]
        lengths = ends - starts
        total = int(lengths.sum())
        if total:
            offsets = np.repeat(starts - np.cumsum(lengths) + lengths, lengths) + np.arange(total)
            weight.reshape(-1)[self.cols[offsets]] *= self.values[offsets]


class _Sampler:
    """Draws requests with one calibration; with ``track``, sums the expected age classes (per regime) and
    expert inclusions of every draw (for calibration)."""

    def __init__(self, model: RoutingModel, calibration: Calibration, rng: np.random.Generator, track: bool = False):
        self.counts, self.tilt, self.rng, self.track = model.counts, model.tilt, rng, track
        self.base, self.classes = calibration.base, calibration.classes
        self.regime_weights = np.asarray(_regimes(model.reuse)[0])
        self.regime_weights = self.regime_weights / self.regime_weights.sum()
        self.independent = model.reuse is None
        n_layers, n_experts = self.base.shape
        self.rows = np.arange(n_layers)
        self.class_offsets = (self.rows * N_CLASSES)[:, None]  # flat (layer, class) index = layer * N_CLASSES + class
        self.age_sums = np.zeros_like(self.classes)
        self.inclusion_sums = np.zeros_like(self.base)

    def _per_class(self, age_class: np.ndarray, values: np.ndarray) -> np.ndarray:
        """``[layers, N_CLASSES]``: ``values`` summed per layer and age class."""
        return np.bincount((age_class + self.class_offsets).ravel(), values.ravel(),
                           len(self.rows) * N_CLASSES).reshape(-1, N_CLASSES)

    def request(self, n_decode: int, n_prefill: int) -> np.ndarray:
        n_tokens, (n_layers, n_experts), top_k = n_prefill + n_decode, self.base.shape, self.counts.top_k
        rows, rng = self.rows, self.rng
        out = np.empty((n_tokens, n_layers, top_k), dtype=np.int16)
        last = np.full((n_layers, n_experts), -(1 << 30), dtype=np.int64)
        regimes = rng.choice(len(self.regime_weights), size=n_tokens, p=self.regime_weights)
        eligible = self.base > 0
        flat_rows = rows * n_experts
        for i in range(n_tokens):
            age_class = np.minimum(i - last, N_CLASSES) - 1  # [layers, experts], 0..MAX_DISTANCE
            if self.independent:
                age_class[:] = N_CLASSES - 1
            available = eligible.copy()
            left = self._per_class(age_class, available)  # candidates per layer and class
            weight = self.base.copy()
            probs = self.classes[regimes[i]]
            for j in range(top_k):
                class_probs = probs * (left > 0)
                class_probs /= class_probs.sum(axis=1, keepdims=True)
                chosen_class = _draw_rows(class_probs, rng)
                candidates = weight * available
                if self.track:
                    self._account(class_probs, candidates, age_class, regimes[i], i)
                expert = _draw_rows(np.where(age_class == chosen_class[:, None], candidates, 0.0), rng)
                out[i, :, j] = expert
                available[rows, expert] = False
                left[rows, chosen_class] -= 1
                if self.tilt is not None:
                    self.tilt.apply(weight, flat_rows + expert)
            last[rows[:, None], out[i]] = i
        return out

    def _account(self, class_probs, candidates, age_class, regime, position) -> None:
        """Add this draw's expected class (per regime) and expert probabilities."""
        class_totals = self._per_class(age_class, candidates)
        share = np.take_along_axis(class_probs / np.where(class_totals > 0, class_totals, 1.0), age_class, axis=1)
        self.inclusion_sums += share * candidates
        if position >= MAX_DISTANCE:
            self.age_sums[regime] += class_probs.sum(axis=0)


def _draw_rows(weights: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """One index per row, with probability proportional to that row's non-negative weights (each row has one
    positive weight at least)."""
    cumulative = np.cumsum(weights, axis=1)
    target = rng.random(len(weights)) * cumulative[:, -1]
    index = np.minimum((cumulative <= target[:, None]).sum(axis=1), weights.shape[1] - 1)
    rows = np.arange(len(weights))
    stuck = weights[rows, index] <= 0  # target rounded up to the row's total: take its last positive weight
    if stuck.any():
        index[stuck] = weights.shape[1] - 1 - np.argmax(weights[stuck, ::-1] > 0, axis=1)
    return index
