"""Enumerate a GGUF model's routed-expert tensors (split-aware) and its identity.

Packed tensors are ``blk.{L}.ffn_{gate,up,down,gate_up}_exps.weight``. Expert biases/scales and
any other tensor stay resident in llama.cpp and are not part of the pack.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

from llamapack.errors import PackFormatError, PackIOError

from .gguf_file import GgufHeader, read_gguf_header
from .identity import hparams_sha256
from .layout import ExpertTensor, PackLayout, compute_layout, expert_nbytes

EXPERT_TENSOR = re.compile(r"^blk\.(\d+)\.ffn_(gate_up|gate|up|down)_exps\.weight$")
SHARD_NAME = re.compile(r"^(?P<prefix>.*)-(?P<no>\d{5})-of-(?P<count>\d{5})\.gguf$")


@dataclass(frozen=True)
class GgufModel:
    paths: tuple[str, ...]  # shard files in order (one for an unsplit model)
    arch: str
    expert_tensors: tuple[ExpertTensor, ...]
    hparams_sha256: str

    @property
    def stem(self) -> str:
        """Model name for default pack paths: file stem without the ``-0000N-of-0000M`` suffix."""
        match = SHARD_NAME.match(os.path.basename(self.paths[0]))
        return match["prefix"] if match else Path(self.paths[0]).stem

    @cached_property
    def layout(self) -> PackLayout:
        return compute_layout(self.expert_tensors)

    def tensor(self, layer: int, role: str) -> ExpertTensor:
        for t in self.expert_tensors:
            if t.layer == layer and t.role == role:
                return t
        raise KeyError(f"no expert tensor for layer {layer} role {role!r}")


def _shard_paths(path: str, count: int) -> list[str]:
    match = SHARD_NAME.match(os.path.basename(path))
    if not match or int(match["count"]) != count:
        raise PackFormatError(f"{path}: split.count={count} but the name is not <prefix>-NNNNN-of-{count:05d}.gguf")
    folder = os.path.dirname(path)
    return [os.path.join(folder, f"{match['prefix']}-{i:05d}-of-{count:05d}.gguf") for i in range(1, count + 1)]


def _expert_tensors(header: GgufHeader) -> list[ExpertTensor]:
    tensors = []
    for t in header.tensors:
        match = EXPERT_TENSOR.match(t.name)
        if not match:
            continue
        if len(t.ne) != 3:
            raise PackFormatError(f"{header.path}: expert tensor {t.name} has ne={list(t.ne)}, expected 3 dimensions")
        nbytes = expert_nbytes(t.ggml_type, t.ne) * t.ne[2]
        if t.data_offset + nbytes > header.file_size:
            raise PackFormatError(f"{header.path}: tensor {t.name} runs past the end of the file (truncated?)")
        tensors.append(ExpertTensor(t.name, int(match[1]), match[2], t.ggml_type, t.ne, nbytes, header.path,
                                    t.data_offset))
    return tensors


def open_gguf(path: str | os.PathLike) -> GgufModel:
    """Read a GGUF (any shard of a split model) and list its routed-expert tensors."""
    path = os.path.abspath(os.fspath(path))
    if not os.path.isfile(path):
        raise PackIOError(f"GGUF file not found: {path}")
    given = read_gguf_header(path)
    count = int(given.kv.get("split.count", ("", 1))[1])
    paths = _shard_paths(path, count) if count > 1 else [path]
    headers = []
    for index, shard in enumerate(paths):
        if not os.path.isfile(shard):
            raise PackFormatError(f"split GGUF: shard {shard} is missing")
        header = given if shard == path else read_gguf_header(shard)
        if count > 1 and header.kv.get("split.no", ("", -1))[1] != index:
            raise PackFormatError(f"{shard}: split.no is not {index}")
        headers.append(header)
    kv = headers[0].kv  # llama.cpp takes hyperparameters from the first shard
    arch = str(kv.get("general.architecture", ("", "unknown"))[1])
    tensors = [t for header in headers for t in _expert_tensors(header)]
    if not tensors:
        raise PackFormatError(f"{path}: no routed-expert tensors ({arch} is dense): pack mode does not apply")
    model = GgufModel(tuple(paths), arch, tuple(tensors), hparams_sha256(kv))
    layout = model.layout  # validates shapes, types, expert counts
    declared = kv.get(f"{arch}.expert_count", ("", layout.num_experts))[1]
    if declared != layout.num_experts:
        raise PackFormatError(f"{path}: {arch}.expert_count={declared} but expert tensors hold {layout.num_experts}")
    return model
