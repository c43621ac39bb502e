"""Helpers for tests that run llama.cpp: synthetic models and the logits worker in a subprocess."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

REPO = Path(__file__).resolve().parent.parent
WORKER = Path(__file__).resolve().parent / "logits_worker.py"
CACHE = Path(os.environ.get("LLAMAPACK_CACHE", Path.home() / ".cache" / "llamapack"))


def flip_byte(path, offset: int) -> None:
    """Corrupt one byte of a file in place (every bit flipped)."""
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0xFF]))


def vanilla_lib_dir() -> Path:
    """The unpatched libllama built by ``scripts/build_llama.py --vanilla-dir`` (required, never skipped)."""
    path = Path(os.environ.get("LLAMAPACK_VANILLA_LIB", CACHE / "vanilla"))
    if not (path / "libllama.so").exists():
        pytest.fail(f"no vanilla libllama in {path}: run `python scripts/build_llama.py --vanilla-dir {path}`")
    return path


def run_worker(spec: dict, tmp_path: Path, vanilla: bool = False, timeout: int = 600, lib_dir: Path | None = None) -> dict:
    """Run tests/logits_worker.py on ``spec``; returns its JSON result (logits in spec['out'] when written).

    The library: the vanilla build when ``vanilla``, else ``lib_dir`` when given, else the installed one.
    """
    spec_path = tmp_path / f"spec-{os.getpid()}-{len(list(tmp_path.glob('spec-*')))}.json"
    spec_path.write_text(json.dumps(spec))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p))
    env.pop("LLAMA_CPP_LIB_PATH", None)
    if vanilla:
        env["LLAMA_CPP_LIB_PATH"] = str(vanilla_lib_dir())
    elif lib_dir is not None:
        env["LLAMA_CPP_LIB_PATH"] = str(lib_dir)
    proc = subprocess.run([sys.executable, str(WORKER), str(spec_path)], capture_output=True, text=True,
                          env=env, timeout=timeout)
    if proc.returncode != 0:
        raise AssertionError(f"worker failed ({proc.returncode}):\n{proc.stderr[-4000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def logits(spec: dict, tmp_path: Path, vanilla: bool = False, lib_dir: Path | None = None) -> tuple[np.ndarray, dict]:
    result = run_worker(spec, tmp_path, vanilla=vanilla, lib_dir=lib_dir)
    return np.load(spec["out"]), result


def models_with_packs(folder: Path, presets) -> dict:
    """preset -> (gguf path, pack path): each synthetic model (seed 0) with its expert pack beside it."""
    from llamapack.pack import build_pack
    from llamapack.synth import write_model

    out = {}
    for preset in presets:
        path = write_model(folder / f"{preset}.gguf", preset, seed=0)
        out[preset] = (Path(path), Path(build_pack(path, progress=False, safety_margin_mib=0).pack_path))
    return out


def smallest_pool(preset: str, n_ubatch: int) -> int:
    """The fewest slots a ubatch of ``n_ubatch`` tokens of this preset may need (one layer's working set)."""
    from llamapack.synth import PRESETS

    spec = PRESETS[preset]
    return min(spec.n_expert, spec.n_expert_used * n_ubatch)


def cached_vanilla(folder: Path, vanilla_spec):
    """(preset, n_ubatch) -> vanilla logits, computed on first use; ``vanilla_spec(preset, n_ubatch, out)``
    gives the worker spec."""
    cache = {}

    def get(preset: str, n_ubatch: int) -> np.ndarray:
        if (preset, n_ubatch) not in cache:
            spec = vanilla_spec(preset, n_ubatch, folder / f"{preset}-{n_ubatch}.npy")
            cache[preset, n_ubatch] = logits(spec, folder, vanilla=True)[0]
        return cache[preset, n_ubatch]

    return get
