"""NativeNextUsePolicy (native/llama-expert-policy.cpp) takes NextUsePolicy's decisions bit for bit.

Every test feeds the same calls to the Python reference and to the native port, and asserts equal answers
call by call (plans with their assignments and evictions in order, abandon and preload results, capacity
errors) and an equal estimate at the end (frequencies, popularity, reuse rates and next uses: exact float
equality). Traces: granite's real routing and a qwen3-30b-a3b routing model (in the repository), decode
alone and as the provider sees a request (prefill steps of many tokens, preloads, repeated keys, steps of
two layers, failed loads abandoned, steps larger than the pool), plus random small traces.
"""
from __future__ import annotations

from pathlib import Path

import llama_cpp  # noqa: F401 - the patched libllama, before numpy (see docs/hook.md)
import numpy as np
import pytest

from llamapack import native
from llamapack.errors import CapacityError
from llamapack.policy_native import NativeNextUsePolicy
from llamapack.policy_next_use import NextUsePolicy
from llamapack.routing import load_trace

ROOT = Path(__file__).resolve().parent.parent
GRANITE = ROOT / "llamapack" / "routing" / "data" / "granite-3.0-1b-a400m.npz"  # = ../shared/routing's json
Q30B = ROOT / "bench" / "results" / "q30b_routing_model_seed0.trace.npz"
FRACTIONS = (0.125, 0.25, 0.5)
ODD_PARAMETERS = [dict(half_life=4.0, horizon=3, rate_half_life=64.0), dict(half_life=1, horizon=1, rate_half_life=1.0),
                  dict(half_life=100.0, horizon=60, rate_half_life=5000.0)]


@pytest.fixture(scope="module")
def lib():
    return native.lib()


class Twins:
    """The reference and the native policy, fed the same calls; every answer must be the same."""

    def __init__(self, lib, n_slots: int, **parameters):
        self.reference = NextUsePolicy(n_slots, **parameters)
        self.native = NativeNextUsePolicy(n_slots, lib=lib, **parameters)
        self.n_slots, self.calls, self.failed = n_slots, 0, 0

    def acquire(self, keys, n_tokens: int = 1):
        self.calls += 1
        try:
            expected = self.reference.acquire(keys, n_tokens)
        except CapacityError:
            with pytest.raises(CapacityError):
                self.native.acquire(keys, n_tokens)
            self.failed += 1
            return None
        plan = self.native.acquire(keys, n_tokens)
        assert plan == expected, f"call {self.calls}: {keys} (n_tokens {n_tokens})"
        return plan

    def abandon(self, key) -> None:
        assert self.native.abandon(key) == self.reference.abandon(key), key

    def preload(self, keys) -> None:
        assert self.native.preload(keys) == self.reference.preload(keys)

    def load_ahead(self, keys, pinned):
        plan = self.native.load_ahead(keys, pinned)
        assert plan == self.reference.load_ahead(keys, pinned), f"after call {self.calls}: load_ahead {keys[:4]}..."
        return plan

    def seed(self, popularity) -> None:
        self.reference.seed(popularity)
        self.native.seed(popularity)

    def check_estimate(self, n_layers: int, n_experts: int) -> None:
        """Same residents and the same estimate, bit for bit, for every key of the trace and a few more."""
        reference, ours = self.reference, self.native
        assert ours.resident() == reference.resident() and len(ours) == len(reference)
        popularity = reference.popularity()
        assert list(ours.popularity()) == list(popularity)  # the layers, in first-seen order
        assert {layer: bits(shares) for layer, shares in ours.popularity().items()} == {
            layer: bits(shares) for layer, shares in popularity.items()}
        assert bits(ours.reuse_rates()) == bits(reference.reuse_rates())
        keys = [(layer, expert) for layer in range(n_layers + 1) for expert in range(n_experts + 1)]
        assert bits(map(ours.frequency, keys)) == bits(map(reference.frequency, keys))
        assert bits(map(ours.next_use, keys)) == bits(map(reference.next_use, keys))
        assert [ours.slot_of(key) for key in keys] == [reference.slot_of(key) for key in keys]
        # per-layer residency (what libllama's whole-pool graphs wait for), against the reference's residents
        per_layer = [sum(1 for layer, _ in reference.resident() if layer == wanted) for wanted in range(n_layers + 1)]
        assert [ours.layer_size(layer) for layer in range(n_layers + 1)] == per_layer
        assert ours.layer_size(-1) == 0 and ours.layer_size(10**6) == 0


def bits(values) -> bytes:
    """The doubles' bytes: exact equality that tells -0.0 from 0.0 and matches NaN with NaN."""
    return np.fromiter(values, dtype=np.float64).tobytes()


