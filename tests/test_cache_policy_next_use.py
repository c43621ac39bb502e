"""NextUsePolicy (the default): hand-built traces, the exact rule against a plain re-implementation, and hit rates
on real and routing-model traces locked against LRU, LfuLru and Belady."""
from __future__ import annotations

import functools
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from llamapack.cache_policy import (DEFAULT_POLICY, Eviction, LfuLruPolicy, LruPolicy, SlotAssignment, belady_hits,
                                    simulate)
from llamapack.policy_next_use import NextUsePolicy
from llamapack.routing import load_trace

A, B, C, D = (0, 0), (0, 1), (0, 2), (0, 3)
DATA = Path(__file__).parent / "data" / "routing"
GRANITE = Path(__file__).parent.parent / "llamapack" / "routing" / "data" / "granite-3.0-1b-a400m.npz"


def test_it_is_the_default():
    assert DEFAULT_POLICY is NextUsePolicy


# ---------------------------------------------------------------- hand-built traces


def test_the_victim_is_the_key_whose_layer_comes_last_where_lru_evicts_the_next_layers():
    """Layers 0, 1, 2 in a cycle, one key each, 3 slots; then layer 0 asks for its key and a new one. LRU evicts
    layer 1's key (least recent outside the step, and needed next step); NextUse evicts layer 2's (its layer
    comes back last)."""
    warm = [[(0, 0)], [(1, 0)], [(2, 0)]] * 3
    lru, next_use = LruPolicy(3), NextUsePolicy(3)
    for step in warm:
        lru.acquire(step)
        next_use.acquire(step)
    assert lru.acquire([(0, 0), (0, 1)]).evictions == (Eviction((1, 0), 1),)
    assert next_use.acquire([(0, 0), (0, 1)]).evictions == (Eviction((2, 0), 2),)
    assert next_use.acquire([(1, 0)]).hits == 1


def test_a_layer_cycle_that_does_not_fit_keeps_half_not_nothing():
    """3 layers x 2 keys, the same every token, 4 slots (of 6 keys): LRU and LfuLru hit nothing (each miss evicts
    a key needed before any other); NextUse keeps the layers coming up, as Belady does (56 and 58 hits of 120)."""
    trace = [[(layer, 0), (layer, 1)] for _ in range(20) for layer in range(3)]
    assert simulate(LruPolicy, trace, 4)["hits"] == simulate(LfuLruPolicy, trace, 4)["hits"] == 0
    assert belady_hits(trace, 4) == 58
    assert simulate(NextUsePolicy, trace, 4)["hits"] == 56


def test_of_two_keys_of_the_same_age_the_popular_one_stays():
    """A used 4 times, B once, both at the latest visit: LRU evicts A (accessed first in that step), NextUse B."""
    trace = [[A], [A], [A], [A, B]]
    lru, next_use = LruPolicy(2), NextUsePolicy(2)
    for step in trace:
        lru.acquire(step)
        next_use.acquire(step)
    assert lru.acquire([C]).evictions == (Eviction(A, 0),)
    assert next_use.acquire([C]).evictions == (Eviction(B, 1),)
    assert next_use.frequency(A) > next_use.frequency(B) > 0


def test_the_period_of_a_layer_is_measured_and_first_guessed_from_the_layers_seen():
    policy = NextUsePolicy(8)
    for layer in (0, 1, 2):
        policy.acquire([(layer, 0)])
    assert policy._layers[2].period == 3 and policy._layers[0].period == 1  # first visits: layers seen so far
    policy.acquire([(0, 0)])
    assert policy._layers[0].period == 3  # measured: steps 1 and 4
    upcoming = policy.next_use((0, 0))  # ranks layer 0's keys (done lazily, when a victim is looked for)
    p = policy._layers[0].p[policy._layers[0].order.index(0)]
    assert upcoming == pytest.approx(4 + 3 / p)
    assert policy.next_use((5, 5)) == float("inf")


def test_reuse_rates_are_learned_per_age():
    """Key 0 is used at every visit, key 1 at every other one. Age 1 (used at the latest visit): key 0 at every
    visit (used), key 1 at every other (not used): 2 of 3 used. Age 2: key 1, always used. Ages never seen keep
    the prior."""
    policy = NextUsePolicy(16, horizon=4)
    for token in range(400):
        for layer in range(2):
            policy.acquire([(layer, 0), (layer, 1)] if token % 2 == 0 else [(layer, 0)])
    rates = policy.reuse_rates()
    assert rates[0] == pytest.approx(2 / 3, abs=0.01) and rates[1] == pytest.approx(1.0, abs=0.01)
    assert rates[2] == pytest.approx(0.25)  # no key ever had age 3: the prior


