"""``inspect``: a one-screen summary of a pack (from its manifest) or of a GGUF's would-be pack."""

from __future__ import annotations

import os
from dataclasses import dataclass

from .gguf_model import open_gguf
from .layout import PackLayout
from .pack_reader import PackReader


@dataclass(frozen=True)
class PackSummary:
    kind: str  # "pack" or "gguf" (GGUF-direct layout, no pack on disk)
    path: str
    moe_layers: tuple[int, ...]
    num_experts: int
    expert_stride: int
    total_bytes: int  # pack file size (for a GGUF: the size a pack would have)
    role_types: tuple[tuple[str, tuple[str, ...]], ...]  # (role, ggml type names over layers)
    source_files: tuple[str, ...]
    fingerprint_mode: str | None
    hparams_sha256: str

    def lines(self) -> list[str]:
        types = ", ".join(f"{role}: {'/'.join(names)}" for role, names in self.role_types)
        layers = self.moe_layers
        return [
            f"{self.kind}: {self.path}",
            f"MoE layers: {len(layers)} ({layers[0]}..{layers[-1]}), experts per layer: {self.num_experts}",
            f"expert stride: {self.expert_stride} bytes ({self.expert_stride / 2**20:.2f} MiB), "
            f"blocks: {len(layers) * self.num_experts}, total: {self.total_bytes / 1e9:.3f} GB",
            f"types: {types}",
            f"source: {', '.join(self.source_files)}"
            + (f" (fingerprint {self.fingerprint_mode})" if self.fingerprint_mode else ""),
            f"hparams sha256: {self.hparams_sha256}",
        ]


def _role_types(layout: PackLayout) -> tuple[tuple[str, tuple[str, ...]], ...]:
    found: dict[str, list[str]] = {}
    for layer in layout.layers:
        for role in layer.roles:
            names = found.setdefault(role.role, [])
            if role.type_name not in names:
                names.append(role.type_name)
    return tuple((role, tuple(names)) for role, names in found.items())


def inspect(path: str | os.PathLike) -> PackSummary:
    """Summarize a pack / manifest (checks it is complete and consistent) or a GGUF."""
    if os.fspath(path).endswith(".gguf"):
        model = open_gguf(path)
        lay = model.layout
        return PackSummary("gguf", model.paths[0], lay.moe_layers, lay.num_experts, lay.expert_stride,
                           lay.pack_size, _role_types(lay), tuple(os.path.basename(p) for p in model.paths),
                           None, model.hparams_sha256)
    with PackReader(path, direct_io=False) as reader:
        m, lay = reader.manifest, reader.layout
        return PackSummary("pack", reader.pack_path, lay.moe_layers, lay.num_experts, lay.expert_stride,
                           lay.pack_size, _role_types(lay), tuple(f.name for f in m.source.files),
                           m.source.fingerprint_mode, m.hparams_sha256)
