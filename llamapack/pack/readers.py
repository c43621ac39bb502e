"""What both expert readers share: the reader interface and the slot-buffer contract."""

from __future__ import annotations

from typing import Protocol

import numpy as np

from llamapack.errors import PackIOError

from .layout import ALIGNMENT, PackLayout
from .odirect import aligned_buffer, is_aligned


class ExpertReader(Protocol):
    """Fills one slot (``layout.expert_stride`` bytes, slot layout) per call."""

    layout: PackLayout

    def read_expert(self, layer: int, expert: int, out: np.ndarray) -> np.ndarray: ...

    def close(self) -> None: ...


def alloc_slot(layout: PackLayout, count: int = 1) -> np.ndarray:
    """A page-aligned staging buffer of ``count`` slots."""
    return aligned_buffer(layout.expert_stride * count)


def slot_view(out: np.ndarray, stride: int) -> np.ndarray:
    """The first ``stride`` bytes of ``out``, after checking the staging-buffer contract."""
    if not isinstance(out, np.ndarray) or out.dtype != np.uint8 or not out.flags.c_contiguous \
            or not out.flags.writeable:
        raise PackIOError("slot buffer must be a writable, contiguous numpy uint8 array")
    if out.nbytes < stride:
        raise PackIOError(f"slot buffer holds {out.nbytes} bytes, less than expert_stride {stride}")
    if not is_aligned(out):
        raise PackIOError(f"slot buffer at 0x{out.ctypes.data:x} is not {ALIGNMENT}-aligned (O_DIRECT needs it)")
    return out.reshape(-1)[:stride]
