"""The expert-hook C API, bound on the libllama that llama-cpp-python loaded.

Thin layer: ``ffi``/``lib`` plus typed helpers that check return codes and raise ``NativeError``.
"""
from __future__ import annotations

import ctypes
import functools
from dataclasses import dataclass

from .errors import NativeError

EXPECTED_API_VERSION = 14
MAX_LOOKAHEAD = 8  # LLAMA_EXPERT_MAX_LOOKAHEAD
ROLE_NAMES = {0: "gate", 1: "up", 2: "down", 3: "gate_up"}


def _load_ffi():
    try:
        from ._expert_cffi import ffi  # built by setup.py (cffi_modules)
    except ImportError:  # source checkout without an install: same definitions, parsed at import
        import importlib.util
        from pathlib import Path

        spec = importlib.util.spec_from_file_location(
            "_llamapack_build_ffi", Path(__file__).resolve().parent.parent / "native" / "build_ffi.py")
        if spec is None or spec.loader is None:
            raise NativeError("llamapack's cffi module is not built and native/build_ffi.py is missing")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        ffi = module.ffibuilder
    return ffi


ffi = _load_ffi()


@functools.lru_cache(maxsize=1)
def lib():
    """Open the libllama llama_cpp already loaded and check it carries the llamapack hook."""
    try:
        import llama_cpp.llama_cpp as llama_cpp_module
    except Exception as exc:  # llama_cpp raises plain exceptions when its library is missing
        raise NativeError(f"llama-cpp-python could not be imported: {exc}") from exc
    path = llama_cpp_module._lib._name
    handle = ffi.dlopen(path)
    try:
        version = handle.llama_expert_api_version()
    except AttributeError:
        raise NativeError(
            f"{path} is a vanilla libllama without the llamapack hook; "
            "build the patched one with `python scripts/build_llama.py`") from None
    if version != EXPECTED_API_VERSION:
        raise NativeError(f"{path} has hook API version {version}, llamapack needs {EXPECTED_API_VERSION}; rebuild it")
    return handle


def is_patched() -> bool:
    try:
        lib()
        return True
    except NativeError:
        return False


def _ptr(kind: str, ctypes_pointer) -> object:
    value = ctypes_pointer.value if isinstance(ctypes_pointer, ctypes.c_void_p) else ctypes_pointer
    if not value:
        raise NativeError(f"null {kind} pointer")
    return ffi.cast(f"struct {kind} *", value)


def model_ptr(llama_cpp_model) -> object:
    """cffi pointer to the llama_model behind a llama_cpp ``_internals.LlamaModel``."""
    return _ptr("llama_model", llama_cpp_model.model)


def context_ptr(llama_cpp_context) -> object:
    """cffi pointer to the llama_context behind a llama_cpp ``_internals.LlamaContext``."""
    return _ptr("llama_context", llama_cpp_context.ctx)


@dataclass(frozen=True)
class ExpertTensorInfo:
    """One routed-expert weight tensor as libllama loaded it (all experts of one role in one layer)."""

    index: int          # position in libllama's table (the order role offsets are passed in)
    name: str
    layer: int
    role: str           # gate | up | down | gate_up
    ggml_type: int
    ne: tuple[int, int, int, int]
    nb: tuple[int, int, int, int]
    file_idx: int
    file_offset: int
    nbytes: int
    lazy: bool

    @property
    def n_expert(self) -> int:
        return self.ne[2]

    @property
    def expert_nbytes(self) -> int:
        return self.nb[2]


def expert_tensors(model) -> list[ExpertTensorInfo]:
    """The routed-expert tensors of a loaded model, in libllama's order."""
    handle = lib()
    n = handle.llama_model_expert_tensor_count(model)
    info = ffi.new("struct llama_expert_tensor_info *")
    out = []
    for i in range(n):
        if handle.llama_model_expert_tensor_get(model, i, info) != 0:
            raise NativeError(f"expert tensor {i} of {n} could not be read")
        out.append(ExpertTensorInfo(
            index=i, name=ffi.string(info.name).decode(), layer=info.layer, role=ROLE_NAMES[info.role],
            ggml_type=info.type, ne=tuple(info.ne), nb=tuple(info.nb), file_idx=info.file_idx,
            file_offset=info.file_offset, nbytes=info.nbytes, lazy=bool(info.lazy)))
    return out


def last_error(ctx) -> str:
    return ffi.string(lib().llama_expert_last_error(ctx)).decode(errors="replace")


