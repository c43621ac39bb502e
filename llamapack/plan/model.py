"""The speed model of ``llamapack plan`` (pure: no I/O, no clock).

Decode, per token:
    t = compute + n_moe_layers * hook + python_steps * python_step + python_loads * python_load
        + ssd_reads * block / disk + ram_hits * block / h2d
where ``ssd_reads`` and ``ram_hits`` are the pool misses per token served by the SSD and by the RAM tier
(``hits.py`` replays a routing-model trace of the model's shape through the real cache policy to get them).
``hook`` is what every cache step costs (GPU: the remap op's graph split, the router ids' readback, the native
policy); ``python_steps`` are the steps that enter the Python provider and ``python_loads`` the pool misses they
load. With the native hot path (``Budgets.native_hot_path``, the provider's default) only a step with an SSD read
enters Python (the replay counts them: ``StepLoads.ssd_steps``); without it every step does. A host pool costs
``host_hook`` per step, Python or not (the native path's saving there is not measured).
A decode read of a key the process has not read before costs ``decode_first_read_factor`` times the probed block
time (``decode_ssd_factor``; the replay counts which reads are a key's first).
Nothing overlaps: reads are demand reads, the layer waits for them (``Costs.io_overlap``). With a slot for every
expert and whole-pool graphs (``Budgets.whole_pool``) there is no cache step per layer: t = compute.

Prefill of P tokens in ubatches of U: ceil(P / U) ubatches; in each, every MoE layer's distinct experts of the
ubatch are made resident once (one cache step per layer and ubatch), so
    t = compute(P, U) + ubatches * (n_moe_layers * hook + Python's steps and loads) + reads + copies,
a Python load in a prefill step costing ``python_prefill_load_s`` (its steps batch tens of misses), a RAM-tier hit
``prefill_ram_hit_s`` beyond its copy (GPU pool), and a process's first request's reads ``cold_read_factor`` times
the probed time (``cold``). A GPU pool's multi-token matmuls also walk every slot of the pool, not only the
layer's experts (``pool_view_s``), unless whole-pool graphs give each layer its own view.

Compute is vanilla llama.cpp's time for the model (every expert resident). On a GPU it is scaled from the
measured reference model (``Costs``) by the bytes a token reads (non-expert weights + top-k experts per MoE
layer); on the CPU it is those bytes over the probed memory read rate (decode) or the probed matmul rate
(prefill). Every measured constant is a field of ``Costs`` with its source, so the device calibration can
replace them.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

MIB = 1 << 20

# The reference model of the measured figures: the Qwen3-30B-A3B-shaped synthetic model of
# bench/results/gpu_bench_README.md (17.46 GB, experts 16.31 GB, 48 MoE layers x 128 experts, top-8, Q4_K).
REF_N_MOE_LAYERS, REF_N_EXPERTS, REF_TOP_K = 48, 128, 8
REF_EXPERT_BYTES = 16.31e9 / (REF_N_MOE_LAYERS * REF_N_EXPERTS)
REF_ACTIVE_BYTES = (17.46e9 - 16.31e9) + REF_N_MOE_LAYERS * REF_TOP_K * REF_EXPERT_BYTES  # ~2.17 GB per token


@dataclass(frozen=True)
class Costs:
    """Measured (or, where said, guessed) per-token costs. Sources are in bench/results/."""

    # Calibrated on the H100 machine's Qwen3-30B-shaped runs (bench/results/gpu_hotpath_q30b.json and
    # gpu_ssd_policy_warm_q30b.json, sampled decode at temperature 1; docs/plan.md "Validation"), checked on the
    # granite-shaped runs (gpu_hotpath_granite.json), which were not fitted on.
    # vanilla-vram decode 163.57 tok/s (gpu_hotpath_q30b.json), per active byte (the H200's greedy 221.20 tok/s,
    # gpu_bench_idle_prefetch_greedy_skew0.md, was the earlier source)
    gpu_decode_s_per_active_byte: float = (1 / 163.57) / REF_ACTIVE_BYTES
    # vanilla-vram prefill of 512 tokens at 2011.2 tok/s, n_ubatch 512 (same file), per token and active byte
    gpu_prefill_s_per_token_per_active_byte: float = (1 / 2011.2) / REF_ACTIVE_BYTES
    gpu_prefill_reference_ubatch: int = 512
    # every cache step on a GPU, native or not: the remap op's graph split, the router ids' readback, the native
    # policy's acquire. pack-25%+ram+preload and pack-50%+ram+preload (gpu_hotpath_q30b.json, native: no step
    # enters Python, provider_calls 0): 9.25 and 8.33 ms per token, less vanilla's 6.11 and their RAM copies at
    # the probed 55.29 GB/s (27.9 and 12.7 per token: 1.34, 0.61 ms), over 48 layers: 37.4 and 33.4 us; the mean
    gpu_hook_s_per_layer: float = 35.4e-6
    # a step that enters the Python provider (cffi callback, GIL, the Python policy): pack-100%+pyhot against
    # pack-100% (gpu_hotpath_q30b.json, the same loads): 1.63 ms more per token for 46.8 more Python steps per
    # token (19104 against 488 provider_calls in 398 tokens)
    python_step_s: float = 34.9e-6
    # per pool miss the Python provider loads (plans the slot, stages the read, bookkeeping): pack-25%@8G and
    # pack-12.5%@8G (gpu_ssd_policy_warm_q30b.json, native) "rest of the provider" + "entering the callbacks"
    # (1.99, 6.30 ms per token), less python_step_s x their provider_calls per token (21.0, 45.3), over their
    # misses per token (28.5, 120.1): 44.1 and 39.3 us; the mean. (The pyhot RAM-tier runs give 48 and 82 us.)
    python_load_s: float = 41.7e-6
    # per pool miss the Python provider loads in a prefill step (tens of misses per step, one cache step per layer
    # and ubatch): the +pyhot RAM-tier runs against their native twins (gpu_hotpath_q30b.json, the same loads),
    # prefill time difference less python_step_s x 48 steps, over the prefill's misses: 6.1, 9.7 (pack-25%+ram
    # +preload, 512 then 32 tokens), 6.7, 8.0 us (pack-50%+ram+preload); the mean. Held out: granite's pair gives
    # 8.7 and 7.4 us. (python_load_s, fitted on decode steps of one or two misses each, is ~5x this.)
    python_prefill_load_s: float = 7.6e-6
    # the SSD reads of a process's first request (the pool empty, the provider just loaded) take this times the
    # probed per-block time (cause not identified: not slot first use, pack-12.5% is as slow per read as pack-100%):
    # (prefill_s - vanilla's prefill) / SSD reads over 2.53 MiB at the probed 2.29 GB/s, first requests of
    # gpu_hotpath_q30b.json (pack-100%, +pyhot: 512 tokens, 1.68, 1.71) and gpu_ssd_policy_warm_q30b.json (the
    # four non-warm 32-token first requests: 1.77, 1.83, 1.76, 1.81); the mean. A later request's reads run at the
    # probed rate (those runs' 512-token second requests: 1.02-1.10 with Python). Held out: granite's first
    # requests give 2.0-2.1. Only the bench comparison's first request uses it (the plan's own prefill is warm).
    cold_read_factor: float = 1.76
    # a decode read (one or two a layer: the disk's latency, not its bandwidth) of a key the process has not read
    # before takes this times the probed block time, a repeated read the probed time (a replay counts which is
    # which: StepLoads.ssd_first_reads). Fitted on read_wait_s of each decode request of
    # gpu_ssd_policy_warm_q30b.json's four non-warm runs (8 requests; the bench's own trace and requests replayed
    # through each run's policy and pool for the counts), least squares with repeats at the probed 1.16 ms:
    # within 0.87-1.29 a request. (Free, the repeats fit at 0.79x and first reads at 2.09x, each request within
    # 5%, but held out granite's repeats run at 0.88x of its probe: the 1.69 with repeats at 1.0 predicts
    # granite's decode within 0.99-1.08, the free pair 1.23-1.34.) The process's first request then decodes at
    # 1.4-1.9x its second's time per read. Why a first read is slower is not identified (the guest's page cache is
    # dropped before the process and the reads are O_DIRECT: the VM's host or the disk caching blocks)
    decode_first_read_factor: float = 1.69
    # per RAM-tier hit in a prefill step on a GPU pool, beyond its copy at the probed H2D rate (the tier hit's
    # handling: slot, copy issue and wait): fitted with the pool-view term below (its comment gives the data). In
    # decode this cost is inside gpu_hook_s_per_layer (fitted on decode with the copies at the probed rate).
    prefill_ram_hit_s: float = 9.5e-6
    # a GPU pool's multi-token ubatch (prefill): its matmuls see the whole pool (the remap op's and the slot
    # lookup's graphs; whole-pool graphs give each layer a view of its own experts), and CUDA's mul_mat_id sizes
    # its work by the expert count the weights declare (mmq.cu: the ids helper runs a block per expert, each
    # scanning the ubatch's ids; the MMQ grid's z is that count). Per expert matmul (3 a MoE layer) and slot
    # beyond the layer's experts: view_s_per_slot + view_s_per_slot_token x the ubatch's tokens. Fitted with
    # prefill_ram_hit_s (least squares, 6 points) on gpu_lookup_q30b.json's native RAM-tier runs with pools of
    # 1536, 3072 and 6144 slots: first 512-token requests (4804 tier hits each) 591.2, 640.5, 759.9 ms; second
    # 32-token requests (854, 401, 42 tier hits) 86.3, 75.2, 85.8 ms; less vanilla's and 48 hooks. The fit is
    # within 1% of each; gpu_hotpath_q30b.json's four such rows (another call) within 1.5-3.1%. A tier hit then
    # costs 57.5 us in prefill: its copy at 55.29 GB/s (48.0 us) and 9.5 us (prefill_ram_hit_s, above; it was
    # 26.0 us when this term was not modelled and the tier hits carried it).
    gpu_view_s_per_slot: float = 55.1e-9
    gpu_view_s_per_slot_token: float = 0.394e-9
    # provider callback on the host (no device sync): 27.2 us per acquire (provider_overhead_h200_cpu.json); a host
    # pool's every step, Python or native (not measured with the native path)
    host_hook_s_per_layer: float = 27.17e-6
    # guessed, not measured: weights per byte for the CPU prefill's FLOPs (~4.5 bits per weight, Q4_K-like)
    cpu_weights_per_byte: float = 1.8
    # share of the read time hidden under compute: 0 (serial), the formula; pack-50% sampled decode
    # (57.2 tok/s measured, gpu_prefetch_README.md second round) fits the serial model within 3%
    io_overlap: float = 0.0


EXPERT_MATMULS_PER_LAYER = 3  # gate, up, down (a fused gate_up model has 2: the view term is then over-counted)

DEFAULT_COSTS = Costs()


@dataclass(frozen=True)
class ModelShape:
    """What the plan needs of a model: ``block_bytes`` is one (layer, expert) as read from the pack (its
    stride), ``slot_bytes`` what one pool slot costs, ``expert_bytes`` one expert's weights (mean over layers),
    ``nonexpert_bytes`` every other weight, ``kv_bytes_per_token`` the f16 K and V of one context token."""

    name: str
    n_moe_layers: int
    n_experts: int
    top_k: int
    block_bytes: int
    slot_bytes: int
    expert_bytes: float
    nonexpert_bytes: int
    kv_bytes_per_token: int = 0

    def __post_init__(self):
        if min(self.n_moe_layers, self.n_experts, self.top_k, self.block_bytes, self.slot_bytes) < 1 \
                or self.top_k > self.n_experts:
            raise ValueError(f"{self.name}: a model shape needs positive sizes and top_k <= n_experts")

    @property
    def n_blocks(self) -> int:
        return self.n_moe_layers * self.n_experts

    @property
    def active_bytes(self) -> float:
        """Weight bytes one token reads: the non-expert weights and top_k experts per MoE layer."""
        return self.nonexpert_bytes + self.n_moe_layers * self.top_k * self.expert_bytes

    def layer_working_set(self, n_ubatch: int = 1) -> int:
        """Distinct experts one layer may use in one ubatch: the fewest slots (and tier blocks) that can run."""
        return min(self.n_experts, self.top_k * n_ubatch)


@dataclass(frozen=True)
class Machine:
    """Probe figures. ``free_vram_bytes`` None: no GPU (host pool, CPU compute). ``disk_bytes_per_s``: O_DIRECT
    random reads of one block at the provider's queue depth. ``h2d_bytes_per_s``: pinned host-to-device copies
    (None without a GPU). ``cpu_read_bytes_per_s`` / ``cpu_flops``: the host's matrix-vector read rate and
    matmul rate."""

    free_vram_bytes: int | None
    spare_ram_bytes: int
    disk_bytes_per_s: float
    h2d_bytes_per_s: float | None
    cpu_read_bytes_per_s: float
    cpu_flops: float

    @property
    def gpu(self) -> bool:
        return self.free_vram_bytes is not None


@dataclass(frozen=True)
class Budgets:
    """Pool slots, RAM-tier blocks (0: none) and the prefill ubatch; ``gpu``: the pool is in VRAM;
    ``native_hot_path``: steps with no SSD read are served in libllama (StreamingSettings.native_hot_path, which the
    provider applies with the ``next-use`` policy and no lookahead only: give False otherwise)."""

    pool_slots: int
    tier_blocks: int
    n_ubatch: int
    gpu: bool
    native_hot_path: bool = True
    whole_pool_graphs: bool = True  # StreamingSettings.whole_pool_graphs and its default (no hybrid, no lookahead)

    def whole_pool(self, shape: "ModelShape") -> bool:
        """Whether graphs run whole-pool (a slot for every expert, the native hot path on): no cache step per
        layer, the steps' bookkeeping done natively after each ubatch."""
        return self.whole_pool_graphs and self.native_hot_path and self.pool_slots >= shape.n_blocks

    def settings(self, shape: ModelShape) -> dict:
        """The StreamingSettings / run options these budgets are: cache_vram_mib, ram_cache_mib, n_ubatch,
        native_hot_path."""
        return {"cache_vram_mib": mib_up(self.pool_slots * shape.slot_bytes),
                "ram_cache_mib": mib_up(self.tier_blocks * shape.block_bytes) if self.tier_blocks else None,
                "n_ubatch": self.n_ubatch, "native_hot_path": self.native_hot_path}


