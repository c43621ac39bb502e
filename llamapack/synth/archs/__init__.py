"""One module per llama.cpp architecture; each exposes ARCH, add_metadata(w, spec), plan_tensors(spec, n_vocab)."""

from __future__ import annotations

from types import ModuleType

from . import deepseek2, deepseek4, gpt_oss, kimi_k3, llama_moe, qwen3moe

ARCHS: dict[str, ModuleType] = {m.ARCH: m for m in (qwen3moe, deepseek2, gpt_oss, llama_moe, deepseek4, kimi_k3)}


def arch_module(arch: str) -> ModuleType:
    try:
        return ARCHS[arch]
    except KeyError:
        raise ValueError(f"no synthetic generator for arch {arch!r} (have: {', '.join(sorted(ARCHS))})") from None
