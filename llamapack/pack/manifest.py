"""The JSON manifest that sits beside a pack: schema v1, strict parser, writer.

Schema (all offsets/sizes in bytes)::

    {"format": "llamapack.expert-pack", "version": 1,
     "alignment": 4096, "data_start": 4096, "expert_stride": S, "num_experts": E,
     "pack_file": "<name>.expert-pack", "pack_size": data_start + n_layers * E * S,
     "hparams_sha256": "<hex>", "hparams_hash_mode": "gguf-kv-v1",
     "source": {"fingerprint_mode": "sampled-v1" | "sha256",
                "files": [{"name": "...gguf", "size": N, "fingerprint": "<hex>", "mtime_ns": T}]},
     "layers": [{"layer": L,
                 "roles": [{"role": "gate", "offset": 0, "nbytes": N, "ggml_type": "Q4_K",
                            "ggml_type_id": 12, "ne": [ne0, ne1, E]}, ...],
                 "block_sha256": ["<hex>" x E]}, ...]}

Roles appear in block order (gate_up, gate, up, down); ``ne`` is the whole tensor's ggml shape.
``mtime_ns`` (the source's st_mtime_ns when packed) is optional: manifests written before it lack it.

``parse_manifest`` accepts any JSON value and either returns a ``Manifest`` or raises
``PackFormatError``. The pack header stores ``manifest_sha256`` (canonical JSON) so a pack and a
manifest cannot be mixed up.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from dataclasses import dataclass

from llamapack.errors import PackFormatError

from .identity import FINGERPRINT_MODES, HPARAMS_HASH_MODE, SourceFile, SourceIdentity
from .layout import LayerLayout, PackLayout, RoleEntry, check_layout, expert_nbytes, ggml_type_name

FORMAT = "llamapack.expert-pack"
VERSION = 1
PACK_SUFFIX = ".expert-pack"
MANIFEST_SUFFIX = ".manifest.json"  # appended to the pack path
_HEX64 = re.compile(r"^[0-9a-f]{64}$")


@dataclass(frozen=True)
class Manifest:
    layout: PackLayout
    block_sha256: tuple[tuple[str, ...], ...]  # [moe layer index][expert]
    pack_file: str  # file name, in the manifest's directory
    hparams_sha256: str
    source: SourceIdentity

    @property
    def pack_size(self) -> int:
        return self.layout.pack_size

    def block_hash(self, layer: int, expert: int) -> str:
        return self.block_sha256[self.layout.moe_index(layer)][expert]


def manifest_to_dict(m: Manifest) -> dict:
    lay = m.layout
    return {
        "format": FORMAT,
        "version": VERSION,
        "alignment": lay.alignment,
        "data_start": lay.data_start,
        "expert_stride": lay.expert_stride,
        "num_experts": lay.num_experts,
        "pack_file": m.pack_file,
        "pack_size": lay.pack_size,
        "hparams_sha256": m.hparams_sha256,
        "hparams_hash_mode": HPARAMS_HASH_MODE,
        "source": {
            "fingerprint_mode": m.source.fingerprint_mode,
            "files": [{"name": f.name, "size": f.size, "fingerprint": f.fingerprint,
                       **({} if f.mtime_ns is None else {"mtime_ns": f.mtime_ns})} for f in m.source.files],
        },
        "layers": [
            {
                "layer": layer.layer,
                "roles": [
                    {"role": r.role, "offset": r.offset, "nbytes": r.nbytes, "ggml_type": r.type_name,
                     "ggml_type_id": r.ggml_type, "ne": list(r.ne)}
                    for r in layer.roles
                ],
                "block_sha256": list(hashes),
            }
            for layer, hashes in zip(lay.layers, m.block_sha256)
        ],
    }


def canonical_sha256(obj: dict) -> bytes:
    """sha256 of the canonical JSON of ``obj`` less the source files' ``mtime_ns`` (so that ``verify --against
    --update-source`` can re-record a source without rewriting the pack header; manifests without it hash
    as before)."""
    source = obj.get("source")
    if isinstance(source, dict) and isinstance(source.get("files"), list):
        files = [{k: v for k, v in f.items() if k != "mtime_ns"} if isinstance(f, dict) else f
                 for f in source["files"]]
        obj = {**obj, "source": {**source, "files": files}}
    text = json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=True)
    return hashlib.sha256(text.encode("ascii")).digest()


def _field(obj: object, key: str, kind: type, where: str):
    if not isinstance(obj, dict):
        raise PackFormatError(f"manifest: {where or 'top level'} must be an object")
    if key not in obj:
        raise PackFormatError(f"manifest: {where}{key} is missing")
    value = obj[key]
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise PackFormatError(f"manifest: {where}{key} must be {kind.__name__}, got {type(value).__name__}")
    if kind is int and value < 0:
        raise PackFormatError(f"manifest: {where}{key} is negative")
    return value


def _hex(value: object, where: str) -> str:
    if not isinstance(value, str) or not _HEX64.match(value):
        raise PackFormatError(f"manifest: {where} is not a lowercase sha256 hex digest")
    return value


def _role(obj: object, where: str) -> RoleEntry:
    ne = _field(obj, "ne", list, where)
    if len(ne) != 3 or not all(isinstance(d, int) and not isinstance(d, bool) for d in ne):
        raise PackFormatError(f"manifest: {where}ne must be 3 integers")
    type_id = _field(obj, "ggml_type_id", int, where)
    if _field(obj, "ggml_type", str, where) != ggml_type_name(type_id):
        raise PackFormatError(f"manifest: {where}ggml_type does not name ggml_type_id {type_id}")
    entry = RoleEntry(_field(obj, "role", str, where), _field(obj, "offset", int, where),
                      _field(obj, "nbytes", int, where), type_id, tuple(ne))
    if entry.nbytes != expert_nbytes(type_id, entry.ne):
        raise PackFormatError(f"manifest: {where}nbytes {entry.nbytes} does not match {entry.type_name} ne={ne}")
    return entry


def _layer(obj: object, index: int, num_experts: int) -> tuple[LayerLayout, tuple[str, ...]]:
    where = f"layers[{index}]."
    layer = _field(obj, "layer", int, where)
    roles = _field(obj, "roles", list, where)
    entries = tuple(_role(r, f"layer {layer} roles[{i}].") for i, r in enumerate(roles))
    if any(r.ne[2] != num_experts for r in entries):
        raise PackFormatError(f"manifest: layer {layer}: ne[2] differs from num_experts {num_experts}")
    hashes = _field(obj, "block_sha256", list, where)
    if len(hashes) != num_experts:
        raise PackFormatError(f"manifest: layer {layer}: {len(hashes)} block hashes for {num_experts} experts")
    return LayerLayout(layer, entries), tuple(_hex(h, f"layer {layer} block_sha256[{i}]") for i, h in enumerate(hashes))


def _source(obj: object) -> SourceIdentity:
    mode = _field(obj, "fingerprint_mode", str, "source.")
    if mode not in FINGERPRINT_MODES:
        raise PackFormatError(f"manifest: source.fingerprint_mode {mode!r} is not one of {FINGERPRINT_MODES}")
    files = []
    for i, f in enumerate(_field(obj, "files", list, "source.")):
        where = f"source.files[{i}]."
        mtime_ns = _field(f, "mtime_ns", int, where) if isinstance(f, dict) and "mtime_ns" in f else None
        files.append(SourceFile(_field(f, "name", str, where), _field(f, "size", int, where),
                                _hex(_field(f, "fingerprint", str, where), f"{where}fingerprint"), mtime_ns))
    if not files:
        raise PackFormatError("manifest: source.files is empty")
    return SourceIdentity(mode, tuple(files))


def parse_manifest(obj: object) -> Manifest:
    """Validate a decoded manifest JSON value; raises PackFormatError on anything unexpected."""
    if _field(obj, "format", str, "") != FORMAT:
        raise PackFormatError(f"manifest: format is not {FORMAT!r}")
    version = _field(obj, "version", int, "")
    if version != VERSION:
        raise PackFormatError(f"manifest: unsupported version {version} (this llamapack reads version {VERSION})")
    num_experts = _field(obj, "num_experts", int, "")
    parsed = [_layer(x, i, num_experts) for i, x in enumerate(_field(obj, "layers", list, ""))]
    layout = PackLayout(_field(obj, "alignment", int, ""), _field(obj, "data_start", int, ""),
                        _field(obj, "expert_stride", int, ""), num_experts, tuple(layer for layer, _ in parsed))
    check_layout(layout)
    if _field(obj, "pack_size", int, "") != layout.pack_size:
        raise PackFormatError(f"manifest: pack_size {obj['pack_size']} != data_start + blocks * stride = {layout.pack_size}")
    pack_file = _field(obj, "pack_file", str, "")
    if not pack_file or os.path.basename(pack_file) != pack_file or pack_file in (".", ".."):
        raise PackFormatError(f"manifest: pack_file {pack_file!r} must be a plain file name")
    if _field(obj, "hparams_hash_mode", str, "") != HPARAMS_HASH_MODE:
        raise PackFormatError(f"manifest: hparams_hash_mode is not {HPARAMS_HASH_MODE!r}")
    return Manifest(layout, tuple(hashes for _, hashes in parsed), pack_file,
                    _hex(_field(obj, "hparams_sha256", str, ""), "hparams_sha256"), _source(_field(obj, "source", dict, "")))


def load_manifest(path: str) -> tuple[Manifest, bytes]:
    """Parse the manifest at ``path``; returns it and its canonical sha256 (for the pack header)."""
    try:
        with open(path, "rb") as f:
            raw = f.read()
    except FileNotFoundError:
        raise PackFormatError(f"manifest not found: {path} (build the pack with `llamapack pack MODEL.gguf`)") from None
    except OSError as exc:
        raise PackFormatError(f"cannot read manifest {path}: {exc.strerror}") from None
    try:
        obj = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise PackFormatError(f"manifest {path} is not valid JSON: {exc}") from None
    try:
        manifest = parse_manifest(obj)
    except PackFormatError as exc:
        raise PackFormatError(f"{path}: {exc}") from None
    return manifest, canonical_sha256(obj)


def write_manifest(path: str, manifest: Manifest) -> bytes:
    """Write the manifest to ``path`` and fsync it (the builder writes a temporary name and renames it, see
    publish); returns the canonical sha256."""
    obj = manifest_to_dict(manifest)
    with open(path, "w", encoding="ascii") as f:
        json.dump(obj, f, indent=1)
        f.write("\n")
        f.flush()
        os.fsync(f.fileno())
    return canonical_sha256(obj)
