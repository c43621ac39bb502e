"""Synthetic MoE GGUF models: random (valid) weights, a real tokenizer, loadable by vanilla llama.cpp.

    from llamapack.synth import write_model
    write_model("tiny.gguf", "qwen3moe-tiny", seed=0, router_skew=1.0)

Layout: spec (dataclasses), quant (block encoders), init (value draws, router skew), plan (tensor
plans and chunked byte streams), vocab (tokenizer files), writer (streaming GGUF writer),
archs/<arch> (metadata + tensor list per llama.cpp arch), presets, command (click CLI).
"""

from .init import hottest_experts
from .plan import TensorPlan, expert_bytes, total_bytes
from .presets import PRESETS, TINY_PRESETS
from .spec import ExpertQuant, ModelSpec
from .vocab import find_vocab
from .writer import plan_model, write_model

__all__ = ["PRESETS", "TINY_PRESETS", "ExpertQuant", "ModelSpec", "TensorPlan", "expert_bytes", "find_vocab",
           "hottest_experts", "plan_model", "total_bytes", "write_model"]
