"""``llamapack.Llama`` is a drop-in ``llama_cpp.Llama``: the same calls give the same results, exactly.

The vanilla side loads inside ``model_params_override(use_extra_bufts=False)``, as the pack side does
(llama.cpp's CPU repack would round differently). Both live in this one process on the same patched
library; only the pack side has a provider attached.
"""
from __future__ import annotations

import llama_cpp  # before numpy (see docs/hook.md: static C++ runtime)

import numpy as np
import pytest

import llamapack
from llamapack.compat import model_params_override
from llamapack.pack import build_pack, load_manifest
from llamapack.run import expert_read_bytes
from llamapack.synth import write_model

PARAMS = dict(n_ctx=512, n_threads=2, n_threads_batch=2, logits_all=True, verbose=False)
PROMPT = "The quick brown fox jumps over the lazy dog because"
MESSAGES = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Tell me about foxes."}]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    path = write_model(tmp_path_factory.mktemp("dropin") / "m.gguf", "qwen3moe-tiny", seed=0)
    build_pack(path, progress=False, safety_margin_mib=0)
    return str(path)


@pytest.fixture(scope="module")
def pair(model):
    """(vanilla llama_cpp.Llama, llamapack.Llama serving experts from the pack), with the same settings."""
    with model_params_override(use_extra_bufts=False):
        vanilla = llama_cpp.Llama(model, **PARAMS)
    packed = llamapack.Llama(model, pack=True, **PARAMS)
    yield vanilla, packed
    vanilla.close()
    packed.close()


def same(pair, call):
    """``call`` on both models; returns its (equal) result."""
    want, got = call(pair[0]), call(pair[1])
    assert got == want
    return got


def completion(llm, **kw):
    out = llm.create_completion(PROMPT, max_tokens=16, **kw)
    return out["choices"], out["usage"]


def test_create_completion_greedy(pair):
    choices, usage = same(pair, lambda llm: completion(llm, temperature=0))
    assert usage["completion_tokens"] == 16 and choices[0]["text"]


def test_create_completion_seeded_sampling(pair):
    first = same(pair, lambda llm: completion(llm, temperature=0.8, seed=1234))
    assert same(pair, lambda llm: completion(llm, temperature=0.8, seed=1234)) == first  # deterministic given seed
    assert same(pair, lambda llm: completion(llm, temperature=0.8, seed=99)) != first  # and it does sample


def test_create_chat_completion(pair):
    def chat(llm):
        out = llm.create_chat_completion(MESSAGES, max_tokens=12, temperature=0)
        return out["choices"], out["usage"]

    def chat_stream(llm):
        return [(c["choices"][0]["delta"], c["choices"][0]["finish_reason"])
                for c in llm.create_chat_completion(MESSAGES, max_tokens=12, temperature=0, stream=True)]

    choices, _ = same(pair, chat)
    chunks = same(pair, chat_stream)
    assert len(chunks) > 2
    assert "".join(delta.get("content", "") for delta, _ in chunks) == choices[0]["message"]["content"]


def test_tokenize_detokenize(pair):
    tokens = same(pair, lambda llm: llm.tokenize(PROMPT.encode(), add_bos=True))
    assert len(tokens) > 5
    assert same(pair, lambda llm: llm.detokenize(tokens)) == PROMPT.encode()


def test_eval_scores_bit_identical(pair):
    vanilla, packed = pair
    tokens = vanilla.tokenize(PROMPT.encode())
    rows = []
    for llm in pair:
        llm.reset()
        llm.eval(tokens)
        llm.eval([42])  # one decode step after the prompt batch
        rows.append(np.array(llm.scores[:llm.n_tokens]))
    assert rows[0].shape == (len(tokens) + 1, vanilla.n_vocab())
    assert np.array_equal(rows[0], rows[1])


