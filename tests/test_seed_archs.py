"""The seed models' architectures through the hook: deepseek4 (DeepSeek-V4-Flash) and kimi-k3 (Kimi-K3).

Tiny synthetic GGUFs of each (llamapack.synth presets) give bit-exact logits through the expert hook, on
the GGUF-direct reader and on a built pack, with pools smaller than a layer's experts where the step allows.
deepseek4's hash-routed layers pick experts from a token-id table but still go through build_moe_ffn, so the
provider serves them too: every MoE layer acquires once per ubatch. See docs/archs.md.
"""
from __future__ import annotations

import dataclasses
import json
import math

import gguf
import numpy as np
import pytest

from hookutil import logits
from test_hook_bitexact import N_DECODE, N_PROMPT, model_path, poison_experts, small_pool, spec_for
from llamapack.pack import build_pack, verify
from llamapack.synth import PRESETS, write_model

SEED_ARCHS = ("deepseek4-tiny", "kimi-k3-tiny")
# role -> routed-expert type in every MoE layer, as in the seed GGUFs
EXPECTED_TYPES = {
    "deepseek4-tiny": {"gate": "MXFP4", "up": "MXFP4", "down": "MXFP4"},
    "kimi-k3-tiny": {"gate": "Q2_K", "up": "Q2_K", "down": "Q3_K"},
}
MOE_LAYERS = {"deepseek4-tiny": (0, 1, 2, 3), "kimi-k3-tiny": (1, 2, 3)}  # kimi-k3: layer 0 is dense


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("seed-archs")


def vanilla_logits(model_dir, preset: str, n_ubatch: int) -> np.ndarray:
    out = model_dir / f"{preset}-vanilla-{n_ubatch}.npy"
    if not out.exists():
        logits(spec_for(model_path(model_dir, preset), "vanilla", n_ubatch, out), model_dir, vanilla=True)
    return np.load(out)


def n_ubatches(n_ubatch: int) -> int:
    return math.ceil(N_PROMPT / n_ubatch) + N_DECODE


@pytest.mark.parametrize("n_ubatch", [1, 512])
@pytest.mark.parametrize("preset", SEED_ARCHS)
def test_hook_logits_equal_vanilla(preset, n_ubatch, model_dir, tmp_path):
    n_slots = small_pool(preset, n_ubatch)  # 4 of 16 slots when one token runs at a time
    want = vanilla_logits(model_dir, preset, n_ubatch)
    got, stats = logits(spec_for(model_path(model_dir, preset), "hook", n_ubatch, tmp_path / "hook.npy",
                                 n_slots=n_slots), tmp_path)

    assert want.shape == (N_PROMPT + N_DECODE, want.shape[1]) and np.isfinite(want).all()
    assert (want.std(axis=1) > 0.1).all() and len(set(want.argmax(axis=1).tolist())) > N_PROMPT // 2
    assert np.array_equal(got, want), f"max |diff| = {np.abs(got - want).max()}"
    # every MoE layer (deepseek4's hash-routed ones included) asked the provider once per ubatch
    assert stats["acquires"] == n_ubatches(n_ubatch) * len(MOE_LAYERS[preset])
    assert stats["n_slots"] == n_slots and stats["cache_misses"] > 0 and stats["cache_evictions"] > 0


@pytest.mark.parametrize("preset", SEED_ARCHS)
def test_poisoned_experts_are_never_read(preset, model_dir, tmp_path):
    """llama.cpp loads a copy whose routed-expert bytes are garbage; the provider serves the clean file."""
    clean = model_path(model_dir, preset)
    assert poison_experts(clean, tmp_path / "poisoned.gguf") > 0
    got, _ = logits(spec_for(tmp_path / "poisoned.gguf", "hook", 512, tmp_path / "h.npy", serve_from=str(clean),
                             n_slots=PRESETS[preset].n_expert), tmp_path)
    assert np.array_equal(got, vanilla_logits(model_dir, preset, 512))


def gguf_expert_table(path) -> dict[tuple[int, str], tuple[str, tuple[int, ...]]]:
    """(layer, role) -> (type name, ne) of the GGUF's routed-expert weights, read with gguf-py."""
    table = {}
    for t in gguf.GGUFReader(path).tensors:
        if t.name.endswith("_exps.weight"):
            layer, kind = t.name.split(".")[1:3]
            table[int(layer), kind.removeprefix("ffn_").removesuffix("_exps")] = (
                t.tensor_type.name, tuple(int(n) for n in t.shape))
    return table


@pytest.mark.parametrize("preset", SEED_ARCHS)
def test_pack_builds_verifies_and_serves(preset, model_dir, tmp_path):
    model = model_path(model_dir, preset)
    result = build_pack(model, tmp_path / f"{preset}.expert-pack", progress=False, safety_margin_mib=0)
    verify(result.pack_path, against=model, progress=False)

    with open(result.manifest_path) as f:
        manifest = json.load(f)
    table = {(layer["layer"], role["role"]): (role["ggml_type"], tuple(role["ne"]))
             for layer in manifest["layers"] for role in layer["roles"]}
    assert table == gguf_expert_table(model)  # only routed-expert weights: no router, hash table, shexp, bias
    assert {key: type_name for key, (type_name, _) in table.items()} == {
        (layer, role): type_name for layer in MOE_LAYERS[preset] for role, type_name in EXPECTED_TYPES[preset].items()}

    got, _ = logits(spec_for(model, "hook", 1, tmp_path / "pack.npy", pack=True, serve_from=result.pack_path,
                             n_slots=small_pool(preset, 1)), tmp_path)
    assert np.array_equal(got, vanilla_logits(model_dir, preset, 1))


def test_deepseek4_with_mtp_block_is_served(model_dir, tmp_path):
    base = PRESETS["deepseek4-tiny"]
    spec = dataclasses.replace(base, name="deepseek4-tiny-mtp", extra=dataclasses.replace(base.extra, mtp_layers=1))
    model = write_model(tmp_path / "mtp.gguf", spec, seed=0)
    want, _ = logits(spec_for(model, "vanilla", 1, tmp_path / "v.npy"), tmp_path, vanilla=True)
    assert np.array_equal(want, vanilla_logits(model_dir, "deepseek4-tiny", 1))  # the skipped block changes nothing
    # llama.cpp skips the MTP block (load_mtp off); the GGUF-direct layout still lists its experts, which
    # the provider accepts as a layer the model never asks for
    got, _ = logits(spec_for(model, "hook", 1, tmp_path / "h.npy", n_slots=4), tmp_path)
    assert np.array_equal(got, want)