def mib_up(nbytes: int) -> float:
    """``nbytes`` in MiB, rounded up to 0.1 MiB: a budget the provider floors back to the same slot count."""
    return math.ceil(nbytes / MIB * 10) / 10


@dataclass(frozen=True)
class StepLoads:
    """Where a pool's misses came from, averaged: per decode token, or per prefill ubatch. ``lookups``: distinct
    (layer, expert) keys asked for; ``pool_hits``; ``ram_hits`` (misses the tier held); ``ssd_reads``.
    ``ssd_steps``: the cache steps with an SSD read (those the native hot path sends to Python) and
    ``ssd_step_misses`` their pool misses, where counted (None: estimated from the rates, ``python_work``)."""

    lookups: float
    pool_hits: float
    ram_hits: float
    ssd_reads: float
    ssd_steps: float | None = None
    ssd_step_misses: float | None = None
    ssd_first_reads: float | None = None  # of ssd_reads, a key's first read in the process (None: not counted)

    @property
    def pool_hit_rate(self) -> float | None:
        return self.pool_hits / self.lookups if self.lookups else None

    @property
    def tier_hit_rate(self) -> float | None:
        misses = self.ram_hits + self.ssd_reads
        return self.ram_hits / misses if misses else None


@dataclass(frozen=True)
class TimeSplit:
    """Seconds of one decode token (or one prefill), by cause."""

    compute: float
    hook: float
    ssd: float
    ram: float
    overlap: float = 0.0
    python: float = 0.0  # the Python provider's steps and loads (GPU pool)
    view: float = 0.0    # prefill matmuls through a pool view wider than a layer's experts (pool_view_s)

    @property
    def total(self) -> float:
        return self.compute + self.hook + self.python + self.ssd + self.ram + self.view - self.overlap


