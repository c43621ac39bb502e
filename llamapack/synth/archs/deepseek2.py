"""deepseek2 (DeepSeek V2/V3 shape): MLA attention, sigmoid routing with a selection bias and expert
groups, a shared expert, and leading dense layers.

Loader notes (src/models/deepseek2.cpp): ``attention.q_lora_rank`` is required unless n_layer is
26/27 (the "lite" models); 0 means a plain ``attn_q``. Setting key_length_mla/value_length_mla selects
the absorbed MLA form (split ``attn_k_b``/``attn_v_b``, MQA cache with head_count_kv = 1, key_length =
kv_lora_rank + rope dims, value_length = kv_lora_rank). ``exp_probs_b.bias`` is optional; the loader
first looks for merged ``ffn_gate_up_exps`` and falls back to separate gate/up.
"""

from __future__ import annotations

from dataclasses import dataclass

from gguf import ExpertGatingFuncType, GGUFWriter, GGMLQuantizationType as Q, MODEL_TENSOR as T

from ..plan import TensorPlan
from ..spec import ModelSpec
from .common import SMALL, base_metadata, embeddings, matrix, norm, routed_experts, tname

ARCH = "deepseek2"


@dataclass(frozen=True)
class Deepseek2Params:
    n_layer_dense_lead: int = 1
    n_ff_dense: int = 512
    n_expert_shared: int = 1
    n_expert_groups: int = 4
    n_group_used: int = 2
    kv_lora_rank: int = 128
    q_lora_rank: int = 0  # 0: plain attn_q (minimum tensors); > 0: attn_q_a / q_a_norm / attn_q_b
    qk_rope_dim: int = 32
    qk_nope_dim: int = 64
    v_head_dim: int = 64
    expert_weights_scale: float = 2.5
    fused_gate_up: bool = False

    def check(self, spec: ModelSpec) -> None:
        groups, used = self.n_expert_groups, self.n_group_used
        if groups > 1 and not (spec.n_expert % groups == 0 and 0 < used < groups
                               and used * spec.n_expert // groups >= spec.n_expert_used):
            raise ValueError(f"{spec.name}: expert groups {groups}/{used} do not fit {spec.n_expert} experts")
        if not 0 <= self.n_layer_dense_lead < spec.n_layer:
            raise ValueError(f"{spec.name}: need 0 <= n_layer_dense_lead < n_layer")


def _params(spec: ModelSpec) -> Deepseek2Params:
    if not isinstance(spec.extra, Deepseek2Params):
        raise ValueError(f"{spec.name}: deepseek2 needs extra=Deepseek2Params(...)")
    spec.extra.check(spec)
    return spec.extra


def add_metadata(w: GGUFWriter, spec: ModelSpec) -> None:
    p = _params(spec)
    base_metadata(w, spec)
    w.add_feed_forward_length(p.n_ff_dense)
    w.add_leading_dense_block_count(p.n_layer_dense_lead)
    w.add_q_lora_rank(p.q_lora_rank)
    w.add_kv_lora_rank(p.kv_lora_rank)
    w.add_key_length(p.kv_lora_rank + p.qk_rope_dim)
    w.add_value_length(p.kv_lora_rank)
    w.add_key_length_mla(p.qk_nope_dim + p.qk_rope_dim)
    w.add_value_length_mla(p.v_head_dim)
    w.add_rope_dimension_count(p.qk_rope_dim)
    w.add_expert_feed_forward_length(spec.n_ff_exp)
    w.add_expert_shared_count(p.n_expert_shared)
    w.add_expert_group_count(p.n_expert_groups)
    w.add_expert_group_used_count(p.n_group_used)
    w.add_expert_weights_scale(p.expert_weights_scale)
    w.add_expert_weights_norm(True)
    w.add_expert_gating_func(ExpertGatingFuncType.SIGMOID)


def _mla_attention(spec: ModelSpec, p: Deepseek2Params, i: int) -> list[TensorPlan]:
    d, h, qt = spec.n_embd, spec.n_head, spec.dense_type
    q_width = h * (p.qk_nope_dim + p.qk_rope_dim)
    if p.q_lora_rank:
        q = [matrix(T.ATTN_Q_A, i, d, p.q_lora_rank, qt), norm(T.ATTN_Q_A_NORM, i, p.q_lora_rank),
             matrix(T.ATTN_Q_B, i, p.q_lora_rank, q_width, qt)]
    else:
        q = [matrix(T.ATTN_Q, i, d, q_width, qt)]
    return [*q,
            matrix(T.ATTN_KV_A_MQA, i, d, p.kv_lora_rank + p.qk_rope_dim, qt),
            norm(T.ATTN_KV_A_NORM, i, p.kv_lora_rank),
            matrix(T.ATTN_K_B, i, p.qk_nope_dim, p.kv_lora_rank, qt, h),
            matrix(T.ATTN_V_B, i, p.kv_lora_rank, p.v_head_dim, qt, h),
            matrix(T.ATTN_OUT, i, h * p.v_head_dim, d, qt)]


def _ffn(spec: ModelSpec, p: Deepseek2Params, i: int) -> list[TensorPlan]:
    d, qt = spec.n_embd, spec.dense_type
    if i < p.n_layer_dense_lead:
        return [matrix(T.FFN_GATE, i, d, p.n_ff_dense, qt), matrix(T.FFN_UP, i, d, p.n_ff_dense, qt),
                matrix(T.FFN_DOWN, i, p.n_ff_dense, d, qt)]
    shared = spec.n_ff_exp * p.n_expert_shared
    return [*routed_experts(spec, i, fused_gate_up=p.fused_gate_up),
            TensorPlan(tname(T.FFN_EXP_PROBS_B, i, "bias"), (spec.n_expert,), Q.F32, SMALL),
            matrix(T.FFN_GATE_SHEXP, i, d, shared, qt), matrix(T.FFN_UP_SHEXP, i, d, shared, qt),
            matrix(T.FFN_DOWN_SHEXP, i, shared, d, qt)]


def plan_tensors(spec: ModelSpec, n_vocab: int) -> list[TensorPlan]:
    p = _params(spec)
    plans = embeddings(spec, n_vocab)
    for i in range(spec.n_layer):
        plans += [norm(T.ATTN_NORM, i, spec.n_embd), *_mla_attention(spec, p, i),
                  norm(T.FFN_NORM, i, spec.n_embd), *_ffn(spec, p, i)]
    return plans