def attach_pool(ctx, base: int | None, size: int, n_slots: int, tensor_offsets: list[int],
                tensor_strides: list[int], device: int = -1) -> int:
    """Attach a slot pool (see ``llama_expert_pool_desc``) and return its base address.

    ``device=-1``: a host pool at ``base`` that the caller owns. ``device>=0``: ``base`` is None and
    libllama allocates the pool on that GPU. Raises NativeError with libllama's reason.
    """
    offsets = ffi.new("uint64_t[]", tensor_offsets)
    strides = ffi.new("uint64_t[]", tensor_strides)
    desc = ffi.new("struct llama_expert_pool_desc *", {
        "base": ffi.NULL if base is None else ffi.cast("void *", base), "size": size, "n_slots": n_slots,
        "device": device, "tensor_offsets": offsets, "tensor_strides": strides})
    if lib().llama_expert_pool_attach(ctx, desc) != 0:
        raise NativeError(last_error(ctx))
    return int(ffi.cast("uintptr_t", lib().llama_expert_pool_base(ctx)))


def set_provider(ctx, callback) -> None:
    if lib().llama_expert_provider_set(ctx, callback, ffi.NULL) != 0:
        raise NativeError(last_error(ctx))


def set_prefetch(ctx, callback, depth: int = 1) -> None:
    """Turn router lookahead on with ``callback`` (None: off), guessing the next ``depth`` served layers;
    graphs built from now on carry it."""
    if lib().llama_expert_prefetch_set(ctx, ffi.NULL if callback is None else callback, ffi.NULL, depth) != 0:
        raise NativeError(last_error(ctx))


def set_slot_lookup(ctx, max_tokens: int, whole_pool: bool = True) -> None:
    """Remap ubatches of at most ``max_tokens`` tokens on a GPU pool by the slot lookup (0: always the CPU remap
    op); ``whole_pool``: once the pool holds every expert, graphs look slots up in static maps on the pool's
    device (docs/hook.md). Graphs built from now on use it."""
    if lib().llama_expert_slot_lookup_set(ctx, max_tokens, whole_pool) != 0:
        raise NativeError(last_error(ctx))


def set_load_ahead(ctx, min_tokens: int) -> None:
    """After a step of at least ``min_tokens`` tokens (0: off), the next layer's experts in the RAM tier are
    copied into the pool while the layer computes (llama_expert_load_ahead_set; the native hot path's)."""
    if lib().llama_expert_load_ahead_set(ctx, min_tokens) != 0:
        raise NativeError(last_error(ctx))


def set_layer_windows(ctx, min_tokens: int) -> None:
    """Ubatches of at least ``min_tokens`` tokens (0: off) read each layer's experts from one of two windows of
    pool slots, the next layer's loaded from the RAM tier meanwhile (llama_expert_layer_windows_set)."""
    if lib().llama_expert_layer_windows_set(ctx, min_tokens) != 0:
        raise NativeError(last_error(ctx))


def hook_stats(ctx) -> dict:
    """Calls and wall seconds inside the provider and prefetch callbacks, timed on libllama's side, and the
    steps the slot lookup served."""
    out = ffi.new("struct llama_expert_hook_stats *")
    lib().llama_expert_hook_stats_get(ctx, out)
    return dict(provider_calls=out.provider_calls, prefetch_calls=out.prefetch_calls,
                provider_call_s=out.provider_s, prefetch_call_s=out.prefetch_s, lookup_steps=out.lookup_steps,
                whole_pool_steps=out.whole_pool_steps, whole_pool_span=out.whole_pool_span)


def set_fast_path(ctx, pool_policy, tier_policy=None, tier_holds_every_key: bool = False, block_addrs=(),
                  copy_spans=(), first_layer: int = 0, h2d: int | None = None, sync: int | None = None,
                  stream: int = 0, d2d: int | None = None):
    """Turn the native hot path on (``llama_expert_fast_path_desc``): ``pool_policy``/``tier_policy`` are
    policy_native.NativeNextUsePolicy instances (the provider's own), ``block_addrs`` the tier's block
    addresses, ``copy_spans`` (layer, pool offset, slot stride, block offset, nbytes) per role of each served
    layer; ``h2d``/``sync``: addresses of cuMemcpyHtoDAsync_v2 / cuStreamSynchronize for a GPU pool (None: a
    host pool, memcpy); ``d2d``: cuMemcpyDtoDAsync_v2's, for layer windows' experts already in the pool. Returns what must stay alive while it is on (the description's arrays)."""
    blocks = ffi.new("void *[]", [ffi.cast("void *", addr) for addr in block_addrs] or [ffi.NULL])
    spans = ffi.new("struct llama_expert_copy_span[]", [tuple(span) for span in copy_spans] or 1)
    desc = ffi.new("struct llama_expert_fast_path_desc *", {
        "pool": pool_policy.ptr, "tier": tier_policy.ptr if tier_policy is not None else ffi.NULL,
        "tier_holds_every_key": int(tier_holds_every_key), "n_blocks": len(block_addrs), "block_addrs": blocks,
        "n_spans": len(copy_spans), "spans": spans, "first_layer": first_layer,
        "h2d": ffi.cast("llama_expert_h2d_fn", h2d or 0), "sync": ffi.cast("llama_expert_sync_fn", sync or 0),
        "stream": ffi.cast("void *", stream), "d2d": ffi.cast("llama_expert_d2d_fn", d2d or 0)})
    if lib().llama_expert_fast_path_set(ctx, desc) != 0:
        raise NativeError(last_error(ctx))
    return blocks, spans, desc


