"""The bit-exact contract on CPU: logits through the hook equal vanilla llama.cpp's, compared exactly.

Vanilla is the unpatched libllama of the pinned commit (built by scripts/build_llama.py --vanilla-dir),
loaded in its own process. Both sides run with use_extra_bufts=False: llama.cpp's CPU repack re-lays
Q4_0/Q4_K/IQ4_NL/Q8_0 weights out for other SIMD kernels whose sums round differently, while the slot
pool holds the GGUF's own bytes (see README, "What bit-exact means").
"""
from __future__ import annotations

import shutil

import gguf
import numpy as np
import pytest

from hookutil import logits, run_worker
from hookutil import smallest_pool as small_pool  # noqa: F401 - also imported by test_seed_archs
from llamapack.synth import PRESETS, write_model

ARCH_PRESETS = ("qwen3moe-tiny", "deepseek2-tiny", "deepseek2-tiny-fused", "gpt-oss-tiny", "mixtral-tiny")
N_PROMPT, N_DECODE = 64, 32


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("models")


def model_path(model_dir, preset: str):
    path = model_dir / f"{preset}.gguf"
    if not path.exists():
        write_model(path, preset, seed=0)
    return path


def spec_for(model, mode: str, n_ubatch: int, out, **extra) -> dict:
    return dict(model=str(model), mode=mode, n_ubatch=n_ubatch, n_prompt=N_PROMPT, n_decode=N_DECODE,
                out=str(out), **extra)


@pytest.mark.parametrize("n_ubatch", [1, 7, 512])
@pytest.mark.parametrize("preset", ARCH_PRESETS)
def test_hook_logits_equal_vanilla(preset, n_ubatch, model_dir, tmp_path):
    model = model_path(model_dir, preset)
    n_slots = small_pool(preset, n_ubatch)
    want, _ = logits(spec_for(model, "vanilla", n_ubatch, tmp_path / "vanilla.npy"), tmp_path, vanilla=True)
    got, stats = logits(spec_for(model, "hook", n_ubatch, tmp_path / "hook.npy", n_slots=n_slots), tmp_path)

    assert want.shape == (N_PROMPT + N_DECODE, want.shape[1]) and np.isfinite(want).all()
    assert np.array_equal(got, want), f"max |diff| = {np.abs(got - want).max()}"
    # the pool really was exercised: ids remapped into fewer slots than experts, slots reused
    assert stats["n_slots"] == n_slots
    assert stats["cache_misses"] > 0 and stats["cache_evictions"] > 0
    if n_slots < PRESETS[preset].n_expert:
        assert stats["cache_evictions"] >= stats["acquires"] // 2


@pytest.mark.parametrize("preset", ["qwen3moe-tiny", "gpt-oss-tiny"])
def test_patched_library_without_provider_is_vanilla(preset, model_dir, tmp_path):
    model = model_path(model_dir, preset)
    want, _ = logits(spec_for(model, "vanilla", 7, tmp_path / "v.npy"), tmp_path, vanilla=True)
    got, _ = logits(spec_for(model, "vanilla", 7, tmp_path / "p.npy"), tmp_path, vanilla=False)
    assert np.array_equal(got, want)


def poison_experts(src, dst) -> int:
    """Copy a GGUF with every routed-expert weight byte replaced by garbage; returns bytes poisoned."""
    shutil.copyfile(src, dst)
    reader = gguf.GGUFReader(src)
    rng = np.random.default_rng(1234)
    poisoned = 0
    with open(dst, "r+b") as f:
        for t in reader.tensors:
            if t.name.endswith(("_exps.weight",)):
                f.seek(t.data_offset)
                f.write(rng.integers(0, 256, t.n_bytes, dtype=np.uint8).tobytes())
                poisoned += t.n_bytes
    return poisoned


@pytest.mark.parametrize("preset", ["qwen3moe-tiny", "mixtral-tiny"])
def test_poisoned_experts_are_never_read(preset, model_dir, tmp_path):
    """llama.cpp loads the poisoned copy; the provider serves the clean file: logits still equal vanilla."""
    clean = model_path(model_dir, preset)
    poisoned = tmp_path / "poisoned.gguf"
    assert poison_experts(clean, poisoned) > 0
    want, _ = logits(spec_for(clean, "vanilla", 7, tmp_path / "v.npy"), tmp_path, vanilla=True)
    got, _ = logits(spec_for(poisoned, "hook", 7, tmp_path / "h.npy", serve_from=str(clean),
                             n_slots=PRESETS[preset].n_expert), tmp_path)
    assert np.array_equal(got, want)
    # and the poison is real: vanilla on the poisoned file computes something else (or NaN)
    bad, _ = logits(spec_for(poisoned, "vanilla", 7, tmp_path / "b.npy"), tmp_path, vanilla=True)
    assert not np.array_equal(bad, want)


def test_lazy_experts_without_provider_refuse_to_decode(model_dir, tmp_path):
    model = model_path(model_dir, "qwen3moe-tiny")
    result = run_worker(spec_for(model, "lazy_no_provider", 7, tmp_path / "x.npy"), tmp_path)
    assert result["decode_error"] == "llama_decode returned -1"


def test_warmup_is_refused_while_a_provider_is_attached(model_dir, tmp_path):
    model = model_path(model_dir, "qwen3moe-tiny")
    want, _ = logits(spec_for(model, "vanilla", 7, tmp_path / "v.npy"), tmp_path, vanilla=True)
    got, result = logits(spec_for(model, "hook", 7, tmp_path / "h.npy", n_slots=16, warmup=True), tmp_path)
    assert result["warmup_error"] == "llama_decode returned -1"
    assert np.array_equal(got, want)  # and normal decoding afterwards is unaffected


@pytest.mark.parametrize("fault", ["io", "bad_slot"])
def test_provider_failure_fails_the_decode_then_recovers(fault, model_dir, tmp_path):
    model = model_path(model_dir, "qwen3moe-tiny")
    want, _ = logits(spec_for(model, "vanilla", 7, tmp_path / "v.npy"), tmp_path, vanilla=True)
    spec = spec_for(model, "hook", 7, tmp_path / "h.npy", n_slots=16, fault=fault, fault_at=3)
    got, result = logits(spec, tmp_path)
    assert result["decode_error"] == "llama_decode returned -3"
    if fault == "io":
        assert "PackIOError" in result["provider_error"] and "provider failed" in result["native_error"]
    else:
        assert "provider returned slot id 19" in result["native_error"]
    # the failed ubatch left nothing behind: the same request afterwards is bit-exact again
    assert np.array_equal(got, want)