def decode_steps(path: Path, n_tokens: int | None = None) -> list[list[tuple[int, int]]]:
    trace = load_trace(path).select("decode")
    return trace.steps()[:None if n_tokens is None else n_tokens * trace.n_layers]


def request_steps(path: Path, n_prompt: int, n_decode: int) -> list[tuple[int, list]]:
    """(n_tokens, keys) per step as the provider sees each request: per layer one step of the prompt's experts
    (one ubatch, in the order the router named them: repeats included), then one step per (token, layer)."""
    trace, steps = load_trace(path), []
    for first, end in trace.request_bounds():
        rows, prefill = trace.experts[first:end], trace.prefill[first:end]
        prompt = rows[prefill][:n_prompt]
        for layer in range(trace.n_layers):
            steps.append((len(prompt), [(layer, int(e)) for e in prompt[:, layer].ravel()]))
        for row in rows[~prefill][:n_decode]:
            steps += [(1, [(layer, int(e)) for e in row[layer]]) for layer in range(trace.n_layers)]
    return steps


def replay_perturbed(twins: Twins, steps, n_layers: int, n_experts: int, seed: int) -> None:
    """The steps, with what the provider (or a misuse) adds now and then: repeated keys, a decode step told
    several tokens (not learned from), a preload step (n_tokens 0) of the next layer's keys, two layers in one
    step, failed loads abandoned, a stray abandon, a step larger than the pool."""
    rng = np.random.default_rng(seed)
    index = 0
    while index < len(steps):
        n_tokens, keys = steps[index]
        keys, index = list(keys), index + 1
        roll = rng.random()
        if roll < 0.05 and keys:  # a key named again, anywhere after its first use
            at = int(rng.integers(0, len(keys)))
            keys.insert(int(rng.integers(at + 1, len(keys) + 1)), keys[at])
        elif roll < 0.08 and n_tokens == 1:
            n_tokens = int(rng.integers(2, 9))
        elif roll < 0.10 and index < len(steps):
            twins.acquire(steps[index][1], n_tokens=0)
        elif roll < 0.12 and index < len(steps):
            keys, index = keys + list(steps[index][1]), index + 1
        elif roll < 0.13 and twins.n_slots < n_layers * n_experts:
            flat = rng.choice(n_layers * n_experts, size=twins.n_slots + 1, replace=False)
            assert twins.acquire([(int(k) // n_experts, int(k) % n_experts) for k in flat]) is None
        plan = twins.acquire(keys, n_tokens)
        if plan is None:
            continue
        roll = rng.random()
        if roll < 0.05 and plan.loads:  # the last loads failed
            for load in plan.loads[-int(rng.integers(1, len(plan.loads) + 1)):]:
                twins.abandon(load.key)
        elif roll < 0.07:
            twins.abandon((int(rng.integers(0, n_layers)), int(rng.integers(0, n_experts))))


def pools(n_keys: int, top_k: int) -> list[int]:
    return [round(fraction * n_keys) for fraction in FRACTIONS] + [top_k, top_k + 1, 2 * top_k + 3]


# ---------------------------------------------------------------- traces


@pytest.mark.parametrize("n_slots", pools(24 * 32, 8))
def test_granite_decode(lib, n_slots):
    twins = Twins(lib, n_slots)
    for keys in decode_steps(GRANITE):  # 192 tokens x 24 layers
        twins.acquire(keys)
    twins.check_estimate(24, 32)


@pytest.mark.parametrize("n_slots", pools(48 * 128, 8))
def test_qwen3_30b_routing_model_decode(lib, n_slots):
    twins = Twins(lib, n_slots)
    for keys in decode_steps(Q30B, n_tokens=100):  # of 400
        twins.acquire(keys)
    twins.check_estimate(48, 128)


@pytest.mark.parametrize("n_slots", pools(24 * 32, 8))
def test_granite_requests_with_prefill_preloads_repeats_and_failed_loads(lib, n_slots):
    twins = Twins(lib, n_slots)
    replay_perturbed(twins, request_steps(GRANITE, n_prompt=64, n_decode=64), 24, 32, seed=n_slots)
    assert twins.failed > 0  # steps larger than the pool were refused alike
    twins.check_estimate(24, 32)


@pytest.mark.parametrize("n_slots", pools(48 * 128, 8))
def test_qwen3_30b_requests_with_prefill_preloads_repeats_and_failed_loads(lib, n_slots):
    twins = Twins(lib, n_slots)
    replay_perturbed(twins, request_steps(Q30B, n_prompt=48, n_decode=40), 48, 128, seed=n_slots)
    twins.check_estimate(48, 128)


def replay_with_load_ahead(twins: Twins, steps, n_layers: int, n_experts: int) -> int:
    """The steps, each multi-token one followed by a load-ahead of the next layer's every expert with the step's
    keys pinned (what the native hot path does on a prefill ubatch); returns how many keys were loaded ahead."""
    loaded = 0
    for n_tokens, keys in steps:
        plan = twins.acquire(keys, n_tokens)
        if plan is not None and n_tokens > 1 and keys[0][0] + 1 < n_layers:
            ahead = twins.load_ahead([(keys[0][0] + 1, e) for e in range(n_experts)], keys)
            assert all(key in twins.reference for key in distinct(keys))  # the step's keys kept their slots
            loaded += len(ahead.assignments)
    return loaded


def distinct(keys):
    return list(dict.fromkeys(keys))


@pytest.mark.parametrize("n_slots", pools(24 * 32, 8))
def test_granite_requests_with_load_ahead(lib, n_slots):
    twins = Twins(lib, n_slots)
    loaded = replay_with_load_ahead(twins, request_steps(GRANITE, n_prompt=64, n_decode=32), 24, 32)
    assert loaded > 0 or n_slots < 32  # a 64-token step of granite wants nearly all 32 experts of its layer
    twins.check_estimate(24, 32)


@pytest.mark.parametrize("n_slots", pools(48 * 128, 8)[:3])
def test_qwen3_30b_requests_with_load_ahead(lib, n_slots):
    twins = Twins(lib, n_slots)
    assert replay_with_load_ahead(twins, request_steps(Q30B, n_prompt=48, n_decode=20), 48, 128) > 0
    twins.check_estimate(48, 128)


def test_load_ahead_keeps_the_pins_and_stops_when_only_pins_are_left(lib):
    twins = Twins(lib, 6)
    step = [(0, 0), (0, 1), (0, 2)]
    for t in range(6):
        twins.acquire([(1, t % 4), (2, t % 3)])
    twins.acquire(step, 16)
    plan = twins.load_ahead([(1, e) for e in range(8)], step)
    assert len(twins.reference) == 6 and all(key in twins.reference for key in step)
    resident_ahead = [key for key in twins.reference.resident() if key[0] == 1]
    assert len(resident_ahead) == 3 and {load.key for load in plan.assignments} <= set(resident_ahead)
    assert twins.load_ahead([(1, e) for e in range(8)], step).assignments == ()  # nothing left to evict
    with pytest.raises(ValueError):
        twins.native.load_ahead([(-1, 0)], step)


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")  # the reference's unused rate[0]
@pytest.mark.parametrize("parameters", ODD_PARAMETERS)
def test_other_parameters(lib, parameters):
    twins = Twins(lib, 96, **parameters)
    replay_perturbed(twins, request_steps(GRANITE, n_prompt=16, n_decode=48), 24, 32, seed=3)
    twins.check_estimate(24, 32)


@pytest.mark.parametrize("n_slots", [12, 96, 384])
def test_seed_then_preload_then_requests(lib, n_slots):
    """As a warm start: the popularity of an earlier session seeds both (with an empty layer and a layer of no
    trace), the hottest keys are preloaded (more than fit, repeats, a layer never seeded), then requests."""
    earlier = NextUsePolicy(384)
    for keys in decode_steps(GRANITE, n_tokens=64):
        earlier.acquire(keys)
    popularity = {**earlier.popularity(), 7: [], 40: [0.5, 0.25]}
    twins = Twins(lib, n_slots)
    twins.seed(popularity)
    hottest = sorted(((share, layer, expert) for layer, shares in popularity.items()
                      for expert, share in enumerate(shares)), reverse=True)
    preload = [(layer, expert) for _, layer, expert in hottest[:n_slots + 8]]
    twins.preload([(50, 3), preload[0], *preload, (50, 3)])
    twins.check_estimate(24, 32)
    replay_perturbed(twins, request_steps(GRANITE, n_prompt=16, n_decode=32), 24, 32, seed=n_slots)
    twins.check_estimate(24, 32)


def test_seed_after_acquires_leaves_seen_layers_alone_and_preload_of_new_layers(lib):
    twins = Twins(lib, 20)
    for keys in decode_steps(GRANITE, n_tokens=3):
        twins.acquire(keys)
    twins.seed({0: [0.1] * 32, 30: [0.2, 0.3], 31: np.full(4, 0.125)})
    twins.preload([(30, 1), (32, 0), (33, 5), (31, 2)])  # seeded, then new layers: periods len(layers) + 1
    twins.preload([(34, 0)])  # the pool is full: nothing
    for keys in decode_steps(GRANITE, n_tokens=6):
        twins.acquire(keys)
    twins.check_estimate(35, 32)


def test_random_small_traces(lib):
    """Few layers and experts, tiny pools: every rule meets every other often (a victim in a layer of the same
    step, pinned fronts, preloaded keys of p 0, abandoned fronts, the layer heap's compaction)."""
    rng = np.random.default_rng(11)
    for trial in range(120):
        n_layers, n_experts = int(rng.integers(1, 5)), int(rng.integers(2, 8))
        parameters = ODD_PARAMETERS[trial % len(ODD_PARAMETERS)] if trial % 4 == 0 else {}
        twins = Twins(lib, int(rng.integers(1, 9)), **parameters)
        if trial % 5 == 0:
            twins.seed({layer: rng.random(n_experts).tolist() for layer in range(n_layers) if rng.random() < 0.7})
            twins.preload([(int(rng.integers(0, n_layers)), int(rng.integers(0, n_experts))) for _ in range(6)])
        for _ in range(80):
            action = rng.random()
            if action < 0.1 and len(twins.native):
                key = list(twins.reference.resident())[int(rng.integers(0, len(twins.native)))]
                twins.abandon(key)
                continue
            if action < 0.13:
                twins.preload([(int(rng.integers(0, n_layers)), int(rng.integers(0, n_experts))) for _ in range(3)])
                continue
            layers = rng.choice(n_layers, size=1 + (rng.random() < 0.2 and n_layers > 1), replace=False)
            keys = [(int(layer), int(rng.integers(0, n_experts))) for layer in layers
                    for _ in range(int(rng.integers(1, 4)))]
            n_tokens = int(rng.choice([1, 1, 1, 0, 4]))
            plan = twins.acquire(keys, n_tokens)
            if plan is not None and plan.loads and rng.random() < 0.15:
                twins.abandon(plan.loads[-1].key)
        twins.check_estimate(n_layers, n_experts)


# ---------------------------------------------------------------- the API


def test_a_step_larger_than_the_pool_changes_nothing(lib):
    twins = Twins(lib, 10)
    for keys in decode_steps(GRANITE, n_tokens=2):
        twins.acquire(keys)
    before = (twins.native.resident(), twins.native.popularity(), twins.native.reuse_rates().tolist())
    assert twins.acquire([(0, e) for e in range(11)] + [(0, 0)] * 5) is None
    assert (twins.native.resident(), twins.native.popularity(), twins.native.reuse_rates().tolist()) == before
    for keys in decode_steps(GRANITE, n_tokens=2):
        twins.acquire(keys)
    twins.check_estimate(24, 32)


def test_plans_have_the_reference_types_and_the_native_object_is_freed(lib):
    policy = NativeNextUsePolicy(4, lib=lib)
    plan = policy.acquire([(0, 1), (0, 2), (0, 1)])
    assert [tuple(a) for a in plan.assignments] == [((0, 1), 0, False), ((0, 2), 1, False)]
    assert all(type(a.hit) is bool for a in plan.assignments) and policy.acquire([(0, 1)]).assignments[0].hit is True
    assert (0, 2) in policy and (0, 3) not in policy and len(policy) == 2 and policy.slot_of((0, 3)) is None
    assert policy.frequency((9, 9)) == 0.0 and policy.next_use((9, 9)) == float("inf")
    assert policy.acquire([]).assignments == () and policy.acquire(iter([(1, 1)])).assignments[0].slot == 2
    big = [(layer, 0) for layer in range(100)]  # more keys than the buffers first held
    with pytest.raises(CapacityError, match="needs 100 distinct experts"):
        policy.acquire(big)
    assert NativeNextUsePolicy(200, lib=lib).acquire(big).assignments[99] == ((99, 0), 99, False)
    with pytest.raises(ValueError):
        policy.acquire([(0, -1)])
    assert len(policy) == 3
    assert native.ffi.typeof(policy.ptr) is native.ffi.typeof("struct llama_expert_policy *")
    policy.close()
    assert policy.ptr is None
    policy.close()


def test_bad_arguments_as_the_reference(lib):
    for cls in (NextUsePolicy, lambda *a, **k: NativeNextUsePolicy(*a, lib=lib, **k)):
        with pytest.raises(CapacityError):
            cls(0)
        for bad in (dict(half_life=0), dict(horizon=0), dict(rate_half_life=-1.0), dict(half_life=float("nan"))):
            with pytest.raises(ValueError):
                cls(3, **bad)
    assert lib.llama_expert_policy_new(0, 32.0, 32, 1024.0) == native.ffi.NULL
    assert lib.llama_expert_policy_new(3, 32.0, 0, 1024.0) == native.ffi.NULL
