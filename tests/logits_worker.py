"""Run one model once and save its logits: a 64-token prompt, then greedy decode steps.

Run as a subprocess (``python tests/logits_worker.py SPEC.json``) because one process can load only one
libllama: the vanilla library comes in through LLAMA_CPP_LIB_PATH, the patched one is the installed one.

Modes: ``vanilla`` (whatever libllama is loaded, no hook), ``hook`` (patched libllama, experts left on disk,
served from ``serve_from``, default the model itself, by the provider named in ``provider``: ``reference``
(default) or ``streaming``, whose StreamingSettings fields come from ``streaming``, with ``n_slots``).
"""
from __future__ import annotations

import json
import resource
import sys
from pathlib import Path

# llama_cpp before numpy: a libllama linked with a static C++ runtime crashes loading a model when numpy
# loaded the shared one first (docs/hook.md); build_llama.py now links the shared runtime.
import llama_cpp  # noqa: F401  isort: skip
import numpy as np

PROMPT_TEXT = ("The quick brown fox jumps over the lazy dog while seven wizards quietly brew a strange "
               "potion; meanwhile, 1234 numbers, commas, and punctuation marks! ")


def prompt_tokens(llm, n_tokens: int) -> list[int]:
    tokens = llm.tokenize(PROMPT_TEXT.encode(), add_bos=True)
    while len(tokens) < n_tokens:
        tokens += llm.tokenize(PROMPT_TEXT.encode(), add_bos=False)
    return tokens[:n_tokens]


def load(spec: dict):
    """Load the model as the spec says; returns (llm, provider or None)."""
    import llama_cpp

    from llamapack.compat import model_params_override

    kwargs = dict(model_path=spec["model"], n_ctx=spec.get("n_ctx", 256), n_batch=512,
                  n_gpu_layers=spec.get("n_gpu_layers", 0),
                  n_ubatch=spec["n_ubatch"], logits_all=spec.get("logits_all", True),  # False: the last rows only
                  n_threads=spec.get("n_threads", 2),
                  n_threads_batch=spec.get("n_threads", 2), verbose=False, seed=0)
    # CPU: repack off on both sides (see test_hook_bitexact). Layers offloaded to a GPU are never repacked:
    # there the default stands, as in llamapack.Llama.
    gpu_build = llama_cpp.llama_supports_gpu_offload()
    overrides = {} if gpu_build and spec.get("n_gpu_layers", 0) else {"use_extra_bufts": spec.get("repack", False)}
    with model_params_override(**overrides):
        if spec["mode"] == "vanilla" and spec.get("cpu_moe"):  # --cpu-moe (with --no-repack unless repack)
            from llamapack.compat import cpu_moe

            with cpu_moe(use_extra_bufts=spec.get("repack", False)):
                return llama_cpp.Llama(**kwargs), None
        if spec["mode"] == "vanilla":
            return llama_cpp.Llama(**kwargs), None
        from llamapack import native
        from llamapack.provider.reference import ReferenceProvider

        with native.lazy_experts_load():
            llm = llama_cpp.Llama(**kwargs)
    if spec["mode"] == "lazy_no_provider":
        return llm, None
    from llamapack.pack import GgufDirectReader, PackReader

    source = spec.get("serve_from", spec["model"])
    if spec.get("provider", "reference") == "streaming":
        return llm, streaming_provider(llm, spec, source)
    reader = PackReader(source, model=spec["model"]) if spec.get("pack") else GgufDirectReader(source)
    provider = ReferenceProvider(native.model_ptr(llm._model), native.context_ptr(llm._ctx), reader,
                                 n_slots=spec["n_slots"], device=spec.get("device", -1))
    return llm, provider


def streaming_provider(llm, spec: dict, source: str, read_fn=None):
    """The streaming provider serving ``source``: StreamingSettings fields from spec['streaming'], n_slots."""
    from llamapack import native
    from llamapack.pack import GgufDirectReader, PackReader
    from llamapack.provider.streaming import StreamingProvider, StreamingSettings

    settings = StreamingSettings(n_slots=spec["n_slots"], **spec.get("streaming", {}))
    io = dict(direct_io=settings.direct_io, read_fn=read_fn)
    reader = PackReader(source, model=spec["model"], **io) if spec.get("pack") else GgufDirectReader(source, **io)
    n_used = int(llm.metadata[f"{llm.metadata['general.architecture']}.expert_used_count"])
    return StreamingProvider(native.model_ptr(llm._model), native.context_ptr(llm._ctx), reader, settings,
                             n_ubatch=spec["n_ubatch"], n_expert_used=n_used, device=spec.get("device", -1),
                             read_fn=read_fn)


def inject_fault(provider, kind: str, at_acquire: int) -> None:
    """Make the provider's ``at_acquire``-th acquire fail: raise (``io``) or return a bad slot id (``bad_slot``)."""
    from llamapack.errors import PackIOError

    real_acquire = provider.acquire
    calls = {"n": 0}

    def acquire(layer, ids):
        calls["n"] += 1
        if calls["n"] == at_acquire:
            if kind == "io":
                raise PackIOError(f"injected EIO at layer {layer}")
            return np.full(len(ids), provider.n_slots + 3, dtype=np.int32)
        return real_acquire(layer, ids)

    provider.acquire = acquire


def greedy_logits(llm, prompt: list[int], n_decode: int) -> np.ndarray:
    llm.reset()
    llm.eval(prompt)
    rows = [llm.scores[: llm.n_tokens].copy()]
    for _ in range(n_decode):
        next_token = int(np.argmax(llm.scores[llm.n_tokens - 1]))
        llm.eval([next_token])
        rows.append(llm.scores[llm.n_tokens - 1: llm.n_tokens].copy())
    return np.concatenate(rows)


def run(spec: dict) -> dict:
    from llamapack import native

    llm, provider = load(spec)
    prompt = prompt_tokens(llm, spec["n_prompt"])
    result: dict = {}
    if spec.get("warmup"):  # warmup runs every expert at once: refused while a provider is attached
        llama_cpp.llama_set_warmup(llm._ctx.ctx, True)
        try:
            llm.eval(prompt[:1])
            result["warmup_error"] = None
        except RuntimeError as exc:
            result["warmup_error"] = str(exc)
        llama_cpp.llama_set_warmup(llm._ctx.ctx, False)
    if spec["mode"] == "lazy_no_provider" or "fault" in spec:
        if provider is not None:
            inject_fault(provider, spec["fault"], spec.get("fault_at", 3))
        try:
            llm.eval(prompt)
            result["decode_error"] = None
        except RuntimeError as exc:
            result["decode_error"] = str(exc)
        if provider is not None:
            result["native_error"] = native.last_error(native.context_ptr(llm._ctx))
            result["provider_error"] = repr(provider.error)
    if spec["mode"] == "lazy_no_provider":
        llm.close()
        return result
    logits = np.concatenate([greedy_logits(llm, prompt, spec["n_decode"])  # rounds: the same request again
                             for _ in range(spec.get("rounds", 1))])
    np.save(spec["out"], logits)
    result.update(n_rows=int(logits.shape[0]), max_rss_kib=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)
    if provider is not None:
        result.update(provider.stats() if callable(provider.stats) else provider.stats.as_dict())
        result.update(slot_bytes=provider.layout.slot_bytes, n_slots=provider.n_slots,
                      pool_bytes=provider.layout.pool_bytes)
        provider.close()
    llm.close()
    return result


if __name__ == "__main__":
    spec = json.loads(Path(sys.argv[1]).read_text())
    print(json.dumps(run(spec)))
