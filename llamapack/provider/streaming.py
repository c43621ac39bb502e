"""The streaming expert provider: slot cache, parallel O_DIRECT reads, pinned staging, async copies.

Per MoE layer and ubatch llama.cpp calls ``acquire`` (from its compute thread) with the router's expert ids.
The cache policy (``cache_policy.DEFAULT_POLICY``, docs/cache_policy.md) says which experts hit and which load
into which slot. The misses are read in parallel by a read pool (pack mode: native threads outside the GIL,
native_reads.NativeReads; else reads.ThreadReads), at most ``stage_slots`` at once, each into its own staging
buffer (pinned when the pool is on a GPU), optionally in ``read_splits`` sub-reads; as each read completes its
roles are copied into the slot (numpy on the host, ``cudaMemcpyAsync`` on the provider's stream for a GPU pool)
and the buffer takes the next miss. Before returning, every copy of the step is complete.

A failed read (I/O error, short read, sha256 mismatch) stops new reads, waits for the reads in flight,
abandons the failed expert and every miss of the step not copied yet (their slots go back to the free list,
mapped to no expert), counts ``io_errors`` and raises; the callback returns non-zero, so llama_decode fails
and nothing computes on a partial slot. The next request starts from a consistent cache.
A read still running after ``read_timeout_s`` fails the step the same way; it is left behind with its
staging buffer, which is replaced, so a late write lands in memory nothing reads.

With ``ram_cache_mib`` a host-RAM tier (host_tier.HostTier) sits between the SSD and the pool: its blocks
replace the staging buffers as read targets. A pool miss whose expert is in a RAM block is copied from it
(a RAM hit, no read); any other is read into the RAM block the tier assigns, then copied. A failed or
abandoned read also frees its RAM block (mapped to no expert); a hung read's block gets fresh memory.
With ``ram_preload`` the provider fills the tier before it returns (``preload_ram_tier``), checking each
block as a demand read is checked; a failed preload read fails the start-up. With ``warm_start`` (pack mode) it
first seeds the policies with the last session's popularity and fills the tier, then the pool, with the
hottest experts (``warm_start``; warm), and saves the popularity again at ``close``. With ``pool_preload`` and a
pool that has a slot for every served expert, it loads them all before it returns (``preload_pool``, after
the tier's preload so that the copies come from RAM).

With ``native_hot_path`` (the default, for the ``next-use`` policy without lookahead) the pool's and the tier's
policies are policy_native.NativeNextUsePolicy objects, which libllama's remap op asks first: a step whose
experts are all in the pool, or whose every miss is in a RAM block, is served there (the policies' plans, the
tier's copies on this provider's CUDA stream through the driver API, then a synchronize) without calling
``acquire``; its counts come back through ``native.fast_path_counts`` (``native_steps``). Only steps that read
from the SSD (or do not fit the pool) reach Python. The decisions are those of the Python policy
(tests/test_policy_native.py, tests/test_host_tier.py).

With ``prefetch`` libllama also calls ``prefetch`` (right after a layer's acquire) with a guess at each of
the next ``prefetch_depth`` layers' experts; their reads start in buffers of their own
(prefetch.PrefetchBook) at prefetch priority (only while no demand read is queued or running, in small
pieces), and the guessed layer's acquire waits only for
what is still being read (promoted to demand priority) and copies from those buffers; the reads of wrong
guesses that have not started yet are cancelled. A failed lookahead read that the next layer needs fails
that acquire like any demand read; one it does not need is dropped. With a RAM tier too, the tier plans
each step's misses whether they were read ahead or not, and a used lookahead read the tier keeps swaps
its buffer with the RAM block (no copy): lookahead changes where bytes are read, not what RAM holds.
"""
from __future__ import annotations

import logging
import os
import time
from collections import deque

import numpy as np

from .. import native
from ..errors import InputError, PackIOError
from ..cache_policy import SlotAssignment, policy_class
from ..policy_native import NativeNextUsePolicy
from ..telemetry import CounterAccumulator, StatsFlusher
from . import hybrid as hybrid_policy
from .copies import CudaCopier, HostCopier, import_cupy
from .host_tier import AUTO, HostTier, TierPlan, preload_keys, spare_ram_bytes, tier_blocks
from .prefetch import PrefetchBook, PrefetchEntry
from .native_reads import NativeReads
from .reads import PackSource, ThreadReads, open_source
from .reference import check_reader_matches_model
from .settings import MIB, StreamingSettings, slot_budget
from .slots import SlotLayout
from .warm import WarmFile, hottest, pack_identity

__all__ = ["StreamingProvider", "StreamingSettings"]

ffi = native.ffi
log = logging.getLogger(__name__)
MAX_READ_THREADS = 32


def free_vram(device: int) -> int:
    cupy = import_cupy()
    with cupy.cuda.Device(device):
        return cupy.cuda.runtime.memGetInfo()[0]


