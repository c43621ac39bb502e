"""``make_plan``: read the model's shape, probe the machine, replay the routing model, predict (I/O glue)."""
from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path

from tqdm import tqdm

from ..cache_dir import user_cache_dir
from . import hits, probe, recommend
from .model import MIB, ModelShape, Prediction
from .shape import read_shape

NOTES = (recommend.HYBRID_NOTE, "multi-GPU: not modelled (one pool on one GPU)",
         "constants calibrated on one H100 machine's Qwen3-30B-shaped runs, checked on granite-shaped ones "
         "(docs/plan.md, Validation)")


@dataclass(frozen=True)
class Plan:
    shape: ModelShape
    report: probe.ProbeReport
    n_ctx: int
    predictions: list[Prediction]  # the recommendation first

    @property
    def recommended(self) -> Prediction:
        return self.predictions[0]

    def settings(self) -> dict:
        """cache_vram_mib, ram_cache_mib (None: no tier) and n_ubatch of the recommendation."""
        return self.recommended.budgets.settings(self.shape)

    def as_json(self) -> dict:
        machine = self.report.machine
        return {
            "model": {**vars(self.shape), "active_bytes_per_token": self.shape.active_bytes},
            "machine": {**vars(machine), "total_ram_bytes": self.report.total_ram_bytes,
                        "probe_cache": self.report.cache_path, "measured_now": list(self.report.measured),
                        "disk": self.report.disk},
            "n_ctx": self.n_ctx,
            "recommended": self.settings(),
            "predictions": [prediction_json(p, self.shape) for p in self.predictions],
            "notes": list(NOTES),
        }


def tier_hit_rate(p: Prediction) -> float | None:
    """The RAM tier's hit rate on the pool's decode misses; None without a tier."""
    return p.decode_loads.tier_hit_rate if p.budgets.tier_blocks else None


def prediction_json(p: Prediction, shape: ModelShape) -> dict:
    d = p.decode
    out = {"label": p.label, "settings": p.budgets.settings(shape), "pool_slots": p.budgets.pool_slots,
           "tier_blocks": p.budgets.tier_blocks, "gpu_pool": p.budgets.gpu,
           "decode_tok_s": p.decode_tok_s,
           "decode_ms_per_token": {"compute": 1e3 * d.compute, "hook": 1e3 * d.hook, "python": 1e3 * d.python,
                                   "ssd": 1e3 * d.ssd,
                                   "ram": 1e3 * d.ram, "overlap": 1e3 * d.overlap, "total": 1e3 * d.total},
           "decode_pool_hit_rate": p.decode_loads.pool_hit_rate, "decode_tier_hit_rate": tier_hit_rate(p),
           "decode_misses_per_token": p.decode_loads.ram_hits + p.decode_loads.ssd_reads,
           "decode_ssd_bytes_per_token": p.ssd_bytes_per_token,
           "vram_bytes": p.memory.vram, "ram_bytes": p.memory.ram}
    for n_tokens in p.prefill:
        out[f"prefill_{n_tokens}_tok_s"] = p.prefill_tok_s(n_tokens)
    return out


def make_plan(model: str, pack: str | None = None, *, n_ctx: int = 4096, reprobe: bool = False,
              use_gpu: bool = True, progress: bool = True, cache_dir: Path | None = None) -> Plan:
    """The plan of ``model`` (a GGUF) read from ``pack`` (None: GGUF-direct; "" or True: the default pack beside
    the model); ``use_gpu=False``: a host pool even where a GPU is seen. CapacityError / PackIOError when it
    cannot run at all."""
    from ..pack import default_pack_path, open_gguf

    if pack == "" or pack is True:
        pack = default_pack_path(open_gguf(model))
    shape = read_shape(model)
    root = cache_dir or user_cache_dir()
    target = probe.disk_target(model, pack)
    bar = tqdm(desc="plan", unit="step", leave=False) if progress else nullcontext()
    with bar:
        def step(name: str) -> None:
            if progress:
                bar.set_postfix_str(name)
                bar.update(1)

        report = probe.probe(target, reprobe=reprobe, cache_dir=root / "probe", use_gpu=use_gpu,
                             step=step)
        recommend.recommend(shape, report.machine, n_ctx)  # refuse before the slow part
        step("routing model")
        trace = hits.decode_trace(shape, root / "plan")
        prompts = hits.prompt_trace(shape, root / "plan")
        predictions = recommend.plan(shape, report.machine, n_ctx, trace, step=step, prompt_source=prompts)
    return Plan(shape, report, n_ctx, predictions)


