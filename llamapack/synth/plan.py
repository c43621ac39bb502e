"""Tensor plans: what each tensor is (name, ggml shape, type, init) and how its bytes are streamed."""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as Q

from .init import Gaussian, NormWeight, Router, SynthContext, TokenEmbedding
from .quant import (FLOAT_ENCODED_TYPES, RANDOM_BLOCK_TYPES, SUPPORTED_TYPES, encode_floats, random_blocks,
                    tensor_nbytes)

Init = Gaussian | NormWeight | Router | TokenEmbedding

# Payload generated per step: bounds RAM use regardless of tensor size. Part of the byte-exact
# output: changing it changes the bytes a seed gives.
CHUNK_BYTES = 32 << 20


@dataclass(frozen=True)
class TensorPlan:
    name: str
    ne: tuple[int, ...]  # ggml order: ne[0] is the row length (the matmul input dim)
    qtype: Q
    init: Init

    def __post_init__(self) -> None:
        if self.qtype not in SUPPORTED_TYPES:
            raise ValueError(f"{self.name}: unsupported type {self.qtype.name}")
        if self.ne[0] % GGML_QUANT_SIZES[self.qtype][0]:
            raise ValueError(f"{self.name}: row length {self.ne[0]} is not a multiple of the "
                             f"{self.qtype.name} block size {GGML_QUANT_SIZES[self.qtype][0]}")
        if not self.uses_random_blocks and self.qtype not in FLOAT_ENCODED_TYPES:
            raise ValueError(f"{self.name}: {type(self.init).__name__} values need F32, F16 or Q8_0, "
                             f"not {self.qtype.name}")

    @property
    def n_elements(self) -> int:
        return math.prod(self.ne)

    @property
    def nbytes(self) -> int:
        return tensor_nbytes(self.qtype, self.n_elements)

    @property
    def is_expert(self) -> bool:
        """Routed-expert weights and biases (the part llamapack keeps on SSD)."""
        return "_exps." in self.name

    @property
    def uses_random_blocks(self) -> bool:
        return isinstance(self.init, Gaussian) and self.qtype in RANDOM_BLOCK_TYPES

    def chunks(self, ctx: SynthContext) -> Iterator[np.ndarray]:
        """The tensor's bytes, generated in pieces of about CHUNK_BYTES (uint8 arrays)."""
        rng = ctx.rng(self.name)
        if self.uses_random_blocks:
            n_blocks = self.n_elements // GGML_QUANT_SIZES[self.qtype][0]
            step = max(1, CHUNK_BYTES // GGML_QUANT_SIZES[self.qtype][1])
            for start in range(0, n_blocks, step):
                yield random_blocks(rng, self.qtype, min(step, n_blocks - start), self.init.std).reshape(-1)
            return
        width = self.ne[0]
        n_rows = self.n_elements // width
        step = max(1, CHUNK_BYTES // (4 * width))
        for start in range(0, n_rows, step):
            stop = min(n_rows, start + step)
            yield encode_floats(self.init.rows(ctx, rng, start, stop, width), self.qtype).reshape(-1)


def expert_bytes(plans: list[TensorPlan]) -> int:
    return sum(p.nbytes for p in plans if p.is_expert)


def total_bytes(plans: list[TensorPlan]) -> int:
    return sum(p.nbytes for p in plans)
