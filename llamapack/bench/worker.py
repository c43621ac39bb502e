"""One benchmark configuration in its own process: ``python -m llamapack.bench.worker SPEC.json``.

A process per configuration because one process loads one libllama (vanilla or patched, chosen by
LLAMA_CPP_LIB_PATH) and because a memory limit applies to a whole process. Prints one JSON line.

A ``+warm`` config runs in two processes: first the priming phase (``spec["phase"] == "prime"``: the same
settings, warm start on in ``spec["warm_start_dir"]``, which is empty, so it starts cold; it serves the trace
requests of ``spec["warm"]`` and saves the popularity at close), then the measured one, which starts warm from
that folder. Every other config starts cold and saves nothing.

Before them, a thrown-away warm-up prompt of ``spec["warmup_tokens"]`` tokens (``warm_up``; upstream's
batched-bench makes the same). Each prompt is one request from an empty context: evaluate the prompt (prefill;
its end is the time to first token), then decode one token per eval until ``n_decode`` tokens or
``decode_cap_s``: greedy, or with ``temperature`` > 0 sampled from softmax(logits / T) by a generator seeded per
request, so runs with the same logits pick the same tokens. The logits of every step are hashed, so runs that should compute the same
bits can be compared exactly.
"""
from __future__ import annotations

import llama_cpp  # noqa: F401  isort: skip - before numpy (see docs/hook.md: static C++ runtime)

import hashlib
import inspect
import json
import resource
import sys
import time
from pathlib import Path

import numpy as np

from .configs import AHEAD_MIN_TOKENS, BenchConfig
from .workload import prompt_tokens


def load(spec: dict, config: BenchConfig):
    """The model as ``config`` runs it."""
    from ..compat import cpu_moe, model_params_override

    params = dict(n_ctx=spec["n_ctx"], n_batch=spec["n_batch"], n_ubatch=spec["n_ubatch"],
                  n_gpu_layers=config.n_gpu_layers, n_threads=config.n_threads,
                  n_threads_batch=config.n_threads, verbose=False, seed=0)
    if config.source == "vanilla":
        if config.cpu_moe:
            with cpu_moe(use_extra_bufts=config.repack):
                return llama_cpp.Llama(spec["model"], **params)
        with model_params_override(use_extra_bufts=config.repack):
            return llama_cpp.Llama(spec["model"], **params)
    from ..llama import Llama

    ram_cache_mib = config.ram_cache_mib(spec["expert_bytes"])
    extra = {} if ram_cache_mib is None else dict(ram_cache_mib=ram_cache_mib, ram_preload=config.ram_preload)
    if config.prefetch:
        extra.update(prefetch=True, prefetch_top=config.prefetch_top, prefetch_depth=config.prefetch_depth,
                     prefetch_slots=4 * config.prefetch_depth, prefetch_in_flight=config.prefetch_in_flight)
    source = dict(gguf_direct=True) if config.source == "gguf_direct" else dict(pack=spec.get("pack") or True)
    read_splits = config.read_splits if config.read_splits is not None else spec.get("read_splits", 1)
    if config.warm_start != bool(spec.get("warm_start_dir")):
        raise ValueError(f"{config.name}: a warm config runs with a warm_start_dir (its priming session's), "
                         "any other without one")
    # every other config starts cold: no counts carried from an earlier run or config, none saved
    warm = dict(warm_start=True, warm_start_dir=spec["warm_start_dir"]) if config.warm_start else dict(warm_start=False)
    llm = Llama(spec["model"], **source, cache_slots=config.cache_slots(spec["n_experts"]),
                stage_slots=spec.get("stage_slots", 4), read_splits=read_splits, native_reads=config.native_reads,
                **warm, verify_pack_sha256=config.verify, cache_policy=config.cache_policy,
                **hot_path_option(Llama, config), **hybrid_option(Llama, config), **lookup_option(Llama, config),
                **extra, **params)
    served = getattr(getattr(llm._provider, "settings", None), "native_hot_path", True)
    if served != config.native_hot_path:
        llm.close()
        raise RuntimeError(f"{config.name}: asked native_hot_path={config.native_hot_path}, the provider runs "
                           f"with {served}")
    return llm


def hot_path_option(llama_class, config: BenchConfig) -> dict:
    """``native_hot_path`` for ``llamapack.Llama`` when it takes that parameter; {} when it does not and the
    config keeps the default. ``+pyhot`` on a Llama without the parameter is an error, never a silent default
    (llama_cpp.Llama takes unknown keywords and ignores them)."""
    if "native_hot_path" in inspect.signature(llama_class.__init__).parameters:
        return dict(native_hot_path=config.native_hot_path)
    if not config.native_hot_path:
        raise RuntimeError(f"{config.name}: +pyhot needs llamapack.Llama to take native_hot_path "
                           "(StreamingSettings has it; this Llama does not pass it on)")
    return {}