def table_lines(plan: Plan) -> list[str]:
    """The plan as text: model, machine, one row per configuration, notes."""
    s, m, r = plan.shape, plan.report.machine, plan.report
    gb = lambda n: f"{n / 1e9:.2f} GB/s"  # noqa: E731
    lines = [f"model: {s.name}: {s.n_moe_layers} MoE layers x {s.n_experts} experts, top-{s.top_k}; "
             f"block {s.block_bytes / MIB:.2f} MiB, slot {s.slot_bytes / MIB:.2f} MiB; "
             f"experts {s.n_blocks * s.block_bytes / 1e9:.2f} GB, other weights {s.nonexpert_bytes / 1e9:.2f} GB",
             "machine: " + (f"{m.free_vram_bytes / MIB:,.0f} MiB VRAM free" if m.gpu else "no GPU (host pool)")
             + f"; {m.spare_ram_bytes / MIB:,.0f} MiB RAM spare of {r.total_ram_bytes / MIB:,.0f}; "
             f"disk {gb(m.disk_bytes_per_s)} (O_DIRECT, {s.block_bytes / MIB:.2f} MiB reads, "
             f"{r.disk.get('threads', '?')} at once)"
             + (f"; H2D {gb(m.h2d_bytes_per_s)}" if m.h2d_bytes_per_s else "")
             + f"; CPU {gb(m.cpu_read_bytes_per_s)} read, {m.cpu_flops / 1e9:.0f} GFLOP/s",
             f"probe: {'measured now: ' + ', '.join(r.measured) if r.measured else 'cached'} ({r.cache_path}; "
             "--reprobe measures again)", ""]
    header = ("config", "pool MiB", "tier MiB", "ubatch", "decode tok/s", "prefill 512", "prefill 4096",
              "pool hit", "tier hit", "SSD MiB/tok", "VRAM MiB", "RAM MiB")
    rows = [header]
    pct = lambda v: "-" if v is None else f"{100 * v:.1f}%"  # noqa: E731
    for p in plan.predictions:
        settings = p.budgets.settings(s)
        rows.append((p.label, f"{settings['cache_vram_mib']:,.0f}",
                     "-" if settings["ram_cache_mib"] is None else f"{settings['ram_cache_mib']:,.0f}",
                     str(p.budgets.n_ubatch), f"{p.decode_tok_s:.1f}", f"{p.prefill_tok_s(512):.1f}",
                     f"{p.prefill_tok_s(4096):.1f}", pct(p.decode_loads.pool_hit_rate),
                     pct(tier_hit_rate(p)), f"{p.ssd_bytes_per_token / MIB:.1f}",
                     f"{p.memory.vram / MIB:,.0f}", f"{p.memory.ram / MIB:,.0f}"))
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    lines += ["  ".join(cell.ljust(w) if i == 0 else cell.rjust(w) for i, (cell, w) in enumerate(zip(row, widths)))
              for row in rows]
    d = plan.recommended.decode
    lines += ["", f"recommended decode, ms per token: compute {1e3 * d.compute:.2f}, hook {1e3 * d.hook:.2f}, "
                  f"Python provider {1e3 * d.python:.2f}, "
                  f"SSD reads {1e3 * d.ssd:.2f}, RAM copies {1e3 * d.ram:.2f}",
              "settings: " + ", ".join(f"{k}={v}" for k, v in plan.settings().items()),
              *(f"note: {note}" for note in NOTES)]
    return lines
