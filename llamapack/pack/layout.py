"""Expert pack layout: where every expert block and every role inside a block lives.

Pure policy, no I/O. The same ``compute_layout`` runs on a GGUF's expert tensors (GGUF-direct
mode, builder) and is what a pack manifest records, so the runtime gets one slot layout either way:

* one block per (MoE layer, expert), blocks in layer order then expert order;
* inside a block each role starts at a multiple of ``ALIGNMENT``; gaps and tail are zero;
* the block stride is the largest block of any layer, rounded up to ``ALIGNMENT``;
* ``block_offset(layer, expert) = data_start + (moe_index * num_experts + expert) * expert_stride``.

A block copied verbatim into a slot of ``expert_stride`` bytes is the slot layout: role ``r`` of
layer ``L`` lives at ``slot_base + role_offset(L, r)``.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import Iterable, Iterator

from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from llamapack.errors import PackFormatError

ALIGNMENT = 4096
HEADER_SIZE = 4096  # the pack file's header page; blocks start right after it
ROLE_ORDER = ("gate_up", "gate", "up", "down")  # order of roles inside a block


def align_up(n: int, alignment: int = ALIGNMENT) -> int:
    return -(-n // alignment) * alignment


def align_down(n: int, alignment: int = ALIGNMENT) -> int:
    return n // alignment * alignment


def ggml_type_name(type_id: int) -> str:
    try:
        return GGMLQuantizationType(type_id).name
    except ValueError:
        return f"TYPE_{type_id}"


def expert_nbytes(type_id: int, ne: tuple[int, ...]) -> int:
    """Bytes of one expert's 2-D slice of a ggml tensor with shape ``ne`` (ne0 = row length)."""
    try:
        block_size, type_size = GGML_QUANT_SIZES[GGMLQuantizationType(type_id)]
    except (ValueError, KeyError):
        raise PackFormatError(f"unknown ggml type id {type_id}") from None
    if len(ne) != 3 or min(ne) <= 0 or ne[0] % block_size:
        raise PackFormatError(f"bad expert tensor shape ne={list(ne)} for {ggml_type_name(type_id)}")
    return ne[0] // block_size * type_size * ne[1]


@dataclass(frozen=True)
class ExpertTensor:
    """One routed-expert weight tensor of a GGUF, located in its (shard) file."""

    name: str
    layer: int
    role: str
    ggml_type: int
    ne: tuple[int, int, int]  # ggml order: (row length, rows, n_expert)
    nbytes: int  # whole tensor
    path: str
    data_offset: int  # absolute offset of the tensor data in ``path``

    @property
    def n_expert(self) -> int:
        return self.ne[2]

    @property
    def expert_nbytes(self) -> int:
        return self.nbytes // self.n_expert

    def expert_offset(self, expert: int) -> int:
        """Absolute file offset of expert ``expert``'s bytes (the slice [e*nb2, (e+1)*nb2))."""
        return self.data_offset + expert * self.expert_nbytes


@dataclass(frozen=True)
class RoleEntry:
    role: str
    offset: int  # inside the block / slot
    nbytes: int  # payload of one expert
    ggml_type: int
    ne: tuple[int, int, int]

    @property
    def type_name(self) -> str:
        return ggml_type_name(self.ggml_type)

    @property
    def end(self) -> int:
        return self.offset + self.nbytes


@dataclass(frozen=True)
class LayerLayout:
    layer: int  # model layer index (blk.N)
    roles: tuple[RoleEntry, ...]

    @property
    def block_nbytes(self) -> int:
        return align_up(self.roles[-1].end)

    def role(self, role: str) -> RoleEntry:
        for entry in self.roles:
            if entry.role == role:
                return entry
        raise KeyError(f"layer {self.layer} has no role {role!r}")

    def gaps(self, stride: int) -> Iterator[tuple[int, int]]:
        """Zero-filled [start, end) ranges of a block of ``stride`` bytes."""
        pos = 0
        for entry in self.roles:
            if entry.offset > pos:
                yield pos, entry.offset
            pos = entry.end
        if stride > pos:
            yield pos, stride


