"""llama with experts (Mixtral): softmax routing, separate experts sized by feed_forward_length.

The loader reads the expert FFN width from ``feed_forward_length`` (not expert_feed_forward_length),
requires head_dim == rope dims, and has no merged gate_up path (src/models/llama.cpp).
"""

from __future__ import annotations

from gguf import GGUFWriter, MODEL_TENSOR as T

from ..plan import TensorPlan
from ..spec import ModelSpec
from .common import base_metadata, embeddings, gqa_attention, norm, routed_experts

ARCH = "llama"


def add_metadata(w: GGUFWriter, spec: ModelSpec) -> None:
    base_metadata(w, spec)
    w.add_feed_forward_length(spec.n_ff_exp)
    w.add_key_length(spec.head_dim)
    w.add_value_length(spec.head_dim)
    w.add_rope_dimension_count(spec.head_dim)


def plan_tensors(spec: ModelSpec, n_vocab: int) -> list[TensorPlan]:
    plans = embeddings(spec, n_vocab)
    for i in range(spec.n_layer):
        plans += [norm(T.ATTN_NORM, i, spec.n_embd),
                  *gqa_attention(spec, i),
                  norm(T.FFN_NORM, i, spec.n_embd),
                  *routed_experts(spec, i)]
    return plans