def test_a_step_of_two_layers_is_a_visit_of_each():
    policy = NextUsePolicy(4)
    plan = policy.acquire([(0, 1), (1, 1), (0, 2)])
    assert [a.slot for a in plan.assignments] == [0, 1, 2]
    assert policy._layers[0].last == policy._layers[1].last == 1
    plan = policy.acquire([(1, 3), (2, 0)])
    assert policy._layers[1].period == 1 and policy._layers[2].last == 2
    assert len(plan.evictions) == 1 and plan.evictions[0].key in {(0, 1), (0, 2), (1, 1)}


def test_free_slots_first_lowest_first_and_bad_arguments():
    policy = NextUsePolicy(3)
    assert policy.acquire([B, A]).assignments == (SlotAssignment(B, 0, False), SlotAssignment(A, 1, False))
    policy.abandon(B)
    assert policy.acquire([C, D]).assignments == (SlotAssignment(C, 0, False), SlotAssignment(D, 2, False))
    with pytest.raises(ValueError):
        NextUsePolicy(3, half_life=0)
    with pytest.raises(ValueError):
        NextUsePolicy(3, horizon=0)


# ---------------------------------------------------------------- the exact rule


class NextUseReference:
    """The module docstring's rule written plainly: every estimate recomputed per expert in Python (same
    arithmetic as the policy, in the same order, so ties break the same), and at every eviction a full scan of
    the resident keys: per layer the unpinned key of lowest (p, expert), then the layer whose such key has the
    largest next use (ties: lower layer)."""

    def __init__(self, n_slots, half_life=32.0, horizon=32, rate_half_life=1024.0):
        self.n_slots, self.cap = n_slots, horizon + 1
        self.decay, self.rate_decay = 2.0 ** (-1.0 / half_life), 2.0 ** (-1.0 / rate_half_life)
        self.used, self.seen = [0.25] * (horizon + 2), [1.0] * (horizon + 2)
        self.resident, self.free = {}, list(range(n_slots))
        self.layers, self.step = {}, 0

    def visit(self, number, experts):
        if number not in self.layers:
            self.layers[number] = {"counts": [], "ages": [], "period": len(self.layers) + 1, "last": 0, "p": {}}
        else:
            self.layers[number]["period"] = self.step - self.layers[number]["last"]
        layer = self.layers[number]
        layer["last"] = self.step
        while len(layer["counts"]) < max(experts) + 1:
            layer["counts"].append(0.0)
            layer["ages"].append(self.cap)
        counts, ages = layer["counts"], layer["ages"]
        for a in range(self.cap + 1):
            self.seen[a] = self.seen[a] * self.rate_decay + float(sum(1 for x in ages if x == a))
            self.used[a] = self.used[a] * self.rate_decay + float(sum(1 for e in experts if ages[e] == a))
        for e in range(len(counts)):
            counts[e] *= self.decay
        for e in experts:
            counts[e] += 1.0
        for e in range(len(ages)):
            ages[e] = 1 if e in experts else min(ages[e] + 1, self.cap)
        weight = []
        for a in range(self.cap + 1):
            total = 0.0
            for e in range(len(counts)):
                if ages[e] == a:
                    total += counts[e]
            size = float(sum(1 for x in ages if x == a))
            weight.append(self.used[a] * size / max(self.seen[a] * total, 1e-300))
        ranked = {e for (n, e) in self.resident if n == number} | set(experts)
        layer["p"] = {e: weight[ages[e]] * counts[e] for e in ranked}

    def victim(self, pinned):
        best = None
        for number, layer in self.layers.items():
            keys = [(layer["p"][e], e) for (n, e) in self.resident if n == number and (n, e) not in pinned]
            if keys:
                p, expert = min(keys)
                candidate = (layer["last"] + layer["period"] / p, -number)
                if best is None or candidate > best[0]:
                    best = (candidate, (number, expert))
        return best[1]

    def acquire(self, keys):
        self.step += 1
        for number in dict.fromkeys(k[0] for k in keys):
            self.visit(number, [e for n, e in keys if n == number])
        out = []
        for key in keys:
            hit = key in self.resident
            if not hit:
                if self.free:
                    self.free.sort()
                    self.resident[key] = self.free.pop(0)
                else:
                    self.resident[key] = self.resident.pop(self.victim(set(keys)))
            out.append((key, self.resident[key], hit))
        return out

    def abandon(self, key):
        self.free.append(self.resident.pop(key))