def test_pack_stats_consistent(pair, model):
    vanilla, packed = pair
    packed.create_completion(PROMPT, max_tokens=4, temperature=0)
    stats = packed.pack_stats()
    assert stats["acquires"] > 0 and stats["cache_hits"] + stats["cache_misses"] > 0
    assert stats["hit_rate"] == stats["cache_hits"] / (stats["cache_hits"] + stats["cache_misses"])
    assert 0 <= stats["hit_rate"] <= 1
    assert stats["cache_evictions"] <= stats["cache_misses"] and stats["io_errors"] == 0
    manifest, _ = load_manifest(model.removesuffix(".gguf") + ".expert-pack.manifest.json")
    assert expert_read_bytes(stats) == stats["cache_misses"] * manifest.layout.expert_stride
    assert stats["n_slots"] == 16 and stats["gguf_direct"] is False  # default: one layer's experts
    assert vanilla is not packed and not hasattr(vanilla, "pack_stats")


def test_close_and_context_manager_release_the_provider(model):
    llm = llamapack.Llama(model, pack=True, **PARAMS)
    llm.create_completion(PROMPT, max_tokens=2, temperature=0)
    assert llm.pack_stats()["acquires"] > 0
    llm.close()
    assert llm.pack_stats() == {}  # decided: after close the provider is gone and its stats with it
    llm.close()  # and close is idempotent

    with llamapack.Llama(model, gguf_direct=True, **PARAMS) as llm:
        llm.create_completion(PROMPT, max_tokens=2, temperature=0)
        assert llm.pack_stats()["gguf_direct"] is True
    assert llm.pack_stats() == {}


def test_without_pack_it_is_llama_cpp(model):
    plain, reference = llamapack.Llama(model, **PARAMS), llama_cpp.Llama(model, **PARAMS)
    try:
        assert plain.pack_stats() == {}
        want, got = completion(reference, temperature=0), completion(plain, temperature=0)
        assert got == want
        assert np.array_equal(plain.scores[:plain.n_tokens], reference.scores[:reference.n_tokens])
    finally:
        plain.close()
        reference.close()


def test_prefetch_settings_reach_the_provider(model, pair):
    """Every StreamingSettings field of the drop-in is a named parameter: one llama_cpp.Llama would take in
    its **kwargs is silently dropped (prefetch_top once was)."""
    import inspect

    from llamapack.provider.settings import StreamingSettings

    named = inspect.signature(llamapack.Llama.__init__).parameters
    missing = [f for f in StreamingSettings.__dataclass_fields__ if f != "n_slots" and f not in named]
    assert missing == []
    with llamapack.Llama(model, pack=True, cache_slots=4, n_ubatch=1, prefetch=True, prefetch_top=1,
                         prefetch_slots=3, **PARAMS) as llm:
        want = pair[0].create_completion(PROMPT, max_tokens=8, temperature=0)["choices"][0]["text"]
        assert llm.create_completion(PROMPT, max_tokens=8, temperature=0)["choices"][0]["text"] == want
        stats = llm.pack_stats()
    assert (stats["prefetch_top"], stats["prefetch_slots"]) == (1, 3) and stats["lookahead_keys"] > 0


def test_vocab_only_with_a_pack_loads_the_vocabulary(model, pair):
    llm = llamapack.Llama(model, pack=True, vocab_only=True, verbose=False)
    try:
        assert llm.tokenize(PROMPT.encode()) == pair[0].tokenize(PROMPT.encode())
        assert llm.pack_stats() == {}
    finally:
        llm.close()


def test_pickling_keeps_pack_mode_and_its_settings(model, pair):
    import pickle

    packed = llamapack.Llama(model, pack=True, cache_slots=24, read_splits=2, verify_pack_sha256=False, **PARAMS)
    try:
        copy = pickle.loads(pickle.dumps(packed))
    finally:
        packed.close()
    try:
        assert copy.pack_settings == packed.pack_settings
        assert copy.pack_stats()["n_slots"] == 24
        greedy = dict(max_tokens=8, temperature=0)
        assert copy.create_completion(PROMPT, **greedy)["choices"][0]["text"] == \
            pair[0].create_completion(PROMPT, **greedy)["choices"][0]["text"]
        assert expert_read_bytes(copy.pack_stats()) > 0  # served from the pack, not a full load
    finally:
        copy.close()
