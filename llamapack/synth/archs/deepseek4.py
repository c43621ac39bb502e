"""deepseek4 (DeepSeek-V4-Flash shape): hyper-connections, grouped low-rank attention output, per-layer
KV compression (CSA with a lightning indexer, HCA), sqrt-softplus routing, hash-routed leading layers.

Loader notes (src/models/deepseek4.cpp): every layer is SWA (``attention.sliding_window``) and carries
``hc_{attn,ffn}_{fn,base,scale}`` (hc_mult must be 4); ``output_hc_*`` mix the streams at the head.
``attention.compress_ratios`` (one per layer, 0, 4 or 128) decides which compressor tensors a layer has:
4 adds the indexer ones too. ``attn_output_a`` is stored 2-D and reshaped by the loader. The gating func
must be 4 (sqrt-softplus). The first ``hash_layer_count`` layers have ``ffn_gate_tid2eid`` (I32
{n_expert_used, n_vocab}: the expert ids per token) instead of ``exp_probs_b``; they still have a router,
whose probabilities weight the hashed experts, and they go through ``build_moe_ffn`` with
``selected_experts_in``, so the expert hook serves them like any other layer. No leading dense layers.
MTP blocks (``nextn_predict_layers``) only appear in the separate MTP GGUF the converter writes, so the
main model has none; ``mtp_layers`` appends some anyway (a full layer, ratio 0, plus ``nextn.*``), which
llama.cpp skips unless asked to load MTP. Routed experts are MXFP4, as in the converted checkpoint.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np
from gguf import GGUFValueType as V, GGUFWriter, GGMLQuantizationType as Q

from ..init import Gaussian, NormWeight, Router, SynthContext, fan_in
from ..plan import TensorPlan
from ..spec import ModelSpec
from .common import SMALL, base_metadata, embeddings

ARCH = "deepseek4"
GATING_SQRT_SOFTPLUS = 4  # llama_expert_gating_func_type (newer than gguf-py's ExpertGatingFuncType)
HC_MULT = 4  # the graph asserts it


@dataclass(frozen=True)
class Deepseek4Params:
    q_lora_rank: int = 128
    rope_dim: int = 32
    o_groups: int = 2
    o_lora_rank: int = 64
    sliding_window: int = 32
    compress_ratios: tuple[int, ...] = (0, 4, 128, 4)  # one per layer: 0 (plain SWA), 4 (CSA), 128 (HCA)
    mtp_layers: int = 0  # nextn blocks after the n_layer trunk layers (not in the converted main model)
    hash_layers: int = 2  # the first layers route by token id
    indexer_heads: int = 4
    indexer_head_dim: int = 64
    indexer_top_k: int = 8
    n_expert_shared: int = 1
    expert_weights_scale: float = 1.5
    swiglu_limit: float = 10.0
    compress_rope_freq_base: float = 160000.0
    hc_sinkhorn_iters: int = 20
    hc_eps: float = 1e-6

    def ratios(self) -> tuple[int, ...]:
        """Compress ratio of every block, MTP ones included (their attention is plain SWA)."""
        return self.compress_ratios + (0,) * self.mtp_layers

    def check(self, spec: ModelSpec) -> None:
        if len(self.compress_ratios) != spec.n_layer or set(self.compress_ratios) - {0, 4, 128}:
            raise ValueError(f"{spec.name}: need one compress ratio (0, 4 or 128) per layer")
        if not 0 <= self.hash_layers <= spec.n_layer or self.mtp_layers < 0:
            raise ValueError(f"{spec.name}: need 0 <= hash_layers <= n_layer and mtp_layers >= 0")
        if spec.n_head % self.o_groups or spec.n_head_kv != 1:
            raise ValueError(f"{spec.name}: n_head must be a multiple of o_groups, n_head_kv must be 1")


def _params(spec: ModelSpec) -> Deepseek4Params:
    if not isinstance(spec.extra, Deepseek4Params):
        raise ValueError(f"{spec.name}: deepseek4 needs extra=Deepseek4Params(...)")
    spec.extra.check(spec)
    return spec.extra


def _key(name: str) -> str:
    return f"{ARCH}.{name}"


def add_metadata(w: GGUFWriter, spec: ModelSpec) -> None:
    p = _params(spec)
    n_all = spec.n_layer + p.mtp_layers
    base_metadata(w, replace(spec, n_layer=n_all))
    w.add_key_length(spec.head_dim)
    w.add_value_length(spec.head_dim)
    w.add_rope_dimension_count(p.rope_dim)
    w.add_q_lora_rank(p.q_lora_rank)
    w.add_sliding_window(p.sliding_window)
    w.add_expert_feed_forward_length(spec.n_ff_exp)
    w.add_expert_shared_count(p.n_expert_shared)
    w.add_expert_weights_scale(p.expert_weights_scale)
    w.add_expert_weights_norm(True)
    w.add_uint32(_key("expert_gating_func"), GATING_SQRT_SOFTPLUS)
    w.add_array(_key("swiglu_clamp_exp"), [p.swiglu_limit] * n_all)
    w.add_array(_key("swiglu_clamp_shexp"), [p.swiglu_limit] * n_all)
    w.add_uint32(_key("attention.indexer.head_count"), p.indexer_heads)
    w.add_uint32(_key("attention.indexer.key_length"), p.indexer_head_dim)
    w.add_uint32(_key("attention.indexer.top_k"), p.indexer_top_k)
    w.add_uint32(_key("attention.output_group_count"), p.o_groups)
    w.add_uint32(_key("attention.output_lora_rank"), p.o_lora_rank)
    w.add_key_value(_key("attention.compress_ratios"), list(p.ratios()), V.ARRAY, sub_type=V.UINT32)
    w.add_float32(_key("attention.compress_rope_freq_base"), p.compress_rope_freq_base)
    w.add_uint32(_key("hyper_connection.count"), HC_MULT)
    w.add_uint32(_key("hyper_connection.sinkhorn_iterations"), p.hc_sinkhorn_iters)
    w.add_float32(_key("hyper_connection.epsilon"), p.hc_eps)
    w.add_uint32(_key("hash_layer_count"), p.hash_layers)
    w.add_uint32(_key("embedding_length_out"), HC_MULT * spec.n_embd)
    if p.mtp_layers:
        w.add_uint32(_key("nextn_predict_layers"), p.mtp_layers)


@dataclass(frozen=True)
class HashRouting:
    """A token-id -> expert-ids table: n_used distinct experts per token, uniformly drawn."""

    n_expert: int


@dataclass(frozen=True)
class HashTablePlan(TensorPlan):
    """``ffn_gate_tid2eid``: I32 data, which the synthetic weight types do not cover."""

    def __post_init__(self) -> None:
        if self.qtype != Q.I32 or not isinstance(self.init, HashRouting):
            raise ValueError(f"{self.name}: a hash table is I32 with HashRouting values")

    @property
    def uses_random_blocks(self) -> bool:
        return False

    def chunks(self, ctx: SynthContext):
        n_used, n_vocab = self.ne
        keys = ctx.rng(self.name).random((n_vocab, self.init.n_expert))
        yield np.argsort(keys, axis=1)[:, :n_used].astype("<i4").view(np.uint8).reshape(-1)


def _t(name: str, layer: int | None, ne: tuple[int, ...], qtype: Q, init) -> TensorPlan:
    return TensorPlan(name if layer is None else f"blk.{layer}.{name}", ne, qtype, init)


def _mat(name: str, layer: int | None, n_in: int, n_out: int, qtype: Q, *extra: int) -> TensorPlan:
    return _t(name, layer, (n_in, n_out, *extra), qtype, fan_in(n_in))


def _norm(name: str, layer: int | None, width: int) -> TensorPlan:
    return _t(name, layer, (width,), Q.F32, NormWeight())


def _hyper_connection(prefix: str, layer: int | None, n_embd: int, n_mix: int, n_scale: int) -> list[TensorPlan]:
    """fn (mixes from the RMS-normed streams), base and scale of one hyper-connection (F32, as converted)."""
    return [_mat(f"{prefix}_fn.weight", layer, HC_MULT * n_embd, n_mix, Q.F32),
            _t(f"{prefix}_base.weight", layer, (n_mix,), Q.F32, Gaussian(0.5)),
            _t(f"{prefix}_scale.weight", layer, (n_scale,), Q.F32, Gaussian(0.5))]


def _compressor(prefix: str, i: int, d: int, width: int, head_dim: int, ratio: int, qt: Q) -> list[TensorPlan]:
    return [_mat(f"{prefix}_kv.weight", i, d, width, qt), _mat(f"{prefix}_gate.weight", i, d, width, qt),
            _t(f"{prefix}_ape.weight", i, (width, ratio), Q.F32, SMALL), _norm(f"{prefix}_norm.weight", i, head_dim)]


def _attention(spec: ModelSpec, p: Deepseek4Params, i: int) -> list[TensorPlan]:
    d, h, hd, qt = spec.n_embd, spec.n_head, spec.head_dim, spec.dense_type
    plans = [_t("attn_sinks.weight", i, (h,), Q.F32, Gaussian(1.0)),
             _mat("attn_q_a.weight", i, d, p.q_lora_rank, qt), _norm("attn_q_a_norm.weight", i, p.q_lora_rank),
             _mat("attn_q_b.weight", i, p.q_lora_rank, h * hd, qt),
             _mat("attn_kv.weight", i, d, hd, qt), _norm("attn_kv_a_norm.weight", i, hd),
             _mat("attn_output_a.weight", i, h * hd // p.o_groups, p.o_lora_rank * p.o_groups, qt),
             _mat("attn_output_b.weight", i, p.o_groups * p.o_lora_rank, d, qt)]
    ratio = p.ratios()[i]
    if ratio:
        plans += _compressor("attn_compressor", i, d, (2 if ratio == 4 else 1) * hd, hd, ratio, qt)
    if ratio == 4:
        plans += [_mat("indexer.proj.weight", i, d, p.indexer_heads, qt),
                  _mat("indexer.attn_q_b.weight", i, p.q_lora_rank, p.indexer_heads * p.indexer_head_dim, qt),
                  *_compressor("indexer_compressor", i, d, 2 * p.indexer_head_dim, p.indexer_head_dim, ratio, qt)]
    return plans


def _moe(spec: ModelSpec, p: Deepseek4Params, i: int, n_vocab: int) -> list[TensorPlan]:
    d, ff, n, qt = spec.n_embd, spec.n_ff_exp, spec.n_expert, spec.dense_type
    quant, shared = spec.expert_quant_for(i), ff * p.n_expert_shared
    if i < p.hash_layers:
        routing = HashTablePlan(f"blk.{i}.ffn_gate_tid2eid.weight", (spec.n_expert_used, n_vocab), Q.I32,
                                HashRouting(n))
    else:
        routing = _t("exp_probs_b.bias", i, (n,), Q.F32, SMALL)
    return [_t("ffn_gate_inp.weight", i, (d, n), Q.F32, Router(i, n)), routing,
            _mat("ffn_gate_exps.weight", i, d, ff, quant.gate_up, n),
            _mat("ffn_up_exps.weight", i, d, ff, quant.gate_up, n),
            _mat("ffn_down_exps.weight", i, ff, d, quant.down, n),
            _mat("ffn_gate_shexp.weight", i, d, shared, qt), _mat("ffn_up_shexp.weight", i, d, shared, qt),
            _mat("ffn_down_shexp.weight", i, shared, d, qt)]


def plan_tensors(spec: ModelSpec, n_vocab: int) -> list[TensorPlan]:
    p = _params(spec)
    d, mix = spec.n_embd, (2 + HC_MULT) * HC_MULT
    plans = [*embeddings(spec, n_vocab), *_hyper_connection("output_hc", None, d, HC_MULT, 1)]
    for i in range(spec.n_layer + p.mtp_layers):
        plans += [_norm("attn_norm.weight", i, d), *_attention(spec, p, i),
                  *_hyper_connection("hc_attn", i, d, mix, 3), *_hyper_connection("hc_ffn", i, d, mix, 3),
                  _norm("ffn_norm.weight", i, d), *_moe(spec, p, i, n_vocab)]
        if i >= spec.n_layer:
            plans += [_mat("nextn.eh_proj.weight", i, 2 * d, d, Q.Q8_0), _norm("nextn.enorm.weight", i, d),
                      _norm("nextn.hnorm.weight", i, d), _norm("nextn.shared_head_norm.weight", i, d)]
    return plans
