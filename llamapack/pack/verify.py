"""Verify a pack: every block's sha256 against the manifest, optionally against the GGUF's bytes (and then
record that GGUF's modification time in the manifest, ``update_source``)."""

from __future__ import annotations

import hashlib
import os
import time
from dataclasses import dataclass, replace

import numpy as np
from tqdm import tqdm

from llamapack.errors import IntegrityError, ModelMismatchError

from .gguf_direct import GgufDirectReader
from .gguf_model import open_gguf
from .identity import source_file
from .manifest import write_manifest
from .pack_reader import PackReader
from .publish import temp_path, writer_lock
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
           direct_io: bool = True, update_source: bool = False) -> VerifyReport:
    """Raise IntegrityError naming the bad blocks (layer/expert); ModelMismatchError for a wrong GGUF.

    ``against`` is compared block by block whatever its size, time or fingerprint (the load-time source check
    is skipped). ``update_source``: when every block matches it, record its modification time in the manifest
    (what a pack load checks), so a copied or touched GGUF with the same bytes loads again; a GGUF whose size
    or fingerprint changed needs a new pack instead."""
    if update_source and against is None:
        raise ValueError("update_source records the GGUF given as against=: give one")
    model = open_gguf(against) if against is not None else None
    started = time.perf_counter()
    mtimes = [os.stat(path).st_mtime_ns for path in model.paths] if update_source else None
    with PackReader(pack, model=model, direct_io=direct_io, check_source=False) as reader:
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
        if update_source:
            record_source(reader, model, mtimes)
        return VerifyReport(reader.pack_path, total, total * stride, time.perf_counter() - started,
                            os.fspath(against) if against is not None else None)


def record_source(reader: PackReader, model, mtimes: list[int]) -> None:
    """Record ``model``'s modification times (``mtimes``, taken before its blocks were compared) in the
    manifest, replacing it atomically under the writers' lock; refused when the files' sizes or fingerprints
    differ from the recorded ones (those are part of the pack header's manifest hash: a new pack is needed)."""
    manifest = reader.manifest
    files = []
    for recorded, path, mtime_ns in zip(manifest.source.files, model.paths, mtimes):
        current = source_file(path, manifest.source.fingerprint_mode)
        if (current.size, current.fingerprint) != (recorded.size, recorded.fingerprint):
            raise ModelMismatchError(
                f"{path} holds the pack's experts but its size or fingerprint changed since packing, which "
                f"cannot be re-recorded: build the pack again (`llamapack pack {model.paths[0]} -o {reader.pack_path}`)")
        if current.mtime_ns != mtime_ns:
            raise ModelMismatchError(f"{path} changed while it was being verified; verify again")
        files.append(current)
    updated = replace(manifest, source=replace(manifest.source, files=tuple(files)))
    with writer_lock(reader.pack_path):
        tmp = temp_path(reader.manifest_path)
        try:
            write_manifest(tmp, updated)
            os.replace(tmp, reader.manifest_path)
        finally:
            if os.path.lexists(tmp):
                os.unlink(tmp)
