"""Host-RAM tier: whole expert blocks kept in host memory (pinned for a GPU pool) between the SSD and the pool.

Pure bookkeeping, no I/O. Its own instance of the default policy over (layer, expert) keys (measured best on
the pool's misses too: docs/cache_policy.md) sees the slot-pool misses of each step: a key already in a RAM
block is a *RAM hit* (the provider copies from that block, no SSD read); any other key is a *RAM miss*, given
a block to read into (its previous key, if any, is evicted from RAM).
The step's keys are pinned, so a block the step copies from is never refilled in the same step; the
copier's per-block events keep a refill from overtaking an earlier copy out of the block. A read that fails
(or is not known to have completed and passed its check) is ``abandon``-ed: its block is freed, mapped to
no key. An expert evicted from the pool stays in RAM until the tier itself evicts it.

``tier_blocks`` sizes the tier (``ram_cache_mib="auto"``: half the spare RAM, ``spare_ram_bytes``);
``chunked_blocks`` carves the blocks out of a few large allocations; ``preload_keys`` is what a preload
(``ram_preload``) fills the tier with before the first decode.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np

from ..cache_policy import DEFAULT_POLICY, CachePolicy, Key, distinct_keys
from ..errors import CapacityError
from .settings import MIB, StreamingSettings

CHUNK_BYTES = 1 << 30  # one allocation holds at most this many bytes of blocks (at least one block)
AUTO = "auto"
AUTO_SHARE = 0.5  # of the spare RAM; the rest stays for the KV cache, compute buffers and the page cache


@dataclass(frozen=True)
class TierPlan:
    """For one step's slot-pool misses: (key, block) pairs already in RAM and to be read, and RAM evictions."""

    hits: tuple[tuple[Key, int], ...]
    misses: tuple[tuple[Key, int], ...]
    evictions: int


class HostTier:
    """``n_blocks`` RAM blocks of whole experts, managed by a cache policy (a block id is a policy slot):
    ``policy_class``, the default policy unless told otherwise.

    ``n_keys``: how many distinct keys there can be (layers x experts served), if known. A tier of at least
    that many blocks never evicts, so its policy's estimate never decides anything: a step whose keys are all
    in RAM then skips the policy (same plan, no estimate update); misses still go through it (free blocks,
    lowest first)."""

    def __init__(self, n_blocks: int, policy_class: Callable[[int], CachePolicy] = DEFAULT_POLICY,
                 n_keys: int | None = None):
        self.n_blocks = n_blocks
        self.policy = policy_class(n_blocks)
        self.holds_every_key = n_keys is not None and n_blocks >= n_keys

    def plan(self, keys: Sequence[Key], n_tokens: int = 1) -> TierPlan:
        """Where each of ``keys`` (distinct slot-pool misses of one step) comes from; pins them for the step."""
        if self.holds_every_key:
            keys = distinct_keys(keys)
            blocks = [self.policy.slot_of(key) for key in keys]
            if None not in blocks:  # all RAM hits, and no eviction can ever happen: nothing to decide
                return TierPlan(tuple(zip(keys, blocks)), (), 0)
        plan = self.policy.acquire(keys, n_tokens=n_tokens)
        hits = tuple((a.key, a.slot) for a in plan.assignments if a.hit)
        misses = tuple((a.key, a.slot) for a in plan.assignments if not a.hit)
        return TierPlan(hits, misses, len(plan.evictions))

    def abandon(self, key: Key) -> bool:
        """The key's block does not hold its bytes (read failed, unchecked or left behind): forget it."""
        return self.policy.abandon(key)

    def block_of(self, key: Key) -> int | None:
        return self.policy.slot_of(key)

    def resident(self) -> dict[Key, int]:
        return self.policy.resident()


