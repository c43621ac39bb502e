"""Routing traces: which experts a trained model's router chose, per token and MoE layer.

A trace is an ``.npz`` file with
  * ``experts``   int16 ``[n_tokens, n_layers, top_k]``: the router's top-k expert ids, layer by layer;
  * ``request``   int32 ``[n_tokens]``: the request each token belongs to (a request's tokens are consecutive);
  * ``prefill``   bool  ``[n_tokens]``: True for prompt tokens, False for generated ones;
  * ``n_experts`` int scalar: routed experts per layer;
  * ``source``    str scalar (optional): where the trace comes from.
``load_trace`` is the one reader; it checks every field and names what is wrong.
"""
from __future__ import annotations

import json
import os
import zipfile
from dataclasses import dataclass, field

import numpy as np

from ..errors import LlamapackError


class TraceError(LlamapackError):
    """A routing trace (or the file it is converted from) is malformed."""


@dataclass(frozen=True, eq=False)
class RoutingTrace:
    experts: np.ndarray
    request: np.ndarray
    prefill: np.ndarray
    n_experts: int
    source: str = ""
    origin: str = field(default="<memory>", compare=False)  # the file it was read from, for messages

    def __post_init__(self):
        check_trace(self)

    @property
    def n_tokens(self) -> int:
        return self.experts.shape[0]

    @property
    def n_layers(self) -> int:
        return self.experts.shape[1]

    @property
    def top_k(self) -> int:
        return self.experts.shape[2]

    @property
    def n_requests(self) -> int:
        return len(self.request_bounds())

    def request_bounds(self) -> list[tuple[int, int]]:
        """(first token, end token) of each request, in order."""
        if self.n_tokens == 0:
            return []
        starts = [0, *(np.flatnonzero(np.diff(self.request)) + 1).tolist()]
        return list(zip(starts, [*starts[1:], self.n_tokens]))

    def select(self, phase: str = "all") -> "RoutingTrace":
        """The tokens of one phase: ``decode``, ``prefill`` or ``all``."""
        if phase == "all":
            return self
        if phase not in ("decode", "prefill"):
            raise ValueError(f"phase must be decode, prefill or all, not {phase!r}")
        keep = self.prefill if phase == "prefill" else ~self.prefill
        return RoutingTrace(self.experts[keep], self.request[keep], self.prefill[keep], self.n_experts,
                            self.source, self.origin)

    def steps(self) -> list[list[tuple[int, int]]]:
        """The cache's view: one step per (token, layer), in order, each the (layer, expert) keys of that step
        (as the provider acquires them in decode, one token and one layer at a time)."""
        layers = np.arange(self.n_layers)
        return [list(zip([layer] * self.top_k, row.tolist()))
                for token in self.experts for layer, row in zip(layers, token)]


def check_trace(trace: RoutingTrace) -> None:
    """Raise TraceError naming the first field that breaks the format (module docstring)."""
    where = trace.origin
    experts, request, prefill = trace.experts, trace.request, trace.prefill
    if experts.ndim != 3 or experts.dtype != np.int16:
        raise TraceError(f"{where}: experts must be int16 [n_tokens, n_layers, top_k], got {experts.dtype} "
                         f"{list(experts.shape)}")
    n_tokens = experts.shape[0]
    for name, array, dtype in (("request", request, np.int32), ("prefill", prefill, np.bool_)):
        if array.shape != (n_tokens,) or array.dtype != dtype:
            raise TraceError(f"{where}: {name} must be {np.dtype(dtype)} [{n_tokens}] (one per token), got "
                             f"{array.dtype} {list(array.shape)}")
    if not isinstance(trace.n_experts, (int, np.integer)) or trace.n_experts < 1:
        raise TraceError(f"{where}: n_experts must be a positive integer, got {trace.n_experts!r}")
    if experts.size and (experts.min() < 0 or experts.max() >= trace.n_experts):
        token, layer, _ = np.argwhere((experts < 0) | (experts >= trace.n_experts))[0]
        raise TraceError(f"{where}: token {token} layer {layer} has expert id outside [0, {trace.n_experts})")
    if experts.shape[2] > trace.n_experts:
        raise TraceError(f"{where}: top_k {experts.shape[2]} exceeds n_experts {trace.n_experts}")
    duplicates = np.any(np.diff(np.sort(experts, axis=2), axis=2) == 0, axis=2)
    if duplicates.any():
        token, layer = np.argwhere(duplicates)[0]
        raise TraceError(f"{where}: token {token} layer {layer} names an expert twice in its top-k")
    if n_tokens and len(np.unique(request)) != 1 + np.count_nonzero(np.diff(request)):
        raise TraceError(f"{where}: the tokens of a request must be consecutive (request ids reappear)")


