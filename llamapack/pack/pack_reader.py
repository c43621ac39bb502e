"""Read expert blocks from a pack file (one O_DIRECT pread per expert)."""

from __future__ import annotations

import hashlib
import os
import time

import numpy as np

from llamapack.errors import IntegrityError, ModelMismatchError, PackFormatError

from .contract import check_manifest_matches_model
from .gguf_model import GgufModel, open_gguf
from .header import check_header, decode_header
from .layout import HEADER_SIZE
from .manifest import MANIFEST_SUFFIX, load_manifest
from .odirect import DirectFile, ReadFn, aligned_buffer
from .readers import slot_view

OPEN_ATTEMPTS = 3  # a pack and manifest that differ are opened again this many times in all ...
REOPEN_DELAY_S = 0.05  # ... this long apart: a build renames the two one after the other


def resolve_pack_paths(path: str | os.PathLike) -> tuple[str, str | None]:
    """(manifest path, pack path or None = take it from the manifest) for a pack or manifest path."""
    path = os.path.abspath(os.fspath(path))
    if path.endswith(MANIFEST_SUFFIX):
        return path, None
    if path.endswith(".gguf"):
        raise PackFormatError(f"{path} is a GGUF, not an expert pack (use GGUF-direct mode or `llamapack pack`)")
    return path + MANIFEST_SUFFIX, path


class PackReader:
    """Validated, open pack. ``model`` (GGUF path or ``GgufModel``) adds the model-match check."""

    def __init__(self, path: str | os.PathLike, *, model: GgufModel | str | os.PathLike | None = None,
                 direct_io: bool = True, verify_sha256: bool = False, read_fn: ReadFn | None = None,
                 check_source: bool = True):
        self.manifest_path, pack_path = resolve_pack_paths(path)
        self.verify_sha256 = verify_sha256
        self._file = None
        for attempt in range(OPEN_ATTEMPTS):
            self.manifest, manifest_sha256 = load_manifest(self.manifest_path)
            self.layout = self.manifest.layout
            self.pack_path = pack_path or os.path.join(os.path.dirname(self.manifest_path), self.manifest.pack_file)
            if not os.path.isfile(self.pack_path):
                raise PackFormatError(f"pack file not found: {self.pack_path}")
            self._file = DirectFile(self.pack_path, direct_io=direct_io, read_fn=read_fn)
            try:
                self._check_pair(manifest_sha256)
                break
            except (ModelMismatchError, PackFormatError):
                self.close()
                if attempt + 1 == OPEN_ATTEMPTS:
                    raise
                time.sleep(REOPEN_DELAY_S)  # maybe a build publishing between its two renames (publish.py)
        try:
            if model is not None:
                model = model if isinstance(model, GgufModel) else open_gguf(model)
                try:
                    check_manifest_matches_model(self.manifest, model, check_source=check_source,
                                                 pack_path=self.pack_path)
                except ModelMismatchError as exc:  # say which files: the check itself knows only fields
                    raise ModelMismatchError(f"{exc} (pack {self.pack_path}, manifest {self.manifest_path}, "
                                             f"model {model.paths[0]})") from None
        except BaseException:
            self.close()
            raise

    def _check_pair(self, manifest_sha256: bytes) -> None:
        """The open pack file is the one the manifest describes (size, header geometry, manifest hash)."""
        size = self._file.size()
        if size != self.layout.pack_size:
            raise PackFormatError(
                f"{self.pack_path} is {size} bytes but its manifest says {self.layout.pack_size} (truncated?)"
            )
        page = aligned_buffer(HEADER_SIZE)
        self._file.read_into(page, 0, where="header")
        check_header(decode_header(page.tobytes(), self.pack_path), self.layout, manifest_sha256, self.pack_path)

    def read_expert(self, layer: int, expert: int, out: np.ndarray) -> np.ndarray:
        """Fill ``out`` (>= expert_stride bytes, 4096-aligned) with the block; returns the slot view."""
        slot = slot_view(out, self.layout.expert_stride)
        offset = self.layout.block_offset(layer, expert)
        self._file.read_into(slot, offset, where=f"layer {layer} expert {expert}")
        if self.verify_sha256:
            self.check_block(layer, expert, slot)
        return slot

    def read_blocks(self, first: int, out: np.ndarray) -> None:
        """Fill ``out`` with consecutive blocks in file order, starting at block index ``first``."""
        layer, expert = self.layout.block_at(first)
        offset = self.layout.data_start + first * self.layout.expert_stride
        self._file.read_into(out, offset, where=f"blocks from layer {layer} expert {expert}")

    def check_block(self, layer: int, expert: int, data: np.ndarray) -> None:
        if hashlib.sha256(data).hexdigest() != self.manifest.block_hash(layer, expert):
            raise IntegrityError(
                f"{self.pack_path}: block of layer {layer} expert {expert} "
                f"(offset {self.layout.block_offset(layer, expert)}) fails its sha256 check"
            )

    def close(self) -> None:
        if getattr(self, "_file", None) is not None:
            self._file.close()
            self._file = None

    def __enter__(self) -> "PackReader":
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()
