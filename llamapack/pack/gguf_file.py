"""Minimal GGUF header parser: KV entries and tensor infos, nothing else.

``gguf.GGUFReader`` builds numpy views for every vocabulary string (seconds for a 150k-token
vocabulary); this walks the header with ``struct`` instead and skips ``tokenizer.*`` values. Only
little-endian GGUF v2/v3 files. Every malformed or truncated file is a PackFormatError naming it.
"""

from __future__ import annotations

import mmap
import os
import struct
from dataclasses import dataclass

from gguf import GGUF_DEFAULT_ALIGNMENT, GGUF_MAGIC, GGUFValueType as V

from llamapack.errors import PackFormatError, PackIOError

from .layout import align_up

_SCALARS = {V.UINT8: "B", V.INT8: "b", V.UINT16: "H", V.INT16: "h", V.UINT32: "I", V.INT32: "i",
            V.FLOAT32: "f", V.BOOL: "?", V.UINT64: "Q", V.INT64: "q", V.FLOAT64: "d"}
SKIPPED_KV_PREFIX = "tokenizer."  # vocabulary: large, and not a hyperparameter


@dataclass(frozen=True)
class TensorInfo:
    name: str
    ggml_type: int
    ne: tuple[int, ...]
    data_offset: int  # absolute, in this file


@dataclass(frozen=True)
class GgufHeader:
    path: str
    kv: dict  # key -> (type name, value); tokenizer.* values are None
    tensors: tuple[TensorInfo, ...]
    file_size: int


class _Cursor:
    def __init__(self, buf: mmap.mmap):
        self.buf, self.pos = buf, 0

    def take(self, fmt: str) -> tuple:
        values = struct.unpack_from("<" + fmt, self.buf, self.pos)
        self.pos += struct.calcsize("<" + fmt)
        return values

    def one(self, fmt: str):
        return self.take(fmt)[0]

    def string(self, keep: bool = True) -> str | None:
        n = self.one("Q")
        if n > len(self.buf) - self.pos:
            raise ValueError("string runs past the end of the file")
        self.pos += n
        return bytes(self.buf[self.pos - n:self.pos]).decode("utf-8", errors="replace") if keep else None

    def value(self, kind: V, keep: bool):
        if kind in _SCALARS:
            return self.one(_SCALARS[kind])
        if kind == V.STRING:
            return self.string(keep)
        if kind != V.ARRAY:
            raise ValueError(f"unknown value type {kind}")
        item, n = V(self.one("I")), self.one("Q")
        if n * struct.calcsize(_SCALARS.get(item, "Q")) > len(self.buf) - self.pos:
            raise ValueError("array runs past the end of the file")
        if item in _SCALARS:
            if keep:
                return list(self.take(f"{n}{_SCALARS[item]}"))
            self.pos += n * struct.calcsize(_SCALARS[item])
            return None
        values = [self.value(item, keep) for _ in range(n)]
        return values if keep else None


def _parse(buf: mmap.mmap, path: str) -> GgufHeader:
    cur = _Cursor(buf)
    magic, version, n_tensors, n_kv = cur.take("IIQQ")
    if magic != GGUF_MAGIC:
        raise ValueError("bad magic")
    if version not in (2, 3):
        raise ValueError(f"unsupported GGUF version {version} (or big-endian file)")
    kv = {}
    for _ in range(n_kv):
        key, kind = cur.string(), V(cur.one("I"))
        type_name = f"ARRAY[{V(struct.unpack_from('<I', buf, cur.pos)[0]).name}]" if kind == V.ARRAY else kind.name
        kv[key] = (type_name, cur.value(kind, keep=not key.startswith(SKIPPED_KV_PREFIX)))
    infos = []
    for _ in range(n_tensors):
        name, n_dims = cur.string(), cur.one("I")
        if n_dims > 8:
            raise ValueError(f"tensor {name} has {n_dims} dimensions")
        ne = cur.take(f"{n_dims}Q")
        kind, offset = cur.take("IQ")
        infos.append((name, kind, ne, offset))
    alignment = kv.get("general.alignment", ("", GGUF_DEFAULT_ALIGNMENT))[1]
    if not isinstance(alignment, int) or alignment <= 0 or alignment & (alignment - 1):
        raise ValueError(f"bad general.alignment {alignment}")
    data_start = align_up(cur.pos, alignment)
    tensors = tuple(TensorInfo(name, kind, ne, data_start + offset) for name, kind, ne, offset in infos)
    return GgufHeader(path, kv, tensors, len(buf))


def read_gguf_header(path: str) -> GgufHeader:
    try:
        with open(path, "rb") as f:
            if os.fstat(f.fileno()).st_size == 0:
                raise PackFormatError(f"{path}: empty file, not a GGUF")
            with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
                return _parse(buf, path)
    except OSError as exc:
        raise PackIOError(f"cannot read {path}: {exc.strerror or exc}") from None
    except (ValueError, struct.error, OverflowError, MemoryError) as exc:
        raise PackFormatError(f"{path}: not a valid GGUF file or truncated ({exc})") from None
