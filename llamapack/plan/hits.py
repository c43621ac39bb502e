"""Hit rates for ``llamapack plan``: the routing model at the model's shape, replayed through the real cache policy.

Routing: the shipped counts when one has the model's shape (Qwen3-30B-A3B, Qwen3-Next-80B-A3B), else
``shape_counts``: Qwen3-30B-A3B's measured popularity curve of each layer, resampled to the model's expert count
and top-k (no co-activation pairs). ``RoutingModel`` turns the counts into a seeded trace (``decode_trace``), with
the granite reuse profile, as ``llamapack trace synth`` does.

Replay (``replay``) mirrors the streaming provider: one cache step per (token or ubatch, MoE layer), the pool's
policy (``cache_policy.DEFAULT_POLICY``) sees the step's keys, the RAM tier's own policy sees the pool's misses.
Decode figures are measured on the last request of the trace (the earlier ones warm the cache).

Prefill: a prompt ubatch asks, per layer, for the distinct experts of its tokens. They are counted on real prompt
rows, the routing model's prefill rows (``prompt_trace``: the same model at the model's shape, 2 requests of
``PROMPT_TRACE_TOKENS`` prompt tokens), request i of a sequence taking request i's rows (cycled past their end, as
``bench/replay`` does): the model's reuse makes a prompt's tokens share experts (Qwen3-30B shape: ~31 distinct
per layer for 32 tokens, ~101 for 512, where the bench measured 29.7 and 100.1). Without a prompt trace
(``prompt_source=None``) the fallback draws each expert present with ``1 - (1 - p) ** n_ubatch`` from the counts'
inclusion, tokens independent: an upper bound (~79 and ~121 at that shape). One prompt warms the cache, the next
is measured.
"""
from __future__ import annotations

import os
from functools import lru_cache
from pathlib import Path

import numpy as np

from .. import cache_policy
from ..provider.settings import StreamingSettings
from ..routing import RoutingCounts, RoutingModel, RoutingTrace, TraceError, load_trace, save_trace
from ..routing.counts import SHIPPED_COUNTS, load_counts
from .model import ModelShape, StepLoads

REFERENCE_COUNTS = "qwen3-30b-a3b"
TRACE_REQUESTS = 3           # the last one is measured, the others warm the cache
TRACE_PREFILL_TOKENS = 32    # per request
TRACE_DECODE_TOKENS = 160    # per request
TRACE_SEED = 0
PROMPT_TRACE_REQUESTS = 2    # prompts: request i of a sequence takes request i % 2's prefill rows
PROMPT_TRACE_TOKENS = 512    # prefill rows per request: the largest ubatch the plan chooses
COUNTS_TOKENS = 1_000_000    # the heat scale of derived counts (only shares matter)
WARM_TIER_BATCH = 8 * StreamingSettings().stage_slots  # the provider's tier fill reads this many keys a step


