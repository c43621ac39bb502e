"""How each tensor's values are drawn, deterministically from (seed, tensor name).

Scales keep activations healthy at any width: matrices are N(0, 1/fan_in) (0.022 at n_embd 2048),
norm weights sit around 1, token embeddings are N(0, 1).

Router skew ``s`` (0 = routers unbiased: measured in llama.cpp, every expert gets 1/n_expert of the
picks to within ~50%). With ``s > 0`` every token embedding also carries
``MEAN_DIRECTION_WEIGHT * sqrt(n_embd) * u`` for one unit vector ``u``, so hidden states share a
positive projection on ``u``; each layer ranks its experts in a seeded random order and router row
``e`` gets ``b_e * u / projection`` with ``b_e = -s * ln(1 + rank_e)`` (centred), i.e. its logit
shifts by about ``b_e`` and selection falls off roughly like Zipf ``(1 + rank)^-s``. Router rows are
otherwise orthogonal to ``u``. It is approximate: ``u`` also leaks through attention into other
shared directions with their own random per-expert preferences, so only the hottest few experts
reliably follow ``hottest_experts``; the effect fades in deeper layers, and sigmoid gating with
expert groups (deepseek2) bends the shape. Measured on qwen3moe-tiny (top-4 of 16, so at most 0.25):
the intended hottest expert takes ~0.19/0.23/0.25 of the picks for s = 0.5/1/2.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass

import numpy as np

MEAN_DIRECTION_WEIGHT = 0.5


@dataclass(frozen=True)
class SynthContext:
    seed: int
    n_embd: int
    router_skew: float = 0.0

    def rng(self, label: str) -> np.random.Generator:
        digest = hashlib.blake2b(label.encode(), digest_size=8).digest()
        return np.random.default_rng([self.seed, int.from_bytes(digest, "little")])

    def mean_direction(self) -> np.ndarray:
        u = self.rng("mean-direction").standard_normal(self.n_embd)
        return (u / np.linalg.norm(u)).astype(np.float32)


@dataclass(frozen=True)
class Gaussian:
    """N(0, std^2); quantized tensors get random valid blocks of that spread instead."""

    std: float

    def rows(self, ctx: SynthContext, rng: np.random.Generator, start: int, stop: int, width: int) -> np.ndarray:
        return rng.standard_normal((stop - start, width), dtype=np.float32) * np.float32(self.std)


def fan_in(width: int, gain: float = 1.0) -> Gaussian:
    return Gaussian(gain / math.sqrt(width))


@dataclass(frozen=True)
class NormWeight:
    """RMS-norm gains, uniform in [0.8, 1.2]."""

    def rows(self, ctx: SynthContext, rng: np.random.Generator, start: int, stop: int, width: int) -> np.ndarray:
        return rng.uniform(0.8, 1.2, (stop - start, width)).astype(np.float32)


@dataclass(frozen=True)
class TokenEmbedding:
    """N(0, 1) rows, plus the shared mean direction the router skew aligns with when skew > 0."""

    def rows(self, ctx: SynthContext, rng: np.random.Generator, start: int, stop: int, width: int) -> np.ndarray:
        noise = rng.standard_normal((stop - start, width), dtype=np.float32)
        if ctx.router_skew == 0:
            return noise
        return noise + np.float32(MEAN_DIRECTION_WEIGHT * math.sqrt(width)) * ctx.mean_direction()


@dataclass(frozen=True)
class Router:
    """Router rows (one per expert): N(0, 1/n_embd) orthogonal to the mean direction, plus the skew bias
    along it."""

    layer: int
    n_expert: int

    def rows(self, ctx: SynthContext, rng: np.random.Generator, start: int, stop: int, width: int) -> np.ndarray:
        u = ctx.mean_direction()
        rows = rng.standard_normal((stop - start, width), dtype=np.float32) / np.float32(math.sqrt(width))
        rows -= np.outer(rows @ u, u)  # no accidental preference along u: skew 0 means unbiased
        if ctx.router_skew > 0:
            bias = expert_logit_bias(ctx, self.layer, self.n_expert)[start:stop]
            rows += np.outer(bias / typical_projection(width), u).astype(np.float32)
        return rows


def expert_logit_bias(ctx: SynthContext, layer: int, n_expert: int) -> np.ndarray:
    """Per-expert router logit offset for ``layer``: -skew * ln(1 + hotness rank), centred."""
    ranks = ctx.rng(f"hot-experts/{layer}").permutation(n_expert)
    bias = -ctx.router_skew * np.log1p(ranks)
    return bias - bias.mean()


def hottest_experts(ctx: SynthContext, layer: int, n_expert: int) -> np.ndarray:
    """Expert ids of ``layer`` ordered from the hottest (rank 0) down, as the skew intends."""
    return np.argsort(ctx.rng(f"hot-experts/{layer}").permutation(n_expert), kind="stable")


def typical_projection(width: int) -> float:
    """Expected projection of an RMS-normalized embedding on the mean direction."""
    w = MEAN_DIRECTION_WEIGHT
    return w / math.sqrt(1.0 + w * w) * math.sqrt(width)
