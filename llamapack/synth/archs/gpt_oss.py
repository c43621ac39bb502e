"""gpt-oss (llama.cpp's LLM_ARCH_OPENAI_MOE): biased experts, swiglu-oai, attention sinks, SWA.

Every layer needs: post_attention_norm, attn_sinks {n_head}, attn_output.bias, router bias, and
per-expert biases for gate/up ({n_ff_exp, n_expert}) and down ({n_embd, n_expert}). output.weight is
mandatory (no tied fallback). Sliding window: ``attention.sliding_window`` is required; without a
pattern key the loader makes every other layer SWA (pattern 2). Experts are separate gate/up/down
(no merged gate_up path, src/models/openai-moe.cpp). Routing is softmax over the selected top-k.
"""

from __future__ import annotations

from dataclasses import dataclass

from gguf import GGUFWriter, GGMLQuantizationType as Q, MODEL_TENSOR as T

from ..init import Gaussian
from ..plan import TensorPlan
from ..spec import ModelSpec
from .common import base_metadata, bias, embeddings, gqa_attention, norm, routed_experts, tname

ARCH = "gpt-oss"


@dataclass(frozen=True)
class GptOssParams:
    sliding_window: int = 128


def _params(spec: ModelSpec) -> GptOssParams:
    return spec.extra if isinstance(spec.extra, GptOssParams) else GptOssParams()


def add_metadata(w: GGUFWriter, spec: ModelSpec) -> None:
    base_metadata(w, spec)
    w.add_key_length(spec.head_dim)
    w.add_value_length(spec.head_dim)
    w.add_rope_dimension_count(spec.head_dim)
    w.add_expert_feed_forward_length(spec.n_ff_exp)
    w.add_sliding_window(_params(spec).sliding_window)


def plan_tensors(spec: ModelSpec, n_vocab: int) -> list[TensorPlan]:
    d, ff, n = spec.n_embd, spec.n_ff_exp, spec.n_expert
    plans = embeddings(spec, n_vocab)
    for i in range(spec.n_layer):
        plans += [norm(T.ATTN_NORM, i, d),
                  *gqa_attention(spec, i, qkv_bias=True),
                  bias(T.ATTN_OUT, i, d),
                  TensorPlan(tname(T.ATTN_SINKS, i), (spec.n_head,), Q.F32, Gaussian(1.0)),
                  norm(T.ATTN_POST_NORM, i, d),
                  *routed_experts(spec, i),
                  bias(T.FFN_GATE_INP, i, n),
                  bias(T.FFN_GATE_EXP, i, ff, n),
                  bias(T.FFN_UP_EXP, i, ff, n),
                  bias(T.FFN_DOWN_EXP, i, d, n)]
    return plans
