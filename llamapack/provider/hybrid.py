"""Hybrid execution: the policy side (pure), StreamingSettings.hybrid.

With hybrid on, a step the native hot path serves leaves some of its slot-pool misses that are in RAM blocks
where they are and computes their rows on the CPU (libllama's ``llama_expert_hybrid_set``); the rest are
copied into the pool before the step's GPU work, while the CPU works. The CPU's experts are then copied into
the pool too, behind the step (``hybrid_fill_pool``, on by default): the pool's policy decides exactly as
without hybrid, so the hit rate is the PCIe-only tier's, and only the wait for those copies moves off the
step's critical path. Which share of a step's misses is copied before its GPU work:

- ``"on"``: none (0.0): every miss in RAM runs on the CPU.
- ``"auto"``: the split that makes the copies and the CPU's work end together, from the measured per-expert
  costs: copying ``u`` of ``m`` misses takes ``u * copy_s``, computing the rest ``(m - u) * cpu_s``, so
  ``u / m = cpu_s / (cpu_s + copy_s)``; rounded to eighths, so that runs with slightly different timings
  still split the same way (the split decides which kernel computes a row, hence the output's last bits).
- a number in [0, 1]: that share.
"""
from __future__ import annotations

import math

MODES = ("off", "on", "auto")
# ubatches up to this many tokens are split (llama.cpp's CUDA backend takes larger ones to the GPU even under
# --cpu-moe: its op offload starts at 32 tokens)
MAX_TOKENS = 31
SHARE_STEPS = 8


def parse_mode(value) -> str | float:
    """``"off"``, ``"on"``, ``"auto"`` or a share in [0, 1]; ValueError otherwise."""
    if isinstance(value, str) and value.lower() in MODES:
        return value.lower()
    try:
        share = float(value)
    except (TypeError, ValueError):
        raise ValueError(f'hybrid must be "off", "on", "auto" or an upload share in [0, 1] (got {value!r})') from None
    if not 0.0 <= share <= 1.0:
        raise ValueError(f"hybrid's upload share must be in [0, 1] (got {share})")
    return share


def upload_share(cpu_s: float, copy_s: float) -> float:
    """The share of a step's RAM misses to copy so that copies (``copy_s`` each) and CPU work (``cpu_s`` each)
    end together, in eighths."""
    if not (cpu_s > 0 and copy_s > 0 and math.isfinite(cpu_s) and math.isfinite(copy_s)):
        raise ValueError(f"per-expert costs must be finite and > 0 (cpu {cpu_s}, copy {copy_s})")
    return round(cpu_s / (cpu_s + copy_s) * SHARE_STEPS) / SHARE_STEPS


def share_for(mode: str | float, cpu_s: float | None = None, copy_s: float | None = None) -> float:
    """The upload share a mode gives (``"auto"`` needs the measured costs)."""
    if mode == "on":
        return 0.0
    if mode == "auto":
        return upload_share(cpu_s, copy_s)
    if isinstance(mode, float):
        return mode
    raise ValueError(f"hybrid {mode!r} has no upload share")


def default_threads(cpu_count: int | None) -> int:
    """All cores but one (the thread that drives the decode), at least one."""
    return max(1, (cpu_count or 2) - 1)
