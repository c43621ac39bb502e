"""The speed model of ``llamapack plan`` (pure: no I/O, no clock).

Decode, per token:
    t = compute + n_moe_layers * hook + ssd_reads * block / disk + ram_hits * block / h2d
where ``ssd_reads`` and ``ram_hits`` are the pool misses per token served by the SSD and by the RAM tier
(``hits.py`` replays a routing-model trace of the model's shape through the real cache policy to get them).
Nothing overlaps: reads are demand reads, the layer waits for them (``Costs.io_overlap`` may later say
otherwise, from the device calibration).

Prefill of P tokens in ubatches of U: ceil(P / U) ubatches; in each, every MoE layer's distinct experts of the
ubatch are made resident once (one cache step per layer and ubatch), so
    t = compute(P, U) + ubatches * n_moe_layers * hook + ssd_reads * block / disk + ram_hits * block / h2d.

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

    # vanilla-vram decode 221.20 tok/s on the H200 (gpu_bench_idle_prefetch_greedy_skew0.md), per active byte
    gpu_decode_s_per_active_byte: float = (1 / 221.20) / REF_ACTIVE_BYTES
    # vanilla-vram prefill of 512 tokens at 1929.1 tok/s, n_ubatch 512 (same file), per token and active byte
    gpu_prefill_s_per_token_per_active_byte: float = (1 / 1929.1) / REF_ACTIVE_BYTES
    gpu_prefill_reference_ubatch: int = 512
    # pack-100% (nothing read) 111.83 tok/s against vanilla's 221.20 (same file): the hook's callback, the router
    # ids' readback and graph splits, per MoE layer per cache step (~92 us)
    gpu_hook_s_per_layer: float = (1 / 111.83 - 1 / 221.20) / REF_N_MOE_LAYERS
    # provider callback on the host (no device sync): 27.2 us per acquire (provider_overhead_h200_cpu.json)
    host_hook_s_per_layer: float = 27.17e-6
    # guessed, not measured: weights per byte for the CPU prefill's FLOPs (~4.5 bits per weight, Q4_K-like)
    cpu_weights_per_byte: float = 1.8
    # share of the read time hidden under compute: 0 (serial), the formula; pack-50% sampled decode
    # (57.2 tok/s measured, gpu_prefetch_README.md second round) fits the serial model within 3%
    io_overlap: float = 0.0


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
    """Pool slots, RAM-tier blocks (0: none) and the prefill ubatch; ``gpu``: the pool is in VRAM."""

    pool_slots: int
    tier_blocks: int
    n_ubatch: int
    gpu: bool

    def settings(self, shape: ModelShape) -> dict:
        """The StreamingSettings / run options these budgets are: cache_vram_mib, ram_cache_mib, n_ubatch."""
        return {"cache_vram_mib": mib_up(self.pool_slots * shape.slot_bytes),
                "ram_cache_mib": mib_up(self.tier_blocks * shape.block_bytes) if self.tier_blocks else None,
                "n_ubatch": self.n_ubatch}


def mib_up(nbytes: int) -> float:
    """``nbytes`` in MiB, rounded up to 0.1 MiB: a budget the provider floors back to the same slot count."""
    return math.ceil(nbytes / MIB * 10) / 10


@dataclass(frozen=True)
class StepLoads:
    """Where a pool's misses came from, averaged: per decode token, or per prefill ubatch. ``lookups``: distinct
    (layer, expert) keys asked for; ``pool_hits``; ``ram_hits`` (misses the tier held); ``ssd_reads``."""

    lookups: float
    pool_hits: float
    ram_hits: float
    ssd_reads: float

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

    @property
    def total(self) -> float:
        return self.compute + self.hook + self.ssd + self.ram - self.overlap


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


def decode_time(shape: ModelShape, machine: Machine, per_token: StepLoads, costs: Costs = DEFAULT_COSTS) -> TimeSplit:
    """One decode token's seconds (module docstring)."""
    compute = decode_compute_s(shape, machine, costs)
    hook = shape.n_moe_layers * hook_s_per_layer(machine, costs)
    ssd, ram = load_seconds(per_token, shape, machine)
    overlap = costs.io_overlap * min(ssd + ram, compute + hook)
    return TimeSplit(compute, hook, ssd, ram, overlap)


def prefill_time(shape: ModelShape, machine: Machine, n_tokens: int, n_ubatch: int, per_ubatch: StepLoads,
                 costs: Costs = DEFAULT_COSTS) -> TimeSplit:
    """Seconds to prefill ``n_tokens`` (module docstring); ``per_ubatch``: the loads of one ubatch, all layers."""
    n_ubatches = math.ceil(n_tokens / n_ubatch)
    compute = prefill_compute_s(shape, machine, n_tokens, n_ubatch, costs)
    hook = n_ubatches * shape.n_moe_layers * hook_s_per_layer(machine, costs)
    ssd, ram = load_seconds(per_ubatch, shape, machine)
    ssd, ram = ssd * n_ubatches, ram * n_ubatches
    overlap = costs.io_overlap * min(ssd + ram, compute + hook)
    return TimeSplit(compute, hook, ssd, ram, overlap)


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
