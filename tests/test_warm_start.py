"""Warm start: the popularity file (format, every way it is refused), the policy's seed and preload, and
``llamapack.Llama`` runs that warm-start from the last session and stay bit-exact against vanilla llama.cpp.

The Llama runs happen in subprocesses (``python tests/test_warm_start.py SPEC.json``), as in
test_provider_streaming.
"""
if __name__ == "__main__":  # worker process: llama_cpp before numpy (see logits_worker)
    import llama_cpp  # noqa: F401  isort: skip

import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from llamapack.policy_next_use import NextUsePolicy
from llamapack.provider.warm import FORMAT, VERSION, WarmFile, default_warm_start, hottest, warm_folder

N_PROMPT, N_DECODE, N_THREADS = 24, 16, 1
PRESET = "qwen3moe-tiny"


# ---------------------------------------------------------------- the file


def warm_file(folder, identity="ab" * 32, layers=(0, 1), num_experts=4) -> WarmFile:
    return WarmFile(folder, identity, layers, num_experts)


def test_save_then_load_round_trips_and_hottest_orders_keys(tmp_path):
    file = warm_file(tmp_path)
    assert file.load() is None  # no file yet: silently cold
    assert file.save({0: [0.5, 0.0, 0.25, 1.0], 1: [0.125, 0.75], 7: [1.0]})  # layer 7 is not served: dropped
    assert file.path == tmp_path / f"{'ab' * 32}.json"
    assert file.load() == {0: [0.5, 0.0, 0.25, 1.0], 1: [0.125, 0.75]}
    assert hottest(file.load(), 4) == [(0, 3), (1, 1), (0, 0), (0, 2)]
    assert hottest({0: [0.0, 0.0]}, 5) == []  # never used: never preloaded
    assert not file.save({})  # nothing seen: nothing written
    assert json.loads(file.path.read_text())["format"] == FORMAT


@pytest.mark.parametrize("content,problem", [
    ("{not json", "is not JSON"),
    (json.dumps([1, 2]), f"is not a {FORMAT} v{VERSION} file"),
    (json.dumps(dict(format=FORMAT, version=VERSION + 1)), "is not a"),
    (json.dumps(dict(format=FORMAT, version=VERSION, identity="cd" * 32, num_experts=4, layers={})),
     "belongs to another pack"),
    (json.dumps(dict(format=FORMAT, version=VERSION, identity="ab" * 32, num_experts=8, layers={})),
     "does not have 4 experts per layer"),
    (json.dumps(dict(format=FORMAT, version=VERSION, identity="ab" * 32, num_experts=4, layers={"5": [0.1]})),
     "names layer '5'"),
    (json.dumps(dict(format=FORMAT, version=VERSION, identity="ab" * 32, num_experts=4, layers={"0": [1.5]})),
     "shares must be"),
    (json.dumps(dict(format=FORMAT, version=VERSION, identity="ab" * 32, num_experts=4,
                     layers={"0": [0.1] * 5})), "shares must be"),
    ('{"format": "llamapack.warm-start", "version": 1, "identity": "' + "ab" * 32 + '", "num_experts": 4, '
     '"layers": {"0": [NaN]}}', "shares must be"),
])
def test_a_bad_file_is_ignored_with_a_warning(tmp_path, caplog, content, problem):
    file = warm_file(tmp_path)
    file.path.write_text(content)
    with caplog.at_level(logging.WARNING, logger="llamapack.provider.warm"):
        assert file.load() is None
    assert problem in caplog.text and str(file.path) in caplog.text and "starts cold" in caplog.text


def test_an_unwritable_folder_is_a_warning(tmp_path, caplog):
    (tmp_path / "file").write_text("")
    file = warm_file(tmp_path / "file" / "below")
    with caplog.at_level(logging.WARNING, logger="llamapack.provider.warm"):
        assert not file.save({0: [0.5]})
    assert "cannot save" in caplog.text


