"""qwen3moe: softmax routing over separate gate/up/down experts, QK-norm attention, no shared expert.

The loader has no merged gate_up path for this arch (src/models/qwen3moe.cpp).
"""

from __future__ import annotations

from gguf import GGUFWriter, MODEL_TENSOR as T

from ..plan import TensorPlan
from ..spec import ModelSpec
from .common import base_metadata, embeddings, gqa_attention, norm, routed_experts

ARCH = "qwen3moe"


def add_metadata(w: GGUFWriter, spec: ModelSpec) -> None:
    base_metadata(w, spec)
    w.add_key_length(spec.head_dim)
    w.add_value_length(spec.head_dim)
    w.add_expert_feed_forward_length(spec.n_ff_exp)


def plan_tensors(spec: ModelSpec, n_vocab: int) -> list[TensorPlan]:
    plans = embeddings(spec, n_vocab)
    for i in range(spec.n_layer):
        plans += [norm(T.ATTN_NORM, i, spec.n_embd),
                  *gqa_attention(spec, i),
                  norm(T.ATTN_Q_NORM, i, spec.head_dim),
                  norm(T.ATTN_K_NORM, i, spec.head_dim),
                  norm(T.FFN_NORM, i, spec.n_embd),
                  *routed_experts(spec, i)]
    return plans
