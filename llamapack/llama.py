"""``llamapack.Llama``: llama-cpp-python's ``Llama`` with routed experts served from an expert pack.

    llm = llamapack.Llama("model.gguf", pack=True, n_ctx=4096)      # <stem>.expert-pack beside the model
    llm = llamapack.Llama("model.gguf", gguf_direct=True)           # no pack: read experts from the GGUF
    llm = llamapack.Llama("model.gguf")                             # exactly llama_cpp.Llama

Only the pack parameters are added; every other argument goes to ``llama_cpp.Llama`` unchanged. In pack
mode the model loads with its routed experts left on disk and, when the pool is in host memory, CPU weight
repacking off (``use_extra_bufts``: llama.cpp's repacked layouts use kernels that round differently from
the GGUF bytes the pool holds).
Experts are served by ``provider.streaming.StreamingProvider``; its settings (``StreamingSettings``) are
keyword parameters of the same names. ``vocab_only=True`` loads the vocabulary only (no provider); a pickled
pack-mode ``Llama`` unpickles in pack mode with the same settings.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, fields

import llama_cpp

from . import native
from .errors import NativeError
from .compat import model_params_override
from .pack import GgufDirectReader, PackReader, default_pack_path, open_gguf
from .provider.streaming import StreamingProvider, StreamingSettings
from .provider.warm import default_warm_start

DEFAULTS = StreamingSettings()


@dataclass(frozen=True)
class PackSettings:
    """Where routed experts come from and how the streaming provider serves them."""

    source: str                 # pack manifest/data path, or the GGUF itself for GGUF-direct
    gguf_direct: bool = False
    streaming: StreamingSettings = DEFAULTS


def resolve_settings(model_path: str, pack, gguf_direct: bool, cache_slots: int | None = None,
                     cache_mib: float | None = None, **streaming) -> PackSettings | None:
    """``cache_slots`` is StreamingSettings.n_slots and ``cache_mib`` its cache_vram_mib (older names)."""
    if pack and gguf_direct:
        raise ValueError("pass either pack= or gguf_direct=True, not both")
    if not (pack or gguf_direct):
        return None
    if cache_mib is not None:
        if streaming.get("cache_vram_mib") not in (None, cache_mib):
            raise ValueError("cache_mib and cache_vram_mib name the same budget: pass one of them")
        streaming["cache_vram_mib"] = cache_mib
    settings = StreamingSettings(n_slots=cache_slots, **streaming)
    if gguf_direct:
        return PackSettings(source=str(model_path), gguf_direct=True, streaming=settings)
    source = default_pack_path(open_gguf(model_path)) if pack is True else os.fspath(pack)
    return PackSettings(source=str(source), streaming=settings)


def default_hybrid_threads(n_threads: int | None) -> int:
    """The cores llama.cpp's own threads leave (they spin at barriers while the CPU rows compute), at least one;
    ``n_threads`` None is llama_cpp.Llama's default (half the cores)."""
    cores = os.cpu_count() or 2
    return max(1, cores - (n_threads or max(cores // 2, 1)))


class Llama(llama_cpp.Llama):
    """``llama_cpp.Llama`` plus: ``pack`` / ``gguf_direct`` (where experts come from), ``cache_slots`` /
    ``cache_mib`` (older names of ``n_slots`` / ``cache_vram_mib``) and the StreamingSettings fields.
    ``warm_start`` is on here unless ``LLAMAPACK_WARM_START=0`` (``warm_start=False``: start cold, save nothing)."""

    def __init__(self, model_path: str, *args, pack=None, gguf_direct: bool = False, cache_slots: int | None = None,
                 cache_mib: float | None = None, direct_io: bool = DEFAULTS.direct_io,
                 verify_pack_sha256: bool = DEFAULTS.verify_pack_sha256,
                 cache_vram_mib: float | None = DEFAULTS.cache_vram_mib,
                 cache_vram_reserve_mib: float = DEFAULTS.cache_vram_reserve_mib,
                 stage_slots: int = DEFAULTS.stage_slots, read_splits: int = DEFAULTS.read_splits,
                 stats_path: str | os.PathLike | None = DEFAULTS.stats_path,
                 stats_flush_interval: int = DEFAULTS.stats_flush_interval,
                 read_timeout_s: float | None = DEFAULTS.read_timeout_s,
                 ram_cache_mib: float | str | None = DEFAULTS.ram_cache_mib, ram_preload: bool = DEFAULTS.ram_preload,
                 prefetch: bool = DEFAULTS.prefetch,
                 prefetch_slots: int = DEFAULTS.prefetch_slots, prefetch_top: int | None = DEFAULTS.prefetch_top,
                 prefetch_depth: int = DEFAULTS.prefetch_depth, prefetch_in_flight: int | None = DEFAULTS.prefetch_in_flight,
                 native_reads: bool | None = DEFAULTS.native_reads, warm_start: bool | None = None,
                 warm_start_dir: str | os.PathLike | None = DEFAULTS.warm_start_dir,
                 cache_policy: str = DEFAULTS.cache_policy, native_hot_path: bool = DEFAULTS.native_hot_path,
                 hybrid: str | float = DEFAULTS.hybrid, hybrid_threads: int | None = DEFAULTS.hybrid_threads,
                 hybrid_fill_pool: bool = DEFAULTS.hybrid_fill_pool,
                 slot_lookup_max_tokens: int = DEFAULTS.slot_lookup_max_tokens,
                 whole_pool_graphs: bool = DEFAULTS.whole_pool_graphs, pool_preload: bool = DEFAULTS.pool_preload,
                 load_ahead_min_tokens: int = DEFAULTS.load_ahead_min_tokens,
                 layer_windows_min_tokens: int = DEFAULTS.layer_windows_min_tokens, **kwargs):
        self._provider = None
        if hybrid_threads is None and str(hybrid).lower() != "off":
            hybrid_threads = default_hybrid_threads(kwargs.get("n_threads"))
        self.pack_settings = resolve_settings(
            model_path, pack, gguf_direct, cache_slots=cache_slots, cache_mib=cache_mib, direct_io=direct_io,
            verify_pack_sha256=verify_pack_sha256, cache_vram_mib=cache_vram_mib,
            cache_vram_reserve_mib=cache_vram_reserve_mib, stage_slots=stage_slots, read_splits=read_splits,
            stats_path=None if stats_path is None else os.fspath(stats_path), stats_flush_interval=stats_flush_interval,
            read_timeout_s=read_timeout_s, ram_cache_mib=ram_cache_mib, ram_preload=ram_preload, prefetch=prefetch,
            prefetch_slots=prefetch_slots, prefetch_top=prefetch_top, prefetch_depth=prefetch_depth,
            prefetch_in_flight=prefetch_in_flight, native_reads=native_reads,
            warm_start=default_warm_start() if warm_start is None else warm_start,
            warm_start_dir=None if warm_start_dir is None else os.fspath(warm_start_dir), cache_policy=cache_policy,
            native_hot_path=native_hot_path, hybrid=hybrid, hybrid_threads=hybrid_threads,
            hybrid_fill_pool=hybrid_fill_pool, slot_lookup_max_tokens=slot_lookup_max_tokens,
            whole_pool_graphs=whole_pool_graphs, pool_preload=pool_preload, load_ahead_min_tokens=load_ahead_min_tokens,
            layer_windows_min_tokens=layer_windows_min_tokens)
        if self.pack_settings is not None and self.pack_settings.streaming.hybrid != "off" and kwargs.get("lora_path"):
            raise ValueError("hybrid does not apply LoRA adapters to the rows it computes on the CPU: "
                             "pass hybrid='off' with lora_path")
        if self.pack_settings is None or kwargs.get("vocab_only"):
            super().__init__(model_path, *args, **kwargs)  # vocab_only: no weights, no experts to serve
            return
        reader = self._open_reader(model_path)  # a bad pack fails here, before the model loads
        # a host pool computes experts with the CPU's plain kernels: keep llama.cpp from repacking the rest
        device = 0 if kwargs.get("n_gpu_layers", 0) and llama_cpp.llama_supports_gpu_offload() else -1
        overrides = {"use_extra_bufts": False} if device < 0 else {}
        try:
            with model_params_override(**overrides), native.lazy_experts_load():
                super().__init__(model_path, *args, **kwargs)
            tensors = native.expert_tensors(native.model_ptr(self._model))
            if not tensors:
                raise NativeError(f"{model_path}: libllama reports no routed-expert tensors (not an MoE model, or a "
                                  "libllama whose hook is not compiled in); nothing to serve from the pack")
            arch = self.metadata.get("general.architecture", "")
            n_used = int(self.metadata.get(f"{arch}.expert_used_count", max(t.n_expert for t in tensors)))
            self._provider = StreamingProvider(
                native.model_ptr(self._model), native.context_ptr(self._ctx), reader, self.pack_settings.streaming,
                n_ubatch=self.context_params.n_ubatch, n_expert_used=n_used, device=device)
        except BaseException:
            reader.close()
            if getattr(self, "_ctx", None) is not None:
                super().close()
            raise

    def _open_reader(self, model_path: str):
        s, streaming = self.pack_settings, self.pack_settings.streaming
        if s.gguf_direct:
            return GgufDirectReader(s.source, direct_io=streaming.direct_io)
        return PackReader(s.source, model=model_path, direct_io=streaming.direct_io,
                          verify_sha256=streaming.verify_pack_sha256)

    def __getstate__(self) -> dict:
        """llama_cpp's state plus the pack parameters: an unpickled copy loads and serves experts the same way."""
        state = super().__getstate__()
        s = self.pack_settings
        if s is not None:
            state.update({f.name: getattr(s.streaming, f.name) for f in fields(s.streaming) if f.name != "n_slots"},
                         cache_slots=s.streaming.n_slots, gguf_direct=s.gguf_direct,
                         pack=None if s.gguf_direct else s.source)
        return state

    def eval(self, tokens):
        try:
            result = super().eval(tokens)
            if self._provider is not None:
                self._provider.after_decode()  # the native steps count towards the stats file's interval
            return result
        except RuntimeError as exc:
            cause = self._provider.error if self._provider is not None else None
            if cause is not None:
                self._provider.error = None
                raise cause from exc  # the provider's own error (file, layer, expert) instead of a return code
            raise

    def pack_stats(self) -> dict:
        """The provider's counters (telemetry.ProviderCounters fields, hit_rate, n_slots...; empty without a pack)."""
        if self._provider is None:
            return {}
        return dict(self._provider.stats(), source=self.pack_settings.source,
                    gguf_direct=self.pack_settings.gguf_direct)

    def close(self) -> None:
        """Release the provider (pool, reader threads, files), then llama.cpp's model and context; idempotent.
        Also safe on an object whose __init__ failed before llama_cpp.Llama's (a bad pack): nothing to free."""
        if getattr(self, "_provider", None) is not None:
            self._provider.close()
            self._provider = None
        if "_stack" in vars(self):
            super().close()

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()