def open_npz(path: str) -> np.lib.npyio.NpzFile:
    """``np.load`` of an ``.npz`` archive without pickles; TraceError when the file holds a single ``.npy`` array."""
    data = np.load(path, allow_pickle=False)
    if not isinstance(data, np.lib.npyio.NpzFile):
        raise TraceError(f"{path}: an .npy array, not an .npz archive")
    return data


def load_trace(path: str | os.PathLike) -> RoutingTrace:
    """Read and check a trace ``.npz`` (module docstring); TraceError names the file and the bad field."""
    path = os.fspath(path)
    try:
        with open_npz(path) as data:
            missing = [name for name in ("experts", "request", "prefill", "n_experts") if name not in data.files]
            if missing:
                raise TraceError(f"{path}: not a routing trace (missing {', '.join(missing)})")
            fields = {name: data[name] for name in ("experts", "request", "prefill", "n_experts")}
            source = str(data["source"]) if "source" in data.files else ""
    except TraceError:
        raise
    except (OSError, ValueError, EOFError, zipfile.BadZipFile) as exc:
        raise TraceError(f"{path}: cannot read a routing trace ({exc})") from None
    n_experts = fields.pop("n_experts")
    if n_experts.shape != () or n_experts.dtype.kind not in "iu":
        raise TraceError(f"{path}: n_experts must be an integer scalar")
    return RoutingTrace(**fields, n_experts=int(n_experts), source=source, origin=path)


def save_trace(trace: RoutingTrace, path: str | os.PathLike) -> None:
    """Write ``trace`` as a compressed ``.npz`` (via a temporary file, so a reader never sees half of one)."""
    path = os.fspath(path)
    tmp = f"{path}.tmp-{os.getpid()}.npz"
    try:
        np.savez_compressed(tmp, experts=trace.experts, request=trace.request, prefill=trace.prefill,
                            n_experts=np.int64(trace.n_experts), source=np.str_(trace.source))
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def trace_from_granite_json(path: str | os.PathLike, source: str = "") -> RoutingTrace:
    """Convert a per-token router trace in the JSON layout of ``shared/routing/*.trace.json``
    (``prompts.NAME.{prefill,decode}[token][layer] = top-k ids``, with ``num_experts``): one request per prompt,
    its prefill tokens then its decode tokens, prompts in file order."""
    path = os.fspath(path)
    try:
        with open(path) as handle:
            document = json.load(handle)
        n_experts = int(document["num_experts"])
        rows, request, prefill = [], [], []
        for index, prompt in enumerate(document["prompts"].values()):
            for phase in ("prefill", "decode"):
                tokens = prompt[phase]
                rows += tokens
                request += [index] * len(tokens)
                prefill += [phase == "prefill"] * len(tokens)
        experts = np.array(rows, dtype=np.int64)
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        raise TraceError(f"{path}: not a per-token router trace ({type(exc).__name__}: {exc})") from None
    if experts.ndim != 3:
        raise TraceError(f"{path}: every token must list the same number of layers and top-k ids")
    if experts.size and (experts.min() < 0 or experts.max() >= n_experts):
        raise TraceError(f"{path}: an expert id is outside [0, {n_experts})")
    return RoutingTrace(experts.astype(np.int16), np.array(request, dtype=np.int32), np.array(prefill, dtype=bool),
                        n_experts, source or document.get("model", ""), path)
