"""Reference expert provider: the simplest correct one.

A slot pool (numpy in host memory, or device memory libllama allocates on a GPU, written through CuPy),
one expert read at a time through an ``ExpertReader`` (an expert pack, or GGUF-direct) into an aligned
staging block, each role copied to its slot region, LRU eviction that never evicts an expert the current
step uses. It proves the hook bit-exact and is the yardstick for the real provider (pinned staging,
parallel O_DIRECT reads, async copies, LFU/LRU).
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import numpy as np

from .. import native
from ..errors import CapacityError, ModelMismatchError
from ..pack import alloc_slot
from .slots import SlotLayout, aligned_empty

ffi = native.ffi


@dataclass
class ProviderStats:
    """Counters of one provider. Hits and misses count distinct (layer, expert) keys per acquire."""

    acquires: int = 0
    cache_hits: int = 0
    cache_misses: int = 0
    cache_evictions: int = 0
    read_bytes: int = 0
    io_errors: int = 0

    def as_dict(self) -> dict:
        return dict(self.__dict__)


def check_reader_matches_model(reader_layout, tensors) -> None:
    """The reader's layout must describe exactly the expert tensors libllama loaded (fail closed).

    Whole layers the model did not load (deepseek4's MTP blocks, skipped while MTP is off) may be in the
    source: they are never requested. Anything else the model has must match role by role.
    """
    by_key = {(t.layer, t.role): t for t in tensors}
    loaded_layers = {t.layer for t in tensors}
    seen = set()
    for layer in reader_layout.layers:
        if layer.layer not in loaded_layers:
            continue
        for entry in layer.roles:
            t = by_key.get((layer.layer, entry.role))
            where = f"layer {layer.layer} role {entry.role}"
            if t is None:
                raise ModelMismatchError(f"{where}: in the expert source but not in the loaded model")
            if entry.ggml_type != t.ggml_type or tuple(entry.ne) != tuple(t.ne[:3]) or entry.nbytes != t.expert_nbytes:
                raise ModelMismatchError(
                    f"{where}: expert source has type {entry.ggml_type} shape {list(entry.ne)}, the model has "
                    f"type {t.ggml_type} shape {list(t.ne[:3])}")
            seen.add((layer.layer, entry.role))
    missing = sorted(set(by_key) - seen)
    if missing:
        raise ModelMismatchError(f"the expert source lacks {missing[0][1]} of layer {missing[0][0]} "
                                 f"(and {len(missing) - 1} more)")


class ReferenceProvider:
    """Serves routed experts from ``reader`` into a slot pool attached to one llama context.

    ``device`` -1 keeps the pool in host memory (CPU compute); N >= 0 puts it on GPU N (compute there).
    """

    def __init__(self, model_ptr, ctx_ptr, reader, n_slots: int, device: int = -1):
        if n_slots < 1:
            raise CapacityError(f"a slot pool needs at least one slot (asked for {n_slots})")
        self.tensors = native.expert_tensors(model_ptr)
        check_reader_matches_model(reader.layout, self.tensors)
        self.reader = reader
        self.layout = SlotLayout.from_tensors(self.tensors, n_slots)
        self.n_slots = n_slots
        self.device = device
        self.stats = ProviderStats()
        self.error: BaseException | None = None
        self._staging = alloc_slot(reader.layout)
        self._slot_of: OrderedDict[tuple[int, int], int] = OrderedDict()  # LRU order, oldest first
        self._free = list(range(n_slots - 1, -1, -1))
        self._host_pool = None
        host_base = None
        if device < 0:
            self._host_pool = aligned_empty(self.layout.pool_bytes)
            self._host_pool[:] = 0  # kernels may read past row ends: tails stay zero
            host_base = self._host_pool.ctypes.data
        self._ctx = ctx_ptr
        self._callback = ffi.callback(
            "int32_t(void *, int32_t, const int32_t *, int32_t, int32_t, int32_t *)", self._provide)
        self.pool_base = native.attach_pool(
            ctx_ptr, host_base, self.layout.pool_bytes, n_slots,
            self.layout.tensor_offsets(self.tensors), self.layout.tensor_strides(self.tensors), device=device)
        native.set_provider(ctx_ptr, self._callback)

    # called from llama.cpp's compute thread, once per MoE layer per ubatch
    def _provide(self, _user, layer, ids_ptr, n_used, n_tokens, slots_ptr) -> int:
        try:
            n = n_used * n_tokens
            ids = np.frombuffer(ffi.buffer(ids_ptr, 4 * n), dtype=np.int32)
            slots = np.frombuffer(ffi.buffer(slots_ptr, 4 * n), dtype=np.int32)
            slots[:] = self.acquire(layer, ids)
            if self.device >= 0:
                import cupy

                cupy.cuda.runtime.deviceSynchronize()  # every copy done before compute reads the slots
            return 0
        except BaseException as exc:  # noqa: BLE001 - must not unwind into C; reported by the caller
            self.error = exc
            return 1

    def acquire(self, layer: int, expert_ids: np.ndarray) -> np.ndarray:
        """Make every expert in ``expert_ids`` of ``layer`` resident; return their slot ids."""
        distinct = list(dict.fromkeys(int(e) for e in expert_ids))
        if len(distinct) > self.n_slots:
            raise CapacityError(
                f"layer {layer}: one step uses {len(distinct)} distinct experts but the pool has {self.n_slots} slots")
        self.stats.acquires += 1
        active = {(layer, e) for e in distinct}
        for expert in distinct:
            key = (layer, expert)
            if key in self._slot_of:
                self.stats.cache_hits += 1
                self._slot_of.move_to_end(key)
                continue
            self.stats.cache_misses += 1
            slot = self._take_slot(active)
            self._load(layer, expert, slot)
            self._slot_of[key] = slot
        lookup = {e: self._slot_of[(layer, e)] for e in distinct}
        return np.fromiter((lookup[int(e)] for e in expert_ids), dtype=np.int32, count=len(expert_ids))

    def _take_slot(self, active: set[tuple[int, int]]) -> int:
        if self._free:
            return self._free.pop()
        for key in self._slot_of:  # oldest first
            if key not in active:
                self.stats.cache_evictions += 1
                return self._slot_of.pop(key)
        raise CapacityError("every slot holds an expert the current step uses")  # unreachable after the size check

    def _load(self, layer: int, expert: int, slot: int) -> None:
        """Read the expert and copy each role into the slot; on failure the slot goes back to the free list
        (it is mapped to no expert, so nothing computes on its partial bytes)."""
        try:
            block = self.reader.read_expert(layer, expert, self._staging)
        except BaseException:
            self.stats.io_errors += 1
            self._free.append(slot)
            raise
        self.stats.read_bytes += self.reader.layout.expert_stride
        for info in self.layout.tensors_by_layer[layer]:
            entry = self.reader.layout.layer_layout(layer).role(info.role)
            payload = block[entry.offset:entry.offset + entry.nbytes]
            self._write(self.layout.slot_offset(info.role, slot), payload)

    def _write(self, pool_offset: int, payload: np.ndarray) -> None:
        if self.device < 0:
            self._host_pool[pool_offset:pool_offset + payload.nbytes] = payload
        else:
            import cupy

            cupy.cuda.runtime.memcpy(self.pool_base + pool_offset, payload.ctypes.data, payload.nbytes,
                                     cupy.cuda.runtime.memcpyHostToDevice)

    def close(self) -> None:
        if self._ctx is not None:
            native.detach(self._ctx)
            self._ctx = None
        self.reader.close()