def decode_compute_s(shape: ModelShape, machine: Machine, costs: Costs = DEFAULT_COSTS) -> float:
    """Vanilla decode time of one token: every expert resident."""
    if machine.gpu:
        return shape.active_bytes * costs.gpu_decode_s_per_active_byte
    return shape.active_bytes / machine.cpu_read_bytes_per_s


def prefill_compute_s(shape: ModelShape, machine: Machine, n_tokens: int, n_ubatch: int,
                      costs: Costs = DEFAULT_COSTS) -> float:
    """Vanilla prefill time of ``n_tokens`` in ubatches of ``n_ubatch``. GPU: a ubatch of U tokens costs the
    decode time plus (U - 1) times the marginal token cost between the two measured points (U = 1, decode; U =
    512, prefill). CPU: the weights' FLOPs (2 per weight, a guessed weights per byte) at the matmul rate, and
    never less than reading them."""
    decode = decode_compute_s(shape, machine, costs)
    full, last = divmod(n_tokens, n_ubatch)
    if machine.gpu:
        ref = costs.gpu_prefill_reference_ubatch
        per_ref_token = shape.active_bytes * costs.gpu_prefill_s_per_token_per_active_byte
        marginal = max(per_ref_token * ref - decode, 0.0) / (ref - 1)
        ubatch = lambda u: decode + (u - 1) * marginal  # noqa: E731
    else:
        flops_per_token = 2 * shape.active_bytes * costs.cpu_weights_per_byte
        ubatch = lambda u: max(u * flops_per_token / machine.cpu_flops, decode)  # noqa: E731
    return full * ubatch(n_ubatch) + (ubatch(last) if last else 0.0)


