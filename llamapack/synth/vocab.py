"""Tokenizer vocab files (llama.cpp's ggml-vocab-*.gguf): where to find them and how to copy them.

A vocab file holds no tensors, only ``tokenizer.*`` metadata; we copy those entries verbatim (same
GGUF value types) into the synthetic model. A small dedicated parser keeps this fast: gguf-py's
GGUFReader takes seconds on the 150k-token vocabularies.
"""

from __future__ import annotations

import functools
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGUFValueType as V

from ..errors import PackFormatError

VOCAB_DIR_ENV = "LLAMAPACK_VOCAB_DIR"
DEFAULT_VOCAB_DIR = Path("~/.cache/llamapack/vocab")

# Token counts of the vocab files the presets use (for planning sizes without the files).
KNOWN_VOCAB_SIZES = {"qwen2": 151936, "deepseek-llm": 102400, "gpt-2": 50257, "llama-spm": 32000}

_SCALARS = {V.UINT8: "<B", V.INT8: "<b", V.UINT16: "<H", V.INT16: "<h", V.UINT32: "<I", V.INT32: "<i",
            V.FLOAT32: "<f", V.BOOL: "<?", V.UINT64: "<Q", V.INT64: "<q", V.FLOAT64: "<d"}


def vocab_dirs() -> list[Path]:
    """$LLAMAPACK_VOCAB_DIR, then $LLAMAPACK_CACHE/vocab (where scripts/build_llama.py puts them), then the
    default cache's."""
    dirs = [Path(os.environ[VOCAB_DIR_ENV])] if os.environ.get(VOCAB_DIR_ENV) else []
    if os.environ.get("LLAMAPACK_CACHE"):
        dirs.append(Path(os.environ["LLAMAPACK_CACHE"]) / "vocab")
    return dirs + [DEFAULT_VOCAB_DIR.expanduser()]


def find_vocab(name: str) -> Path:
    """Path of ``ggml-vocab-<name>.gguf``: $LLAMAPACK_VOCAB_DIR first, then ~/.cache/llamapack/vocab/."""
    filename = f"ggml-vocab-{name}.gguf"
    for directory in vocab_dirs():
        if (directory / filename).is_file():
            return directory / filename
    searched = ", ".join(str(d) for d in vocab_dirs())
    raise PackFormatError(
        f"tokenizer vocab {filename} not found (searched {searched}). Run `python scripts/build_llama.py`, "
        f"which extracts the vocab files from the pinned sdist, or point {VOCAB_DIR_ENV} at a directory "
        f"holding llama.cpp's models/ggml-vocab-*.gguf.")


@dataclass(frozen=True)
class TokenizerEntry:
    key: str
    value: Any  # scalar, bytes (a string) or list (an array)
    vtype: V
    sub_type: V | None = None


@dataclass(frozen=True)
class Tokenizer:
    entries: tuple[TokenizerEntry, ...]
    n_tokens: int

    def value(self, key: str) -> Any:
        return next(e.value for e in self.entries if e.key == key)


@functools.cache
def load_tokenizer(path: Path) -> Tokenizer:
    """The ``tokenizer.*`` entries of a GGUF file (cached: presets share vocabs)."""
    data = memoryview(path.read_bytes())
    try:
        return _parse_tokenizer(data)
    except (struct.error, ValueError, IndexError) as exc:
        raise PackFormatError(f"{path}: not a readable GGUF vocab file ({exc})") from exc


def _parse_tokenizer(data: memoryview) -> Tokenizer:
    if bytes(data[:4]) != b"GGUF":
        raise ValueError("bad magic")
    _version, _n_tensors, n_kv = struct.unpack_from("<IQQ", data, 4)
    pos, entries = 24, []
    for _ in range(n_kv):
        key, pos = _read_string(data, pos)
        vtype = V(struct.unpack_from("<I", data, pos)[0])
        value, sub_type, pos = _read_value(data, pos + 4, vtype)
        name = key.decode()
        if name.startswith("tokenizer."):
            entries.append(TokenizerEntry(name, value, vtype, sub_type))
    tokens = next((e.value for e in entries if e.key == "tokenizer.ggml.tokens"), None)
    if tokens is None:
        raise ValueError("no tokenizer.ggml.tokens")
    return Tokenizer(tuple(entries), len(tokens))


def _read_string(data: memoryview, pos: int) -> tuple[bytes, int]:
    (n,) = struct.unpack_from("<Q", data, pos)
    return bytes(data[pos + 8:pos + 8 + n]), pos + 8 + n


def _read_value(data: memoryview, pos: int, vtype: V) -> tuple[Any, V | None, int]:
    if vtype == V.STRING:
        value, pos = _read_string(data, pos)
        return value, None, pos
    if vtype in _SCALARS:
        fmt = _SCALARS[vtype]
        return struct.unpack_from(fmt, data, pos)[0], None, pos + struct.calcsize(fmt)
    if vtype != V.ARRAY:
        raise ValueError(f"unknown GGUF value type {vtype}")
    sub_raw, n = struct.unpack_from("<IQ", data, pos)
    sub, pos = V(sub_raw), pos + 12
    if sub == V.STRING:
        items = []
        for _ in range(n):
            item, pos = _read_string(data, pos)
            items.append(item)
        return items, sub, pos
    if sub not in _SCALARS:
        raise ValueError(f"unsupported array element type {sub}")
    fmt = _SCALARS[sub]
    size = struct.calcsize(fmt)
    items = np.frombuffer(data, dtype=np.dtype(fmt), count=n, offset=pos).tolist()
    return items, sub, pos + n * size
