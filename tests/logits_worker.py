"""Run one model once and save its logits: a 64-token prompt, then greedy decode steps.

Run as a subprocess (``python tests/logits_worker.py SPEC.json``) because one process can load only one
libllama: the vanilla library comes in through LLAMA_CPP_LIB_PATH, the patched one is the installed one.

Modes: ``vanilla`` (whatever libllama is loaded, no hook), ``hook`` (patched libllama, experts left on disk,
served by the reference provider from ``serve_from``, default the model itself).
"""
from __future__ import annotations

import json
import resource
import sys
from pathlib import Path

import numpy as np

PROMPT_TEXT = ("The quick brown fox jumps over the lazy dog while seven wizards quietly brew a strange "
               "potion; meanwhile, 1234 numbers, commas, and punctuation marks! ")


def prompt_tokens(llm, n_tokens: int) -> list[int]:
    tokens = llm.tokenize(PROMPT_TEXT.encode(), add_bos=True)
    while len(tokens) < n_tokens:
        tokens += llm.tokenize(PROMPT_TEXT.encode(), add_bos=False)
    return tokens[:n_tokens]


def run(spec: dict) -> dict:
    import llama_cpp

    kwargs = dict(model_path=spec["model"], n_ctx=spec.get("n_ctx", 256), n_batch=512,
                  n_ubatch=spec["n_ubatch"], logits_all=True, n_threads=spec.get("n_threads", 2),
                  n_threads_batch=spec.get("n_threads", 2), verbose=False, seed=0)
    provider = None
    if spec["mode"] == "hook":
        from llamapack import native
        from llamapack.provider.reference import ReferenceProvider

        with native.lazy_experts_load():
            llm = llama_cpp.Llama(**kwargs)
        provider = ReferenceProvider(native.model_ptr(llm._model), native.context_ptr(llm._ctx),
                                     [spec.get("serve_from", spec["model"])], n_slots=spec["n_slots"])
    else:
        llm = llama_cpp.Llama(**kwargs)

    prompt = prompt_tokens(llm, spec["n_prompt"])
    llm.eval(prompt)
    rows = [llm.scores[: llm.n_tokens].copy()]
    for _ in range(spec["n_decode"]):
        next_token = int(np.argmax(llm.scores[llm.n_tokens - 1]))
        llm.eval([next_token])
        rows.append(llm.scores[llm.n_tokens - 1: llm.n_tokens].copy())
    logits = np.concatenate(rows)
    np.save(spec["out"], logits)
    result = {"n_rows": int(logits.shape[0]), "max_rss_kib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss}
    if provider is not None:
        s = provider.stats
        result.update(cache_hits=s.cache_hits, cache_misses=s.cache_misses, cache_evictions=s.cache_evictions,
                      read_bytes=s.read_bytes, acquires=s.acquires, slot_bytes=provider.layout.slot_bytes,
                      n_slots=provider.n_slots, pool_bytes=int(provider.pool.nbytes))
        provider.close()
    llm.close()
    return result


if __name__ == "__main__":
    spec = json.loads(Path(sys.argv[1]).read_text())
    print(json.dumps(run(spec)))