def shape_counts(n_layers: int, n_experts: int, top_k: int) -> RoutingCounts:
    """Counts of this shape: shipped ones when a shipped model has it, else the reference model's per-layer
    popularity curves (sorted, resampled by quantile, scaled to top_k picks, each share capped at 1)."""
    for name in SHIPPED_COUNTS:
        counts = _shipped(name)
        if (counts.n_layers, counts.n_experts, counts.top_k) == (n_layers, n_experts, top_k):
            return counts
    reference = _shipped(REFERENCE_COUNTS)
    source_share = np.sort(reference.inclusion(), axis=1)[:, ::-1] / reference.top_k  # [layers, experts], rows sum 1
    x_source = (np.arange(reference.n_experts) + 0.5) / reference.n_experts
    x_target = (np.arange(n_experts) + 0.5) / n_experts
    heat = np.empty((n_layers, n_experts))
    for layer in range(n_layers):
        curve = np.interp(x_target, x_source, source_share[layer * reference.n_layers // n_layers])
        heat[layer] = cap_shares(curve / curve.sum() * top_k) * COUNTS_TOKENS
    return RoutingCounts(heat, tuple(np.zeros((0, 4)) for _ in range(n_layers)), top_k, COUNTS_TOKENS,
                         f"{REFERENCE_COUNTS} popularity resampled to {n_layers} x {n_experts}, top-{top_k}")


def cap_shares(inclusion: np.ndarray) -> np.ndarray:
    """``inclusion`` with no value above 1 and the same sum: the excess goes to the others, in proportion."""
    inclusion, total = inclusion.astype(float).copy(), float(inclusion.sum())
    for _ in range(len(inclusion)):
        over = inclusion > 1
        if not over.any():
            break
        inclusion[over] = 1.0
        free = inclusion < 1
        if not free.any():
            break
        inclusion[free] *= (total - (~free).sum()) / inclusion[free].sum()
    return np.minimum(inclusion, 1.0)  # rounding only: the sum moves by ~1e-15


@lru_cache(maxsize=None)
def _shipped(name: str) -> RoutingCounts:
    return load_counts(name)


def decode_trace(shape: ModelShape, cache_dir: str | os.PathLike | None = None) -> RoutingTrace:
    """The routing model's trace at ``shape`` (module docstring); kept as a ``.npz`` under ``cache_dir``."""
    return _model_trace(shape, cache_dir, TRACE_REQUESTS, TRACE_PREFILL_TOKENS, TRACE_DECODE_TOKENS)


def prompt_trace(shape: ModelShape, cache_dir: str | os.PathLike | None = None) -> RoutingTrace:
    """The routing model's prompt rows at ``shape``: ``PROMPT_TRACE_REQUESTS`` requests of ``PROMPT_TRACE_TOKENS``
    prefill tokens (and one decode token each, which the prompts do not use); cached as ``decode_trace`` is."""
    return _model_trace(shape, cache_dir, PROMPT_TRACE_REQUESTS, PROMPT_TRACE_TOKENS, 1)


def _model_trace(shape: ModelShape, cache_dir, n_requests: int, n_prefill: int, n_decode: int) -> RoutingTrace:
    name = (f"routing-{shape.n_moe_layers}x{shape.n_experts}-top{shape.top_k}-{n_requests}x"
            f"{n_prefill}+{n_decode}-seed{TRACE_SEED}.npz")
    path = Path(cache_dir) / name if cache_dir is not None else None
    if path is not None and path.is_file():
        try:
            return load_trace(path)
        except TraceError:
            pass  # a damaged cache file is drawn again
    counts = shape_counts(shape.n_moe_layers, shape.n_experts, shape.top_k)
    trace = RoutingModel(counts).synthesize(n_requests * n_decode, n_requests, n_prefill, TRACE_SEED)
    if path is not None:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            save_trace(trace, path)
        except OSError:
            pass  # no cache: the next plan draws it again
    return trace


def new_caches(pool_slots: int, tier_blocks: int, policy=None):
    """A pool of ``pool_slots`` and a tier of ``tier_blocks`` (0: None), each with ``policy`` (a policy class;
    None: the default policy)."""
    policy = policy or cache_policy.DEFAULT_POLICY
    return policy(pool_slots), policy(tier_blocks) if tier_blocks else None


def warm_start(pool, tier, popularity: dict[int, list[float]], batch: int = WARM_TIER_BATCH) -> None:
    """What the provider's warm start does with a saved ``popularity`` (``StreamingSettings.warm_start``): both
    policies seeded, the tier's free blocks filled with the hottest experts (``batch`` a step, as no token uses
    them), then the pool's free slots. Policies without a seed (LfuLru, Lru) start cold, as in the provider."""
    from ..provider.warm import hottest

    if not hasattr(pool, "seed"):
        return
    pool.seed(popularity)
    if tier is not None and hasattr(tier, "seed"):
        tier.seed(popularity)
        free = tier.n_slots - len(tier.resident())
        keys = [key for key in hottest(popularity, tier.n_slots) if tier.slot_of(key) is None][:free]
        batch = min(batch, tier.n_slots)
        for first in range(0, len(keys), batch):
            tier.acquire(keys[first:first + batch], n_tokens=0)
    pool.preload(hottest(popularity, pool.n_slots))


def replay(steps: list[list[tuple[int, int]]], measured: list[bool], pool_slots: int, tier_blocks: int,
           n_tokens: int | list[int] = 1, policy=None, preload: list[list[tuple[int, int]]] = (),
           warm: dict[int, list[float]] | None = None) -> StepLoads:
    """Sum the loads of the ``measured`` steps after replaying all of ``steps`` (each of ``n_tokens`` tokens, or
    per step, as the provider tells the policies) through a pool of ``pool_slots`` and a tier of ``tier_blocks``
    (0: none), each with ``policy`` (a policy class; None: the default policy). Also counts the steps with an SSD
    read and their misses (the steps the native hot path sends to Python). ``preload``: steps the tier alone
    acquires (a tier filled at load, ``tier_preload``); ``warm``: a warm start from this popularity, first."""
    pool, tier = start_caches(pool_slots, tier_blocks, policy, preload, warm)
    return run_steps(pool, tier, steps, measured, n_tokens, read=resident_keys(pool, tier))


def start_caches(pool_slots: int, tier_blocks: int, policy=None, preload: list[list[tuple[int, int]]] = (),
                 warm: dict[int, list[float]] | None = None):
    """``new_caches`` as a process starts them: a warm start from ``warm``, then the tier's ``preload`` steps
    (``tier_preload``) into its free blocks, never evicting, as the provider does."""
    pool, tier = new_caches(pool_slots, tier_blocks, policy)
    if warm:
        warm_start(pool, tier, warm)
    for step in preload if tier is not None else ():
        step = [key for key in step if tier.slot_of(key) is None][:tier.n_slots - len(tier.resident())]
        if step:
            tier.acquire(step)
    return pool, tier


def resident_keys(pool, tier) -> set[tuple[int, int]]:
    """The keys the caches hold: read from the disk before the first step (a warm start, a tier preload)."""
    return set(pool.resident()) | (set(tier.resident()) if tier is not None else set())


NO_LOADS = StepLoads(0, 0, 0, 0, 0, 0, 0)  # steps that loaded nothing (every count zero)


def run_steps(pool, tier, steps: list[list[tuple[int, int]]], measured: list[bool],
              n_tokens: int | list[int] = 1, read: set[tuple[int, int]] | None = None) -> StepLoads:
    """``replay``'s loop on caches the caller made (``new_caches``). ``read``: the keys the process has read from
    the disk before (updated), to count the SSD reads that are a key's first (``StepLoads.ssd_first_reads``)."""
    labels = [True if counted else None for counted in measured]
    return run_labelled_steps(pool, tier, steps, labels, n_tokens, read).get(True, NO_LOADS)


def run_labelled_steps(pool, tier, steps: list[list[tuple[int, int]]], labels: list, n_tokens: int | list[int] = 1,
                       read: set[tuple[int, int]] | None = None) -> dict:
    """``run_steps`` summing the loads of each label's steps apart (a step labelled None is not counted)."""
    tokens = n_tokens if isinstance(n_tokens, list) else [n_tokens] * len(steps)
    read = set() if read is None else read
    sums: dict = {}
    for step, label, n in zip(steps, labels, tokens):
        if not step:
            continue
        plan = pool.acquire(step, n_tokens=n)
        misses = [a.key for a in plan.assignments if not a.hit]
        from_disk = misses
        if tier is not None and misses:
            from_disk = [a.key for a in tier.acquire(misses, n_tokens=n).assignments if not a.hit]
        first = [key for key in from_disk if key not in read]
        read.update(first)
        if label is not None:
            total = sums.setdefault(label, [0] * 7)
            for k, value in enumerate((len(plan.assignments), plan.hits, len(misses) - len(from_disk), len(from_disk),
                                       1 if from_disk else 0, len(misses) if from_disk else 0, len(first))):
                total[k] += value
    return {label: StepLoads(*total) for label, total in sums.items()}


def tier_preload(n_layers: int, n_experts: int, tier_blocks: int) -> list[list[tuple[int, int]]]:
    """The steps of a tier filled at load (``ram_preload``): the provider's keys (``host_tier.preload_keys``,
    expert 0 of every layer, then expert 1...), one expert of every layer a step."""
    from ..provider.host_tier import preload_keys

    keys = preload_keys(range(n_layers), n_experts, min(tier_blocks, n_layers * n_experts))
    return [keys[i:i + n_layers] for i in range(0, len(keys), n_layers)]


def decode_loads(trace: RoutingTrace, pool_slots: int, tier_blocks: int, policy=None,
                 preloaded: bool = False) -> StepLoads:
    """Loads per decode token of the trace's last request (the earlier requests warm the cache); ``preloaded``:
    the tier filled at load."""
    last_start = trace.request_bounds()[-1][0]
    measured_tokens = (np.arange(trace.n_tokens) >= last_start) & ~trace.prefill
    measured = np.repeat(measured_tokens, trace.n_layers).tolist()
    preload = tier_preload(trace.n_layers, trace.n_experts, tier_blocks) if preloaded and tier_blocks else []
    total = replay(trace.steps(), measured, pool_slots, tier_blocks, policy=policy, preload=preload)
    return _per(total, int(measured_tokens.sum()))


def ubatch_steps(inclusion: np.ndarray, n_tokens: int, n_ubatch: int, rng: np.random.Generator):
    """Cache steps of one prompt of ``n_tokens``: per ubatch, per layer, the experts drawn present."""
    steps = []
    for start in range(0, n_tokens, n_ubatch):
        size = min(n_ubatch, n_tokens - start)
        present = rng.random(inclusion.shape) < 1 - (1 - np.minimum(inclusion, 1.0)) ** size
        steps += [[(layer, int(e)) for e in np.flatnonzero(row)] for layer, row in enumerate(present)]
    return steps


def prompt_rows(prompts: RoutingTrace, request: int) -> np.ndarray:
    """``[tokens, layers, top_k]``: the prefill rows of ``prompts``' request ``request`` (modulo its requests; its
    decode rows if it has no prefill row, as ``bench/replay`` does)."""
    first, end = prompts.request_bounds()[request % prompts.n_requests]
    rows, prefill = prompts.experts[first:end], prompts.prefill[first:end]
    return rows[prefill] if prefill.any() else rows


def prompt_steps(rows: np.ndarray, n_tokens: int, n_ubatch: int) -> list[list[tuple[int, int]]]:
    """Cache steps of a prompt of ``n_tokens`` whose token t routes as ``rows[t % len(rows)]`` (cycled past the
    rows, as the bench replays them): per ubatch, per layer, the distinct experts its tokens ask for."""
    tokens = rows[np.arange(n_tokens) % len(rows)]
    steps = []
    for start in range(0, n_tokens, n_ubatch):
        ubatch = tokens[start:start + n_ubatch]  # [u, layers, top_k]
        steps += [[(layer, int(e)) for e in np.unique(ubatch[:, layer])] for layer in range(ubatch.shape[1])]
    return steps


def _prompt(shape: ModelShape, prompts: RoutingTrace | None, request: int, n_tokens: int, n_ubatch: int,
            rng: np.random.Generator) -> list[list[tuple[int, int]]]:
    """One prompt's cache steps: the real prompt rows of ``prompts`` (request ``request``), else independent draws."""
    if prompts is not None:
        if (prompts.n_layers, prompts.n_experts) != (shape.n_moe_layers, shape.n_experts):
            raise ValueError(f"prompt trace of {prompts.n_layers} x {prompts.n_experts} for a "
                             f"{shape.n_moe_layers} x {shape.n_experts} model")
        return prompt_steps(prompt_rows(prompts, request), n_tokens, n_ubatch)
    inclusion = shape_counts(shape.n_moe_layers, shape.n_experts, shape.top_k).inclusion()
    return ubatch_steps(inclusion, n_tokens, n_ubatch, rng)


def prefill_loads(shape: ModelShape, n_tokens: int, n_ubatch: int, pool_slots: int, tier_blocks: int,
                  seed: int = TRACE_SEED, policy=None, prompt_source: RoutingTrace | None = None) -> StepLoads:
    """Loads per ubatch of a prompt of ``n_tokens`` after one such prompt warmed the cache: ``prompt_source``'s
    requests 0 then 1 (``prompt_trace``), or, without it, two independent draws (the fallback, an upper bound)."""
    rng = np.random.default_rng(seed)
    warm, measured = (_prompt(shape, prompt_source, i, n_tokens, n_ubatch, rng) for i in range(2))
    total = replay(warm + measured, [False] * len(warm) + [True] * len(measured), pool_slots, tier_blocks,
                   n_tokens=min(n_tokens, n_ubatch), policy=policy)
    return _per(total, -(-n_tokens // n_ubatch))


def priming_popularity(trace: RoutingTrace, requests: list[tuple[int, int, int]], n_ubatch: int, pool_slots: int,
                       tier_blocks: int, policy=None) -> dict[int, list[float]] | None:
    """The popularity a priming session saves at close (a bench ``+warm`` run's first process): ``requests``
    ``(request, n_prompt, n_decoded)`` of ``trace`` served in order from cold caches of these budgets, each prompt
    its request's first ``n_prompt`` prefill rows, then its first ``n_decoded`` decode rows (``bench/replay``);
    the pool's policy's shares (None for a policy without them)."""
    pool, tier = new_caches(pool_slots, tier_blocks, policy)
    if not hasattr(pool, "popularity"):
        return None
    bounds, decode_steps = trace.request_bounds(), trace.steps()
    steps, tokens = [], []
    for request, n_prompt, n_decoded in requests:
        prompt = prompt_steps(prompt_rows(trace, request), n_prompt, n_ubatch)
        steps += prompt
        tokens += [min(n_prompt, n_ubatch)] * len(prompt)
        start, end = bounds[request % len(bounds)]
        for t in [t for t in range(start, end) if not trace.prefill[t]][:n_decoded]:
            steps += decode_steps[t * trace.n_layers:(t + 1) * trace.n_layers]
            tokens += [1] * trace.n_layers
    run_steps(pool, tier, steps, [False] * len(steps), tokens)
    return pool.popularity()


def request_prefill_loads(shape: ModelShape, trace: RoutingTrace, prompts: list[int], n_decoded: list[int],
                          n_ubatch: int, pool_slots: int, tier_blocks: int, seed: int = TRACE_SEED,
                          policy=None, preloaded: bool = False, prompt_source: RoutingTrace | None = None,
                          warm: dict[int, list[float]] | None = None) -> list[StepLoads]:
    """A benchmark's requests in order (prompt ``prompts[i]`` tokens, then ``n_decoded[i]`` decode tokens of the
    trace's request i, as far as it has them), the cache carried from one to the next and empty at the start: the
    loads per ubatch of each prompt. What ``llamapack bench`` measures, where ``prefill_loads`` is a prompt after
    one of the same length. ``preloaded``: the tier filled at load. ``prompt_source``: prompt i takes request
    i's prefill rows (``prompt_trace``); None: independent draws (the fallback). ``warm``: the caches start warm
    from this popularity (``priming_popularity``)."""
    return [prefill for prefill, _ in request_loads(shape, trace, prompts, n_decoded, n_ubatch, pool_slots,
                                                    tier_blocks, seed, policy, preloaded, prompt_source, warm)]


def request_loads(shape: ModelShape, trace: RoutingTrace, prompts: list[int], n_decoded: list[int], n_ubatch: int,
                  pool_slots: int, tier_blocks: int, seed: int = TRACE_SEED, policy=None, preloaded: bool = False,
                  prompt_source: RoutingTrace | None = None,
                  warm: dict[int, list[float]] | None = None, warmup_tokens: int = 0) -> list[tuple[StepLoads, StepLoads]]:
    """``request_prefill_loads``' sequence, one replay: per request, (loads per ubatch of its prompt, loads per
    token of its decode; a request that decoded nothing of the trace: zero loads), first reads counted from the
    process's start (the caches' keys after a warm start or tier preload already read). ``warmup_tokens``: the
    bench's thrown-away warm-up prompt first (request ``len(prompts)``'s rows, as the bench replays it)."""
    rng = np.random.default_rng(seed)
    bounds, decode_steps = trace.request_bounds(), trace.steps()
    steps, tokens, labels, decoded_counts = [], [], [], []
    if warmup_tokens:  # its own draws, so that the measured prompts are those of a run without it
        steps = _prompt(shape, prompt_source, len(prompts), warmup_tokens, n_ubatch, np.random.default_rng(seed + 1))
        tokens, labels = [min(warmup_tokens, n_ubatch)] * len(steps), [("warmup", 0)] * len(steps)
    for i, (n_prompt, n_dec) in enumerate(zip(prompts, n_decoded)):
        prompt = _prompt(shape, prompt_source, i, n_prompt, n_ubatch, rng)
        steps += prompt
        tokens += [min(n_prompt, n_ubatch)] * len(prompt)
        labels += [("prefill", i)] * len(prompt)
        start, end = bounds[i % len(bounds)]
        decoded = [t for t in range(start, end) if not trace.prefill[t]][:n_dec]
        for t in decoded:
            steps += decode_steps[t * trace.n_layers:(t + 1) * trace.n_layers]
        tokens += [1] * (len(decoded) * trace.n_layers)
        labels += [("decode", i)] * (len(decoded) * trace.n_layers)
        decoded_counts.append(len(decoded))
    preload = tier_preload(shape.n_moe_layers, shape.n_experts, tier_blocks) if preloaded and tier_blocks else []
    pool, tier = start_caches(pool_slots, tier_blocks, policy, preload, warm)
    sums = run_labelled_steps(pool, tier, steps, labels, tokens, read=resident_keys(pool, tier))
    return [(_per(sums.get(("prefill", i), NO_LOADS), -(-n_prompt // n_ubatch)),
             _per(sums.get(("decode", i), NO_LOADS), decoded_counts[i]))
            for i, n_prompt in enumerate(prompts)]


def _per(total: StepLoads, n: int) -> StepLoads:
    n = max(n, 1)
    return StepLoads(total.lookups / n, total.pool_hits / n, total.ram_hits / n, total.ssd_reads / n,
                     total.ssd_steps / n, total.ssd_step_misses / n, total.ssd_first_reads / n)