def test_the_folder_and_the_default(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert warm_folder() == tmp_path / "llamapack" / "warm" and warm_folder(tmp_path / "x") == tmp_path / "x"
    monkeypatch.setenv("LLAMAPACK_WARM_START", "0")
    assert not default_warm_start()
    monkeypatch.setenv("LLAMAPACK_WARM_START", "1")
    assert default_warm_start()


# ---------------------------------------------------------------- the policy


def test_popularity_seed_and_preload():
    cold = NextUsePolicy(8)
    for _ in range(10):
        cold.acquire([(0, 1), (0, 2)])
        cold.acquire([(1, 0), (1, 2)])
    cold.acquire([(0, 1), (0, 3)])
    shares = cold.popularity()
    assert shares[0][1] == pytest.approx(1.0) and 0 < shares[0][3] < shares[0][2] < 1 and shares[0][0] == 0
    warm = NextUsePolicy(4)
    warm.seed(shares)
    assert warm.frequency((0, 1)) > warm.frequency((0, 2)) > 0 and warm.frequency((0, 0)) == 0
    loads = warm.preload(hottest(shares, 10))  # more keys than slots: the free slots, hottest first
    assert [(a.key, a.slot, a.hit) for a in loads] == [((0, 1), 0, False), ((1, 0), 1, False),
                                                      ((1, 2), 2, False), ((0, 2), 3, False)]
    assert warm.preload([(0, 3)]) == ()  # no free slot: nothing evicted to preload
    assert warm.abandon((1, 2))  # a failed preload read
    plan = warm.acquire([(0, 1), (0, 3)])  # a hit on a preloaded key; the miss takes the abandoned slot
    assert plan.hits == 1 and plan.evictions == () and plan.slot_of((0, 3)) == 2
    plan = warm.acquire([(1, 0), (1, 3)])  # full: the victim is a preloaded key, the least popular one of layer 0
    assert plan.evictions[0].key == (0, 3) or plan.evictions[0].key == (0, 2)


def test_preload_without_seed_ranks_its_keys_first_out():
    policy = NextUsePolicy(3)
    policy.acquire([(0, 0)])
    assert [a.key for a in policy.preload([(1, 5), (1, 6)])] == [(1, 5), (1, 6)]
    plan = policy.acquire([(0, 0), (0, 1)])  # (1, 5) and (1, 6) were never used: p 0, evicted first
    assert plan.evictions[0].key in {(1, 5), (1, 6)}


# ---------------------------------------------------------------- Llama runs (worker side)


def llama_worker(spec: dict) -> dict:
    """One ``llamapack.Llama`` session: what the pool holds before the first token, the greedy logits, the
    counters, and the warnings logged; closing it saves the counts (when warm_start is on)."""
    from logits_worker import greedy_logits, prompt_tokens

    from llamapack.llama import Llama

    records = []
    handler = logging.Handler()
    handler.emit = lambda record: records.append(record.getMessage())
    logging.getLogger("llamapack").addHandler(handler)
    logging.getLogger("llamapack").setLevel(logging.INFO)
    kwargs = dict(n_ctx=256, n_batch=512, n_ubatch=1, logits_all=True, n_threads=N_THREADS,
                  n_threads_batch=N_THREADS, verbose=False, seed=0)
    with Llama(spec["model"], pack=spec["pack"], cache_slots=spec["n_slots"], **spec["llama"], **kwargs) as llm:
        before = llm.pack_stats()
        resident_before = len(llm._provider.policy.resident())
        prompt = prompt_tokens(llm, N_PROMPT)
        np.save(spec["out"], greedy_logits(llm, prompt, N_DECODE))
        after = llm.pack_stats()
    return dict(resident_before=resident_before, before=before, after=after, log=records)


def run_llama(spec: dict, tmp_path: Path) -> dict:
    from hookutil import REPO

    spec_path = tmp_path / f"warm-spec-{len(list(tmp_path.glob('warm-spec-*')))}.json"
    spec_path.write_text(json.dumps(spec))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p))
    env.pop("LLAMA_CPP_LIB_PATH", None)
    proc = subprocess.run([sys.executable, __file__, str(spec_path)], capture_output=True, text=True, env=env,
                          timeout=600)
    if proc.returncode != 0:
        raise AssertionError(f"worker failed ({proc.returncode}):\n{proc.stderr[-4000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    from hookutil import models_with_packs

    return models_with_packs(tmp_path_factory.mktemp("warm"), (PRESET,))[PRESET]


@pytest.fixture(scope="module")
def vanilla(model, tmp_path_factory):
    from hookutil import logits

    folder = tmp_path_factory.mktemp("warm-vanilla")
    spec = dict(model=str(model[0]), mode="vanilla", n_ubatch=1, n_prompt=N_PROMPT, n_decode=N_DECODE,
                out=str(folder / "v.npy"), n_threads=N_THREADS)
    return logits(spec, folder)[0]


def test_a_warm_started_session_fills_the_pool_and_stays_bit_exact(model, vanilla, tmp_path):
    """Session 1 starts cold and saves its counts at close; session 2 fills its pool with the hottest experts
    before the first token, hits more in its first request, and computes the same logits; with a RAM tier
    the tier is filled too (the pool's fill then copies from RAM: no SSD read for it)."""
    gguf, pack = model
    folder = tmp_path / "warm"
    spec = dict(model=str(gguf), pack=str(pack), n_slots=8, llama=dict(warm_start=True, warm_start_dir=str(folder)))
    cold = run_llama(dict(spec, out=str(tmp_path / "cold.npy")), tmp_path)
    assert cold["resident_before"] == 0 and np.array_equal(np.load(tmp_path / "cold.npy"), vanilla)
    files = list(folder.glob("*.json"))
    assert len(files) == 1 and json.loads(files[0].read_text())["layers"]

    warm = run_llama(dict(spec, out=str(tmp_path / "warm.npy")), tmp_path)
    assert warm["resident_before"] == 8 and np.array_equal(np.load(tmp_path / "warm.npy"), vanilla)
    assert any("warm start" in line and "8 hottest experts" in line for line in warm["log"])
    hits = {name: run["after"]["cache_hits"] - run["before"]["cache_hits"] for name, run in (("cold", cold),
                                                                                                  ("warm", warm))}
    assert hits["warm"] > hits["cold"], hits

    tier = run_llama(dict(spec, out=str(tmp_path / "tier.npy"), llama=dict(spec["llama"], ram_cache_mib=64)),
                     tmp_path)
    assert tier["resident_before"] == 8 and np.array_equal(np.load(tmp_path / "tier.npy"), vanilla)
    assert tier["before"]["ram_preloaded"] > 8 and tier["before"]["ram_misses"] == 0  # the pool's fill: RAM hits


def test_a_pool_of_every_expert_is_filled_layer_by_layer_even_when_warm_started(model, vanilla, tmp_path):
    """With a slot for every expert, the saved counts still seed the policy but the pool preload fills the
    pool, in layer order: each layer's experts take contiguous slots, so whole-pool graphs give each layer's
    matmuls a view of its own experts alone."""
    from llamapack.synth import PRESETS

    gguf, pack = model
    n_expert, n_layer = PRESETS[PRESET].n_expert, PRESETS[PRESET].n_layer
    spec = dict(model=str(gguf), pack=str(pack), n_slots=n_expert * n_layer,
                llama=dict(warm_start=True, warm_start_dir=str(tmp_path / "warm"), whole_pool_graphs=True))
    run_llama(dict(spec, out=str(tmp_path / "cold.npy")), tmp_path)
    warm = run_llama(dict(spec, out=str(tmp_path / "warm.npy")), tmp_path)
    assert np.array_equal(np.load(tmp_path / "warm.npy"), vanilla)
    assert warm["resident_before"] == n_expert * n_layer and warm["before"]["pool_preloaded"] == n_expert * n_layer
    assert not any("hottest experts" in line for line in warm["log"])
    assert warm["after"]["whole_pool_steps"] > 0 and warm["after"]["whole_pool_span"] == n_expert


def test_a_corrupt_file_starts_cold_with_a_warning_and_off_saves_nothing(model, vanilla, tmp_path):
    gguf, pack = model
    folder = tmp_path / "warm"
    spec = dict(model=str(gguf), pack=str(pack), n_slots=8, llama=dict(warm_start=True, warm_start_dir=str(folder)))
    run_llama(dict(spec, out=str(tmp_path / "a.npy")), tmp_path)
    saved = next(folder.glob("*.json"))
    saved.write_text(saved.read_text()[:-20])  # truncated
    run = run_llama(dict(spec, out=str(tmp_path / "b.npy")), tmp_path)
    assert run["resident_before"] == 0 and np.array_equal(np.load(tmp_path / "b.npy"), vanilla)
    assert any("is not JSON" in line and "starts cold" in line for line in run["log"])
    assert json.loads(saved.read_text())["format"] == FORMAT  # rewritten at close

    off = tmp_path / "off"
    run = run_llama(dict(spec, out=str(tmp_path / "c.npy"), llama=dict(warm_start=False, warm_start_dir=str(off))),
                    tmp_path)
    assert run["resident_before"] == 0 and not off.exists()


if __name__ == "__main__":
    print(json.dumps(llama_worker(json.loads(Path(sys.argv[1]).read_text()))))
