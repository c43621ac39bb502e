"""The preset catalogue.

Tiny presets write and run in about a second on 2 CPU cores. They use small vocabularies (gpt-2 BPE,
50k, or llama-spm, 32k) rather than each model's real 100k+ one, which would dominate their size and
make gguf-py's reader take seconds; the big presets keep the real one (qwen2 for Qwen3). The
tokenizer's pre-type comes with the copied vocab. K-quant rows need multiples of 256, hence n_embd
256 wherever K-quants appear.
"""

from __future__ import annotations

from gguf import GGMLQuantizationType as Q

from .archs.deepseek2 import Deepseek2Params
from .archs.deepseek4 import Deepseek4Params
from .archs.gpt_oss import GptOssParams
from .archs.kimi_k3 import KimiK3Params
from .spec import ExpertQuant, ModelSpec

Q4K_Q6K = ExpertQuant(gate_up=Q.Q4_K, down=Q.Q6_K)
Q4K = ExpertQuant(gate_up=Q.Q4_K, down=Q.Q4_K)
Q8 = ExpertQuant(gate_up=Q.Q8_0, down=Q.Q8_0)
F16 = ExpertQuant(gate_up=Q.F16, down=Q.F16)

QWEN3MOE_TINY = ModelSpec(
    name="qwen3moe-tiny", arch="qwen3moe", vocab="gpt-2",
    n_layer=4, n_embd=256, n_head=4, n_head_kv=2, head_dim=64,
    n_expert=16, n_expert_used=4, n_ff_exp=256,
    expert_quant=(Q4K_Q6K, Q8, F16, ExpertQuant(gate_up=Q.Q5_K, down=Q.Q8_0)),
    output_type=Q.Q6_K, rope_freq_base=1e6,
    description="qwen3moe, 4 layers x 16 experts top-4; experts Q4_K/Q6_K, Q8_0, F16, Q5_K/Q8_0 by layer",
)

DEEPSEEK2_TINY = ModelSpec(
    name="deepseek2-tiny", arch="deepseek2", vocab="llama-spm",
    n_layer=3, n_embd=256, n_head=4, n_head_kv=1, head_dim=64,
    n_expert=16, n_expert_used=4, n_ff_exp=256,
    expert_quant=(Q8, Q4K_Q6K),
    extra=Deepseek2Params(n_layer_dense_lead=1, n_expert_groups=4, n_group_used=2, q_lora_rank=0),
    description="deepseek2 MLA, 1 dense + 2 MoE layers, 16 experts in 4 groups (2 used) top-4, "
                "sigmoid + exp_probs_b, 1 shared expert; experts Q4_K/Q6_K and Q8_0",
)

DEEPSEEK2_TINY_FUSED = ModelSpec(
    name="deepseek2-tiny-fused", arch="deepseek2", vocab="llama-spm",
    n_layer=3, n_embd=256, n_head=4, n_head_kv=1, head_dim=64,
    n_expert=16, n_expert_used=4, n_ff_exp=256,
    expert_quant=(F16, Q4K_Q6K),
    extra=Deepseek2Params(n_layer_dense_lead=1, n_expert_groups=4, n_group_used=2, q_lora_rank=128,
                          fused_gate_up=True),
    description="deepseek2-tiny with merged ffn_gate_up_exps (Q4_K, F16) and q_lora attention",
)

GPT_OSS_TINY = ModelSpec(
    name="gpt-oss-tiny", arch="gpt-oss", vocab="gpt-2",
    n_layer=4, n_embd=256, n_head=4, n_head_kv=2, head_dim=64,
    n_expert=16, n_expert_used=4, n_ff_exp=256,
    expert_quant=(ExpertQuant(gate_up=Q.MXFP4, down=Q.MXFP4), Q8),
    rope_freq_base=150000.0, rms_eps=1e-5,
    extra=GptOssParams(sliding_window=32),
    description="gpt-oss, 4 layers (SWA 32 on even layers) x 16 biased experts top-4; MXFP4 and Q8_0 experts",
)

