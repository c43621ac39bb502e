"""Synthetic MoE generator: block encoders, presets, GGUF round trip, determinism, llama.cpp loading.

Writing needs the tokenizer vocab files (LLAMAPACK_VOCAB_DIR or ~/.cache/llamapack/vocab/); running
needs llama.cpp's shared library (LLAMA_CPP_LIB_PATH). Tests skip when either is missing.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
from pathlib import Path

import gguf
import numpy as np
import pytest
from click.testing import CliRunner
from gguf import GGMLQuantizationType as Q
from gguf.quants import dequantize

from llamapack.errors import PackFormatError
from llamapack.synth import PRESETS, TINY_PRESETS, expert_bytes, find_vocab, hottest_experts, plan_model, \
    total_bytes, write_model
from llamapack.synth.command import synth_command
from llamapack.synth.init import Router, SynthContext, TokenEmbedding
from llamapack.synth.plan import CHUNK_BYTES
from llamapack.synth.quant import RANDOM_BLOCK_TYPES, encode_floats, random_blocks
from llamapack.synth.vocab import load_tokenizer

PROMPT = b"The quick brown fox jumps over the lazy dog, then naps in the afternoon sun."


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture(scope="session")
def vocabs_present() -> None:
    try:
        for name in TINY_PRESETS:
            find_vocab(PRESETS[name].vocab)
    except PackFormatError as exc:
        pytest.skip(str(exc))


@pytest.fixture(scope="session")
def llama_cpp():
    """llama-cpp-python bound to the library at $LLAMA_CPP_LIB_PATH (or its bundled one)."""
    try:
        import llama_cpp
    except (ImportError, OSError, RuntimeError, FileNotFoundError) as exc:
        pytest.skip(f"llama.cpp library not loadable: {exc}")
    return llama_cpp


@pytest.fixture(scope="module", params=TINY_PRESETS)
def tiny(request, tmp_path_factory, vocabs_present):
    name = request.param
    path = write_model(tmp_path_factory.mktemp(name) / f"{name}.gguf", name, seed=0)
    return name, path


@pytest.fixture(scope="module")
def tiny_reader(tiny):
    name, path = tiny
    return name, gguf.GGUFReader(path)


# --- encoders ---------------------------------------------------------------------------------

@pytest.mark.parametrize("qtype", sorted(RANDOM_BLOCK_TYPES, key=lambda q: q.value), ids=lambda q: q.name)
def test_random_blocks_dequantize_to_requested_spread(qtype):
    weights = dequantize(random_blocks(np.random.default_rng(7), qtype, 3000, std=0.03), qtype)
    assert np.isfinite(weights).all()
    assert weights.std() == pytest.approx(0.03, rel=0.1)
    assert abs(weights.mean()) < 0.15 * weights.std()


def test_q8_0_encoder_round_trips():
    values = np.random.default_rng(1).standard_normal((4, 64)).astype(np.float32)
    decoded = dequantize(encode_floats(values, Q.Q8_0).reshape(-1), Q.Q8_0).reshape(values.shape)
    np.testing.assert_allclose(decoded, values, atol=np.abs(values).max() / 100)


# --- presets and plans ------------------------------------------------------------------------

def test_presets_are_frozen_and_tiny_ones_leave_room_for_a_slot_pool():
    spec = PRESETS["qwen3moe-tiny"]
    with pytest.raises(dataclasses.FrozenInstanceError):
        spec.n_layer = 5  # type: ignore[misc]
    for name in TINY_PRESETS:
        spec = PRESETS[name]
        assert spec.n_expert > 2 * spec.n_expert_used
        assert 64 <= spec.n_embd <= 256 and 2 <= spec.n_layer <= 4


def test_required_expert_types_appear():
    def expert_types(name):
        return {p.qtype for p in plan_model(name) if p.is_expert and p.name.endswith(".weight")}

    assert {Q.Q4_K, Q.Q6_K, Q.Q8_0, Q.F16} <= expert_types("qwen3moe-tiny")
    assert Q.MXFP4 in expert_types("gpt-oss-tiny")
    for name in TINY_PRESETS:
        assert len(expert_types(name)) >= 2, name


def test_30b_plan_matches_qwen3_30b_a3b_and_streams_in_chunks():
    plans = plan_model("qwen3moe-30b-a3b")
    assert 16.5e9 < total_bytes(plans) < 18.5e9
    experts = [p for p in plans if p.is_expert]
    assert len(experts) == 48 * 3 and {p.qtype for p in experts} == {Q.Q4_K}
    assert all(p.ne[2] == 128 for p in experts)
    assert {p.ne[:2] for p in experts} == {(2048, 768), (768, 2048)}
    biggest = max(plans, key=lambda p: p.nbytes)
    first = next(iter(biggest.chunks(SynthContext(seed=0, n_embd=2048))))
    assert first.nbytes <= CHUNK_BYTES < biggest.nbytes


def test_rss_preset_is_mostly_experts():
    plans = plan_model("qwen3moe-rss")
    assert expert_bytes(plans) >= 2.2 * 2**30
    assert total_bytes(plans) - expert_bytes(plans) < 256 * 2**20


def test_router_skew_makes_the_intended_experts_hot():
    n_embd, n_expert, top_k, n_tok = 256, 16, 4, 4096
    shares = {}
    for skew in (0.0, 2.0):
        ctx = SynthContext(seed=3, n_embd=n_embd, router_skew=skew)
        x = TokenEmbedding().rows(ctx, ctx.rng("tokens"), 0, n_tok, n_embd)
        x /= np.sqrt((x * x).mean(axis=1, keepdims=True))
        w = Router(layer=1, n_expert=n_expert).rows(ctx, ctx.rng("router"), 0, n_expert, n_embd)
        chosen = np.argsort(-(x @ w.T), axis=1)[:, :top_k]
        counts = np.bincount(chosen.ravel(), minlength=n_expert) / chosen.size
        shares[skew] = counts[hottest_experts(ctx, 1, n_expert)]
    uniform = 1 / n_expert
    assert shares[0.0].max() < 1.6 * uniform
    assert shares[2.0][0] > 2.5 * uniform
    assert shares[2.0][:4].sum() > 2 * shares[2.0][-4:].sum() + 0.3


def test_find_vocab_prefers_env_dir_and_explains_how_to_get_files(tmp_path, monkeypatch):
    (tmp_path / "ggml-vocab-foo.gguf").write_bytes(b"GGUF")
    monkeypatch.setenv("LLAMAPACK_VOCAB_DIR", str(tmp_path))
    assert find_vocab("foo") == tmp_path / "ggml-vocab-foo.gguf"
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    with pytest.raises(PackFormatError, match="scripts/build_llama.py"):
        find_vocab("nope")


def test_command_lists_presets_and_requires_output():
    result = CliRunner().invoke(synth_command, ["--list"])
    assert result.exit_code == 0
    assert all(name in result.output for name in PRESETS)
    assert CliRunner().invoke(synth_command, ["mixtral-tiny"]).exit_code == 2


# --- written files ----------------------------------------------------------------------------

def test_tiny_file_matches_its_plan(tiny_reader):
    name, reader = tiny_reader
    spec = PRESETS[name]
    assert reader.fields["general.architecture"].contents() == spec.arch
    assert reader.fields[f"{spec.arch}.expert_count"].contents() == spec.n_expert
    vocab = load_tokenizer(find_vocab(spec.vocab))
    assert reader.fields["tokenizer.ggml.pre"].contents() == vocab.value("tokenizer.ggml.pre").decode()
    assert len(reader.fields["tokenizer.ggml.tokens"].data) == vocab.n_tokens

    planned = {p.name: p for p in plan_model(spec, vocab.n_tokens)}
    written = {t.name: t for t in reader.tensors}
    assert written.keys() == planned.keys()
    for tensor_name, plan in planned.items():
        assert written[tensor_name].tensor_type == plan.qtype, tensor_name
        assert tuple(int(n) for n in written[tensor_name].shape) == plan.ne, tensor_name


def test_arch_specific_tensors(tiny_reader):
    name, reader = tiny_reader
    names = {t.name for t in reader.tensors}
    fields = reader.fields
    if name.startswith("deepseek2"):
        assert fields["deepseek2.leading_dense_block_count"].contents() >= 1
        assert fields["deepseek2.expert_group_count"].contents() > 1
        assert fields["deepseek2.expert_gating_func"].contents() == gguf.ExpertGatingFuncType.SIGMOID.value
        assert "blk.0.ffn_gate.weight" in names and "blk.0.ffn_gate_inp.weight" not in names
        assert {"blk.1.exp_probs_b.bias", "blk.1.ffn_up_shexp.weight", "blk.1.attn_k_b.weight"} <= names
        fused = name.endswith("fused")
        assert ("blk.1.ffn_gate_up_exps.weight" in names) == fused
        assert ("blk.1.ffn_gate_exps.weight" in names) == (not fused)
    if name == "gpt-oss-tiny":
        assert {"blk.0.attn_sinks.weight", "blk.0.ffn_gate_inp.bias", "blk.0.ffn_gate_exps.bias",
                "blk.0.ffn_up_exps.bias", "blk.0.ffn_down_exps.bias"} <= names
        assert fields["gpt-oss.attention.sliding_window"].contents() > 0


def test_tiny_file_is_deterministic_per_seed(tiny, tmp_path):
    name, path = tiny
    assert sha256(write_model(tmp_path / "again.gguf", name, seed=0)) == sha256(path)
    if name == "mixtral-tiny":
        assert sha256(write_model(tmp_path / "other.gguf", name, seed=1)) != sha256(path)
        skewed = write_model(tmp_path / "skewed.gguf", name, seed=0, router_skew=1.0)
        assert sha256(skewed) != sha256(path)
    assert not list(tmp_path.glob("*.partial"))


def test_tiny_model_runs_in_llama_cpp(tiny, llama_cpp):
    name, path = tiny
    model = llama_cpp.Llama(str(path), n_ctx=128, n_threads=2, logits_all=True, verbose=False)
    try:
        tokens = model.tokenize(PROMPT)
        assert len(tokens) > 8
        model.eval(tokens)
        logits = np.asarray(model.scores[:len(tokens)])
    finally:
        model.close()
    assert logits.shape[1] == load_tokenizer(find_vocab(PRESETS[name].vocab)).n_tokens
    assert np.isfinite(logits).all()
    assert (logits.std(axis=1) > 0.1).all()
    assert len(set(logits.argmax(axis=1).tolist())) > len(tokens) // 2
    assert not math.isclose(float(np.abs(logits[0] - logits[-1]).max()), 0.0)
