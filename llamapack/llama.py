"""``llamapack.Llama``: llama-cpp-python's ``Llama`` with routed experts served from an expert pack.

    llm = llamapack.Llama("model.gguf", pack=True, n_ctx=4096)      # <stem>.expert-pack beside the model
    llm = llamapack.Llama("model.gguf", gguf_direct=True)           # no pack: read experts from the GGUF
    llm = llamapack.Llama("model.gguf")                             # exactly llama_cpp.Llama

Only the pack parameters are added; every other argument goes to ``llama_cpp.Llama`` unchanged. In pack
mode the model loads with its routed experts left on disk and CPU weight repacking off (``use_extra_bufts``:
llama.cpp's repacked layouts use kernels that round differently from the GGUF bytes the pool holds).
"""
from __future__ import annotations

import os
from dataclasses import dataclass

import llama_cpp

from . import native
from .compat import model_params_override
from .errors import CapacityError
from .pack import GgufDirectReader, PackReader, default_pack_path, open_gguf
from .provider.reference import ReferenceProvider
from .provider.slots import SlotLayout


@dataclass(frozen=True)
class PackSettings:
    """How routed experts are served. ``cache_slots`` wins over ``cache_mib``; neither: one layer's experts."""

    source: str                 # pack manifest/data path, or the GGUF itself for GGUF-direct
    gguf_direct: bool = False
    cache_slots: int | None = None
    cache_mib: float | None = None
    direct_io: bool = True
    verify_pack_sha256: bool = False


def resolve_settings(model_path: str, pack, gguf_direct: bool, **cache) -> PackSettings | None:
    if pack and gguf_direct:
        raise ValueError("pass either pack= or gguf_direct=True, not both")
    if gguf_direct:
        return PackSettings(source=str(model_path), gguf_direct=True, **cache)
    if pack:
        source = default_pack_path(open_gguf(model_path)) if pack is True else os.fspath(pack)
        return PackSettings(source=str(source), **cache)
    return None


def slot_count(settings: PackSettings, tensors, n_ubatch: int, n_expert_used: int) -> int:
    """Slots for the settings; fails when they cannot hold the experts one step of one layer may use."""
    n_expert = max(t.n_expert for t in tensors)
    per_slot = SlotLayout.from_tensors(tensors, 1).slot_bytes
    if settings.cache_slots is not None:
        slots = settings.cache_slots
    elif settings.cache_mib is not None:
        slots = int(settings.cache_mib * (1 << 20) // per_slot)
    else:
        slots = n_expert
    needed = min(n_expert, n_expert_used * n_ubatch)
    if slots < needed:
        raise CapacityError(
            f"the expert cache holds {slots} experts ({per_slot / (1 << 20):.2f} MiB each) but one step of "
            f"{n_ubatch} tokens may use {needed} experts of one layer; raise the budget or lower n_ubatch")
    return slots


class Llama(llama_cpp.Llama):
    def __init__(self, model_path: str, *args, pack=None, gguf_direct: bool = False, cache_slots: int | None = None,
                 cache_mib: float | None = None, direct_io: bool = True, verify_pack_sha256: bool = False, **kwargs):
        self._provider = None
        self.pack_settings = resolve_settings(model_path, pack, gguf_direct, cache_slots=cache_slots,
                                              cache_mib=cache_mib, direct_io=direct_io,
                                              verify_pack_sha256=verify_pack_sha256)
        if self.pack_settings is None:
            super().__init__(model_path, *args, **kwargs)
            return
        reader = self._open_reader(model_path)  # a bad pack fails here, before the model loads
        try:
            with model_params_override(use_extra_bufts=False), native.lazy_experts_load():
                super().__init__(model_path, *args, **kwargs)
            tensors = native.expert_tensors(native.model_ptr(self._model))
            arch = self.metadata.get("general.architecture", "")
            n_used = int(self.metadata.get(f"{arch}.expert_used_count", max(t.n_expert for t in tensors)))
            slots = slot_count(self.pack_settings, tensors, self.context_params.n_ubatch, n_used)
            device = 0 if kwargs.get("n_gpu_layers", 0) and llama_cpp.llama_supports_gpu_offload() else -1
            self._provider = ReferenceProvider(native.model_ptr(self._model), native.context_ptr(self._ctx),
                                               reader, n_slots=slots, device=device)
        except BaseException:
            reader.close()
            if getattr(self, "_ctx", None) is not None:
                super().close()
            raise

    def _open_reader(self, model_path: str):
        s = self.pack_settings
        if s.gguf_direct:
            return GgufDirectReader(s.source, direct_io=s.direct_io)
        return PackReader(s.source, model=model_path, direct_io=s.direct_io, verify_sha256=s.verify_pack_sha256)

    def eval(self, tokens):
        try:
            return super().eval(tokens)
        except RuntimeError as exc:
            cause = self._provider.error if self._provider is not None else None
            if cause is not None:
                self._provider.error = None
                raise cause from exc  # the provider's own error (file, layer, expert) instead of a return code
            raise

    def pack_stats(self) -> dict:
        """The provider's counters (empty without a pack)."""
        if self._provider is None:
            return {}
        stats = self._provider.stats.as_dict()
        keys = stats["cache_hits"] + stats["cache_misses"]
        stats.update(n_slots=self._provider.n_slots, hit_rate=stats["cache_hits"] / keys if keys else 0.0,
                     source=self.pack_settings.source, gguf_direct=self.pack_settings.gguf_direct)
        return stats

    def close(self) -> None:
        if self._provider is not None:
            self._provider.close()
            self._provider = None
        super().close()

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()