step_keys = st.lists(st.tuples(st.integers(0, 3), st.integers(0, 5)), min_size=1, max_size=4, unique=True)


@settings(max_examples=200, deadline=None)
@given(trace=st.lists(step_keys, min_size=1, max_size=40), extra_slots=st.integers(0, 4),
       half_life=st.sampled_from([1.0, 4.0, 32.0]), horizon=st.sampled_from([1, 2, 32]),
       fail_mask=st.lists(st.booleans(), min_size=40, max_size=40))
def test_victims_equal_a_full_scan_of_the_rule(trace, extra_slots, half_life, horizon, fail_mask):
    """The layers' eviction orders and the lazy heap of layers evict exactly the key a full scan picks, with
    steps of several layers and failed loads abandoned."""
    n_slots = max(len(step) for step in trace) + extra_slots
    policy = NextUsePolicy(n_slots, half_life=half_life, horizon=horizon)
    reference = NextUseReference(n_slots, half_life=half_life, horizon=horizon)
    for index, step in enumerate(trace):
        plan = policy.acquire(step)
        assert [tuple(a) for a in plan.assignments] == reference.acquire(step)
        if fail_mask[index] and plan.loads:
            policy.abandon(plan.loads[-1].key)
            reference.abandon(plan.loads[-1].key)
    assert policy.resident() == reference.resident


# ---------------------------------------------------------------- hit rates on routing traces

FRACTIONS = (0.125, 0.25, 0.5)


@functools.lru_cache(maxsize=None)
def decode_rates(path: str) -> dict:
    """Hit rates of decode tokens, pool shared by all layers, n_slots = round(fraction * n_layers * n_experts)."""
    trace = load_trace(path).select("decode")
    steps, n_keys = trace.steps(), trace.n_layers * trace.n_experts
    lookups = sum(len(step) for step in steps)
    slots = [round(fraction * n_keys) for fraction in FRACTIONS]
    return {"lru": [simulate(LruPolicy, steps, n)["hit_rate"] for n in slots],
            "lfu_lru": [simulate(LfuLruPolicy, steps, n)["hit_rate"] for n in slots],
            "next_use": [simulate(NextUsePolicy, steps, n)["hit_rate"] for n in slots],
            "belady": [belady_hits(steps, n) / lookups for n in slots]}


# measured share of Belady's hit rate at 12.5 / 25 / 50% (docs/cache_policy.md); locked 0.01 below
TRACES = {
    "granite (real)": (GRANITE, (0.65, 0.71, 0.85)),
    "qwen3-30b-a3b (routing model)": (DATA / "qwen3-30b-a3b.model-s0.npz", (0.79, 0.96, 0.98)),
    "qwen3-next-80b-a3b (routing model)": (DATA / "qwen3-next-80b-a3b.model-s0.npz", (0.98, 0.99, 0.99)),
}


@pytest.mark.parametrize("name", TRACES)
def test_hit_rate_never_below_lru_or_lfu_lru_and_near_belady(name):
    path, min_share = TRACES[name]
    rates = decode_rates(str(path))
    for i, fraction in enumerate(FRACTIONS):
        ours = rates["next_use"][i]
        assert ours >= rates["lru"][i] and ours >= rates["lfu_lru"][i], (fraction, rates)
        assert ours >= min_share[i] * rates["belady"][i], (fraction, rates)
        assert rates["belady"][i] >= ours


@pytest.mark.parametrize("name", [n for n in TRACES if "routing model" in n])
def test_routing_model_traces_reach_85_percent_of_belady_at_25_and_50(name):
    rates = decode_rates(str(TRACES[name][0]))
    assert all(rates["next_use"][i] >= 0.85 * rates["belady"][i] for i in (1, 2)), rates