def hybrid_option(llama_class, config: BenchConfig) -> dict:
    """``hybrid`` for ``llamapack.Llama`` when the config asks for it (an error when this Llama lacks it)."""
    if config.hybrid == "off":
        return {}
    if "hybrid" not in inspect.signature(llama_class.__init__).parameters:
        raise RuntimeError(f"{config.name}: +hybrid needs llamapack.Llama to take hybrid")
    return dict(hybrid=config.hybrid)


def lookup_option(llama_class, config: BenchConfig) -> dict:
    """``slot_lookup_max_tokens=0`` for ``+oppath``, ``whole_pool_graphs`` False for ``+nowhole``,
    ``load_ahead_min_tokens`` for ``+ahead``, ``layer_windows_min_tokens`` for ``+windows`` (an error when this Llama lacks the setting); {} otherwise."""
    wanted = ({} if config.slot_lookup else dict(slot_lookup_max_tokens=0)) | (
        {} if config.whole_pool else dict(whole_pool_graphs=False)) | (
        dict(load_ahead_min_tokens=AHEAD_MIN_TOKENS) if config.load_ahead else {}) | (
        dict(layer_windows_min_tokens=AHEAD_MIN_TOKENS) if config.layer_windows else {})
    option = dict(slot_lookup_max_tokens="+oppath", whole_pool_graphs="+nowhole", load_ahead_min_tokens="+ahead",
                  layer_windows_min_tokens="+windows")
    params = inspect.signature(llama_class.__init__).parameters
    for name in wanted:
        if name not in params:
            raise RuntimeError(f"{config.name}: {option[name]} needs llamapack.Llama to take {name}")
    return wanted


def last_logits(llm) -> np.ndarray:
    return np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(llm._ctx.ctx, -1), shape=(llm.n_vocab(),))


def provider_counters(llm) -> dict:
    return llm.pack_stats() if hasattr(llm, "pack_stats") else {}


COUNTER_DELTAS = ("cache_hits", "cache_misses", "cache_evictions", "pack_read_bytes", "h2d_bytes", "read_wait_s",
                  "copy_wait_s", "provide_s", "ram_hits", "ram_misses", "lookahead_keys", "lookahead_hits",
                  "prefetch_reads", "prefetch_used", "prefetch_wasted", "prefetch_wasted_bytes", "prefetch_cancelled",
                  "lookahead_s", "provider_calls", "prefetch_calls", "provider_call_s", "prefetch_call_s",
                  "cpu_experts", "cpu_s", "lookup_steps", "whole_pool_steps", "ahead_loads", "ahead_unused",
                  "ahead_early", "ahead_early_s", "window_skipped",
                  "window_from_pool", "d2d_bytes")


def delta(after: dict, before: dict) -> dict:
    """Counter deltas: COUNTER_DELTAS, and any number whose name mentions the hot path ("hot"), whatever the
    provider calls its native hot path's counters."""
    names = [*COUNTER_DELTAS, *(k for k in after if "hot" in k and k not in COUNTER_DELTAS)]
    return {k: after[k] - before.get(k, 0) for k in names
            if k in after and isinstance(after[k], (int, float)) and not isinstance(after[k], bool)}


def next_token(logits: np.ndarray, temperature: float, rng: np.random.Generator) -> int:
    """Greedy at temperature 0; else a draw from softmax(logits / temperature), in float64."""
    if temperature == 0:
        return int(np.argmax(logits))
    scaled = logits.astype(np.float64) / temperature
    weights = np.exp(scaled - scaled.max())
    return int(rng.choice(len(weights), p=weights / weights.sum()))


def run_request(llm, tokens: list[int], n_decode: int, decode_cap_s: float, temperature: float = 0.0,
                seed: int = 0, replay=None, request_index: int = 0) -> dict:
    """One request: prefill, then decode; timings, counter deltas per phase and logits digests. ``replay``
    (a replay.RoutingReplay, bench runs with ``--routing``): the request replays trace request ``request_index``."""
    rng = np.random.default_rng(seed)
    llm.reset()
    if replay is not None:
        replay.start_request(request_index, len(tokens))
    digests = []
    c0 = provider_counters(llm)
    start = time.perf_counter()
    llm.eval(tokens)
    logits = last_logits(llm)
    token = next_token(logits, temperature, rng)
    ttft = time.perf_counter() - start
    digests.append(hashlib.sha256(logits.tobytes()).hexdigest()[:16])
    c1 = provider_counters(llm)
    generated, kept = [token], []
    eval_s = 0.0  # the model's evaluation alone: the harness's sampling and digests left out
    decode_start = time.perf_counter()
    while len(generated) < n_decode and time.perf_counter() - decode_start < decode_cap_s:
        started = time.perf_counter()
        llm.eval([token])
        logits = last_logits(llm)
        eval_s += time.perf_counter() - started
        kept.append(logits.copy())  # digested after the loop (hashing 0.6 MB of logits costs ~0.5 ms a token)
        token = next_token(logits, temperature, rng)
        generated.append(token)
    decode_s = time.perf_counter() - decode_start
    c2 = provider_counters(llm)
    digests += [hashlib.sha256(row.tobytes()).hexdigest()[:16] for row in kept]
    return dict(n_prompt=len(tokens), prefill_s=ttft, ttft_s=ttft, n_decoded=len(generated) - 1, decode_s=decode_s,
                decode_eval_s=eval_s, decode_capped=len(generated) < n_decode, tokens=generated, digests=digests,
                prefill_counters=delta(c1, c0), decode_counters=delta(c2, c1))


