"""Model specs: one frozen dataclass instance per preset."""

from __future__ import annotations

from dataclasses import dataclass

from gguf import GGMLQuantizationType as Q


@dataclass(frozen=True)
class ExpertQuant:
    """Quant types of one layer's routed experts (gate and up always share a type)."""

    gate_up: Q
    down: Q


@dataclass(frozen=True)
class ModelSpec:
    name: str
    arch: str  # llama.cpp's general.architecture string
    vocab: str  # ggml-vocab-<vocab>.gguf supplies the tokenizer (see vocab.find_vocab)
    n_layer: int
    n_embd: int
    n_head: int
    n_head_kv: int
    head_dim: int  # deepseek2 ignores it: its MLA dims live in Deepseek2Params
    n_expert: int
    n_expert_used: int
    n_ff_exp: int
    expert_quant: tuple[ExpertQuant, ...]  # cycled over layers: layer i uses [i % len]
    dense_type: Q = Q.Q8_0  # attention, dense FFN, shared experts
    embd_type: Q = Q.Q8_0  # F32, F16 or Q8_0 (embeddings are real data, see init.TokenEmbedding)
    output_type: Q = Q.Q8_0
    context_length: int = 4096
    rope_freq_base: float = 10000.0
    rms_eps: float = 1e-6
    extra: object | None = None  # the arch module's own frozen params dataclass, if it has one
    description: str = ""

    def __post_init__(self) -> None:
        if not self.expert_quant:
            raise ValueError(f"{self.name}: expert_quant is empty")
        if not 0 < self.n_expert_used <= self.n_expert:
            raise ValueError(f"{self.name}: need 0 < n_expert_used <= n_expert")
        if self.n_head % self.n_head_kv:
            raise ValueError(f"{self.name}: n_head must be a multiple of n_head_kv")

    def expert_quant_for(self, layer: int) -> ExpertQuant:
        return self.expert_quant[layer % len(self.expert_quant)]
