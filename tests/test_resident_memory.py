"""Resident memory of a pack-mode process: the experts stay on disk, only the pool is resident.

qwen3moe-rss has 2.5 GiB of routed experts and ~140 MiB of everything else. The peak RSS (ru_maxrss, which
counts the mapped file pages llama.cpp touches) of the hook run must stay below the non-expert bytes plus
the pool plus a stated margin for the interpreter, numpy, libllama, KV cache and compute buffers; the
vanilla run of the same prompt (mmap, no repack) is measured beside it to show what the margin is not.
"""
from __future__ import annotations

import gguf
import pytest

from hookutil import run_worker
from llamapack.synth import write_model

MARGIN_MIB = 400  # python + numpy + llama_cpp + libllama/libggml text, KV cache (n_ctx 256), compute buffers
MIB = 1 << 20


@pytest.fixture(scope="module")
def rss_model(tmp_path_factory):
    return write_model(tmp_path_factory.mktemp("rss") / "qwen3moe-rss.gguf", "qwen3moe-rss", seed=0)


def split_bytes(path) -> tuple[int, int]:
    reader = gguf.GGUFReader(path)
    experts = sum(int(t.n_bytes) for t in reader.tensors if t.name.endswith("_exps.weight"))
    others = sum(int(t.n_bytes) for t in reader.tensors) - experts
    return experts, others


def test_pack_mode_rss_stays_below_non_experts_plus_pool(rss_model, tmp_path):
    expert_bytes, other_bytes = split_bytes(rss_model)
    assert expert_bytes >= 2 * (1 << 30)

    spec = dict(model=str(rss_model), n_ubatch=512, n_prompt=64, n_decode=16, n_slots=128)  # one layer's experts
    hook = run_worker(dict(spec, mode="hook", out=str(tmp_path / "h.npy")), tmp_path)
    vanilla = run_worker(dict(spec, mode="vanilla", out=str(tmp_path / "v.npy")), tmp_path, vanilla=True)

    hook_rss = hook["max_rss_kib"] * 1024
    bound = other_bytes + hook["pool_bytes"] + MARGIN_MIB * MIB
    print(f"\nexperts {expert_bytes / MIB:.0f} MiB, non-expert {other_bytes / MIB:.0f} MiB, "
          f"pool {hook['pool_bytes'] / MIB:.0f} MiB; peak RSS: hook {hook_rss / MIB:.0f} MiB "
          f"(bound {bound / MIB:.0f} MiB), vanilla {vanilla['max_rss_kib'] / 1024:.0f} MiB")
    assert hook["cache_misses"] > 0
    assert hook_rss < bound
    assert hook_rss < expert_bytes / 2  # far from what touching the experts costs