def load_seconds(loads: StepLoads, shape: ModelShape, machine: Machine) -> tuple[float, float]:
    """(SSD seconds, RAM-copy seconds) of ``loads``: reads at the disk's rate, RAM-tier hits at the pinned
    copy rate (GPU pool) or the host's read rate (host pool)."""
    ssd = loads.ssd_reads * shape.block_bytes / machine.disk_bytes_per_s
    copy_rate = machine.h2d_bytes_per_s if machine.gpu and machine.h2d_bytes_per_s else machine.cpu_read_bytes_per_s
    return ssd, loads.ram_hits * shape.block_bytes / copy_rate


def hook_s_per_layer(machine: Machine, costs: Costs = DEFAULT_COSTS) -> float:
    return costs.gpu_hook_s_per_layer if machine.gpu else costs.host_hook_s_per_layer


def ssd_step_share(loads: StepLoads, n_steps: int) -> float:
    """Share of ``n_steps`` cache steps with an SSD read: counted by the replay, else estimated from the rates
    (each of a step's ``lookups / n_steps`` keys an SSD read with probability ``ssd_reads / lookups``, alone)."""
    if loads.ssd_steps is not None:
        return min(loads.ssd_steps / n_steps, 1.0) if n_steps else 0.0
    if not loads.lookups or not loads.ssd_reads:
        return 0.0
    return 1 - (1 - loads.ssd_reads / loads.lookups) ** (loads.lookups / n_steps)


