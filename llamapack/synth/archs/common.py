"""Building blocks shared by the per-arch tensor plans."""

from __future__ import annotations

from gguf import GGMLQuantizationType as Q, GGUFWriter, MODEL_TENSOR as T, TENSOR_NAMES

from ..init import Gaussian, NormWeight, Router, TokenEmbedding, fan_in
from ..plan import TensorPlan
from ..spec import ModelSpec

SMALL = Gaussian(0.02)  # biases and other small additive terms


def tname(kind: T, layer: int | None = None, suffix: str = "weight") -> str:
    base = TENSOR_NAMES[kind].format(bid=layer) if layer is not None else TENSOR_NAMES[kind]
    return f"{base}.{suffix}"


def matrix(kind: T, layer: int | None, n_in: int, n_out: int, qtype: Q, *extra: int) -> TensorPlan:
    return TensorPlan(tname(kind, layer), (n_in, n_out, *extra), qtype, fan_in(n_in))


def norm(kind: T, layer: int | None, width: int) -> TensorPlan:
    return TensorPlan(tname(kind, layer), (width,), Q.F32, NormWeight())


def bias(kind: T, layer: int, *ne: int) -> TensorPlan:
    return TensorPlan(tname(kind, layer, "bias"), tuple(ne), Q.F32, SMALL)


def base_metadata(w: GGUFWriter, spec: ModelSpec) -> None:
    w.add_block_count(spec.n_layer)
    w.add_context_length(spec.context_length)
    w.add_embedding_length(spec.n_embd)
    w.add_head_count(spec.n_head)
    w.add_head_count_kv(spec.n_head_kv)
    w.add_rope_freq_base(spec.rope_freq_base)
    w.add_layer_norm_rms_eps(spec.rms_eps)
    w.add_expert_count(spec.n_expert)
    w.add_expert_used_count(spec.n_expert_used)


def embeddings(spec: ModelSpec, n_vocab: int) -> list[TensorPlan]:
    return [
        TensorPlan(tname(T.TOKEN_EMBD), (spec.n_embd, n_vocab), spec.embd_type, TokenEmbedding()),
        norm(T.OUTPUT_NORM, None, spec.n_embd),
        matrix(T.OUTPUT, None, spec.n_embd, n_vocab, spec.output_type),
    ]


def gqa_attention(spec: ModelSpec, layer: int, *, qkv_bias: bool = False) -> list[TensorPlan]:
    """attn_q/k/v/output of grouped-query attention (no norms)."""
    d, q_dim, kv_dim = spec.n_embd, spec.n_head * spec.head_dim, spec.n_head_kv * spec.head_dim
    plans = [
        matrix(T.ATTN_Q, layer, d, q_dim, spec.dense_type),
        matrix(T.ATTN_K, layer, d, kv_dim, spec.dense_type),
        matrix(T.ATTN_V, layer, d, kv_dim, spec.dense_type),
        matrix(T.ATTN_OUT, layer, q_dim, d, spec.dense_type),
    ]
    if qkv_bias:
        plans += [bias(T.ATTN_Q, layer, q_dim), bias(T.ATTN_K, layer, kv_dim), bias(T.ATTN_V, layer, kv_dim)]
    return plans


def router(spec: ModelSpec, layer: int) -> TensorPlan:
    return TensorPlan(tname(T.FFN_GATE_INP, layer), (spec.n_embd, spec.n_expert), Q.F32,
                      Router(layer, spec.n_expert))


def routed_experts(spec: ModelSpec, layer: int, *, fused_gate_up: bool = False) -> list[TensorPlan]:
    """The router plus gate/up/down expert stacks ({n_in, n_out, n_expert} each).

    With ``fused_gate_up`` gate and up become one ``ffn_gate_up_exps`` of {n_embd, 2*n_ff_exp, n_expert}:
    per expert the first n_ff_exp output rows are the gate, the next n_ff_exp the up projection.
    """
    d, ff, n, quant = spec.n_embd, spec.n_ff_exp, spec.n_expert, spec.expert_quant_for(layer)
    if fused_gate_up:
        gate_up = [matrix(T.FFN_GATE_UP_EXP, layer, d, 2 * ff, quant.gate_up, n)]
    else:
        gate_up = [matrix(T.FFN_GATE_EXP, layer, d, ff, quant.gate_up, n),
                   matrix(T.FFN_UP_EXP, layer, d, ff, quant.gate_up, n)]
    return [router(spec, layer), *gate_up, matrix(T.FFN_DOWN_EXP, layer, ff, d, quant.down, n)]
