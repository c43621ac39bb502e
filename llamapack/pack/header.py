"""The pack file's first page: magic, version, geometry and the manifest's sha256.

Little-endian ``<16s I I Q Q I I Q 32s``: magic, version, header size (4096), data_start,
expert_stride, num_experts, MoE layer count, pack_size, canonical manifest sha256; zero padded to
``HEADER_SIZE``. Blocks start at ``data_start``.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

from llamapack.errors import ModelMismatchError, PackFormatError

from .layout import HEADER_SIZE, PackLayout

MAGIC = b"LLAMAPACK-EXPERT"
VERSION = 1
_STRUCT = struct.Struct("<16sIIQQIIQ32s")


@dataclass(frozen=True)
class PackHeader:
    version: int
    data_start: int
    expert_stride: int
    num_experts: int
    num_layers: int
    pack_size: int
    manifest_sha256: bytes

    @classmethod
    def for_layout(cls, layout: PackLayout, manifest_sha256: bytes) -> "PackHeader":
        return cls(VERSION, layout.data_start, layout.expert_stride, layout.num_experts,
                   len(layout.layers), layout.pack_size, manifest_sha256)

    def encode(self) -> bytes:
        fields = _STRUCT.pack(MAGIC, self.version, HEADER_SIZE, self.data_start, self.expert_stride,
                              self.num_experts, self.num_layers, self.pack_size, self.manifest_sha256)
        return fields.ljust(HEADER_SIZE, b"\0")


def decode_header(page: bytes, path: str) -> PackHeader:
    magic, version, header_size, *rest = _STRUCT.unpack_from(page)
    if magic != MAGIC:
        raise PackFormatError(f"{path} is not an expert pack (bad magic)")
    if version != VERSION or header_size != HEADER_SIZE:
        raise PackFormatError(f"{path}: unsupported pack version {version} (this llamapack reads version {VERSION})")
    return PackHeader(version, *rest)


def check_header(header: PackHeader, layout: PackLayout, manifest_sha256: bytes, path: str) -> None:
    """The pack file and the manifest must describe the same pack."""
    expected = PackHeader.for_layout(layout, manifest_sha256)
    for name in ("data_start", "expert_stride", "num_experts", "num_layers", "pack_size", "manifest_sha256"):
        if getattr(header, name) != getattr(expected, name):
            raise ModelMismatchError(
                f"{path} does not belong to this manifest: header {name} differs "
                "(pack and manifest come from different builds, or the manifest was edited); build the pack again "
                "with `llamapack pack`"
            )