def python_work(loads: StepLoads, n_steps: int, native_hot_path: bool) -> tuple[float, float]:
    """(steps, pool misses) the Python provider handles of ``n_steps`` cache steps with ``loads``: all of them
    without the native hot path; with it, the steps with an SSD read and their misses (estimated, when not
    counted, as the SSD reads and the share of RAM hits that fall in those steps)."""
    misses = loads.ram_hits + loads.ssd_reads
    if not native_hot_path:
        return float(n_steps), misses
    share = ssd_step_share(loads, n_steps)
    if loads.ssd_step_misses is not None:
        return share * n_steps, loads.ssd_step_misses
    return share * n_steps, loads.ssd_reads + share * loads.ram_hits


def step_costs(shape: ModelShape, machine: Machine, loads: StepLoads, costs: Costs,
               native_hot_path: bool, prefill: bool = False, whole_pool: bool = False) -> tuple[float, float]:
    """(hook, Python) seconds of one token's or (``prefill``) ubatch's ``n_moe_layers`` cache steps with ``loads``.
    Whole-pool graphs have none: their steps are bookkeeping after the ubatch, in libllama (an assumption of the
    model, microseconds a ubatch on the CPU; not yet checked against a device run)."""
    if whole_pool:
        return 0.0, 0.0
    n = shape.n_moe_layers
    if not machine.gpu:
        return n * costs.host_hook_s_per_layer, 0.0
    steps, misses = python_work(loads, n, native_hot_path)
    load_s = costs.python_prefill_load_s if prefill else costs.python_load_s
    return n * costs.gpu_hook_s_per_layer, steps * costs.python_step_s + misses * load_s


def decode_ssd_factor(loads: StepLoads, costs: Costs = DEFAULT_COSTS) -> float:
    """How many probed block times a decode token's SSD reads take on average: a key's first read in the process
    ``decode_first_read_factor``, a repeated read one (all of them one when not counted)."""
    if loads.ssd_first_reads is None or not loads.ssd_reads:
        return 1.0
    first = min(loads.ssd_first_reads, loads.ssd_reads)
    return (first * costs.decode_first_read_factor + loads.ssd_reads - first) / loads.ssd_reads


def decode_time(shape: ModelShape, machine: Machine, per_token: StepLoads, costs: Costs = DEFAULT_COSTS,
                native_hot_path: bool = True, whole_pool: bool = False) -> TimeSplit:
    """One decode token's seconds (module docstring)."""
    compute = decode_compute_s(shape, machine, costs)
    hook, python = step_costs(shape, machine, per_token, costs, native_hot_path, whole_pool=whole_pool)
    ssd, ram = load_seconds(per_token, shape, machine)
    ssd *= decode_ssd_factor(per_token, costs)
    overlap = costs.io_overlap * min(ssd + ram, compute + hook)
    return TimeSplit(compute, hook, ssd, ram, overlap, python)


