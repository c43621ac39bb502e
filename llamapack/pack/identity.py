"""Model identity: hyperparameter hash and source-file fingerprints.

Hyperparameter hash (mode ``gguf-kv-v1``): sha256 of the canonical JSON object
``{key: [value_type, value]}`` over the first GGUF shard's KV entries, excluding keys under
``tokenizer.`` and ``split.`` (vocabulary and shard bookkeeping are not hyperparameters).
``value_type`` is the GGUF type name (``ARRAY[INT32]`` for arrays); floats are the exact stored
values; JSON is ``sort_keys``, separators ``(",", ":")``, UTF-8.

Source fingerprint: ``sha256`` (whole file) or ``sampled-v1``: sha256 of
``b"llamapack-sampled-v1\\0" + size (u64 LE) + 64 chunks of 64 KiB`` taken at evenly spaced offsets
from the first to the last byte (the whole file when smaller than 4 MiB).
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from typing import Iterable, Mapping

from llamapack.errors import PackIOError

HPARAMS_HASH_MODE = "gguf-kv-v1"
EXCLUDED_KV_PREFIXES = ("tokenizer.", "split.")
SAMPLED = "sampled-v1"
FULL = "sha256"
FINGERPRINT_MODES = (SAMPLED, FULL)
SAMPLE_CHUNK = 64 * 1024
SAMPLE_COUNT = 64


def hparams_sha256(kv: Mapping[str, tuple[str, object]]) -> str:
    """Hash of ``{key: (type name, value)}``, excluding tokenizer.* and split.* keys."""
    kept = {k: [t, v] for k, (t, v) in kv.items() if not k.startswith(EXCLUDED_KV_PREFIXES)}
    text = json.dumps(kept, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


@dataclass(frozen=True)
class SourceFile:
    name: str
    size: int
    fingerprint: str
    mtime_ns: int | None = None  # st_mtime_ns when packed (None: a manifest from before it was recorded)


@dataclass(frozen=True)
class SourceIdentity:
    fingerprint_mode: str
    files: tuple[SourceFile, ...]


def _sample_offsets(size: int) -> Iterable[tuple[int, int]]:
    if size <= SAMPLE_CHUNK * SAMPLE_COUNT:
        return [(0, size)]
    last = size - SAMPLE_CHUNK
    return [(i * last // (SAMPLE_COUNT - 1), SAMPLE_CHUNK) for i in range(SAMPLE_COUNT)]


def file_fingerprint(path: str, mode: str = SAMPLED) -> str:
    try:
        with open(path, "rb", buffering=0) as f:
            size = os.fstat(f.fileno()).st_size
            if mode == FULL:
                return hashlib.file_digest(f, "sha256").hexdigest()
            digest = hashlib.sha256(b"llamapack-sampled-v1\0" + size.to_bytes(8, "little"))
            for offset, length in _sample_offsets(size):
                chunk = os.pread(f.fileno(), length, offset)
                if len(chunk) != length:
                    raise PackIOError(f"short read fingerprinting {path} at offset {offset}")
                digest.update(chunk)
            return digest.hexdigest()
    except OSError as exc:
        raise PackIOError(f"cannot read {path}: {exc.strerror}") from None


def source_file(path: str, mode: str = SAMPLED) -> SourceFile:
    """Name, size, mtime (taken first: a change while fingerprinting shows as a changed file later) and
    fingerprint of ``path``."""
    try:
        st = os.stat(path)
    except OSError as exc:
        raise PackIOError(f"cannot read {path}: {exc.strerror}") from None
    return SourceFile(os.path.basename(path), st.st_size, file_fingerprint(path, mode), st.st_mtime_ns)


def source_identity(paths: Iterable[str], mode: str = SAMPLED) -> SourceIdentity:
    return SourceIdentity(mode, tuple(source_file(p, mode) for p in paths))
