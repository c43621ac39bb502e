"""Slot layout: where each role of each pooled expert lives in a slot pool's memory.

The pool has one region per role (gate_up, gate, up, down). Region r holds ``n_slots`` slots of
``stride[r]`` bytes; slot s of role r is at ``region_offset[r] + s * stride[r]``. An expert occupies the
same slot index in every role region of its layer, so one slot id addresses the whole expert.

Kernels index experts in whole blocks (``nb02 / type_size``; CUDA's F16/BF16 path in pairs), so a role's
stride is its largest expert over the layers rounded up to a multiple of 512 bytes and of every type size
that role has (doubled for F16/BF16). One stride shared by all roles would need the lcm over every type of
the model (30 MB for Q4_K + Q6_K + Q8_0 + F16), hence a region per role.
"""
from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

ALIGNMENT = 4096
ROLE_ORDER = ("gate_up", "gate", "up", "down")  # as in an expert pack block (llamapack.pack.layout)
HALF_TYPES = (GGMLQuantizationType.F16, GGMLQuantizationType.BF16)


def align_up(value: int, alignment: int = ALIGNMENT) -> int:
    return (value + alignment - 1) // alignment * alignment


def aligned_empty(nbytes: int, alignment: int = ALIGNMENT) -> np.ndarray:
    """A uint8 array of ``nbytes`` whose data pointer is ``alignment``-aligned."""
    raw = np.empty(nbytes + alignment, dtype=np.uint8)
    shift = (-raw.ctypes.data) % alignment
    return raw[shift:shift + nbytes]


def stride_multiple(ggml_types) -> int:
    """The least common multiple of 512 and each type's size (doubled for F16/BF16)."""
    multiple = 512
    for type_id in ggml_types:
        qtype = GGMLQuantizationType(type_id)
        multiple = math.lcm(multiple, GGML_QUANT_SIZES[qtype][1] * (2 if qtype in HALF_TYPES else 1))
    return multiple


@dataclass(frozen=True)
class SlotLayout:
    n_slots: int
    role_stride: dict[str, int]
    role_region: dict[str, int]           # offset of slot 0 of each role region
    pool_bytes: int
    tensors_by_layer: dict[int, tuple]    # layer -> its ExpertTensorInfo entries, in ROLE_ORDER

    @classmethod
    def from_tensors(cls, tensors, n_slots: int) -> "SlotLayout":
        by_role: dict[str, list] = defaultdict(list)
        by_layer: dict[int, list] = defaultdict(list)
        for info in tensors:
            by_role[info.role].append(info)
            by_layer[info.layer].append(info)
        strides, regions, cursor = {}, {}, 0
        for role in (r for r in ROLE_ORDER if r in by_role):
            infos = by_role[role]
            stride = max(info.expert_nbytes for info in infos)
            strides[role] = align_up(stride, stride_multiple({info.ggml_type for info in infos}))
            regions[role] = cursor
            cursor = align_up(cursor + strides[role] * n_slots)
        layers = {layer: tuple(sorted(infos, key=lambda i: ROLE_ORDER.index(i.role)))
                  for layer, infos in by_layer.items()}
        # one page of zeros after the last region: CUDA pads quantized rows to 512 elements (it reads past the
        # last slot's last row, and ggml_backend_tensor_alloc checks that the padded size fits the buffer)
        return cls(n_slots=n_slots, role_stride=strides, role_region=regions, pool_bytes=cursor + ALIGNMENT,
                   tensors_by_layer=layers)

    @property
    def slot_bytes(self) -> int:
        """Pool bytes one slot costs (every role)."""
        return sum(self.role_stride.values())

    def tensor_offsets(self, tensors) -> list[int]:
        return [self.role_region[info.role] for info in tensors]

    def tensor_strides(self, tensors) -> list[int]:
        return [self.role_stride[info.role] for info in tensors]

    def slot_offset(self, role: str, slot: int) -> int:
        return self.role_region[role] + slot * self.role_stride[role]
