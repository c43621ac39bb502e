"""Routing counts: how often a router picks each expert, and which experts it picks together, without order.

``RoutingCounts`` holds, over ``n_tokens`` tokens of one model:
  * ``heat``  float64 ``[n_layers, n_experts]``: tokens whose top-k (in that layer) held the expert;
  * ``pairs`` one float64 ``[n_pairs, 4]`` array per layer, rows ``(i, j, count, lift)`` with ``i < j``: tokens
    whose top-k held both, and ``lift = P(i and j) / (P(i) P(j))``; only the pairs a source kept (the shipped
    Qwen3 counts keep count >= 5 and lift >= 1.5, at most 2000 per layer by count), so a missing pair is
    "not notably co-activated", not "never";
  * ``top_k`` and ``n_tokens``; every layer's heat sums to ``top_k * n_tokens``.

Sources, all read by ``load_counts``:
  * the per-model JSON of ``shared/routing/*.counts.json`` (layers' ``heat`` and ``pairs [i, j, count, lift]``,
    ``k``, ``n_decode_tokens``), from the public GitHub repository doramirdor/mbolt
    (``results/colibri-119/coactivation_*.json``);
  * the compact ``.counts.npz`` converted from it (``save_counts``; heat, pair ids and counts; lifts are
    recomputed from them, which matches the JSON's two-decimal lifts);
  * a routing trace ``.npz`` (``counts_from_trace``: measured on its decode tokens);
  * a shipped short name: ``qwen3-30b-a3b``, ``qwen3-next-80b-a3b`` (counts in ``data/``) or
    ``granite-3.0-1b-a400m`` (counts of the shipped trace).
"""
from __future__ import annotations

import json
import os
import zipfile
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from .trace import RoutingTrace, TraceError, load_trace, open_npz

DATA_DIR = Path(__file__).resolve().parent / "data"
SHIPPED_COUNTS = {"qwen3-30b-a3b": "qwen3-30b-a3b.counts.npz", "qwen3-next-80b-a3b": "qwen3-next-80b-a3b.counts.npz"}
SHIPPED_TRACES = {"granite-3.0-1b-a400m": "granite-3.0-1b-a400m.npz"}

# the thresholds of the shipped Qwen3 counts' pairs (their JSON's "definitions"), used by counts_from_trace too
MIN_PAIR_COUNT = 5
MIN_PAIR_LIFT = 1.5
MAX_PAIRS_PER_LAYER = 2000


@dataclass(frozen=True, eq=False)
class RoutingCounts:
    heat: np.ndarray
    pairs: tuple[np.ndarray, ...]
    top_k: int
    n_tokens: int
    source: str = ""
    origin: str = field(default="<memory>", compare=False)  # the file it was read from, for messages

    def __post_init__(self):
        check_counts(self)

    @property
    def n_layers(self) -> int:
        return self.heat.shape[0]

    @property
    def n_experts(self) -> int:
        return self.heat.shape[1]

    def inclusion(self) -> np.ndarray:
        """``[n_layers, n_experts]``: the share of tokens whose top-k held each expert (rows sum to top_k)."""
        return self.heat / self.n_tokens

    def lift_matrix(self, dtype=np.float32) -> np.ndarray:
        """Dense ``[n_layers, n_experts, n_experts]`` lift, symmetric, 1 for pairs not listed (and the diagonal)."""
        lift = np.ones((self.n_layers, self.n_experts, self.n_experts), dtype=dtype)
        for layer, rows in enumerate(self.pairs):
            i, j = rows[:, 0].astype(np.intp), rows[:, 1].astype(np.intp)
            lift[layer, i, j] = lift[layer, j, i] = rows[:, 3]
        return lift