class StreamingProvider:
    """Serves routed experts from ``reader`` (a PackReader or GgufDirectReader, now owned by the provider)
    into a slot pool attached to one llama context.

    ``device`` -1: host pool (CPU compute); N >= 0: pool on GPU N, allocated by libllama, sized from the VRAM
    free now (call it after the model and KV cache are loaded). ``read_fn`` replaces ``os.preadv`` (tests).
    """

    def __init__(self, model_ptr, ctx_ptr, reader, settings: StreamingSettings = StreamingSettings(), *,
                 n_ubatch: int, n_expert_used: int, device: int = -1, read_fn=None):
        self.settings, self.device, self.n_expert_used = settings, device, n_expert_used
        self.error: BaseException | None = None
        self.counters = CounterAccumulator()
        self.flusher: StatsFlusher | None = None
        self._reader, self._reads, self._copier, self._ctx, self._closed = reader, None, None, None, False
        self.tier: HostTier | None = None
        self._step_tokens = 0  # tokens of the step being served (0: a preload or warm start, not a use)
        self.native_reads, self._prefetch_threads = False, 0
        self.warm_file: WarmFile | None = None
        self._native_hot, self._fast_path_arrays, self._fast_counts, self._native_steps_flushed = False, None, {}, 0
        try:
            self.tensors = native.expert_tensors(model_ptr)
            check_reader_matches_model(reader.layout, self.tensors)
            self._source = open_source(reader, direct_io=settings.direct_io, read_fn=read_fn,
                                       read_splits=settings.read_splits, verify_sha256=settings.verify_pack_sha256)
            pack_layout = reader.layout
            loaded_layers = sorted({t.layer for t in self.tensors})  # the source may hold more (deepseek4 MTP)
            self.n_slots = slot_budget(
                settings, SlotLayout.from_tensors(self.tensors, 1).slot_bytes, pack_layout.num_experts,
                len(loaded_layers), n_expert_used, n_ubatch, free_vram(device) if device >= 0 else None,
                spare_ram_bytes() if device < 0 else None)
            self.layout = SlotLayout.from_tensors(self.tensors, self.n_slots)
            # the native hot path (settings.native_hot_path) serves steps from the same policy objects in libllama
            self._native_hot = settings.native_hot_path and settings.cache_policy == "next-use" and not settings.prefetch
            policy_factory = NativeNextUsePolicy if self._native_hot else policy_class(settings.cache_policy)
            self.policy = policy_factory(self.n_slots)
            self.flusher = StatsFlusher(self.counters, settings.stats_path, settings.stats_flush_interval)
            self._layers, self._stride = loaded_layers, pack_layout.expert_stride
            self._first_layer = loaded_layers[0]
            # per layer, per role: (pool offset of slot 0, slot stride, offset in the block, nbytes) for _copy
            region, stride = self.layout.role_region, self.layout.role_stride
            self._copy_spans = {entry.layer: tuple((region[r.role], stride[r.role], r.offset, r.nbytes)
                                                   for r in entry.roles)
                                for entry in pack_layout.layers if entry.layer in self.layout.tensors_by_layer}
            spare = spare_ram_bytes() if settings.ram_cache_mib == AUTO else None
            n_blocks = tier_blocks(settings, self._stride, pack_layout.num_experts, len(loaded_layers),
                                   n_expert_used, n_ubatch, spare)
            if spare is not None:
                log.info("RAM tier (auto): %d expert blocks, %.0f MiB of %.0f MiB spare", n_blocks,
                         n_blocks * self._stride / MIB, spare / MIB)
            self.tier = HostTier(n_blocks, policy_factory,
                                 n_keys=pack_layout.num_experts * len(loaded_layers)) if n_blocks else None
            n_buffers = n_blocks or settings.stage_slots  # the copier's buffers: RAM blocks, or staging buffers
            n_lookahead = settings.prefetch_slots if settings.prefetch else 0  # ... then the lookahead buffers
            self.book = PrefetchBook(range(n_buffers, n_buffers + n_lookahead)) if n_lookahead else None
            self._predicted: dict[int, set[int]] = {}  # layer -> experts the lookahead guessed for it
            n_pieces = len(self._source.pieces)
            n_threads = min(settings.stage_slots * n_pieces, MAX_READ_THREADS)
            # lookahead pieces in flight: one per lookahead buffer, or fewer (prefetch_in_flight)
            n_prefetch_threads = min(n_lookahead, settings.prefetch_in_flight or n_lookahead, MAX_READ_THREADS)
            wants_native = (settings.native_reads if settings.native_reads is not None
                            else settings.prefetch or self.tier is not None)
            self.native_reads = wants_native and isinstance(self._source, PackSource) and read_fn is None
            engine = NativeReads if self.native_reads else ThreadReads
            self._reads = engine(self._source, n_threads + n_prefetch_threads, n_prefetch_threads)
            self._prefetch_threads = n_prefetch_threads
            n_buffers += n_lookahead
            host = HostCopier(self.layout.pool_bytes, n_buffers, self._stride) if device < 0 else None
            self._callback = ffi.callback(
                "int32_t(void *, int32_t, const int32_t *, int32_t, int32_t, int32_t *)", self._provide)
            self.pool_base = native.attach_pool(
                ctx_ptr, host.pool_base if host else None, self.layout.pool_bytes, self.n_slots,
                self.layout.tensor_offsets(self.tensors), self.layout.tensor_strides(self.tensors), device=device)
            self._ctx = ctx_ptr
            self._copier = host or CudaCopier(device, self.pool_base, n_buffers, self._stride)
            native.set_provider(ctx_ptr, self._callback)
            self._slot_lookup_max_tokens = settings.slot_lookup_max_tokens if device >= 0 else 0  # GPU pools only
            native.set_slot_lookup(ctx_ptr, self._slot_lookup_max_tokens, settings.whole_pool_graphs)
            if self._native_hot:
                self._start_fast_path()
                native.set_load_ahead(ctx_ptr, settings.load_ahead_min_tokens)
                self._start_layer_windows(settings.layer_windows_min_tokens)
            self.hybrid: dict | None = None  # hybrid execution's split and the costs it came from, once on
            if settings.hybrid != "off":
                self._start_hybrid()
            if self.book is not None:
                self._lookahead_callback = ffi.callback(
                    "void(void *, int32_t, const int32_t *, int32_t, int32_t)", self._on_lookahead)
                native.set_prefetch(ctx_ptr, self._lookahead_callback, settings.prefetch_depth)
            identity = pack_identity(reader) if settings.warm_start else None
            if identity is not None:
                self.warm_file = WarmFile(settings.warm_start_dir, identity, loaded_layers, pack_layout.num_experts)
                self.warm_start()
            if settings.ram_preload:
                self.preload_ram_tier()
            if settings.pool_preload:
                self.preload_pool()
        except BaseException:
            self.close()
            raise

    def _start_fast_path(self) -> None:
        """Let libllama serve the steps that need no SSD read (StreamingSettings.native_hot_path): every step
        whose experts are all in the pool, and, when its copies can run there, every step whose misses are all
        in the RAM tier. Its counts join ours (``native_steps``)."""
        copy_functions = self._copier.native_copy_functions()
        tier = self.tier if copy_functions is not None else None
        h2d, sync, stream, d2d = copy_functions if copy_functions is not None else (None, None, 0, None)
        spans = [(layer, *span) for layer, layer_spans in self._copy_spans.items() for span in layer_spans]
        self._fast_path_arrays = native.set_fast_path(
            self._ctx, self.policy, tier.policy if tier is not None else None,
            tier_holds_every_key=tier is not None and tier.holds_every_key,
            block_addrs=[self._copier.buffers[block].ctypes.data for block in range(tier.n_blocks)] if tier else [],
            copy_spans=spans if tier else [], first_layer=self._first_layer, h2d=h2d, sync=sync, stream=stream,
            d2d=d2d)
        self.counters.external = self._fast_path_counts
        self._fast_has_tier = tier is not None

    def _start_layer_windows(self, min_tokens: int) -> None:
        """Layer windows (StreamingSettings.layer_windows_min_tokens), where they can work: libllama uses them for
        a ubatch only once the RAM tier holds every expert (ram_preload fills it at start)."""
        if min_tokens <= 0:
            return
        n_expert = self._reader.layout.num_experts
        if not (getattr(self, "_fast_has_tier", False) and self.tier.holds_every_key):
            log.warning("layer windows need a RAM tier that holds every expert (ram_cache_mib): left off")
            return
        if self.n_slots < 2 * n_expert:
            log.warning("layer windows need a pool of %d slots (two layers' experts), this one has %d: left off",
                        2 * n_expert, self.n_slots)
            return
        native.set_layer_windows(self._ctx, min_tokens)

    def _start_hybrid(self) -> None:
        """Hybrid execution (StreamingSettings.hybrid, see provider.hybrid): the fast path leaves a share of each
        step's RAM-tier misses in their blocks and libllama computes their rows on the CPU. ``auto`` measures
        the two per-expert costs first (one token's row on the CPU; one block's copy into the pool)."""
        mode = self.settings.hybrid
        if not (self._native_hot and getattr(self, "_fast_has_tier", False)):
            raise InputError("hybrid needs a RAM tier (ram_cache_mib) and the native hot path (the next-use policy, "
                             "no lookahead, native_hot_path on)")
        role_offsets = {(entry.layer, role.role): role.offset for entry in self._reader.layout.layers
                        for role in entry.roles}
        offsets = [role_offsets[(tensor.layer, tensor.role)] for tensor in self.tensors]
        threads = self.settings.hybrid_threads or hybrid_policy.default_threads(os.cpu_count())
        cpu_s = copy_s = None
        if mode == "auto":
            self._hybrid_arrays = native.set_hybrid(self._ctx, 0.0, threads, hybrid_policy.MAX_TOKENS, offsets, False)
            cpu_s, copy_s = self._hybrid_costs()
        share = hybrid_policy.share_for(mode, cpu_s, copy_s)
        fill_pool = self.settings.hybrid_fill_pool
        self._hybrid_arrays = native.set_hybrid(self._ctx, share, threads, hybrid_policy.MAX_TOKENS, offsets, fill_pool)
        self.hybrid = dict(mode=mode, upload_share=share, threads=threads, fill_pool=fill_pool, cpu_s_per_expert=cpu_s,
                           copy_s_per_expert=copy_s)
        log.info("hybrid %s: %.3g of each step's RAM misses copied to the pool, the rest computed on %d CPU threads%s",
                 mode, share, threads, "" if cpu_s is None else
                 f" (measured per expert: CPU {cpu_s * 1e6:.0f} us, copy {copy_s * 1e6:.0f} us)")

    def _hybrid_costs(self, reps: int = 10) -> tuple[float, float]:
        """Per expert of the first served layer: seconds to compute one token's row on the CPU, and to copy its
        block into a pool slot (RAM block 0 into slot 0, before anything is loaded: the pool holds nothing yet)."""
        layer = self._first_layer
        cpu_s = native.hybrid_probe(self._ctx, layer, 0, reps)
        segments = [(region, offset, nbytes) for region, _, offset, nbytes in self._copy_spans[layer]]
        self._copier.copy(0, segments)  # warm-up
        self._copier.synchronize()
        started = time.perf_counter()
        for _ in range(reps):
            self._copier.copy(0, segments)
            self._copier.synchronize()
        return cpu_s, (time.perf_counter() - started) / reps

    def _fast_path_counts(self) -> dict:
        if self._ctx is not None:  # after close: the last counts read
            self._fast_counts = native.fast_path_counts(self._ctx)
        return self._fast_counts

    def after_decode(self) -> None:
        """Count the steps libllama served since the last call towards the stats file's flush interval (the
        Python steps count themselves); ``llamapack.Llama`` calls it after each evaluation."""
        if self._fast_path_arrays is None or self.flusher is None or self._ctx is None:
            return
        served = self._fast_path_counts().get("native_steps", 0)
        new_steps, self._native_steps_flushed = served - self._native_steps_flushed, served
        if new_steps:
            self._write_stats(acquires=new_steps)

    def _replace_buffer(self, buffer: int) -> None:
        """Fresh memory for a buffer a hung read may still write (and, for a RAM block, for the fast path)."""
        self._copier.replace_buffer(buffer)
        if self._fast_path_arrays is not None and self.tier is not None and buffer < self.tier.n_blocks:
            native.set_fast_path_block(self._ctx, buffer, self._copier.buffers[buffer].ctypes.data)

    def preload_ram_tier(self, progress: bool | None = None) -> int:
        """Fill the RAM tier's free blocks from the SSD (``host_tier.preload_keys``), ``stage_slots`` reads at
        a time; return the blocks filled. Each block is checked as a demand read is (sha256 when verifying).
        On a failure the blocks not read and checked are freed (mapped to no expert) and the error, naming
        the file, layer and expert, is raised. ``progress``: a progress bar (None: on a terminal)."""
        if self.tier is None:
            log.info("ram_preload: no RAM tier (too little spare RAM for one), nothing to preload")
            return 0
        keys = preload_keys(self._layers, self._reader.layout.num_experts, self.tier.n_blocks)
        return self._fill_tier(keys, "RAM tier preload", progress)

    def _fill_tier(self, keys: list, what: str, progress: bool | None) -> int:
        """Read ``keys`` not in the tier yet into free RAM blocks (as many as are free), ``8 * stage_slots`` at a
        time, with a progress bar; return how many were read."""
        from tqdm import tqdm

        free_blocks = self.tier.n_blocks - len(self.tier.resident())
        keys = [key for key in keys if self.tier.block_of(key) is None][:free_blocks]  # never evict to preload
        started, batch_size = time.perf_counter(), min(self.tier.n_blocks, 8 * self.settings.stage_slots)
        with tqdm(total=len(keys), unit="expert", desc=what, disable=None if progress is None else not progress,
                  leave=False) as bar:
            for first in range(0, len(keys), batch_size):
                self._preload_batch(keys[first:first + batch_size])
                bar.update(min(batch_size, len(keys) - first))
        log.info("%s: %d experts (%.0f MiB) in %.1f s", what, len(keys), len(keys) * self._stride / MIB,
                 time.perf_counter() - started)
        return len(keys)

    def warm_start(self, progress: bool | None = None) -> int:
        """Seed the pool's and the tier's policies with the popularity saved by the last session with this pack,
        then fill the free RAM blocks and the free slots with the hottest experts (RAM first, so that the pool's
        copies come from RAM); return the experts loaded into the pool. No file, or a bad one (warned about):
        nothing happens. A failed read fails the start-up, as a preload read does."""
        popularity = self.warm_file.load() if self.warm_file is not None else None
        if popularity is None or not hasattr(self.policy, "seed"):
            return 0
        self.policy.seed(popularity)
        if self.tier is not None and hasattr(self.tier.policy, "seed"):
            self.tier.policy.seed(popularity)
            self._fill_tier(hottest(popularity, self.tier.n_blocks), "warm start (RAM tier)", progress)
        if self.settings.pool_preload and self._pool_holds_every_expert():
            return 0  # preload_pool fills it layer by layer (each layer's slots contiguous: whole-pool graphs' views)
        loads = self.policy.preload(hottest(popularity, self.n_slots))
        return self._load_into_pool(loads, "warm start", "hottest experts of the last session", progress)

    def _pool_holds_every_expert(self) -> bool:
        return self.n_slots >= len(self._layers) * self._reader.layout.num_experts and hasattr(self.policy, "preload")

    def preload_pool(self, progress: bool | None = None) -> int:
        """With a slot for every served expert (and a policy that can preload): load the experts the pool does
        not hold yet, RAM tier first, so that no step misses; return how many were loaded. An empty pool gets
        them layer by layer, so each layer's experts take contiguous slots (whole-pool graphs then give a layer's
        matmuls a view of that layer's slots alone). A failed read fails the start-up, as a preload read does.
        Otherwise nothing happens."""
        if not self._pool_holds_every_expert():
            return 0
        keys = [(layer, expert) for layer in self._layers for expert in range(self._reader.layout.num_experts)]
        loaded = self._load_into_pool(self.policy.preload(keys), "pool preload", "experts (every one)", progress)
        # whole-pool graphs (when allowed and possible) from the first ubatch on, instead of from the second
        native.set_slot_lookup(self._ctx, self._slot_lookup_max_tokens, self.settings.whole_pool_graphs)
        return loaded

    def _load_into_pool(self, loads: tuple[SlotAssignment, ...], what: str, which: str, progress: bool | None) -> int:
        from tqdm import tqdm

        started, batch_size = time.perf_counter(), 8 * self.settings.stage_slots
        with tqdm(total=len(loads), unit="expert", desc=what, disable=None if progress is None else not progress,
                  leave=False) as bar:
            for first in range(0, len(loads), batch_size):
                self._load(loads[first:first + batch_size])
                self.counters.add(pool_preloaded=min(batch_size, len(loads) - first))
                bar.update(min(batch_size, len(loads) - first))
        log.info("%s: %d %s loaded into the pool in %.1f s", what, len(loads), which, time.perf_counter() - started)
        return len(loads)

    def _preload_batch(self, keys: list) -> None:
        plan = self.tier.plan(keys, n_tokens=0)  # a preload: no token uses these keys
        in_flight, filled, error = {}, set(), None
        try:
            for key, block in plan.misses:
                in_flight[block] = (key, self._start_read(key, block))
            while in_flight:
                pending = [f for _, pieces in in_flight.values() for f in pieces if not f.done()]
                if not self._reads.wait_first(pending, self.settings.read_timeout_s):
                    error = error or self._abandon_hung_reads(in_flight)
                    in_flight.clear()
                    break
                for block, (key, pieces) in take_finished(in_flight):
                    try:
                        raise_read_errors(pieces)
                        self._source.check(*key, self._copier.buffers[block][:self._stride])
                        filled.add(key)
                        self.counters.add(ram_preloaded=1, ram_preload_bytes=self._source.read_nbytes(*key))
                    except Exception as exc:  # noqa: BLE001 - raised below, once the batch is settled
                        self.counters.record_io_error()
                        error = error or exc
        finally:
            self._reads.wait_all([f for _, pieces in in_flight.values() for f in pieces])  # only after an interrupt
            for key, _ in plan.misses:
                if key not in filled:
                    self.tier.abandon(key)
        if error is not None:
            raise error

    # called from llama.cpp's compute thread, once per MoE layer per ubatch
    def _provide(self, _user, layer, ids_ptr, n_used, n_tokens, slots_ptr) -> int:
        try:
            n = n_used * n_tokens
            ids = np.frombuffer(ffi.buffer(ids_ptr, 4 * n), dtype=np.int32)
            slots = np.frombuffer(ffi.buffer(slots_ptr, 4 * n), dtype=np.int32)
            started = time.perf_counter()
            try:
                slots[:] = self.acquire(layer, ids)
            finally:
                self.counters.add_seconds("provide_s", time.perf_counter() - started)
            return 0
        except BaseException as exc:  # noqa: BLE001 - must not unwind into C; reported by the caller
            self.error = exc
            return 1

    # called from llama.cpp's compute thread right after a layer's _provide, once per layer guessed ahead
    def _on_lookahead(self, _user, layer, ids_ptr, n_used, n_tokens) -> None:
        try:
            guesses = np.frombuffer(ffi.buffer(ids_ptr, 4 * n_used * n_tokens), dtype=np.int32)
            guesses = guesses.reshape(n_tokens, n_used)
            with self.counters.timing("lookahead_s"):
                self.prefetch(layer, guesses[:, :self.settings.prefetch_top].ravel())  # best guess first
        except BaseException as exc:  # noqa: BLE001 - advisory: must not unwind into C nor fail the decode
            log.warning("router lookahead for layer %d failed (the layer reads on demand): %r", layer, exc)

    def prefetch(self, layer: int, expert_ids: np.ndarray) -> None:
        """Start lookahead reads for the guessed experts of ``layer`` that are in neither the pool nor the RAM
        tier nor read already, as long as lookahead buffers are free. Never blocks on I/O."""
        experts = [e for e in dict.fromkeys(expert_ids.tolist()) if 0 <= e < self._reader.layout.num_experts]
        self._predicted.setdefault(layer, set()).update(experts)  # with depth > 1, several guesses per layer
        for entry in self.book.reclaim():
            self._count_wasted(entry)
        for expert in experts:
            key = (layer, expert)
            if key in self.book or self.policy.slot_of(key) is not None or (
                    self.tier is not None and self.tier.block_of(key) is not None):
                continue
            buffer = self.book.free_buffer()
            if buffer is None:
                break
            self.book.add(key, buffer, self._start_read(key, buffer, prefetch=True))
            self.counters.add(prefetch_reads=1)

    def _count_wasted(self, entry: PrefetchEntry) -> None:
        """A lookahead read nobody used: cancelled before it started, or the bytes of its pieces that ran, or
        the I/O error it hit (counted; nothing computed on it)."""
        ran = [(piece, span) for piece, span in zip(entry.pieces, self._source.prefetch_pieces)
               if not piece.cancelled()]
        if not ran:
            self.counters.add(prefetch_cancelled=1)
            return
        nbytes = sum(self._source.piece_nbytes(*entry.key, *span) for piece, span in ran
                     if piece.exception() is None)
        self.counters.add(prefetch_wasted=1, prefetch_wasted_bytes=nbytes, pack_read_bytes=nbytes)
        failure = next((piece.exception() for piece, _ in ran if piece.exception()), None)
        if failure is not None:
            self.counters.record_io_error()
            log.warning("an unused lookahead read of layer %d expert %d failed: %s", *entry.key, failure)

    def acquire(self, layer: int, expert_ids: np.ndarray) -> np.ndarray:
        """Make every expert in ``expert_ids`` of ``layer`` resident; return their slot ids (copies complete)."""
        ids = expert_ids.tolist()
        experts = list(dict.fromkeys(ids))
        n_tokens = len(ids) // self.n_expert_used
        self._step_tokens = max(1, n_tokens)  # policies learn from decode steps only
        plan = self.policy.acquire([(layer, expert) for expert in experts], n_tokens=self._step_tokens)
        assignments = plan.assignments  # one per distinct key, in the order of ``experts``
        loads = tuple(a for a in assignments if not a.hit)  # plan.loads, plan.misses, plan.hits: one pass
        self.counters.record_acquire(len(assignments) - len(loads), len(loads), len(plan.evictions),
                                     tokens=n_tokens if layer == self._first_layer else 0)
        if self.book is not None:
            predicted = self._predicted.pop(layer, None)
            if predicted is not None:
                self.counters.add(lookahead_keys=len(experts), lookahead_hits=len(predicted.intersection(experts)))
            self.book.retire_layer(layer, {load.key for load in loads})
        try:
            if loads:
                self._load(loads)
        finally:
            self._write_stats()
        if len(experts) == len(ids):  # no repeated id (decode): the assignments are in the ids' order
            return np.array([a.slot for a in assignments], dtype=np.int32)
        slot_of = {key[1]: slot for key, slot, _ in assignments}
        return np.array([slot_of[expert] for expert in ids], dtype=np.int32)

    def _load(self, loads: tuple[SlotAssignment, ...]) -> None:
        """Read the misses, at most ``stage_slots`` at once, and copy each into its slot as soon as it is read.

        Each read takes a free staging buffer or, with a RAM tier, goes into the block the tier gave it;
        RAM hits are copied while the reads run. On a failure no new read starts; the reads in flight are
        waited for; every miss not copied is abandoned, and so is every RAM block not read and checked;
        the first error is raised.
        """
        free_buffers = deque(range(self.settings.stage_slots))  # staging buffers (no tier)
        in_flight: dict[int, tuple[SlotAssignment, list]] = {}  # buffer or block -> its read's pieces
        copied, filled, tier_plan, lookahead = set(), set(), None, {}
        error: BaseException | None = None
        try:
            if self.book is not None:
                lookahead = self._take_lookahead(loads)  # lookahead buffer -> (its load, its read's pieces)
            for buffer, (load, pieces) in lookahead.items():
                in_flight[buffer] = (load, pieces)
                for piece in pieces:
                    self._reads.promote(piece)  # needed now: demand priority
            ram_hits, waiting, tier_plan, install_into = self._plan_sources(loads, lookahead)
            while in_flight or ((waiting or ram_hits) and error is None):
                while (waiting and len(in_flight.keys() - lookahead.keys()) < self.settings.stage_slots
                       and error is None):
                    load, block = waiting.popleft()
                    block = free_buffers.popleft() if block is None else block
                    in_flight[block] = (load, self._start_read(load.key, block))
                while ram_hits and error is None:
                    load, block = ram_hits.popleft()
                    self._copy(load, block)
                    copied.add(load.key)
                if not in_flight:
                    continue
                # only pieces not done: a done piece of a split read would end every wait at once
                pending = [f for _, pieces in in_flight.values() for f in pieces if not f.done()]
                with self.counters.timing("read_wait_s"):
                    finished = self._reads.wait_first(pending, self.settings.read_timeout_s)
                if not finished:
                    error = error or self._abandon_hung_reads(
                        {block: (load.key, pieces) for block, (load, pieces) in in_flight.items()})
                    in_flight.clear()
                    continue
                for block, (load, pieces) in take_finished(in_flight):
                    try:
                        raise_read_errors(pieces)
                        if error is None:
                            self._check_read(load.key, block)
                            filled.add(load.key)
                            self._copy(load, block)
                            copied.add(load.key)
                            if block in lookahead:
                                self.counters.add(prefetch_used=1)
                                if block in install_into:  # the read bytes become its RAM block
                                    self._copier.swap_buffers(block, install_into[block])
                                    filled.add(load.key)
                    except Exception as exc:  # noqa: BLE001 - any failed load is abandoned below
                        self.counters.record_io_error()
                        error = error or exc
                    if self.tier is None and block not in lookahead:
                        free_buffers.append(block)
        finally:
            if in_flight:  # only after an interrupt
                self._reads.wait_all([f for _, pieces in in_flight.values() for f in pieces])
            started = time.perf_counter()
            try:
                self._copier.synchronize()
            finally:
                self.counters.add_seconds("copy_wait_s", time.perf_counter() - started)
            for load in loads:
                if load.key not in copied:
                    self.policy.abandon(load.key)
            for key, _ in tier_plan.misses if tier_plan is not None else ():
                if key not in filled:
                    self.tier.abandon(key)
            for buffer in lookahead:
                self.book.release(buffer)  # its read is done (or left behind with the old memory)
        if error is not None:
            raise error

    def _take_lookahead(self, loads) -> dict[int, tuple[SlotAssignment, list]]:
        """{lookahead buffer: (load, its read's pieces)} for the loads a lookahead read is for."""
        taken = {}
        for load in loads:
            entry = self.book.take(load.key) if self.book is not None else None
            if entry is not None:
                taken[entry.buffer] = (load, list(entry.pieces))
        return taken

    def _plan_sources(self, loads, lookahead: dict) -> tuple[deque, deque, TierPlan | None, dict[int, int]]:
        """(RAM hits, reads to start) as deques of (load, RAM block or None: a staging buffer), the tier's plan,
        and {lookahead buffer: RAM block} for the loads already read ahead that the tier wants to keep.

        The tier plans every load of the step, in the step's order, read ahead or not: so it holds the same
        experts as without lookahead, and a read-ahead expert enters RAM by a buffer swap once checked."""
        ahead = {load.key: buffer for buffer, (load, _) in lookahead.items()}
        if self.tier is None:
            return deque(), deque((load, None) for load in loads if load.key not in ahead), None, {}
        plan = self.tier.plan([load.key for load in loads], n_tokens=self._step_tokens)
        self.counters.record_ram(len(plan.hits), len(plan.misses), plan.evictions)
        load_of = {load.key: load for load in loads}
        if not ahead:
            return (deque((load_of[key], block) for key, block in plan.hits),
                    deque((load_of[key], block) for key, block in plan.misses), plan, {})
        # a read-ahead key the tier already holds (a hit) is copied from its lookahead buffer all the same
        return (deque((load_of[key], block) for key, block in plan.hits if key not in ahead),
                deque((load_of[key], block) for key, block in plan.misses if key not in ahead), plan,
                {ahead[key]: block for key, block in plan.misses if key in ahead})

    def _abandon_hung_reads(self, in_flight: dict) -> PackIOError:
        """Leave the reads in flight ({buffer: (key, pieces)}) behind, each with fresh memory in its buffer's
        place, after a timeout."""
        keys = [key for key, _ in in_flight.values()]
        for buffer, (_, pieces) in in_flight.items():
            for piece in pieces:
                piece.cancel()  # a piece still queued never starts
            self._replace_buffer(buffer)
            self.counters.record_io_error()
        layer, expert = keys[0]
        return PackIOError(f"{', '.join(self._source.paths)}: reading layer {layer} expert {expert} did not finish "
                           f"within {self.settings.read_timeout_s:g} s (read_timeout_s); {len(keys)} read(s) "
                           "abandoned")

    def _start_read(self, key: tuple[int, int], buffer: int, prefetch: bool = False) -> list:
        """Queue the read of block ``key`` into ``buffer``, in pieces (futures, or native_reads.NativeRead)."""
        self._copier.wait_until_free(buffer)  # its previous block's copy has finished
        target = self._copier.buffers[buffer]  # bound now: memory replaced after a timeout is never written
        spans = self._source.prefetch_pieces if prefetch else self._source.pieces
        return self._reads.start(key, target, spans, prefetch)

    def _check_read(self, key: tuple[int, int], buffer: int) -> None:
        """Count the SSD read and check the block read (sha256, pack mode)."""
        layer, expert = key
        self.counters.record_read(self._source.read_nbytes(layer, expert))
        self._source.check(layer, expert, self._copier.buffers[buffer][:self._stride])

    def _copy(self, load: SlotAssignment, buffer: int) -> None:
        """Copy each role payload of the block in ``buffer`` into the slot."""
        slot = load.slot  # pool offset: layout.slot_offset(role, slot)
        segments = [(region + slot * stride, offset, nbytes)
                    for region, stride, offset, nbytes in self._copy_spans[load.key[0]]]
        started = time.perf_counter()
        try:
            self._copier.copy(buffer, segments)
        finally:
            self.counters.add_seconds("copy_wait_s", time.perf_counter() - started)
        if self._copier.h2d:
            self.counters.add(h2d_bytes=sum(nbytes for _, _, nbytes in segments))
        if self._copier.pageable:
            self.counters.record_fallback()

    def _write_stats(self, now: bool = False, acquires: int = 1) -> None:
        try:
            self.flusher.flush() if now else self.flusher.maybe_flush(acquires)
        except OSError as exc:  # telemetry must not fail a decode
            log.warning("could not write provider stats to %s: %s", self.flusher.path, exc)

    def stats(self) -> dict:
        """The counters (telemetry.ProviderCounters, with hit rate and bytes per token), the pool's size and the
        RAM tier's (``ram_slots``: its blocks, 0 without a tier), and hybrid execution's split (None: off)."""
        return dict(self.counters.snapshot().as_dict(), n_slots=self.n_slots, slot_bytes=self.layout.slot_bytes,
                    pool_bytes=self.layout.pool_bytes, device=self.device,
                    ram_slots=self.tier.n_blocks if self.tier else 0,
                    prefetch_slots=self.settings.prefetch_slots if self.book is not None else 0,
                    prefetch_top=self.settings.prefetch_top,
                    prefetch_depth=self.settings.prefetch_depth if self.book is not None else 0,
                    prefetch_in_flight=self._prefetch_threads,
                    read_engine="native" if self.native_reads else "python", hybrid=self.hybrid,
                    **(native.hook_stats(self._ctx) if self._ctx is not None else {}))

    def close(self) -> None:
        """Detach from the context, stop the read threads, close files, free staging memory; idempotent."""
        if self._closed:
            return
        self._closed = True
        if self.warm_file is not None and self.flusher is not None and hasattr(self.policy, "popularity"):
            # the pool's policy saw every step
            self.warm_file.save(self.policy.popularity())
        if self._ctx is not None:
            self._fast_path_counts()  # kept for the stats after detach
            native.detach(self._ctx)
            self._ctx = None
        for part in (self._reads, self._copier, self._reader):
            if part is not None:
                part.close()
        self._reads = self._copier = None
        if self.flusher is not None:
            self._write_stats(now=True)


def take_finished(in_flight: dict) -> list:
    """Remove from ``in_flight`` ({buffer: (what, pieces)}) the reads whose every piece is done; return them as
    (buffer, (what, pieces)) pairs."""
    finished = [(buffer, entry) for buffer, entry in in_flight.items() if all(piece.done() for piece in entry[1])]
    for buffer, _ in finished:
        del in_flight[buffer]
    return finished


def raise_read_errors(pieces: list) -> None:
    """Raise the first failure among the finished pieces of one block's read."""
    for piece in pieces:
        piece.result()
