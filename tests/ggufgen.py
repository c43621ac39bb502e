"""Write tiny (or large, streamed) synthetic MoE GGUFs with random tensor bytes for tests and benches."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as T, GGUFReader, GGUFWriter

Layers = dict[int, dict[str, tuple[T, int, int]]]  # layer -> role -> (ggml type, ne0, ne1)

# Layer 0 is dense; 1: Q4_K gate/up + Q6_K down; 2: F16 everything (plus a resident bias);
# 3: Q8_0 gate/up + Q4_K down. Payload sizes are deliberately not multiples of 4096.
MIXED: Layers = {
    1: {"gate": (T.Q4_K, 256, 40), "up": (T.Q4_K, 256, 40), "down": (T.Q6_K, 256, 24)},
    2: {"gate": (T.F16, 96, 40), "up": (T.F16, 96, 40), "down": (T.F16, 40, 96)},
    3: {"gate": (T.Q8_0, 64, 40), "up": (T.Q8_0, 64, 40), "down": (T.Q4_K, 256, 16)},
}
MERGED: Layers = {
    1: {"gate_up": (T.Q8_0, 128, 80), "down": (T.Q5_K, 256, 32)},
    2: {"gate_up": (T.BF16, 64, 80), "down": (T.Q8_0, 64, 64)},
}
SPLIT_SUFFIX = re.compile(r"-\d{5}-of-\d{5}\.gguf$")


def _role_bytes(spec: tuple[T, int, int], n_expert: int) -> int:
    kind, ne0, ne1 = spec
    block, size = GGML_QUANT_SIZES[kind]
    return ne0 // block * size * ne1 * n_expert


def write_moe_gguf(path: str | Path, layers: Layers = MIXED, *, n_expert: int = 8, seed: int = 0,
                   split_max_tensors: int = 0, name: str = "tiny-moe", dense_layers: tuple[int, ...] = (0,),
                   extra_kv: dict[str, int] | None = None) -> list[Path]:
    """Write the model; returns its shard paths (one unless ``split_max_tensors``).

    Tensors are streamed one at a time, so this also makes multi-GiB GGUFs in little RAM.
    """
    rng = np.random.default_rng(seed)
    w = GGUFWriter(str(path), "qwen3moe", split_max_tensors=split_max_tensors)
    w.add_name(name)
    w.add_block_count(max([*layers, *dense_layers]) + 1)
    w.add_context_length(4096)
    w.add_embedding_length(256)
    w.add_head_count(4)
    w.add_expert_count(n_expert)
    w.add_expert_used_count(2)
    w.add_rope_freq_base(1e6)
    w.add_layer_norm_rms_eps(1e-6)
    for key, value in (extra_kv or {}).items():
        w.add_uint32(key, value)
    w.add_tokenizer_model("gpt2")
    w.add_token_list([f"tok{i}" for i in range(32)])

    plan: list[tuple[str, T, tuple[int, ...], int]] = [("token_embd.weight", T.F32, (32, 256), 32 * 256 * 4)]
    for layer in sorted(dense_layers):
        plan.append((f"blk.{layer}.ffn_up.weight", T.F32, (64, 256), 64 * 256 * 4))
    for layer, roles in sorted(layers.items()):
        plan.append((f"blk.{layer}.ffn_gate_inp.weight", T.F32, (n_expert, 256), n_expert * 256 * 4))
        for role, spec in roles.items():
            kind, ne0, ne1 = spec
            plan.append((f"blk.{layer}.ffn_{role}_exps.weight", kind, (n_expert, ne1, ne0), _role_bytes(spec, n_expert)))
        if layer == 2:  # expert biases stay resident: must not end up in the pack
            plan.append((f"blk.{layer}.ffn_down_exps.bias", T.F32, (n_expert, 256), n_expert * 256 * 4))
    for tensor_name, kind, shape, nbytes in plan:
        w.add_tensor_info(tensor_name, shape, np.dtype(np.float32 if kind == T.F32 else np.float16), nbytes, raw_dtype=kind)
    w.write_header_to_file(Path(path))
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    for _, _, _, nbytes in plan:
        w.write_tensor_data(np.frombuffer(rng.bytes(nbytes), dtype=np.uint8))
    w.close()
    shards = w.format_shard_names(Path(path))
    return [Path(p) for p in shards]


def expert_slices(shards: list[Path]) -> dict[tuple[int, str, int], bytes]:
    """(layer, role, expert) -> that expert's bytes, read independently with gguf.GGUFReader."""
    result = {}
    for shard in shards:
        for t in GGUFReader(shard).tensors:
            match = re.match(r"^blk\.(\d+)\.ffn_(gate_up|gate|up|down)_exps\.weight$", t.name)
            if match:
                raw = np.asarray(t.data).view(np.uint8).reshape(int(t.shape[2]), -1)
                for expert in range(raw.shape[0]):
                    result[int(match[1]), match[2], expert] = raw[expert].tobytes()
    return result


def write_dense_gguf(path: str | Path) -> Path:
    w = GGUFWriter(str(path), "llama")
    w.add_block_count(1)
    w.add_tensor("token_embd.weight", np.zeros((32, 64), dtype=np.float32))
    w.add_tensor("blk.0.ffn_up.weight", np.zeros((128, 64), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return Path(path)
