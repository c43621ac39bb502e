"""NextUsePolicy in C++ (native/llama-expert-policy.cpp), behind NextUsePolicy's API.

The same decisions as ``policy_next_use.NextUsePolicy``, bit for bit (tests/test_policy_native.py replays
traces through both); this class only converts keys and plans. One native instance can be shared with the
hook's native hot path: ``ptr`` is its ``struct llama_expert_policy *``.
"""
from __future__ import annotations

import itertools
from typing import Sequence

import numpy as np

from . import native
from .policy_next_use import DEFAULT_HALF_LIFE, DEFAULT_HORIZON, DEFAULT_RATE_HALF_LIFE, check_parameters
from .policy_plan import AcquirePlan, Eviction, Key, SlotAssignment, check_step_fits

_new_tuple = tuple.__new__  # SlotAssignment(...) without the namedtuple's Python-level __new__ (hot path)
_flatten = itertools.chain.from_iterable


class NativeNextUsePolicy:
    """``NextUsePolicy`` (same parameters and public API) on the C API's ``llama_expert_policy_*``.

    ``lib``: the library holding the C API (default: the patched libllama, ``native.lib()``). ``close()``
    frees the native object (else it is freed with this instance); ``resident()`` is ordered by layer (first
    seen first), then expert id, not in the reference's order.
    """

    def __init__(self, n_slots: int, half_life: float = DEFAULT_HALF_LIFE, horizon: int = DEFAULT_HORIZON,
                 rate_half_life: float = DEFAULT_RATE_HALF_LIFE, lib=None):
        check_parameters(n_slots, half_life, horizon, rate_half_life)
        self.n_slots, self.half_life, self.horizon = n_slots, half_life, horizon
        self._lib = lib = lib if lib is not None else native.lib()
        pointer = lib.llama_expert_policy_new(n_slots, half_life, horizon, rate_half_life)
        if pointer == native.ffi.NULL:
            raise MemoryError("llama_expert_policy_new failed")
        self.ptr = native.ffi.gc(pointer, lib.llama_expert_policy_free)
        self._acquire = lib.llama_expert_policy_acquire
        self._capacity = 0
        self._reserve(64)

    def close(self) -> None:
        """Free the native object now (the hook must no longer hold it)."""
        if self.ptr is not None:
            native.ffi.release(self.ptr)
            self.ptr = None

    def _reserve(self, n_keys: int) -> None:
        """Buffers for a call of ``n_keys`` keys (each output has at most one entry per key)."""
        if n_keys <= self._capacity:
            return
        ffi, capacity = native.ffi, max(n_keys, 2 * self._capacity)
        self._keys = ffi.new("int32_t[]", 2 * capacity)
        self._out_keys = ffi.new("int32_t[]", 2 * capacity)
        self._out_slots = ffi.new("int32_t[]", capacity)
        self._out_hits = ffi.new("uint8_t[]", capacity)
        self._out_hits_bool = ffi.cast("_Bool *", self._out_hits)  # unpacks to bools
        self._evicted_keys = ffi.new("int32_t[]", 2 * capacity)
        self._evicted_slots = ffi.new("int32_t[]", capacity)
        self._n_evicted = ffi.new("int32_t *")
        self._capacity = capacity

    def _put_keys(self, keys: Sequence[Key]) -> None:
        self._reserve(len(keys))
        self._keys[0:2 * len(keys)] = _flatten(keys)

    # -- the provider's API
    def acquire(self, keys: Sequence[Key], n_tokens: int = 1) -> AcquirePlan:
        if not isinstance(keys, (list, tuple)):
            keys = list(keys)
        self._put_keys(keys)
        n = self._acquire(self.ptr, self._keys, len(keys), n_tokens, self._out_keys, self._out_slots,
                          self._out_hits, self._evicted_keys, self._evicted_slots, self._n_evicted)
        if n < 0:
            if n == -1:
                check_step_fits(len(dict.fromkeys(keys)), self.n_slots)  # raises CapacityError
            raise ValueError(f"expert keys must be non-negative (layer, expert) pairs: {keys}")
        unpack = native.ffi.unpack
        wanted = keys if n == len(keys) else self._keys_out(self._out_keys, n)  # no repeats: the keys themselves
        assignments = tuple(map(_new_tuple, itertools.repeat(SlotAssignment, n),
                                zip(wanted, unpack(self._out_slots, n), unpack(self._out_hits_bool, n))))
        n_evicted = self._n_evicted[0]
        evictions = tuple(map(Eviction, self._keys_out(self._evicted_keys, n_evicted),
                              unpack(self._evicted_slots, n_evicted))) if n_evicted else ()
        return AcquirePlan(assignments, evictions)

    @staticmethod
    def _keys_out(buffer, n: int) -> list[Key]:
        flat = native.ffi.unpack(buffer, 2 * n)
        return list(zip(flat[0::2], flat[1::2]))

    def abandon(self, key: Key) -> bool:
        return bool(self._lib.llama_expert_policy_abandon(self.ptr, key[0], key[1]))

    def slot_of(self, key: Key) -> int | None:
        slot = self._lib.llama_expert_policy_slot_of(self.ptr, key[0], key[1])
        return slot if slot >= 0 else None

    def resident(self) -> dict[Key, int]:
        n = len(self)
        keys, slots = native.ffi.new("int32_t[]", 2 * n + 2), native.ffi.new("int32_t[]", n + 1)
        n = self._lib.llama_expert_policy_resident(self.ptr, keys, slots, n)
        return dict(zip(self._keys_out(keys, n), native.ffi.unpack(slots, n)))

    def __len__(self) -> int:
        return self._lib.llama_expert_policy_size(self.ptr)

    def layer_size(self, layer: int) -> int:
        """Resident keys of one layer (libllama builds whole-pool graphs once every served layer is whole)."""
        return self._lib.llama_expert_policy_layer_size(self.ptr, layer)

    def __contains__(self, key: Key) -> bool:
        return self.slot_of(key) is not None

    # -- the estimate (tests, warm start)
    def frequency(self, key: Key) -> float:
        return self._lib.llama_expert_policy_frequency(self.ptr, key[0], key[1])

    def reuse_rates(self) -> np.ndarray:
        rates = np.empty(self.horizon + 1)
        self._lib.llama_expert_policy_reuse_rates(self.ptr, native.ffi.from_buffer("double[]", rates), len(rates))
        return rates

    def next_use(self, key: Key) -> float:
        return self._lib.llama_expert_policy_next_use(self.ptr, key[0], key[1])

    # -- warm start (provider.warm)
    def popularity(self) -> dict[int, list[float]]:
        ffi, lib = native.ffi, self._lib
        n_layers = lib.llama_expert_policy_popular_layers(self.ptr, ffi.NULL, 0)
        layers = ffi.new("int32_t[]", max(n_layers, 1))
        lib.llama_expert_policy_popular_layers(self.ptr, layers, n_layers)
        shares = {}
        for layer in ffi.unpack(layers, n_layers):
            n = lib.llama_expert_policy_popularity(self.ptr, layer, ffi.NULL, 0)
            buffer = ffi.new("double[]", max(n, 1))
            lib.llama_expert_policy_popularity(self.ptr, layer, buffer, n)
            shares[layer] = ffi.unpack(buffer, n)
        return shares

    def seed(self, popularity: dict[int, Sequence[float]]) -> None:
        arrays = [np.asarray(shares, dtype=np.float64).ravel() for shares in popularity.values()]
        ffi = native.ffi
        layers = ffi.new("int32_t[]", [int(layer) for layer in popularity] or [0])
        n_shares = ffi.new("int32_t[]", [len(shares) for shares in arrays] or [0])
        shares = np.ascontiguousarray(np.concatenate(arrays) if arrays else np.zeros(1))
        self._lib.llama_expert_policy_seed(self.ptr, layers, n_shares, ffi.from_buffer("double[]", shares),
                                          len(arrays))

    def load_ahead(self, keys: Sequence[Key], pinned: Sequence[Key]) -> AcquirePlan:
        keys, pinned = list(keys), list(pinned)
        self._put_keys(keys)
        pins = native.ffi.new("int32_t[]", list(_flatten(pinned)) or [0])
        n = self._lib.llama_expert_policy_load_ahead(self.ptr, self._keys, len(keys), pins, len(pinned),
                                                     self._out_keys, self._out_slots, self._evicted_keys,
                                                     self._evicted_slots, self._n_evicted)
        if n < 0:
            raise ValueError(f"expert keys must be non-negative (layer, expert) pairs: {keys}, {pinned}")
        unpack, n_evicted = native.ffi.unpack, self._n_evicted[0]
        loads = tuple(SlotAssignment(key, slot, False)
                      for key, slot in zip(self._keys_out(self._out_keys, n), unpack(self._out_slots, n)))
        return AcquirePlan(loads, tuple(map(Eviction, self._keys_out(self._evicted_keys, n_evicted),
                                            unpack(self._evicted_slots, n_evicted))))

    def preload(self, keys: Sequence[Key]) -> tuple[SlotAssignment, ...]:
        keys = list(keys)
        self._put_keys(keys)
        n = self._lib.llama_expert_policy_preload(self.ptr, self._keys, len(keys), self._out_keys, self._out_slots)
        return tuple(SlotAssignment(key, slot, False)
                     for key, slot in zip(self._keys_out(self._out_keys, n), native.ffi.unpack(self._out_slots, n)))

