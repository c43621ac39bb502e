"""GGUF-direct mode: build each expert's slot straight from the GGUF, no pack on disk.

Each role's bytes are read as the 4096-aligned superset range with O_DIRECT into a scratch buffer,
then the payload is copied to the role's slot offset and the gaps are zero-filled, giving exactly
the bytes a pack block would hold.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np

from .gguf_model import GgufModel, open_gguf
from .layout import ALIGNMENT, ExpertTensor, RoleEntry, align_down, align_up, check_layout
from .odirect import DirectFile, ReadFn, aligned_buffer
from .readers import slot_view


@dataclass(frozen=True)
class RoleRead:
    """One aligned O_DIRECT read that yields one role of one expert."""

    role: str
    path: str
    file_offset: int  # 4096-aligned
    length: int  # multiple of 4096 (may run past EOF for the last tensor)
    skip: int  # payload starts this far into the read
    nbytes: int  # payload length
    slot_offset: int  # where the payload goes in the slot


def plan_role_read(tensor: ExpertTensor, entry: RoleEntry, expert: int) -> RoleRead:
    start = tensor.expert_offset(expert)
    first = align_down(start)
    return RoleRead(entry.role, tensor.path, first, align_up(start + entry.nbytes) - first,
                    start - first, entry.nbytes, entry.offset)


class GgufDirectReader:
    """Same interface as ``PackReader``: ``layout`` and ``read_expert(layer, expert, out)``.

    Uses one scratch buffer: give each thread its own reader.
    """

    def __init__(self, gguf: GgufModel | str | os.PathLike, *, direct_io: bool = True,
                 read_fn: ReadFn | None = None):
        self.model = gguf if isinstance(gguf, GgufModel) else open_gguf(gguf)
        self.layout = self.model.layout
        check_layout(self.layout)
        self._tensors = {(t.layer, t.role): t for t in self.model.expert_tensors}
        largest = max(r.nbytes for layer in self.layout.layers for r in layer.roles)
        self._scratch = aligned_buffer(align_up(largest) + ALIGNMENT)
        self._files: dict[str, DirectFile] = {}
        try:
            for path in self.model.paths:
                self._files[path] = DirectFile(path, direct_io=direct_io, read_fn=read_fn)
        except BaseException:
            self.close()
            raise

    def plan(self, layer: int, expert: int) -> tuple[RoleRead, ...]:
        self.layout.block_offset(layer, expert)  # range-checks layer and expert
        return tuple(plan_role_read(self._tensors[layer, r.role], r, expert)
                     for r in self.layout.layer_layout(layer).roles)

    def read_expert(self, layer: int, expert: int, out: np.ndarray) -> np.ndarray:
        slot = slot_view(out, self.layout.expert_stride)
        for read in self.plan(layer, expert):
            scratch = self._scratch[:read.length]
            self._files[read.path].read_into(scratch, read.file_offset, need=read.skip + read.nbytes,
                                             where=f"layer {layer} expert {expert} role {read.role}")
            slot[read.slot_offset:read.slot_offset + read.nbytes] = scratch[read.skip:read.skip + read.nbytes]
        for start, end in self.layout.layer_layout(layer).gaps(self.layout.expert_stride):
            slot[start:end] = 0
        return slot

    def close(self) -> None:
        for f in self._files.values():
            f.close()

    def __enter__(self) -> "GgufDirectReader":
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()