MIXTRAL_TINY = ModelSpec(
    name="mixtral-tiny", arch="llama", vocab="llama-spm",
    n_layer=3, n_embd=256, n_head=8, n_head_kv=2, head_dim=32,
    n_expert=8, n_expert_used=2, n_ff_exp=512,
    expert_quant=(Q4K_Q6K, ExpertQuant(gate_up=Q.Q2_K, down=Q.Q3_K), F16),
    output_type=Q.Q6_K, rms_eps=1e-5,
    description="llama + experts (Mixtral), 3 layers x 8 experts top-2; Q4_K/Q6_K, Q2_K/Q3_K, F16 experts",
)

DEEPSEEK4_TINY = ModelSpec(
    name="deepseek4-tiny", arch="deepseek4", vocab="gpt-2",
    n_layer=4, n_embd=256, n_head=4, n_head_kv=1, head_dim=128,
    n_expert=16, n_expert_used=4, n_ff_exp=256,
    expert_quant=(ExpertQuant(gate_up=Q.MXFP4, down=Q.MXFP4),),
    extra=Deepseek4Params(),
    description="DeepSeek-V4-Flash shape: 4 layers (2 hash-routed, compress ratios 0/4/128/4) x 16 MXFP4 "
                "experts top-4, sqrt-softplus routing, 1 shared expert, hyper-connections",
)

KIMI_K3_TINY = ModelSpec(
    name="kimi-k3-tiny", arch="kimi-k3", vocab="gpt-2",
    n_layer=4, n_embd=256, n_head=4, n_head_kv=1, head_dim=64,
    n_expert=16, n_expert_used=4, n_ff_exp=256,
    expert_quant=(ExpertQuant(gate_up=Q.Q2_K, down=Q.Q3_K),),
    extra=KimiK3Params(),
    description="Kimi-K3 shape: 3 KDA + 1 MLA layers, 1 dense + 3 latent-MoE layers x 16 experts top-4 "
                "(Q2_K gate/up, Q3_K down), sigmoid routing, 1 shared expert, attention residuals",
)

QWEN3MOE_RSS = ModelSpec(
    name="qwen3moe-rss", arch="qwen3moe", vocab="llama-spm",
    n_layer=24, n_embd=1024, n_head=8, n_head_kv=2, head_dim=128,
    n_expert=128, n_expert_used=8, n_ff_exp=512,
    expert_quant=(Q4K,), rope_freq_base=1e6,
    description="qwen3moe with 2.5 GiB of Q4_K routed experts and ~150 MB of everything else",
)

QWEN3MOE_30B_A3B = ModelSpec(
    name="qwen3moe-30b-a3b", arch="qwen3moe", vocab="qwen2",
    n_layer=48, n_embd=2048, n_head=32, n_head_kv=4, head_dim=128,
    n_expert=128, n_expert_used=8, n_ff_exp=768,
    expert_quant=(Q4K,), dense_type=Q.Q4_K, output_type=Q.Q6_K,
    context_length=40960, rope_freq_base=1e6,
    description="Qwen3-30B-A3B's shape (48 layers, 128 experts top-8), Q4_K experts, ~17 GB",
)

GRANITE_1B_A400M_SHAPE = ModelSpec(
    name="granite-1b-a400m-shape", arch="qwen3moe", vocab="gpt-2",
    n_layer=24, n_embd=1024, n_head=16, n_head_kv=8, head_dim=64,
    n_expert=32, n_expert_used=8, n_ff_exp=512,
    expert_quant=(F16,), rope_freq_base=1e4,
    description="IBM granite-3.0-1b-a400m's MoE shape (24 layers, 32 experts top-8, F16 experts as the "
                "real model's) as qwen3moe, ~2.5 GB: replays the shipped granite routing trace",
)

PRESETS: dict[str, ModelSpec] = {s.name: s for s in (
    QWEN3MOE_TINY, DEEPSEEK2_TINY, DEEPSEEK2_TINY_FUSED, GPT_OSS_TINY, MIXTRAL_TINY,
    DEEPSEEK4_TINY, KIMI_K3_TINY, QWEN3MOE_RSS, QWEN3MOE_30B_A3B, GRANITE_1B_A400M_SHAPE)}

# deepseek4-tiny is not listed: like the converted model it has one expert type (MXFP4) in every layer
TINY_PRESETS = ("qwen3moe-tiny", "deepseek2-tiny", "deepseek2-tiny-fused", "gpt-oss-tiny", "mixtral-tiny",
                "kimi-k3-tiny")
