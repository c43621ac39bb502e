"""Tensor payload encoders: random-but-valid quantized blocks, and real encoders for float data.

Random blocks are random bytes whose fp16 scale fields (``d``, ``dmin``; the E8M0 exponent for MXFP4)
are overwritten with finite values chosen so the dequantized weights have a requested standard
deviation and (for the types with a min) roughly zero mean. The unit scale of each layout is measured
once by dequantizing a sample with gguf-py, so the constants below only name byte offsets.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as Q
from gguf.quants import dequantize


@dataclass(frozen=True)
class ScaleFields:
    """Where a block keeps its fp16 scales (see ggml-common.h) and how dmin relates to d."""

    d_offset: int
    dmin_offset: int | None = None
    dmin_ratio: float = 0.0  # dmin = ratio * d makes E[w] = 0 (ratio = mean quant level)


SCALE_FIELDS: dict[Q, ScaleFields] = {
    Q.Q4_0: ScaleFields(d_offset=0),
    Q.Q8_0: ScaleFields(d_offset=0),
    Q.Q2_K: ScaleFields(d_offset=80, dmin_offset=82, dmin_ratio=1.5),
    Q.Q3_K: ScaleFields(d_offset=108),
    Q.Q4_K: ScaleFields(d_offset=0, dmin_offset=2, dmin_ratio=7.5),
    Q.Q5_K: ScaleFields(d_offset=0, dmin_offset=2, dmin_ratio=15.5),
    Q.Q6_K: ScaleFields(d_offset=208),
}
RANDOM_BLOCK_TYPES = frozenset(SCALE_FIELDS) | {Q.MXFP4}
FLOAT_ENCODED_TYPES = frozenset({Q.F32, Q.F16, Q.Q8_0})
SUPPORTED_TYPES = RANDOM_BLOCK_TYPES | FLOAT_ENCODED_TYPES

_E8M0_UNIT = 127  # exponent byte for a block scale of 2**0 (MXFP4 dequantizes with half of it)
_CALIBRATION_BLOCKS = 4096


def block_size(qtype: Q) -> int:
    return GGML_QUANT_SIZES[qtype][0]


def tensor_nbytes(qtype: Q, n_elements: int) -> int:
    elems, nbytes = GGML_QUANT_SIZES[qtype]
    if n_elements % elems:
        raise ValueError(f"{n_elements} elements is not a whole number of {qtype.name} blocks")
    return n_elements // elems * nbytes


def random_raw_bytes(rng: np.random.Generator, n: int) -> np.ndarray:
    """``n`` random bytes as a writable uint8 array (the raw bit generator is the fastest source)."""
    words = rng.bit_generator.random_raw((n + 7) // 8)
    return words.view(np.uint8)[:n]


def _blocks_at_unit_scale(rng: np.random.Generator, qtype: Q, n_blocks: int, d0: float) -> np.ndarray:
    nbytes = GGML_QUANT_SIZES[qtype][1]
    blocks = random_raw_bytes(rng, n_blocks * nbytes).reshape(n_blocks, nbytes)
    if qtype == Q.MXFP4:
        blocks[:, 0] = _E8M0_UNIT + _power_of_two_exponents(rng, d0, n_blocks)
        return blocks
    fields = SCALE_FIELDS[qtype]
    d = d0 * rng.uniform(0.75, 1.25, n_blocks)  # mild per-block variation, always finite and > 0
    blocks[:, fields.d_offset:fields.d_offset + 2] = _fp16_bytes(d)
    if fields.dmin_offset is not None:
        blocks[:, fields.dmin_offset:fields.dmin_offset + 2] = _fp16_bytes(d * fields.dmin_ratio)
    return blocks


def _power_of_two_exponents(rng: np.random.Generator, d0: float, n: int) -> np.ndarray:
    """Exponents k (scale 2**k) mixing floor and floor + 1 of log2(d0) so E[scale^2] = d0^2."""
    low = int(np.floor(np.log2(d0)))
    p_high = ((d0 / 2.0**low) ** 2 - 1.0) / 3.0
    return low + (rng.random(n) < p_high).astype(np.int64)


def _fp16_bytes(values: np.ndarray) -> np.ndarray:
    return values.astype("<f2").view(np.uint8).reshape(-1, 2)


@functools.cache
def unit_std(qtype: Q) -> float:
    """Std of dequantized random blocks at scale 1 (measured once with gguf-py's dequantizer)."""
    rng = np.random.default_rng(0x5EED)
    blocks = _blocks_at_unit_scale(rng, qtype, _CALIBRATION_BLOCKS, 1.0)
    return float(dequantize(blocks, qtype).std())


def random_blocks(rng: np.random.Generator, qtype: Q, n_blocks: int, std: float) -> np.ndarray:
    """``n_blocks`` random valid blocks of ``qtype`` whose weights have roughly the given std."""
    if qtype not in RANDOM_BLOCK_TYPES:
        raise ValueError(f"no random-block generator for {qtype.name}")
    return _blocks_at_unit_scale(rng, qtype, n_blocks, std / unit_std(qtype))


def encode_floats(values: np.ndarray, qtype: Q) -> np.ndarray:
    """Encode float32 rows as F32, F16 or (really quantized) Q8_0 bytes."""
    if qtype == Q.F32:
        return values.astype("<f4", copy=False).view(np.uint8)
    if qtype == Q.F16:
        return values.astype("<f2").view(np.uint8)
    if qtype == Q.Q8_0:
        return _quantize_q8_0(values)
    raise ValueError(f"cannot encode float data as {qtype.name}")


def _quantize_q8_0(values: np.ndarray) -> np.ndarray:
    blocks = values.reshape(-1, block_size(Q.Q8_0)).astype(np.float32)
    d = np.abs(blocks).max(axis=1, keepdims=True) / 127.0
    inv = np.divide(1.0, d, out=np.zeros_like(d), where=d > 0)
    qs = np.clip(np.rint(blocks * inv), -127, 127).astype(np.int8)
    out = np.empty((blocks.shape[0], GGML_QUANT_SIZES[Q.Q8_0][1]), dtype=np.uint8)
    out[:, :2] = _fp16_bytes(d[:, 0])
    out[:, 2:] = qs.view(np.uint8)
    return out
