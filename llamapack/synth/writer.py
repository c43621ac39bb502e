"""Streams a synthetic model to disk: header, metadata and tensor infos first, then each tensor's
bytes generated chunk by chunk, so even the ~17 GB preset never sits in RAM."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
from gguf import GGUFWriter
from tqdm import tqdm

from .archs import arch_module
from .init import SynthContext
from .plan import TensorPlan
from .presets import PRESETS
from .spec import ModelSpec
from .vocab import KNOWN_VOCAB_SIZES, Tokenizer, find_vocab, load_tokenizer

QUANTIZATION_VERSION = 2


def resolve_spec(preset_or_spec: str | ModelSpec) -> ModelSpec:
    if isinstance(preset_or_spec, ModelSpec):
        return preset_or_spec
    try:
        return PRESETS[preset_or_spec]
    except KeyError:
        raise ValueError(f"unknown preset {preset_or_spec!r} (have: {', '.join(PRESETS)})") from None


def plan_model(preset_or_spec: str | ModelSpec, n_vocab: int | None = None) -> list[TensorPlan]:
    """Every tensor the model will hold, in file order (n_vocab defaults to the vocab's known size)."""
    spec = resolve_spec(preset_or_spec)
    return arch_module(spec.arch).plan_tensors(spec, n_vocab or KNOWN_VOCAB_SIZES[spec.vocab])


def write_model(path: str | os.PathLike[str], preset_or_spec: str | ModelSpec, seed: int = 0,
                router_skew: float = 0.0, progress: bool = False) -> Path:
    """Write a synthetic GGUF for a preset name or spec; the same seed always gives the same bytes."""
    if router_skew < 0:
        raise ValueError("router_skew must be >= 0")
    spec = resolve_spec(preset_or_spec)
    tokenizer = load_tokenizer(find_vocab(spec.vocab))
    plans = plan_model(spec, tokenizer.n_tokens)
    ctx = SynthContext(seed=seed, n_embd=spec.n_embd, router_skew=router_skew)
    path = Path(path)
    partial = path.with_name(path.name + ".partial")
    try:
        _write(partial, spec, tokenizer, plans, ctx, progress)
        os.replace(partial, path)
    finally:
        partial.unlink(missing_ok=True)
    return path


def _write(path: Path, spec: ModelSpec, tokenizer: Tokenizer, plans: list[TensorPlan], ctx: SynthContext,
           progress: bool) -> None:
    writer = GGUFWriter(path, spec.arch)
    try:
        _add_metadata(writer, spec, tokenizer, ctx)
        for plan in plans:
            writer.add_tensor_info(plan.name, plan.ne[::-1], np.dtype(np.float32), plan.nbytes,
                                   raw_dtype=plan.qtype)
        writer.write_header_to_file(path)
        writer.write_kv_data_to_file()
        writer.write_ti_data_to_file()
        (out,) = writer.fout
        writer.write_padding(out, out.tell())
        total = sum(p.nbytes for p in plans)
        with tqdm(total=total, unit="B", unit_scale=True, desc=spec.name, disable=not progress) as bar:
            for plan in plans:
                _write_tensor(writer, out, plan, ctx, bar)
    finally:
        writer.close()


def _add_metadata(w: GGUFWriter, spec: ModelSpec, tokenizer: Tokenizer, ctx: SynthContext) -> None:
    w.add_name(spec.name)
    w.add_description(f"llamapack synthetic model, random weights (seed={ctx.seed}, "
                      f"router_skew={ctx.router_skew:g})")
    w.add_quantization_version(QUANTIZATION_VERSION)
    arch_module(spec.arch).add_metadata(w, spec)
    for e in tokenizer.entries:
        w.add_key_value(e.key, e.value, e.vtype, sub_type=e.sub_type)


def _write_tensor(writer: GGUFWriter, out, plan: TensorPlan, ctx: SynthContext, bar: tqdm) -> None:
    written = 0
    for chunk in plan.chunks(ctx):
        out.write(chunk)
        written += chunk.nbytes
        bar.update(chunk.nbytes)
    if written != plan.nbytes:
        raise RuntimeError(f"{plan.name}: wrote {written} bytes, planned {plan.nbytes}")
    writer.write_padding(out, plan.nbytes)