def check_counts(counts: RoutingCounts) -> None:
    """Raise TraceError naming the first field that breaks the description in the module docstring."""
    where, heat = counts.origin, counts.heat
    if not isinstance(counts.top_k, (int, np.integer)) or not isinstance(counts.n_tokens, (int, np.integer)) \
            or counts.top_k < 1 or counts.n_tokens < 1:
        raise TraceError(f"{where}: top_k and n_tokens must be positive integers, got {counts.top_k!r}, "
                         f"{counts.n_tokens!r}")
    if heat.ndim != 2 or heat.dtype != np.float64 or heat.shape[1] < counts.top_k:
        raise TraceError(f"{where}: heat must be float64 [n_layers, n_experts >= top_k], got {heat.dtype} "
                         f"{list(heat.shape)}")
    if not np.isfinite(heat).all() or heat.min() < 0 or heat.max() > counts.n_tokens:
        raise TraceError(f"{where}: heat must lie in [0, n_tokens={counts.n_tokens}]")
    sums = heat.sum(axis=1)
    bad = np.flatnonzero(np.abs(sums - counts.top_k * counts.n_tokens) > 1e-6 * counts.top_k * counts.n_tokens)
    if bad.size:
        raise TraceError(f"{where}: layer {bad[0]} heat sums to {sums[bad[0]]:g}, not top_k * n_tokens = "
                         f"{counts.top_k * counts.n_tokens}")
    if len(counts.pairs) != heat.shape[0]:
        raise TraceError(f"{where}: pairs must have one array per layer ({heat.shape[0]}), got {len(counts.pairs)}")
    for layer, rows in enumerate(counts.pairs):
        if rows.ndim != 2 or rows.shape[1] != 4:
            raise TraceError(f"{where}: layer {layer} pairs must be [n_pairs, 4] (i, j, count, lift), got "
                             f"{list(rows.shape)}")
        i, j = rows[:, 0], rows[:, 1]
        if rows.size and (i.min() < 0 or j.max() >= heat.shape[1] or (i >= j).any() or (i % 1).any() or (j % 1).any()):
            raise TraceError(f"{where}: layer {layer} pairs need expert ids 0 <= i < j < {heat.shape[1]}")
        if rows.size and ((rows[:, 2] < 0).any() or (rows[:, 3] <= 0).any()):
            raise TraceError(f"{where}: layer {layer} pairs need count >= 0 and lift > 0")


def counts_from_trace(trace: RoutingTrace, phase: str = "decode", min_count: int = MIN_PAIR_COUNT,
                      min_lift: float = MIN_PAIR_LIFT, max_pairs: int = MAX_PAIRS_PER_LAYER) -> RoutingCounts:
    """Heat and pairs measured on a trace's ``phase`` tokens, with the shipped counts' pair thresholds."""
    part = trace.select(phase)
    if part.n_tokens == 0:
        raise TraceError(f"{trace.origin}: no {phase} tokens to count")
    onehot = np.zeros((part.n_tokens, part.n_layers, part.n_experts), dtype=np.float64)
    np.put_along_axis(onehot, part.experts.astype(np.intp), 1.0, axis=2)
    heat = onehot.sum(axis=0)
    together = np.einsum("tle,tlf->lef", onehot, onehot)
    pairs = []
    for layer in range(part.n_layers):
        i, j = np.triu_indices(part.n_experts, k=1)
        count = together[layer, i, j]
        with np.errstate(divide="ignore", invalid="ignore"):
            lift = count * part.n_tokens / (heat[layer, i] * heat[layer, j])
        keep = np.flatnonzero((count >= min_count) & (lift >= min_lift))
        keep = keep[np.argsort(-count[keep], kind="stable")][:max_pairs]
        pairs.append(np.stack([i[keep], j[keep], count[keep], lift[keep]], axis=1).astype(np.float64))
    return RoutingCounts(heat, tuple(pairs), part.top_k, part.n_tokens,
                         f"counts of the {phase} tokens of: {trace.source or trace.origin}", trace.origin)


def counts_from_json(path: str | os.PathLike) -> RoutingCounts:
    """Read the per-model counts JSON of ``shared/routing/*.counts.json`` (module docstring)."""
    path = os.fspath(path)
    try:
        with open(path) as handle:
            document = json.load(handle)
        layers = sorted(document["layers"], key=lambda layer: int(layer["layer"]))
        if [int(layer["layer"]) for layer in layers] != list(range(len(layers))):
            raise ValueError("layers must be numbered 0..n_layers-1 without gaps")
        heat = np.array([layer["heat"] for layer in layers], dtype=np.float64)
        pairs = tuple(np.array(layer["pairs"], dtype=np.float64).reshape(-1, 4) for layer in layers)
        top_k, n_tokens = int(document["k"]), int(document["n_decode_tokens"])
        source = f"{document.get('model', '')} {document.get('quant', '')}".strip()
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        raise TraceError(f"{path}: not a routing counts JSON ({type(exc).__name__}: {exc})") from None
    return RoutingCounts(heat, pairs, top_k, n_tokens, source, path)


