"""Verify a pack: every block's sha256 against the manifest, optionally against the GGUF's bytes."""

from __future__ import annotations

import hashlib
import os
import time
from dataclasses import dataclass

import numpy as np
from tqdm import tqdm

from llamapack.errors import IntegrityError

from .gguf_direct import GgufDirectReader
from .gguf_model import open_gguf
from .pack_reader import PackReader
from .readers import alloc_slot

READ_BYTES = 32 << 20
MAX_LISTED = 5


@dataclass(frozen=True)
class VerifyReport:
    pack_path: str
    blocks: int
    nbytes: int
    seconds: float
    against: str | None  # the GGUF compared byte for byte, if any


def _bad_blocks_error(pack_path: str, bad: list[str], total: int, what: str) -> IntegrityError:
    listed = "; ".join(bad[:MAX_LISTED]) + ("; ..." if len(bad) > MAX_LISTED else "")
    return IntegrityError(f"{pack_path}: {len(bad)} of {total} blocks {what}: {listed}")


def _first_differing_role(reader: PackReader, layer: int, pack_block: np.ndarray, gguf_block: np.ndarray) -> str:
    for role in reader.layout.layer_layout(layer).roles:
        if not np.array_equal(pack_block[role.offset:role.end], gguf_block[role.offset:role.end]):
            return role.role
    return "padding"


def verify(pack: str | os.PathLike, against: str | os.PathLike | None = None, progress: bool = True,
           direct_io: bool = True) -> VerifyReport:
    """Raise IntegrityError naming the bad blocks (layer/expert); ModelMismatchError for a wrong GGUF."""
    model = open_gguf(against) if against is not None else None
    started = time.perf_counter()
    with PackReader(pack, model=model, direct_io=direct_io) as reader:
        layout = reader.layout
        stride, total = layout.expert_stride, layout.num_blocks
        per_read = max(1, READ_BYTES // stride)
        buf = alloc_slot(layout, per_read)
        direct = GgufDirectReader(model, direct_io=direct_io) if model is not None else None
        gguf_slot = alloc_slot(layout) if direct is not None else None
        bad_hash, bad_bytes = [], []
        with tqdm(total=total * stride, unit="B", unit_scale=True, unit_divisor=1000,
                  desc="verify", disable=not progress) as bar:
            for first in range(0, total, per_read):
                count = min(per_read, total - first)
                reader.read_blocks(first, buf[:count * stride])
                for i in range(count):
                    layer, expert = layout.block_at(first + i)
                    block = buf[i * stride:(i + 1) * stride]
                    where = f"layer {layer} expert {expert}"
                    if hashlib.sha256(block).hexdigest() != reader.manifest.block_hash(layer, expert):
                        bad_hash.append(f"{where} (offset {layout.block_offset(layer, expert)})")
                    if direct is not None:
                        direct.read_expert(layer, expert, gguf_slot)
                        if not np.array_equal(block, gguf_slot):
                            role = _first_differing_role(reader, layer, block, gguf_slot)
                            bad_bytes.append(f"{where} role {role}")
                bar.update(count * stride)
        if direct is not None:
            direct.close()
        if bad_hash:
            raise _bad_blocks_error(reader.pack_path, bad_hash, total, "fail their sha256 check")
        if bad_bytes:
            raise _bad_blocks_error(reader.pack_path, bad_bytes, total, f"differ from {against}")
        return VerifyReport(reader.pack_path, total, total * stride, time.perf_counter() - started,
                            os.fspath(against) if against is not None else None)