def clear_fast_path(ctx) -> None:
    lib().llama_expert_fast_path_set(ctx, ffi.NULL)


def set_fast_path_block(ctx, block: int, addr: int) -> None:
    """RAM block ``block`` now lives at ``addr`` (its memory was replaced)."""
    if lib().llama_expert_fast_path_set_block(ctx, block, ffi.cast("void *", addr)) != 0:
        raise NativeError(last_error(ctx))


def fast_path_counts(ctx) -> dict:
    """What the native hot path served, as provider counter totals (telemetry.ProviderCounters names)."""
    out = ffi.new("struct llama_expert_fast_path_stats *")
    lib().llama_expert_fast_path_stats_get(ctx, out)
    return dict(acquires=out.steps, native_steps=out.steps, tokens=out.tokens, cache_hits=out.cache_hits,
                cache_misses=out.cache_misses, cache_evictions=out.cache_evictions, ram_hits=out.ram_hits,
                h2d_bytes=out.h2d_bytes, provide_s=out.seconds, copy_wait_s=out.copy_s,
                cpu_experts=out.cpu_experts, cpu_s=out.cpu_s, ahead_loads=out.ahead_loads,
                ahead_unused=out.ahead_unused, ahead_early=out.ahead_early, ahead_early_s=out.ahead_early_s,
                window_skipped=out.window_skipped, d2d_bytes=out.d2d_bytes, window_from_pool=out.window_from_pool)


def set_hybrid(ctx, upload_share: float, n_threads: int, max_tokens: int, block_offsets, fill_pool: bool = True) -> object:
    """Turn hybrid execution on (``llama_expert_hybrid_desc``; the fast path with a RAM tier must be set):
    ``block_offsets`` per expert tensor (expert_tensors order), its role's offset in a RAM block; ``fill_pool``:
    the CPU's experts are still copied into the pool, behind the step. Graphs built from now on split; returns
    what must stay alive while it is on."""
    offsets = ffi.new("uint64_t[]", list(block_offsets) or [0])
    desc = ffi.new("struct llama_expert_hybrid_desc *", {
        "upload_share": upload_share, "n_threads": n_threads, "max_tokens": max_tokens,
        "tensor_block_offsets": offsets, "fill_pool": int(fill_pool)})
    if lib().llama_expert_hybrid_set(ctx, desc) != 0:
        raise NativeError(last_error(ctx))
    return offsets, desc


def clear_hybrid(ctx) -> None:
    lib().llama_expert_hybrid_set(ctx, ffi.NULL)


def hybrid_probe(ctx, layer: int, block: int, n_reps: int = 20) -> float:
    """Seconds to compute one token's row of ``layer``'s expert in RAM block ``block`` on the CPU (mean)."""
    seconds = lib().llama_expert_hybrid_probe(ctx, layer, block, n_reps)
    if seconds < 0:
        raise NativeError(last_error(ctx))
    return seconds


def set_bench_replay(ctx, prompt_rows, decode_rows, n_prompt: int) -> None:
    """Benchmarks only (``llama_expert_bench_replay_set``): from now on the remap op computes the trace's experts
    (rows: int arrays [n, n_layers, top_k]) in place of the router's, token t of the new request taking its
    row as bench.replay.RoutingReplay says. Outputs are not the model's."""
    import numpy as np

    prompt = np.ascontiguousarray(prompt_rows, dtype=np.int32)
    decode = np.ascontiguousarray(decode_rows, dtype=np.int32)
    if prompt.ndim != 3 or decode.shape[1:] != prompt.shape[1:]:
        raise NativeError(f"replay rows must be [n, n_layers, top_k] (got {prompt.shape} and {decode.shape})")
    rc = lib().llama_expert_bench_replay_set(
        ctx, ffi.cast("const int32_t *", prompt.ctypes.data), len(prompt),
        ffi.cast("const int32_t *", decode.ctypes.data), len(decode), n_prompt, prompt.shape[1], prompt.shape[2])
    if rc != 0:
        raise NativeError(last_error(ctx))


def bench_replay_substituted(ctx) -> int:
    return int(lib().llama_expert_bench_replay_substituted(ctx))


def detach(ctx) -> None:
    lib().llama_expert_detach(ctx)


class lazy_experts_load:
    """Context manager: models loaded inside keep their routed experts on disk (never read by libllama)."""

    def __enter__(self):
        lib().llama_expert_set_lazy_load(True)
        return self

    def __exit__(self, *exc):
        lib().llama_expert_set_lazy_load(False)
        return False
