"""A model's shape for the plan, from its GGUF header only (no tensor data is read)."""
from __future__ import annotations

import os

from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from ..errors import PackFormatError
from ..pack import open_gguf
from ..pack.gguf_file import read_gguf_header
from ..pack.gguf_model import EXPERT_TENSOR
from ..provider.slots import SlotLayout
from .model import ModelShape

KV_BYTES_PER_VALUE = 2  # llama.cpp's default f16 K and V cache


def tensor_nbytes(ggml_type: int, ne: tuple[int, ...]) -> int:
    block, size = GGML_QUANT_SIZES[GGMLQuantizationType(ggml_type)]
    elements = 1
    for n in ne:
        elements *= n
    return elements // block * size


def kv_bytes_per_token(kv: dict, arch: str) -> int:
    """f16 K and V bytes of one context token over all layers (0 when the header lacks the numbers; MLA models'
    compressed cache is not modelled)."""
    def get(key, default=None):
        return kv.get(f"{arch}.{key}", ("", default))[1]

    n_layer, n_head, n_embd = get("block_count", 0), get("attention.head_count", 0), get("embedding_length", 0)
    heads_kv = get("attention.head_count_kv", n_head)
    if not n_layer or not n_head:
        return 0
    n_head = max(n_head) if isinstance(n_head, list) else n_head
    head_dim = n_embd // n_head if n_head else 0
    k, v = get("attention.key_length", head_dim), get("attention.value_length", head_dim)
    per_layer = heads_kv if isinstance(heads_kv, list) else [heads_kv] * n_layer
    return sum(int(h) for h in per_layer) * (int(k) + int(v)) * KV_BYTES_PER_VALUE


def read_shape(gguf_path: str | os.PathLike) -> ModelShape:
    """The model's MoE shape, block and slot bytes, non-expert bytes and KV bytes per token."""
    model = open_gguf(gguf_path)
    layout = model.layout
    headers = [read_gguf_header(path) for path in model.paths]
    kv = headers[0].kv
    top_k = kv.get(f"{model.arch}.expert_used_count", ("", None))[1]
    if not isinstance(top_k, int) or top_k < 1:
        raise PackFormatError(f"{gguf_path}: no {model.arch}.expert_used_count in the header: top-k unknown")
    nonexpert = sum(tensor_nbytes(t.ggml_type, t.ne) for header in headers for t in header.tensors
                    if not EXPERT_TENSOR.match(t.name))
    n_layers = len(layout.layers)
    expert_bytes = sum(t.nbytes for t in model.expert_tensors) / (n_layers * layout.num_experts)
    return ModelShape(name=model.stem, n_moe_layers=n_layers, n_experts=layout.num_experts, top_k=top_k,
                      block_bytes=layout.expert_stride,
                      slot_bytes=SlotLayout.from_tensors(model.expert_tensors, 1).slot_bytes,
                      expert_bytes=expert_bytes, nonexpert_bytes=nonexpert,
                      kv_bytes_per_token=kv_bytes_per_token(kv, model.arch))
