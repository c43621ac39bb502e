"""``llamapack demo``: make a small synthetic MoE model (once, cached), pack it, and run it both ways.

The reference run keeps every expert resident (plain llama.cpp, same library); the pack run serves the
experts from the expert pack through a slot pool holding half of all experts (LRU). The demo shows the
streamed text, speed and cache counters, and checks that tokens and logits are identical.
"""
from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import llama_cpp  # noqa: F401 - imported before numpy (see docs/hook.md: static C++ runtime)
import numpy as np

DEMO_PRESET = "qwen3moe-tiny"
PROMPT = "Once upon a time, in a small town by the sea,"


@dataclass(frozen=True)
class DemoResult:
    model: Path
    pack: Path
    text: str
    n_prompt: int
    n_generated: int
    prefill_tok_s: float
    decode_tok_s: float
    stats: dict
    tokens_identical: bool
    logits_identical: bool


def demo_dir() -> Path:
    return Path(os.environ.get("LLAMAPACK_CACHE", Path.home() / ".cache" / "llamapack")) / "demo"


def prepare(progress: bool = True) -> tuple[Path, Path]:
    """The demo model and its pack, made on first use."""
    from .pack import build_pack, default_pack_path, open_gguf
    from .synth import write_model

    model = demo_dir() / f"{DEMO_PRESET}.gguf"
    if not model.exists():
        model.parent.mkdir(parents=True, exist_ok=True)
        write_model(model, DEMO_PRESET, seed=0)
    pack = Path(default_pack_path(open_gguf(model)))
    if not Path(str(pack) + ".manifest.json").exists():
        build_pack(model, progress=progress, safety_margin_mib=0)
    return model, pack


def greedy(llm, prompt: list[int], n_tokens: int, on_token: Callable[[int], None] | None = None):
    """Greedy decode; returns (tokens, logits rows, prefill seconds, decode seconds)."""
    llm.reset()
    t0 = time.perf_counter()
    llm.eval(prompt)
    t1 = time.perf_counter()
    tokens, rows = [], [llm.scores[llm.n_tokens - 1].copy()]
    for _ in range(n_tokens):
        token = int(np.argmax(llm.scores[llm.n_tokens - 1]))
        tokens.append(token)
        if on_token:
            on_token(token)
        llm.eval([token])
        rows.append(llm.scores[llm.n_tokens - 1].copy())
    return tokens, np.stack(rows), t1 - t0, time.perf_counter() - t1


def run_demo(n_tokens: int = 48, echo: Callable[[str], None] = print, progress: bool = True) -> DemoResult:
    from .compat import model_params_override
    from .llama import Llama

    model, pack = prepare(progress)
    common = dict(n_ctx=256, n_batch=64, n_ubatch=2, n_threads=2, n_threads_batch=2, verbose=False)
    with model_params_override(use_extra_bufts=False):
        reference = llama_cpp.Llama(str(model), logits_all=True, **common)
    try:
        prompt = reference.tokenize(PROMPT.encode(), add_bos=True)
        want_tokens, want_logits, _, _ = greedy(reference, prompt, n_tokens)
    finally:
        reference.close()

    pieces: list[str] = []
    with Llama(str(model), pack=str(pack), cache_slots=32, logits_all=True, **common) as llm:
        def show(token: int) -> None:
            piece = llm.detokenize([token]).decode("utf-8", errors="replace")
            pieces.append(piece)
            echo(piece)

        tokens, logits, prefill_s, decode_s = greedy(llm, prompt, n_tokens, show)
        stats = llm.pack_stats()
    return DemoResult(model=model, pack=pack, text="".join(pieces), n_prompt=len(prompt), n_generated=len(tokens),
                      prefill_tok_s=len(prompt) / prefill_s, decode_tok_s=len(tokens) / decode_s, stats=stats,
                      tokens_identical=tokens == want_tokens, logits_identical=bool(np.array_equal(logits, want_logits)))