def save_counts(counts: RoutingCounts, path: str | os.PathLike) -> None:
    """Write the compact ``.counts.npz``: integer heat, pair ids and counts (lifts are recomputed on reading)."""
    heat = np.rint(counts.heat)
    if not np.array_equal(heat, counts.heat):
        raise TraceError(f"{counts.origin}: only integer counts can be saved compactly")
    rows = np.concatenate([*counts.pairs, np.zeros((0, 4))])
    offsets = np.cumsum([0, *(len(layer) for layer in counts.pairs)])
    path = os.fspath(path)
    tmp = f"{path}.tmp-{os.getpid()}.npz"
    try:
        np.savez_compressed(tmp, heat=heat.astype(np.int32), pair_offsets=offsets.astype(np.int64),
                            pair_experts=rows[:, :2].astype(np.int16), pair_count=rows[:, 2].astype(np.int32),
                            top_k=np.int64(counts.top_k), n_tokens=np.int64(counts.n_tokens),
                            source=np.str_(counts.source))
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


COUNTS_FIELDS = ("heat", "pair_offsets", "pair_experts", "pair_count", "top_k", "n_tokens")


def _counts_from_npz(path: str, data) -> RoutingCounts:
    missing = [name for name in COUNTS_FIELDS if name not in data.files]
    if missing:
        raise TraceError(f"{path}: not a routing counts file (missing {', '.join(missing)})")
    heat, offsets, experts, count = (data[name] for name in COUNTS_FIELDS[:4])
    if heat.ndim != 2 or heat.dtype.kind not in "iu":
        raise TraceError(f"{path}: heat must be an integer [n_layers, n_experts] array")
    if offsets.shape != (heat.shape[0] + 1,) or offsets[0] != 0 or (np.diff(offsets) < 0).any() \
            or experts.shape != (offsets[-1], 2) or count.shape != (offsets[-1],):
        raise TraceError(f"{path}: pair_offsets, pair_experts and pair_count disagree in size")
    n_tokens, top_k = int(data["n_tokens"]), int(data["top_k"])
    heat = heat.astype(np.float64)
    pairs = []
    for layer, (start, end) in enumerate(zip(offsets[:-1], offsets[1:])):
        i, j = experts[start:end, 0].astype(np.intp), experts[start:end, 1].astype(np.intp)
        c = count[start:end].astype(np.float64)
        if i.size and (i.min() < 0 or j.max() >= heat.shape[1]):
            raise TraceError(f"{path}: layer {layer} pairs name an expert outside [0, {heat.shape[1]})")
        with np.errstate(divide="ignore", invalid="ignore"):
            lift = c * n_tokens / (heat[layer, i] * heat[layer, j])
        if not np.isfinite(lift).all():
            raise TraceError(f"{path}: layer {layer} pairs name an expert whose heat is 0")
        pairs.append(np.stack([i, j, c, lift], axis=1))
    source = str(data["source"]) if "source" in data.files else ""
    return RoutingCounts(heat, tuple(pairs), top_k, n_tokens, source, path)


def resolve_shipped(name_or_path: str | os.PathLike) -> str:
    """A shipped short name's file in ``data/`` (counts or trace), else the path unchanged."""
    name = os.fspath(name_or_path)
    shipped = SHIPPED_COUNTS.get(name) or SHIPPED_TRACES.get(name)
    return str(DATA_DIR / shipped) if shipped else name


def load_counts(source: str | os.PathLike) -> RoutingCounts:
    """Counts from a counts JSON, a ``.counts.npz``, a routing trace ``.npz`` (its decode tokens) or a shipped
    short name (module docstring); TraceError names the file and what is wrong."""
    path = resolve_shipped(source)
    if path.endswith(".json"):
        return counts_from_json(path)
    try:
        with open_npz(path) as data:
            if "experts" in data.files:
                is_trace = True
            else:
                is_trace = False
                counts = _counts_from_npz(path, data)
    except TraceError:
        raise
    except (OSError, ValueError, EOFError, zipfile.BadZipFile) as exc:
        raise TraceError(f"{path}: cannot read routing counts ({exc})") from None
    return counts_from_trace(load_trace(path)) if is_trace else counts
