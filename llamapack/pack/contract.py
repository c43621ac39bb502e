"""Fail-closed check that a pack manifest belongs to the GGUF being loaded."""

from __future__ import annotations

import os
from datetime import datetime, timezone

from llamapack.errors import ModelMismatchError

from .gguf_model import GgufModel
from .identity import SAMPLED, file_fingerprint
from .manifest import Manifest


def _mismatch(field: str, pack_value, model_value, where: str = "") -> ModelMismatchError:
    return ModelMismatchError(
        f"pack does not match the model{where}: {field} is {pack_value} in the manifest but {model_value} in the GGUF"
    )


def check_manifest_matches_model(manifest: Manifest, model: GgufModel, *, check_source: bool = True,
                                 pack_path: str = "PACK") -> None:
    """Layers, experts, role types/shapes/offsets, stride, hyperparameters and source files.

    With ``check_source`` the source files' sizes, modification times (when the manifest records them), and
    for ``sampled-v1`` manifests their sampled fingerprints (a few MiB of reads), must match too: a source
    changed since packing is refused with the commands that re-pack it or verify and re-record it
    (``pack_path`` is named in them).
    """
    ours, theirs = manifest.layout, model.layout
    if ours.moe_layers != theirs.moe_layers:
        raise _mismatch("MoE layer list", list(ours.moe_layers), list(theirs.moe_layers))
    if ours.num_experts != theirs.num_experts:
        raise _mismatch("num_experts", ours.num_experts, theirs.num_experts)
    for pack_layer, model_layer in zip(ours.layers, theirs.layers):
        where = f" at layer {pack_layer.layer}"
        pack_roles = [r.role for r in pack_layer.roles]
        model_roles = [r.role for r in model_layer.roles]
        if pack_roles != model_roles:
            raise _mismatch("roles", pack_roles, model_roles, where)
        for p, m in zip(pack_layer.roles, model_layer.roles):
            for field, a, b in (("ggml type", p.type_name, m.type_name), ("ne", list(p.ne), list(m.ne)),
                                ("nbytes", p.nbytes, m.nbytes), ("offset", p.offset, m.offset)):
                if a != b:
                    raise _mismatch(field, a, b, f"{where} role {p.role}")
    if ours.expert_stride != theirs.expert_stride:
        raise _mismatch("expert_stride", ours.expert_stride, theirs.expert_stride)
    if manifest.hparams_sha256 != model.hparams_sha256:
        raise _mismatch("hyperparameter hash", manifest.hparams_sha256[:16], model.hparams_sha256[:16])
    if check_source:
        _check_source(manifest, model, pack_path)


def _check_source(manifest: Manifest, model: GgufModel, pack_path: str) -> None:
    files = manifest.source.files
    if len(files) != len(model.paths):
        raise _mismatch("source file count", len(files), len(model.paths))
    model_path = model.paths[0]
    repack = f"build the pack again: `llamapack pack {model_path} -o {pack_path}`"
    for recorded, path in zip(files, model.paths):
        st = os.stat(path)
        if recorded.size != st.st_size:
            changed = f"its size is {st.st_size} bytes, the pack was built from {recorded.size}"
        elif manifest.source.fingerprint_mode == SAMPLED and recorded.fingerprint != file_fingerprint(path, SAMPLED):
            changed = "its sampled fingerprint differs from the one recorded"
        elif recorded.mtime_ns is not None and recorded.mtime_ns != st.st_mtime_ns:
            raise ModelMismatchError(
                f"the model may have changed since the pack was built: {path} was modified at "
                f"{_when(st.st_mtime_ns)}, the pack was built from the file of {_when(recorded.mtime_ns)}. Either "
                f"{repack}; or, if it holds the same experts (a copy, a touched file), check every block against it "
                f"and record it: `llamapack verify {pack_path} --against {model_path} --update-source`")
        else:
            continue
        raise ModelMismatchError(f"the model changed since the pack was built: {path}: {changed}; {repack}")


def _when(mtime_ns: int) -> str:
    return datetime.fromtimestamp(mtime_ns / 1e9, timezone.utc).strftime("%Y-%m-%d %H:%M:%S.%f UTC")
