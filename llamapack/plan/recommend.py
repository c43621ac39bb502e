"""The plan's choices: budgets for the slot pool, the RAM tier and the prefill ubatch, a few alternatives, and
the predictions of each (no I/O but the routing trace's cache, through ``hits.decode_trace``).

Recommended: a GPU pool of all the VRAM free after the non-expert weights, the KV cache and the provider's
reserve (``StreamingSettings.cache_vram_reserve_mib``); a host pool (no GPU) of ``host_tier.AUTO_SHARE`` of the
RAM spare after the weights and KV cache; with a GPU pool that does not hold every expert, a RAM tier of
``AUTO_SHARE`` of the spare RAM (what ``--ram-cache-mib auto`` takes) when it holds a layer's working set;
``n_ubatch`` the largest power of two up to 512 whose working set the pool (and tier) can hold.
Refused (CapacityError naming the short number): a pool that cannot hold one layer's top-k experts.
Hybrid (the CPU computing some RAM-tier misses, --hybrid) is not modelled: the plan keeps it off, which
measured best on the H100 (bench/results/gpu_hybrid_README.md).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from ..errors import CapacityError
from ..provider.host_tier import AUTO_SHARE
from ..provider.settings import StreamingSettings
from . import hits
from .model import (DEFAULT_COSTS, MIB, Budgets, Costs, Machine, ModelShape, Prediction, decode_time,
                    memory_use, prefill_time)

VRAM_RESERVE_BYTES = int(StreamingSettings().cache_vram_reserve_mib * MIB)
MAX_UBATCH = 512
PREFILL_LENGTHS = (512, 4096)
HYBRID_NOTE = "hybrid mode (--hybrid, CPU computing some misses): not modelled, the plan keeps it off"


@dataclass(frozen=True)
class PoolRoom:
    """Bytes the pool may take, and how that was reached (for messages)."""

    bytes: int
    basis: str


def mib(n: float) -> str:
    return f"{n / MIB:,.0f} MiB"


def pool_room(shape: ModelShape, machine: Machine, n_ctx: int) -> PoolRoom:
    kv = shape.kv_bytes_per_token * n_ctx
    weights = f"{mib(shape.nonexpert_bytes)} of other weights - {mib(kv)} KV cache for {n_ctx} tokens"
    if machine.gpu:
        room = machine.free_vram_bytes - shape.nonexpert_bytes - kv - VRAM_RESERVE_BYTES
        return PoolRoom(room, f"{mib(machine.free_vram_bytes)} VRAM free - {weights} - {mib(VRAM_RESERVE_BYTES)} reserve")
    room = int(AUTO_SHARE * (machine.spare_ram_bytes - shape.nonexpert_bytes - kv))
    return PoolRoom(room, f"{AUTO_SHARE:g} x ({mib(machine.spare_ram_bytes)} RAM spare - {weights}); no GPU: host pool")


def fitting_ubatch(shape: ModelShape, slots: int, tier_blocks: int = 0) -> int:
    """The largest power of two up to MAX_UBATCH whose layer working set fits the pool (and the tier)."""
    capacity = min(slots, tier_blocks) if tier_blocks else slots
    n_ubatch = MAX_UBATCH
    while n_ubatch > 1 and shape.layer_working_set(n_ubatch) > capacity:
        n_ubatch //= 2
    return n_ubatch


def recommend(shape: ModelShape, machine: Machine, n_ctx: int) -> Budgets:
    """The recommended budgets (module docstring); CapacityError when the model cannot run at all."""
    room = pool_room(shape, machine, n_ctx)
    slots = min(max(room.bytes, 0) // shape.slot_bytes, shape.n_blocks)
    need = shape.layer_working_set(1)
    if slots < need:
        where = "VRAM" if machine.gpu else "RAM"
        raise CapacityError(
            f"{where} is short for {shape.name}: {mib(max(room.bytes, 0))} for the expert cache ({room.basis}), "
            f"but one layer's working set is {need} experts x {shape.slot_bytes / MIB:.2f} MiB = "
            f"{mib(need * shape.slot_bytes)}: {mib(need * shape.slot_bytes - max(room.bytes, 0))} short")
    tier = 0
    if machine.gpu and slots < shape.n_blocks:
        tier = min(int(AUTO_SHARE * machine.spare_ram_bytes) // shape.block_bytes, shape.n_blocks)
        if tier < shape.layer_working_set(1):
            tier = 0
    return Budgets(slots, tier, fitting_ubatch(shape, slots, tier), machine.gpu)


def alternatives(shape: ModelShape, chosen: Budgets) -> list[tuple[str, Budgets]]:
    """The recommendation, then without the tier, then with a half and a quarter of the pool (when they run)."""
    options = [("recommended", chosen)]
    if chosen.tier_blocks:
        options.append(("no RAM tier", Budgets(chosen.pool_slots, 0, fitting_ubatch(shape, chosen.pool_slots), chosen.gpu)))
    for label, share in (("pool / 2", 2), ("pool / 4", 4)):
        slots = chosen.pool_slots // share
        if slots >= shape.layer_working_set(1):
            tier = chosen.tier_blocks if chosen.tier_blocks >= shape.layer_working_set(1) else 0
            options.append((label, Budgets(slots, tier, fitting_ubatch(shape, slots, tier), chosen.gpu)))
    seen, unique = set(), []
    for label, budgets in options:
        if budgets not in seen:
            seen.add(budgets)
            unique.append((label, budgets))
    return unique


def predict(shape: ModelShape, machine: Machine, label: str, budgets: Budgets, trace, n_ctx: int,
            costs: Costs = DEFAULT_COSTS, prefill_lengths=PREFILL_LENGTHS, policy=None,
            prefill_loads: dict | None = None, tier_preloaded: bool = False, prompt_source=None,
            cold_lengths=()) -> Prediction:
    """Decode and prefill predictions for ``budgets`` (``trace``: ``hits.decode_trace(shape)``), prefill at each of
    ``prefill_lengths`` tokens (the second of two such prompts, unless ``prefill_loads`` gives a length's loads per
    ubatch); ``policy``: the pool's and tier's policy class (None: the default policy); ``tier_preloaded``: the
    tier filled at load (``--ram-preload``; the plan's own tier starts cold); ``prompt_source``: the real prompt
    rows of ``hits.prompt_trace(shape)`` (None: tokens drawn independently, an upper bound); ``cold_lengths``: the
    prompt lengths whose ``prefill_loads`` are a process's first request (``Costs.cold_read_factor``)."""
    per_token = hits.decode_loads(trace, budgets.pool_slots, budgets.tier_blocks, policy=policy,
                                  preloaded=tier_preloaded)
    native, whole = budgets.native_hot_path, budgets.whole_pool(shape)
    prefill = {}
    for n_tokens in prefill_lengths:
        per_ubatch = (prefill_loads or {}).get(n_tokens) or hits.prefill_loads(
            shape, n_tokens, budgets.n_ubatch, budgets.pool_slots, budgets.tier_blocks, policy=policy,
            prompt_source=prompt_source)
        prefill[n_tokens] = prefill_time(shape, machine, n_tokens, budgets.n_ubatch, per_ubatch, costs, native,
                                         cold=n_tokens in cold_lengths, whole_pool=whole,
                                         pool_slots=budgets.pool_slots if budgets.gpu else 0)
    return Prediction(label, budgets, decode_time(shape, machine, per_token, costs, native, whole), per_token, prefill,
                      memory_use(shape, budgets, n_ctx), shape.block_bytes)


def plan(shape: ModelShape, machine: Machine, n_ctx: int, trace, costs: Costs = DEFAULT_COSTS,
         step: Callable[[str], None] = lambda label: None, prompt_source=None) -> list[Prediction]:
    """Predictions of the recommendation (first) and its alternatives; ``step(label)`` before each;
    ``prompt_source``: ``hits.prompt_trace(shape)`` (None: prompt tokens drawn independently)."""
    out = []
    for label, budgets in alternatives(shape, recommend(shape, machine, n_ctx)):
        step(label)
        out.append(predict(shape, machine, label, budgets, trace, n_ctx, costs, prompt_source=prompt_source))
    return out