def pool_view_s(shape: ModelShape, machine: Machine, pool_slots: int, n_tokens: int, n_ubatch: int,
                costs: Costs = DEFAULT_COSTS, whole_pool: bool = False) -> float:
    """Seconds the prefill of ``n_tokens`` (ubatches of ``n_ubatch``) spends in its matmuls walking the pool's
    slots beyond a layer's experts (``Costs.gpu_view_s_per_slot``): a GPU pool's multi-token ubatches, unless
    whole-pool graphs give each layer a view of its own experts."""
    if not machine.gpu or whole_pool or pool_slots <= shape.n_experts:
        return 0.0
    multi_token = [min(n_ubatch, n_tokens - start) for start in range(0, n_tokens, n_ubatch)]
    multi_token = [n for n in multi_token if n > 1]  # one token: the vector kernels, sized by the ids
    per_slot = sum(costs.gpu_view_s_per_slot + n * costs.gpu_view_s_per_slot_token for n in multi_token)
    return shape.n_moe_layers * EXPERT_MATMULS_PER_LAYER * (pool_slots - shape.n_experts) * per_slot


def prefill_time(shape: ModelShape, machine: Machine, n_tokens: int, n_ubatch: int, per_ubatch: StepLoads,
                 costs: Costs = DEFAULT_COSTS, native_hot_path: bool = True, cold: bool = False,
                 whole_pool: bool = False, pool_slots: int = 0) -> TimeSplit:
    """Seconds to prefill ``n_tokens`` (module docstring); ``per_ubatch``: the loads of one ubatch, all layers;
    ``cold``: the first request of a process (its SSD reads cost ``Costs.cold_read_factor`` times more);
    ``pool_slots``: the pool's (the matmuls' view: ``pool_view_s``; 0: none)."""
    n_ubatches = math.ceil(n_tokens / n_ubatch)
    compute = prefill_compute_s(shape, machine, n_tokens, n_ubatch, costs)
    hook, python = step_costs(shape, machine, per_ubatch, costs, native_hot_path, prefill=True, whole_pool=whole_pool)
    ssd, ram = load_seconds(per_ubatch, shape, machine)
    ssd *= costs.cold_read_factor if cold else 1.0
    ram += per_ubatch.ram_hits * costs.prefill_ram_hit_s if machine.gpu else 0.0
    hook, python, ssd, ram = hook * n_ubatches, python * n_ubatches, ssd * n_ubatches, ram * n_ubatches
    overlap = costs.io_overlap * min(ssd + ram, compute + hook)
    view = pool_view_s(shape, machine, pool_slots, n_tokens, n_ubatch, costs, whole_pool)
    return TimeSplit(compute, hook, ssd, ram, overlap, python, view)


@dataclass(frozen=True)
class Memory:
    """Bytes a configuration holds: in VRAM (GPU pool: non-expert weights, KV cache, pool) and in host RAM."""

    vram: int
    ram: int


def memory_use(shape: ModelShape, budgets: Budgets, n_ctx: int) -> Memory:
    """Weights, KV cache of ``n_ctx`` tokens, pool and tier, where they live (compute buffers not counted)."""
    weights_and_kv = shape.nonexpert_bytes + shape.kv_bytes_per_token * n_ctx
    pool = budgets.pool_slots * shape.slot_bytes
    tier = budgets.tier_blocks * shape.block_bytes
    if budgets.gpu:
        return Memory(vram=weights_and_kv + pool, ram=tier)
    return Memory(vram=0, ram=weights_and_kv + pool + tier)


@dataclass(frozen=True)
class Prediction:
    """One configuration's predicted figures."""

    label: str
    budgets: Budgets
    decode: TimeSplit
    decode_loads: StepLoads
    prefill: dict[int, TimeSplit] = field(default_factory=dict)  # prompt tokens -> seconds
    memory: Memory = Memory(0, 0)
    block_bytes: int = 0

    @property
    def decode_tok_s(self) -> float:
        return 1 / self.decode.total

    def prefill_tok_s(self, n_tokens: int) -> float:
        return n_tokens / self.prefill[n_tokens].total

    @property
    def ssd_bytes_per_token(self) -> float:
        return self.decode_loads.ssd_reads * self.block_bytes
