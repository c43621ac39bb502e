"""kimi-k3 (Kimi-K3 shape): hybrid KDA (linear, recurrent) + MLA attention, cross-layer attention
residuals, latent MoE, situ activation, sigmoid routing with a selection bias, a shared expert.

Loader notes (src/models/kimi-k3.cpp): ``attention.head_count_kv`` is a per-layer array whose 0 entries
mark KDA layers. KDA layers need q/k/v with 3-D ``ssm_conv1d_{q,k,v}`` {d_conv, 1, d_inner}, ``ssm_f_a``,
``ssm_f_b``, ``ssm_beta``, ``ssm_a`` (no suffix; holds -exp(A_log)), ``ssm_dt.bias``, a full-rank
``ssm_g`` and ``ssm_norm``. MLA layers are nope-only, absorbed (``attn_k_b``/``attn_v_b``), with an
optional sigmoid output gate ``attn_gate`` (present in K3). ``attn_res.block_size`` > 0 adds
``{attn,ffn}_res_score`` per layer and ``output_res_score``. Routed experts run in the latent space
(``expert_latent_length``): ``ffn_routed_down``/``ffn_routed_up`` (and the optional ``ffn_routed_norm``)
project around them; the router reads the full-width input and hands its logits to ``build_moe_ffn``.
Leading layers (``leading_dense_block_count``) have a dense situ FFN.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from gguf import GGUFValueType as V, GGUFWriter, GGMLQuantizationType as Q

from ..init import Gaussian, NormWeight, Router, SynthContext, fan_in
from ..plan import TensorPlan
from ..spec import ModelSpec
from .common import SMALL, embeddings

ARCH = "kimi-k3"
GATING_SIGMOID = 2


@dataclass(frozen=True)
class KimiK3Params:
    full_attn_layers: tuple[int, ...] = (3,)  # MLA layers (0-based); the others are KDA
    n_layer_dense_lead: int = 1
    n_ff_dense: int = 512
    n_expert_shared: int = 1
    expert_latent: int = 256
    kda_head_dim: int = 64
    kda_conv: int = 4
    kda_gate_lower_bound: float = -5.0
    kv_lora_rank: int = 128
    qk_nope_dim: int = 64
    qk_rope_dim: int = 32
    v_head_dim: int = 64
    attn_res_block_size: int = 2
    situ_beta: float = 8.0
    situ_linear_beta: float = 4.0
    expert_weights_scale: float = 2.5

    def check(self, spec: ModelSpec) -> None:
        if not set(self.full_attn_layers) <= set(range(spec.n_layer)):
            raise ValueError(f"{spec.name}: full_attn_layers outside the model")
        if not 0 <= self.n_layer_dense_lead < spec.n_layer:
            raise ValueError(f"{spec.name}: need 0 <= n_layer_dense_lead < n_layer")


def _params(spec: ModelSpec) -> KimiK3Params:
    if not isinstance(spec.extra, KimiK3Params):
        raise ValueError(f"{spec.name}: kimi-k3 needs extra=KimiK3Params(...)")
    spec.extra.check(spec)
    return spec.extra


def _key(name: str) -> str:
    return f"{ARCH}.{name}"


def add_metadata(w: GGUFWriter, spec: ModelSpec) -> None:
    p = _params(spec)
    w.add_block_count(spec.n_layer)
    w.add_context_length(spec.context_length)
    w.add_embedding_length(spec.n_embd)
    w.add_feed_forward_length(p.n_ff_dense)
    w.add_head_count(spec.n_head)
    w.add_key_value(_key("attention.head_count_kv"),
                    [1 if i in p.full_attn_layers else 0 for i in range(spec.n_layer)], V.ARRAY, sub_type=V.UINT32)
    w.add_rope_freq_base(spec.rope_freq_base)
    w.add_layer_norm_rms_eps(spec.rms_eps)
    w.add_expert_count(spec.n_expert)
    w.add_expert_used_count(spec.n_expert_used)
    # KDA
    w.add_uint32(_key("ssm.conv_kernel"), p.kda_conv)
    w.add_uint32(_key("kda.head_dim"), p.kda_head_dim)
    w.add_float32(_key("kda.gate_lower_bound"), p.kda_gate_lower_bound)
    # MLA, served as MQA over the compressed latent
    w.add_kv_lora_rank(p.kv_lora_rank)
    w.add_rope_dimension_count(p.qk_rope_dim)
    w.add_key_length(p.kv_lora_rank + p.qk_rope_dim)
    w.add_value_length(p.kv_lora_rank)
    w.add_key_length_mla(p.qk_nope_dim + p.qk_rope_dim)
    w.add_value_length_mla(p.v_head_dim)
    # MoE
    w.add_expert_feed_forward_length(spec.n_ff_exp)
    w.add_expert_shared_count(p.n_expert_shared)
    w.add_leading_dense_block_count(p.n_layer_dense_lead)
    w.add_expert_weights_scale(p.expert_weights_scale)
    w.add_expert_weights_norm(True)
    w.add_uint32(_key("expert_gating_func"), GATING_SIGMOID)
    w.add_uint32(_key("expert_latent_length"), p.expert_latent)
    w.add_float32(_key("activation.situ_beta"), p.situ_beta)
    w.add_float32(_key("activation.situ_linear_beta"), p.situ_linear_beta)
    w.add_uint32(_key("attn_res.block_size"), p.attn_res_block_size)


@dataclass(frozen=True)
class NegativeDecay:
    """-exp(A_log) with A_log ~ U(0, log 16): the KDA per-head decay rates, as the converter folds them."""

    def rows(self, ctx: SynthContext, rng: np.random.Generator, start: int, stop: int, width: int) -> np.ndarray:
        return -np.exp(rng.uniform(0.0, np.log(16.0), (stop - start, width))).astype(np.float32)


def _t(name: str, layer: int | None, ne: tuple[int, ...], qtype: Q, init) -> TensorPlan:
    return TensorPlan(name if layer is None else f"blk.{layer}.{name}", ne, qtype, init)


def _mat(name: str, layer: int, n_in: int, n_out: int, qtype: Q, *extra: int) -> TensorPlan:
    return _t(name, layer, (n_in, n_out, *extra), qtype, fan_in(n_in))


def _norm(name: str, layer: int | None, width: int) -> TensorPlan:
    return _t(name, layer, (width,), Q.F32, NormWeight())


def _res_score(name: str, layer: int | None, width: int) -> TensorPlan:
    return _t(name, layer, (width,), Q.F32, Gaussian(0.1))


def _kda(spec: ModelSpec, p: KimiK3Params, i: int) -> list[TensorPlan]:
    d, h, hd, qt = spec.n_embd, spec.n_head, p.kda_head_dim, spec.dense_type
    inner = h * hd
    convs = [_t(f"ssm_conv1d_{x}.weight", i, (p.kda_conv, 1, inner), Q.F32, fan_in(p.kda_conv)) for x in "qkv"]
    return [*convs,
            _mat("attn_q.weight", i, d, inner, qt), _mat("attn_k.weight", i, d, inner, qt),
            _mat("attn_v.weight", i, d, inner, qt),
            _mat("ssm_f_a.weight", i, d, hd, qt), _mat("ssm_f_b.weight", i, hd, inner, qt),
            _mat("ssm_beta.weight", i, d, h, qt),
            _t("ssm_a", i, (h,), Q.F32, NegativeDecay()), _t("ssm_dt.bias", i, (inner,), Q.F32, SMALL),
            _mat("ssm_g.weight", i, d, inner, qt), _norm("ssm_norm.weight", i, hd),
            _mat("attn_output.weight", i, inner, d, qt)]


def _mla(spec: ModelSpec, p: KimiK3Params, i: int) -> list[TensorPlan]:
    d, h, qt = spec.n_embd, spec.n_head, spec.dense_type
    return [_norm("attn_kv_a_norm.weight", i, p.kv_lora_rank),
            _mat("attn_q.weight", i, d, h * (p.qk_nope_dim + p.qk_rope_dim), qt),
            _mat("attn_kv_a_mqa.weight", i, d, p.kv_lora_rank + p.qk_rope_dim, qt),
            _mat("attn_k_b.weight", i, p.qk_nope_dim, p.kv_lora_rank, qt, h),
            _mat("attn_v_b.weight", i, p.kv_lora_rank, p.v_head_dim, qt, h),
            _mat("attn_gate.weight", i, d, h * p.v_head_dim, qt),
            _mat("attn_output.weight", i, h * p.v_head_dim, d, qt)]


def _ffn(spec: ModelSpec, p: KimiK3Params, i: int) -> list[TensorPlan]:
    d, qt = spec.n_embd, spec.dense_type
    if i < p.n_layer_dense_lead:
        return [_mat("ffn_gate.weight", i, d, p.n_ff_dense, qt), _mat("ffn_down.weight", i, p.n_ff_dense, d, qt),
                _mat("ffn_up.weight", i, d, p.n_ff_dense, qt)]
    ff, n, lat, quant = spec.n_ff_exp, spec.n_expert, p.expert_latent, spec.expert_quant_for(i)
    shared = ff * p.n_expert_shared
    return [_t("ffn_gate_inp.weight", i, (d, n), Q.F32, Router(i, n)),
            _t("exp_probs_b.bias", i, (n,), Q.F32, SMALL),
            _mat("ffn_gate_exps.weight", i, lat, ff, quant.gate_up, n),
            _mat("ffn_down_exps.weight", i, ff, lat, quant.down, n),
            _mat("ffn_up_exps.weight", i, lat, ff, quant.gate_up, n),
            _mat("ffn_routed_down.weight", i, d, lat, qt), _mat("ffn_routed_up.weight", i, lat, d, qt),
            _norm("ffn_routed_norm.weight", i, lat),
            _mat("ffn_gate_shexp.weight", i, d, shared, qt), _mat("ffn_down_shexp.weight", i, shared, d, qt),
            _mat("ffn_up_shexp.weight", i, d, shared, qt)]


def plan_tensors(spec: ModelSpec, n_vocab: int) -> list[TensorPlan]:
    p = _params(spec)
    d = spec.n_embd
    plans = [*embeddings(spec, n_vocab), _res_score("output_res_score.weight", None, d)]
    for i in range(spec.n_layer):
        attention = _mla(spec, p, i) if i in p.full_attn_layers else _kda(spec, p, i)
        plans += [_norm("attn_norm.weight", i, d), _norm("ffn_norm.weight", i, d),
                  _res_score("attn_res_score.weight", i, d), _res_score("ffn_res_score.weight", i, d),
                  *attention, *_ffn(spec, p, i)]
    return plans
