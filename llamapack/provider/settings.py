"""Settings of the streaming provider and the slot budget they give."""
from __future__ import annotations

import math
from dataclasses import dataclass

from ..cache_policy import policy_class
from ..errors import CapacityError
from ..native import MAX_LOOKAHEAD
from .hybrid import parse_mode

MIB = 1 << 20


@dataclass(frozen=True)
class StreamingSettings:
    """How the streaming provider sizes its pool, reads experts and reports.

    ``cache_vram_mib``: the slot pool's budget in MiB (VRAM for a GPU pool, host memory for a host pool);
    None: all free VRAM but ``cache_vram_reserve_mib`` on a GPU, one layer's experts on the host.
    ``n_slots`` overrides the budget with an exact slot count. ``stage_slots`` staging buffers bound the
    expert reads in flight; ``read_splits`` splits each pack read into that many parallel sub-reads (pack
    mode only: a GGUF-direct expert is read by one reader, role after role). ``direct_io=False`` reads
    through the page cache (for filesystems without O_DIRECT). ``stats_path``: a JSON file of the counters,
    rewritten every ``stats_flush_interval`` acquires. ``verify_pack_sha256``: check each block against its
    manifest sha256 the first time it is read in the process (pack mode only; on Python read threads the read
    thread hashes it, on the native pool the compute thread). ``read_timeout_s``: a read that has not finished by then fails
    the decode (None: wait forever). ``ram_cache_mib``: a host-RAM tier of that many MiB (pinned for a GPU
    pool) holding whole expert blocks between the SSD and the pool (None: no tier; "auto": half the RAM
    still available to the process, its cgroup's limit included, or no tier when that holds too little; see
    host_tier). ``ram_preload``: fill the tier from the SSD when the provider starts (every expert when it
    holds them all, else an equal share of each layer's), so that the first tokens do not wait on the SSD;
    start-up then takes the time of reading the tier's bytes.
    ``prefetch``: router lookahead; while a layer computes, read the experts the next layer's router would
    pick from this layer's input, into ``prefetch_slots`` buffers of their own, only while no demand read
    is queued or running (see prefetch); ``prefetch_top``: only each token's best that many guesses (None: all
    n_expert_used); ``prefetch_depth``: guess the next that many served layers (1-8), each from this layer's
    input, so a read can start that many layers before it is needed; ``prefetch_in_flight``: at most that
    many lookahead pieces read at once (None: one per lookahead buffer), which bounds what a demand read
    arriving meanwhile shares the disk with. Compute always uses the router's real choice. ``native_reads``: pack reads run on libllama's native read pool (C++ threads that never take
    Python's GIL; see native_reads) or, False, on Python threads; None: the native pool with ``prefetch`` or a
    RAM tier, Python threads otherwise (what measured faster on the H200: bench/results/gpu_prefetch_README.md,
    fourth round). GGUF-direct mode and an injected read function always read on Python threads.
    ``warm_start``: at close, save each expert's decayed popularity for this pack; at start, seed the cache
    policies with the last session's and fill the pool (and the RAM tier) with its hottest experts before the
    first token (pack mode; see warm). ``warm_start_dir``: where those files live (None: the user cache,
    ``~/.cache/llamapack/warm``). Off here (a provider made directly starts cold); ``llamapack.Llama`` and the
    CLI turn it on unless asked not to. ``cache_policy``: the slot pool's and the RAM tier's policy, a name of
    ``cache_policy.ONLINE_POLICIES`` (``next-use`` is ``DEFAULT_POLICY``; the others are there to be measured
    against it; warm start needs ``next-use``). ``native_hot_path``: with ``next-use`` and no lookahead, the
    policies live in libllama and a step whose experts are all in the pool, or whose misses are all in the RAM
    tier, is served there (slot ids, the tier's copies, the counters) without entering Python; False: every
    step goes through the Python provider and its Python policy (the reference, and the "before" of the bench).
    ``hybrid`` (see provider.hybrid): ``"on"``, ``"auto"`` or an upload share: the native hot path leaves
    (some of) a step's misses in their RAM blocks and computes their rows on the CPU with llama.cpp's CPU
    kernels, ``hybrid_threads`` threads (None: all cores but one); needs the native hot path and a RAM tier.
    ``hybrid_fill_pool``: those experts are still copied into the pool after the CPU's work, without the step
    waiting (the pool's policy decides as without hybrid, so later steps hit them); False keeps them out (with
    ``"on"`` the pool never changes on a split step: every RAM miss on the CPU, the --cpu-moe endpoint).
    Not bit-exact with all-GPU compute in general (rows computed on the CPU round as --cpu-moe's do); with
    every expert in the pool it is, and with every miss on the CPU it matches --cpu-moe. ``"off"``: all on
    the GPU (the default).
    ``slot_lookup_max_tokens``: with a GPU pool, ubatches of at most this many tokens are remapped by a slot
    lookup on the GPU, whose step runs where the scheduler copies the layer's slot map into the experts' split
    (one split boundary per layer, no CPU op; llama_expert_slot_lookup_set) instead of by the CPU remap op
    (0: always the op). Layers the op must serve keep it (lookahead, hybrid splits). Same kernels and inputs
    either way: bit-exact. ``whole_pool_graphs``: once the pool holds every served expert (checked after each
    ubatch; the native hot path on, no hybrid, no lookahead), graphs look slots up in static maps on the pool's
    device, with no split and no wait per layer; each step's ids are kept on the device and go through the same
    bookkeeping (policy, counters) after the ubatch; a layer whose map is the identity (a preloaded pool) skips
    the lookup. On by default: bit-exact on CPU, and on CUDA in rounds 16 and 17 (4 tiny archs, n_ubatch 1, 7
    and 512; the Q30B-shaped model's 400 decode steps).
    ``pool_preload``: with a pool that has a slot for every served expert (and the ``next-use`` policy), load
    them all when the provider starts (from the RAM tier where it holds them), so that no step misses.
    ``load_ahead_min_tokens``: after a step of at least this many tokens (a prefill ubatch; 0: off, the default),
    the next layer's experts that wait in the RAM tier get slots from the pool's policy and their copies start
    while this layer computes (llama_expert_load_ahead_set); needs the native hot path and a RAM tier that holds
    every expert. Same kernels and inputs: bit-exact on CPU; on CUDA, round 15's four tiny-arch cases with it on
    were exact (that check does not count whether they loaded ahead). Rounds 15 and 16 measured 2% and 8.5% off
    a 512-token prefill at 25% on H100s (22% of its loads unused). Since API 12 its copies are issued once the
    layer's GPU work is launched (the copy callback): round 18 (H100) was exact on CUDA with it and took 10% off
    the 512-token prefill at 25% (Qwen3-30B shape, replayed routing-model trace;
    bench/results/gpu_round18_README.md).
    ``layer_windows_min_tokens``: ubatches of at least this many tokens (0: off) read each layer's experts from
    one of two windows of pool slots, a layer's worth each (expert e in the window's slot e: the matmuls see the
    model's own tensor shape), while every expert of the next layer is copied from the RAM tier into the other
    window (llama_expert_layer_windows_set). The first such ubatch takes the windows' slots from the pool (their
    experts are forgotten); the pool's policy is not changed otherwise. Needs the native hot path, a RAM tier
    that holds every expert and a pool of at least two layers' experts (else it stays off, with a warning for
    the pool). Same experts, same bytes: bit-exact on CPU (tests/test_host_tier.py) and on CUDA (round 18, three
    tiny archs, n_ubatch 7 and 512). No faster so far: 2% off the 512-token prefill at 25% on an H100 (Qwen3-30B
    shape, replayed routing-model trace), where the prompt is bound by the host-to-device copies (every expert
    of every layer, 16.3 GB) and not by compute (bench/results/gpu_round18_README.md). Since API 14 a window
    copies fewer bytes: the experts its step does not use are skipped unless their copies started early (all do
    on a GPU unless LLAMAPACK_WINDOW_EARLY caps them), and experts the pool holds are copied from their slot on
    the GPU instead of over PCIe (docs/hook.md).
    """

    cache_vram_mib: float | None = None
    cache_vram_reserve_mib: float = 1024
    stage_slots: int = 4
    read_splits: int = 1
    direct_io: bool = True
    stats_path: str | None = None
    stats_flush_interval: int = 256
    verify_pack_sha256: bool = True
    n_slots: int | None = None
    read_timeout_s: float | None = 60.0
    ram_cache_mib: float | str | None = None
    ram_preload: bool = False
    prefetch: bool = False
    prefetch_slots: int = 4
    prefetch_top: int | None = None
    prefetch_depth: int = 1
    prefetch_in_flight: int | None = None
    native_reads: bool | None = None
    warm_start: bool = False
    warm_start_dir: str | None = None
    cache_policy: str = "next-use"
    native_hot_path: bool = True
    hybrid: str | float = "off"
    hybrid_threads: int | None = None
    hybrid_fill_pool: bool = True
    slot_lookup_max_tokens: int = 32
    whole_pool_graphs: bool = True
    pool_preload: bool = True
    load_ahead_min_tokens: int = 0
    layer_windows_min_tokens: int = 0

    def __post_init__(self):
        object.__setattr__(self, "hybrid", parse_mode(self.hybrid))  # ValueError for a bad mode
        for name in ("stage_slots", "read_splits", "stats_flush_interval", "n_slots", "prefetch_slots", "prefetch_top",
                     "prefetch_in_flight", "hybrid_threads"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1 (got {getattr(self, name)})")
        for name in ("slot_lookup_max_tokens", "load_ahead_min_tokens", "layer_windows_min_tokens"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0 (got {getattr(self, name)})")
        policy_class(self.cache_policy)  # ValueError for an unknown name
        if not 1 <= self.prefetch_depth <= MAX_LOOKAHEAD:
            raise ValueError(f"prefetch_depth must be in [1, {MAX_LOOKAHEAD}] (got {self.prefetch_depth})")
        if self.cache_vram_mib is not None and not (self.cache_vram_mib > 0 and math.isfinite(self.cache_vram_mib)):
            raise ValueError(f"cache_vram_mib must be a finite number > 0 (got {self.cache_vram_mib})")
        if self.ram_cache_mib is not None and self.ram_cache_mib != "auto" and not (
                isinstance(self.ram_cache_mib, (int, float)) and 0 < self.ram_cache_mib < float("inf")):
            raise ValueError(f'ram_cache_mib must be > 0, "auto" or None (got {self.ram_cache_mib!r})')
        if self.ram_preload and self.ram_cache_mib is None:
            raise ValueError("ram_preload fills the RAM tier: it needs ram_cache_mib (a size or \"auto\")")
        if self.read_timeout_s is not None and not self.read_timeout_s > 0:
            raise ValueError(f"read_timeout_s must be > 0 or None (got {self.read_timeout_s})")
        if not (self.cache_vram_reserve_mib >= 0 and math.isfinite(self.cache_vram_reserve_mib)):
            raise ValueError(f"cache_vram_reserve_mib must be a finite number >= 0 (got {self.cache_vram_reserve_mib})")


def slot_budget(settings: StreamingSettings, slot_bytes: int, n_expert: int, n_moe_layers: int,
                n_expert_used: int, n_ubatch: int, free_vram: int | None = None, free_ram: int | None = None) -> int:
    """The pool's slot count: ``floor(min(requested, free - reserve) / slot_bytes)``.

    ``free_vram`` is None for a host pool (then: the request, or one layer's experts). Never more slots than
    experts in the model. Raises CapacityError when the slots cannot hold the distinct experts one ubatch of
    one layer may use, ``min(n_expert, n_expert_used * n_ubatch)``, or when the pool does not fit the memory
    free now (``free_vram``, or ``free_ram`` for a host pool; None: not checked), before anything is allocated.
    """
    requested = None if settings.cache_vram_mib is None else int(settings.cache_vram_mib * MIB)
    total = n_expert * n_moe_layers
    if settings.n_slots is not None:
        slots, basis = min(settings.n_slots, total), f"n_slots={settings.n_slots}"
    elif free_vram is not None:
        usable = free_vram - int(settings.cache_vram_reserve_mib * MIB)
        budget = usable if requested is None else min(requested, usable)
        slots = min(max(budget, 0) // slot_bytes, total)
        basis = (f"{free_vram / MIB:.0f} MiB VRAM free - {settings.cache_vram_reserve_mib:g} MiB reserve"
                 + ("" if requested is None else f", cache_vram_mib={settings.cache_vram_mib:g}"))
    elif requested is not None:
        slots = min(requested // slot_bytes, total)
        basis = f"cache_vram_mib={settings.cache_vram_mib:g}"
    else:
        slots, basis = n_expert, "one layer's experts"
    needed = min(n_expert, n_expert_used * n_ubatch)
    if slots < needed:
        raise CapacityError(
            f"the expert cache holds {slots} experts ({basis}; {slot_bytes / MIB:.2f} MiB per expert) but one "
            f"ubatch of {n_ubatch} tokens may use {needed} experts of one layer ({needed * slot_bytes / MIB:.2f} "
            "MiB); raise the budget or lower n_ubatch")
    free, where = (free_vram, "VRAM") if free_vram is not None else (free_ram, "RAM")
    if free is not None and slots * slot_bytes > free:
        raise CapacityError(
            f"the expert cache of {slots} experts ({basis}; {slot_bytes / MIB:.2f} MiB per expert) needs "
            f"{slots * slot_bytes / MIB:.0f} MiB but {free / MIB:.0f} MiB of {where} is free; lower the cache "
            "size (--cache-slots, --cache-vram-mib)")
    return slots
