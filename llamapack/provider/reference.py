"""Reference host-memory expert provider.

The simplest correct provider: a numpy slot pool, plain ``pread`` of each expert's bytes straight from the
GGUF, LRU eviction that never evicts an expert the current step uses. It exists to prove the hook is
bit-exact and to be the yardstick for the real provider (O_DIRECT, pinned staging, CuPy, LFU/LRU).
"""
from __future__ import annotations

import os
from collections import OrderedDict
from dataclasses import dataclass, field

import numpy as np

from .. import native
from ..errors import CapacityError, PackIOError
from .slots import SlotLayout, aligned_empty

ffi = native.ffi


@dataclass
class ProviderStats:
    """Counters of one provider. Misses and hits count distinct (layer, expert) keys per acquire."""

    acquires: int = 0
    cache_hits: int = 0
    cache_misses: int = 0
    cache_evictions: int = 0
    read_bytes: int = 0
    io_errors: int = 0
    requested_keys: list[tuple[int, int]] = field(default_factory=list, repr=False)


class ReferenceProvider:
    """Serves routed experts from GGUF file(s) into a host slot pool attached to one llama context.

    ``gguf_paths`` lists the model's files in split order (one path for an unsplit model).
    """

    def __init__(self, model_ptr, ctx_ptr, gguf_paths: list[str], n_slots: int, record_trace: bool = False):
        self.tensors = native.expert_tensors(model_ptr)
        if n_slots < 1:
            raise CapacityError(f"a slot pool needs at least one slot (asked for {n_slots})")
        self.layout = SlotLayout.from_tensors(self.tensors, n_slots)
        self.n_slots = n_slots
        self.pool = aligned_empty(self.layout.pool_bytes)
        self.pool[:] = 0
        self._ctx = ctx_ptr
        self._files = [os.open(p, os.O_RDONLY) for p in gguf_paths]
        self._paths = list(gguf_paths)
        self._slot_of: OrderedDict[tuple[int, int], int] = OrderedDict()  # LRU order, oldest first
        self._free = list(range(n_slots - 1, -1, -1))
        self._by_layer = self.layout.tensors_by_layer
        self.stats = ProviderStats()
        self._record = record_trace
        self.error: BaseException | None = None
        self._callback = ffi.callback(
            "int32_t(void *, int32_t, const int32_t *, int32_t, int32_t, int32_t *)", self._provide)
        native.attach_pool(ctx_ptr, self.pool.ctypes.data, self.pool.nbytes, n_slots,
                           self.layout.tensor_offsets(self.tensors), self.layout.tensor_strides(self.tensors))
        native.set_provider(ctx_ptr, self._callback)

    # called from llama.cpp's compute thread, once per MoE layer per ubatch
    def _provide(self, _user, layer, ids_ptr, n_used, n_tokens, slots_ptr) -> int:
        try:
            n = n_used * n_tokens
            ids = np.frombuffer(ffi.buffer(ids_ptr, 4 * n), dtype=np.int32)
            slots = np.frombuffer(ffi.buffer(slots_ptr, 4 * n), dtype=np.int32)
            slots[:] = self.acquire(layer, ids)
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
            if self._record:
                self.stats.requested_keys.append(key)
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
        """Read every role of the expert into the slot; on failure the slot goes back to the free list."""
        try:
            for info in self._by_layer[layer]:
                self._load_role(info, expert, slot)
        except BaseException:
            self._free.append(slot)
            raise

    def _load_role(self, info, expert: int, slot: int) -> None:
        size = info.expert_nbytes
        offset = info.file_offset + expert * size
        path = self._paths[info.file_idx]
        try:
            data = os.pread(self._files[info.file_idx], size, offset)
        except OSError as exc:
            self.stats.io_errors += 1
            raise PackIOError(f"{path}: reading layer {info.layer} expert {expert} {info.role} "
                              f"at offset {offset}: {exc}") from exc
        if len(data) != size:
            self.stats.io_errors += 1
            raise PackIOError(f"{path}: short read for layer {info.layer} expert {expert} {info.role} "
                              f"at offset {offset}: {len(data)} of {size} bytes")
        start = self.layout.slot_offset(info.role, slot)
        self.pool[start:start + size] = np.frombuffer(data, dtype=np.uint8)
        self.stats.read_bytes += size

    def close(self) -> None:
        native.detach(self._ctx)
        for fd in self._files:
            os.close(fd)
        self._files = []