@dataclass(frozen=True)
class PackLayout:
    alignment: int
    data_start: int
    expert_stride: int
    num_experts: int
    layers: tuple[LayerLayout, ...]

    @property
    def moe_layers(self) -> tuple[int, ...]:
        return tuple(entry.layer for entry in self.layers)

    @property
    def payload_nbytes(self) -> int:
        """End of the last role payload of the largest layer (bytes of a block that are not tail)."""
        return max(entry.roles[-1].end for entry in self.layers)

    @property
    def num_blocks(self) -> int:
        return len(self.layers) * self.num_experts

    @property
    def pack_size(self) -> int:
        return self.data_start + self.num_blocks * self.expert_stride

    def moe_index(self, layer: int) -> int:
        for index, entry in enumerate(self.layers):
            if entry.layer == layer:
                return index
        raise KeyError(f"layer {layer} is not a MoE layer (MoE layers: {list(self.moe_layers)})")

    def layer_layout(self, layer: int) -> LayerLayout:
        return self.layers[self.moe_index(layer)]

    def role_offset(self, layer: int, role: str) -> int:
        return self.layer_layout(layer).role(role).offset

    def block_offset(self, layer: int, expert: int) -> int:
        """Absolute offset of (layer, expert)'s block in the pack file."""
        if not 0 <= expert < self.num_experts:
            raise IndexError(f"expert {expert} out of range 0..{self.num_experts - 1}")
        return self.data_start + (self.moe_index(layer) * self.num_experts + expert) * self.expert_stride

    def block_at(self, index: int) -> tuple[int, int]:
        """(model layer, expert) of the ``index``-th block in file order."""
        moe_index, expert = divmod(index, self.num_experts)
        return self.layers[moe_index].layer, expert


def compute_layout(
    expert_tensors: Iterable[ExpertTensor], *, alignment: int = ALIGNMENT, data_start: int = HEADER_SIZE
) -> PackLayout:
    """The pack / slot layout of a model's routed-expert tensors."""
    by_layer: dict[int, dict[str, ExpertTensor]] = defaultdict(dict)
    for tensor in expert_tensors:
        if tensor.role not in ROLE_ORDER:
            raise PackFormatError(f"{tensor.name}: unknown expert role {tensor.role!r}")
        if tensor.role in by_layer[tensor.layer]:
            raise PackFormatError(f"{tensor.name}: layer {tensor.layer} has two {tensor.role} tensors")
        by_layer[tensor.layer][tensor.role] = tensor
    if not by_layer:
        raise PackFormatError("model has no routed-expert tensors: pack mode does not apply to dense models")

    n_experts = {t.n_expert for roles in by_layer.values() for t in roles.values()}
    if len(n_experts) != 1:
        raise PackFormatError(f"expert tensors disagree on the expert count: {sorted(n_experts)}")
    num_experts = n_experts.pop()

    layers = []
    for layer in sorted(by_layer):
        roles = by_layer[layer]
        if "gate_up" in roles and ("gate" in roles or "up" in roles):
            raise PackFormatError(f"layer {layer} has both merged gate_up and separate gate/up expert tensors")
        entries, offset = [], 0
        for role in (r for r in ROLE_ORDER if r in roles):
            tensor = roles[role]
            per_expert = expert_nbytes(tensor.ggml_type, tensor.ne)
            if per_expert * num_experts != tensor.nbytes:
                raise PackFormatError(f"{tensor.name}: {tensor.nbytes} bytes is not {num_experts} x {per_expert}")
            entries.append(RoleEntry(role, offset, per_expert, tensor.ggml_type, tuple(tensor.ne)))
            offset = align_up(offset + per_expert, alignment)
        layers.append(LayerLayout(layer, tuple(entries)))

    stride = max(entry.block_nbytes for entry in layers)
    return PackLayout(alignment, data_start, align_up(stride, alignment), num_experts, tuple(layers))


def check_layout(layout: PackLayout) -> None:
    """Fail-closed alignment / bounds contract of a layout (from a manifest or a GGUF)."""
    a = layout.alignment
    if a != ALIGNMENT:
        raise PackFormatError(f"alignment {a} is not {ALIGNMENT}")
    if layout.data_start % a or layout.data_start < HEADER_SIZE:
        raise PackFormatError(f"data_start {layout.data_start} is not a {a}-aligned offset >= {HEADER_SIZE}")
    if layout.expert_stride <= 0 or layout.expert_stride % a:
        raise PackFormatError(f"expert_stride {layout.expert_stride} is not a positive multiple of {a}")
    if layout.num_experts <= 0 or not layout.layers:
        raise PackFormatError("layout has no experts or no MoE layers")
    previous_layer = -1
    for entry in layout.layers:
        if entry.layer <= previous_layer:
            raise PackFormatError(f"MoE layers are not strictly increasing at layer {entry.layer}")
        previous_layer = entry.layer
        if not entry.roles:
            raise PackFormatError(f"layer {entry.layer} has no roles")
        names = [role.role for role in entry.roles]
        if names != [r for r in ROLE_ORDER if r in names]:
            raise PackFormatError(f"layer {entry.layer}: roles {names} are not distinct roles in order {ROLE_ORDER}")
        end = 0
        for role in entry.roles:
            where = f"layer {entry.layer} role {role.role}"
            if role.offset % a:
                raise PackFormatError(f"{where}: offset {role.offset} is not {a}-aligned")
            if role.offset < end or role.nbytes <= 0 or role.end > layout.expert_stride:
                raise PackFormatError(f"{where}: range [{role.offset}, {role.end}) overlaps or leaves the block")
            end = role.end