def frequency_oracle_rate(path, fraction: float) -> float:
    """The hit rate of the best a popularity estimate could do: each key's real share of its request's decode
    tokens (known in hindsight) as p, ranked by next use = next visit of its layer + n_layers * (1/p - 1)."""
    trace = load_trace(path).select("decode")
    experts, n_experts = trace.experts.astype(np.int64), trace.n_experts
    n_tokens, n_layers, top_k = experts.shape
    share = {}
    for first, end in trace.request_bounds():
        counts = np.zeros((n_layers, n_experts))
        for layer in range(n_layers):
            counts[layer] = np.bincount(experts[first:end, layer].ravel(), minlength=n_experts)
        share.update({token: np.maximum(counts / (end - first), 1e-9) for token in range(first, end)})
    n_slots, resident, hits = round(fraction * n_layers * n_experts), np.zeros((n_layers, n_experts), bool), 0
    for token in range(n_tokens):
        for layer in range(n_layers):
            ids = experts[token, layer]
            hits += int(resident[layer, ids].sum())
            resident[layer, ids] = True
            extra = int(resident.sum()) - n_slots
            if extra > 0:
                distance = (np.arange(n_layers) - layer - 1) % n_layers + 1
                keep = -(distance[:, None] + n_layers * (1 / share[token] - 1))
                keep[~resident] = np.inf
                keep[layer, ids] = np.inf
                resident.ravel()[np.argpartition(keep.ravel(), extra - 1)[:extra]] = False
    return hits / (n_tokens * n_layers * top_k)


def test_on_granite_no_popularity_estimate_reaches_85_percent_of_belady_at_12_and_25():
    """Why the granite trace stays near 2/3 of Belady at 12.5 and 25%: even the true popularity of each expert
    in each request, known in hindsight, gets ~72% and ~77% of Belady's hit rate there (the hindsight-fitted
    models of docs/cache_policy.md add recency and do no better). What Belady has beyond it is knowledge of
    which of several equally likely experts the next token picks."""
    rates = decode_rates(str(GRANITE))
    for i, fraction in ((0, 0.125), (1, 0.25)):
        oracle = frequency_oracle_rate(GRANITE, fraction)
        assert oracle < 0.85 * rates["belady"][i]
        assert rates["next_use"][i] >= 0.9 * oracle  # the online policy gets most of what popularity can give


# ---------------------------------------------------------------- prefill steps


def bench_like_steps(trace, n_prompt: int, n_decode: int) -> list[tuple[int, list]]:
    """(n_tokens, keys) steps as the provider sees a request of each trace request: one step per layer holding
    the union of the prompt's experts (one ubatch), then one step per (decode token, layer)."""
    steps = []
    for first, end in trace.request_bounds():
        rows, prefill = trace.experts[first:end], trace.prefill[first:end]
        prompt = rows[prefill][:n_prompt]
        for layer in range(trace.n_layers):
            steps.append((len(prompt), sorted({(layer, int(e)) for e in prompt[:, layer].ravel()})))
        for row in rows[~prefill][:n_decode]:
            steps += [(1, [(layer, int(e)) for e in row[layer]]) for layer in range(trace.n_layers)]
    return steps


def decode_hit_rate(steps, n_slots: int, tell_tokens: bool) -> float:
    policy, hits, lookups = NextUsePolicy(n_slots), 0, 0
    for n_tokens, keys in steps:
        plan = policy.acquire(keys, n_tokens=n_tokens if tell_tokens else 1)
        if n_tokens == 1:
            hits, lookups = hits + plan.hits, lookups + len(keys)
    return hits / lookups


def test_prefill_steps_do_not_teach_the_estimate():
    """A prompt's step names most of a layer's experts at once; learning reuse rates and popularity from it (as
    from a decode step) drags the following decode's hit rate down. Told the step's token count, the policy
    skips learning there, and the decode hit rate is what the decode steps alone give."""
    trace = load_trace(DATA / "qwen3-30b-a3b.model-s0.npz")
    steps = bench_like_steps(trace, n_prompt=40, n_decode=48)
    n_slots = round(0.125 * trace.n_layers * trace.n_experts)
    decode_only = decode_hit_rate([s for s in steps if s[0] == 1], n_slots, True)
    told, untold = decode_hit_rate(steps, n_slots, True), decode_hit_rate(steps, n_slots, False)
    print(f"\ndecode only {decode_only:.3f}, with prefill steps told {told:.3f}, untold {untold:.3f}")
    assert told >= decode_only - 0.01
    assert told >= untold + 0.015


def test_a_step_of_no_token_teaches_nothing():
    """n_tokens 0 (a preload): keys become resident, but the counts, ages and rates stay as they were."""
    policy = NextUsePolicy(8)
    policy.acquire([(0, 0), (0, 1)])
    rates, frequency = policy.reuse_rates().copy(), policy.frequency((0, 0))
    plan = policy.acquire([(0, 2), (0, 3)], n_tokens=0)
    assert [a.hit for a in plan.assignments] == [False, False] and (0, 3) in policy
    assert np.array_equal(policy.reuse_rates(), rates) and policy.frequency((0, 0)) == frequency
    assert policy.frequency((0, 2)) == 0.0