def spare_ram_bytes(meminfo: str = "/proc/meminfo", cgroup_list: str = "/proc/self/cgroup",
                    cgroup_root: str = "/sys/fs/cgroup") -> int:
    """Memory this process could still take: MemAvailable, or less where its cgroup (v2) sets memory.max.

    In a cgroup, memory.current counts page cache too (the GGUF just read, say); its inactive file pages are
    reclaimable, so they count as spare, as in the usual working-set measure (current - inactive_file).
    """
    with open(meminfo) as lines:
        spare = next(int(line.split()[1]) << 10 for line in lines if line.startswith("MemAvailable:"))
    try:
        with open(cgroup_list) as lines:
            group = next(line.strip()[3:] for line in lines if line.startswith("0::"))
        folder = os.path.join(cgroup_root, group.lstrip("/"))
        with open(os.path.join(folder, "memory.max")) as limit, open(os.path.join(folder, "memory.current")) as used:
            cap, current = limit.read().strip(), int(used.read())
        if cap != "max":
            spare = min(spare, max(int(cap) - current + _inactive_file_bytes(folder), 0))
    except (OSError, StopIteration, ValueError):
        pass  # no cgroup v2 (or no limit to read): MemAvailable alone
    return spare


def _inactive_file_bytes(cgroup_folder: str) -> int:
    try:
        with open(os.path.join(cgroup_folder, "memory.stat")) as lines:
            return next((int(line.split()[1]) for line in lines if line.startswith("inactive_file ")), 0)
    except OSError:
        return 0


def tier_blocks(settings: StreamingSettings, block_bytes: int, n_expert: int, n_moe_layers: int,
                n_expert_used: int, n_ubatch: int, spare_ram: int | None = None) -> int:
    """``floor(ram_cache_mib MiB / block_bytes)`` blocks, at most every expert of the model (0: no tier).

    ``ram_cache_mib="auto"``: ``AUTO_SHARE`` of ``spare_ram`` bytes, or no tier (0) when that cannot hold
    the distinct experts one ubatch of one layer may use; a size given in MiB that cannot hold them raises
    CapacityError.
    """
    if settings.ram_cache_mib is None:
        return 0
    auto = settings.ram_cache_mib == AUTO
    if auto and spare_ram is None:
        raise ValueError('ram_cache_mib="auto" needs the spare RAM (spare_ram_bytes())')
    budget = int(AUTO_SHARE * spare_ram) if auto else int(settings.ram_cache_mib * MIB)
    blocks = min(budget // block_bytes, n_expert * n_moe_layers)
    needed = min(n_expert, n_expert_used * n_ubatch)
    if blocks < needed and auto:
        return 0
    if blocks < needed:
        raise CapacityError(
            f"the RAM tier holds {blocks} experts (ram_cache_mib={settings.ram_cache_mib:g}; "
            f"{block_bytes / MIB:.2f} MiB per expert block) but one ubatch of {n_ubatch} tokens may use {needed} "
            f"experts of one layer ({needed * block_bytes / MIB:.2f} MiB); raise ram_cache_mib or lower n_ubatch")
    return blocks


def preload_keys(layers: Sequence[int], n_expert: int, n_blocks: int) -> list[Key]:
    """The first ``n_blocks`` keys of a tier preload: expert 0 of every layer, then expert 1 of every layer...

    Every expert when the tier holds them all; else each layer gets the same share (within one expert), since
    nothing is known yet about which experts the router prefers."""
    order = [(layer, expert) for expert in range(n_expert) for layer in layers]
    return order[:max(n_blocks, 0)]


def chunked_blocks(allocate: Callable[[int], tuple[object, np.ndarray]], n_blocks: int, block_bytes: int,
                   chunk_bytes: int = CHUNK_BYTES) -> tuple[list, list[np.ndarray]]:
    """(owners, ``n_blocks`` views of ``block_bytes``) carved from as few ``allocate(nbytes)`` calls as
    ``chunk_bytes`` allows; ``allocate`` returns (owner, page-aligned uint8 view), ``block_bytes`` is a
    multiple of the page size, so every block is page-aligned."""
    per_chunk = max(1, chunk_bytes // block_bytes)
    owners, blocks = [], []
    for first in range(0, n_blocks, per_chunk):
        count = min(per_chunk, n_blocks - first)
        owner, memory = allocate(count * block_bytes)
        owners.append(owner)
        blocks += [memory[i * block_bytes:(i + 1) * block_bytes] for i in range(count)]
    return owners, blocks