def warm_up(llm, n_tokens: int, replay=None, request_index: int = 0) -> dict:
    """upstream llama-batched-bench's warm-up, ours: a request of a ``n_tokens`` prompt and nothing decoded, thrown
    away before the measured requests (their ``llm.reset()`` reuses its KV cells), so that first-use costs (CUDA
    modules loaded on first launch, cuBLAS handles) fall on neither side's measured prompts. With ``replay`` it
    replays trace request ``request_index``, the one upstream's warm-up replays (bench/upstream.py
    ``replay_segments``)."""
    done = run_request(llm, prompt_tokens(llm, n_tokens), 1, 0.0, replay=replay, request_index=request_index)
    return dict(n_tokens=n_tokens, seconds=done["prefill_s"], counters=done["prefill_counters"])


PROVIDER_FACTS = ("n_slots", "slot_bytes", "pool_bytes", "device", "ram_slots", "prefetch_slots", "prefetch_top",
                  "prefetch_depth", "prefetch_in_flight", "read_engine", "hybrid")


def provider_facts(llm, stats: dict) -> dict:
    facts = {k: stats[k] for k in PROVIDER_FACTS if k in stats}
    settings = getattr(getattr(llm, "_provider", None), "settings", None)
    if settings is not None:
        facts["native_hot_path"] = getattr(settings, "native_hot_path", True)
    return facts


def prime(spec: dict) -> dict:
    """The priming session of a ``+warm`` config: the trace requests of ``spec["warm"]`` (replayed), then close,
    which saves the popularity under ``spec["warm_start_dir"]``; what it ran and which files it left."""
    from ..routing.trace import load_trace
    from .replay import install

    config = BenchConfig(**spec["config"])
    warm = spec["warm"]
    started = time.perf_counter()
    llm = load(spec, config)
    load_s = time.perf_counter() - started
    try:
        replay = install(llm._provider, load_trace(warm["routing"]))
        requests = []
        for item in warm["requests"]:
            done = run_request(llm, prompt_tokens(llm, item["n_prompt"]), item["decode_tokens"] + 1, warm["cap_s"],
                               spec.get("temperature", 0.0), seed=item["request"], replay=replay,
                               request_index=item["request"])
            requests.append(dict(request=item["request"], **{k: done[k] for k in ("n_prompt", "prefill_s", "n_decoded",
                                                                                  "decode_s")}))
    finally:
        llm.close()  # saves the popularity
    files = sorted(Path(spec["warm_start_dir"]).glob("*.json"))
    layers = len(json.loads(files[0].read_text()).get("layers", {})) if files else 0
    return dict(phase="prime", load_s=load_s, requests=requests, saved=[f.name for f in files], layers_saved=layers,
                max_rss_mib=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)


def run(spec: dict) -> dict:
    if spec.get("phase") == "prime":
        return prime(spec)
    config = BenchConfig(**spec["config"])
    started = time.perf_counter()
    llm = load(spec, config)
    load_s = time.perf_counter() - started
    loaded = provider_counters(llm)  # what the start-up did: a warm start's (or preload's) reads
    try:
        replay = None
        if spec.get("routing") and config.uses_provider and not config.own_routing:
            from ..routing.trace import load_trace
            from .replay import install

            replay = install(llm._provider, load_trace(spec["routing"]))
        warmup = (warm_up(llm, spec["warmup_tokens"], replay, len(spec["prompt_lengths"]))
                  if spec.get("warmup_tokens") else None)
        requests = []
        for index, n_prompt in enumerate(spec["prompt_lengths"]):
            requests.append(run_request(llm, prompt_tokens(llm, n_prompt), spec["n_decode"], spec["decode_cap_s"],
                                        spec.get("temperature", 0.0), seed=index, replay=replay, request_index=index))
        facts = provider_facts(llm, provider_counters(llm))  # before close: the provider goes with it
    finally:
        llm.close()
    return dict(config=config.as_dict(), load_s=load_s, load_counters=delta(loaded, {}), warmup=warmup, requests=requests,
                routing="replayed" if replay is not None else "own", provider=facts,
                max_rss_mib=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)


if __name__ == "__main__":
    print(json.dumps(run(json.loads(Path(sys.argv[1]).read_text()))))
