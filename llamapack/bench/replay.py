"""Trace replay (benchmark only): drive the streaming provider with a recorded routing trace's experts in
place of the router's choice, so the cache, the SSD reads, the copies and the GPU compute see how a trained
model routes, on a synthetic model of the trace's shape.

The substitution happens in the benchmark worker's process alone, in libllama's remap op
(``llama_expert_bench_replay_set``, given the request's rows at each ``start_request``), before the native hot
path or the provider sees the ids: per MoE layer and ubatch, row t of the router's ids (token t of the ubatch) is
replaced by the trace's top-k of the matching token for that layer. ``RoutingReplay.experts_for`` is the same
rule in Python (its reference, used by the tests). The rest of the graph is untouched: the router's gate
weights still scale the outputs, now of other experts, so logits are not the model's (runs are labelled
"replayed routing" and have no bit-exact column). Only the benchmark calls that API.

Token mapping: bench request r replays trace request ``r mod n_requests``; its first ``n_prompt`` tokens
take that request's prefill rows, the rest its decode rows, each cycled when the bench needs more of them
than the trace holds.

Priming (``+warm`` runs, ``priming_requests``): the trace requests no measured prompt replays, each cut to its own
rows (never cycled), so that the warm start learns from other requests than those it is measured on.
"""
from __future__ import annotations

import numpy as np

from ..errors import LlamapackError
from ..routing.trace import RoutingTrace


class ReplayError(LlamapackError):
    """A trace that does not fit the model it should be replayed on, or a replay used out of order."""


def check_trace_fits(trace: RoutingTrace, n_layers: int, n_experts: int, top_k: int, where: str) -> None:
    """Raise ReplayError unless the trace has the model's MoE layers, experts per layer and top-k."""
    theirs, ours = (trace.n_layers, trace.n_experts, trace.top_k), (n_layers, n_experts, top_k)
    if theirs != ours:
        raise ReplayError(f"{trace.origin}: routing of {theirs[0]} layers x {theirs[1]} experts, top-{theirs[2]} "
                          f"cannot replay on {where} ({ours[0]} MoE layers x {ours[1]} experts, top-{ours[2]}): "
                          f"use a model of the trace's shape")


def priming_requests(trace: RoutingTrace, n_measured: int, max_requests: int, prompt_tokens: int,
                     decode_tokens: int) -> list[dict]:
    """The requests a ``+warm`` run's priming session serves: trace requests that none of the ``n_measured``
    measured prompts replays (they replay requests ``0 .. n_measured - 1`` mod ``n_requests``; 0 for a trace of
    other requests), the first ``max_requests`` of them, each ``{"request", "n_prompt", "decode_tokens"}`` with a
    prompt of at most ``prompt_tokens`` of its prefill rows and at most ``decode_tokens`` of its decode rows
    (never more than the request holds, so no row is cycled). ReplayError when no request is left."""
    if min(max_requests, prompt_tokens, decode_tokens) < 1:
        raise ReplayError("priming needs at least one request, one prompt token and one decode token")
    bounds = trace.request_bounds()
    replayed = {r % len(bounds) for r in range(n_measured)} if bounds else set()
    free = [index for index in range(len(bounds)) if index not in replayed]
    if not free:
        raise ReplayError(f"{trace.origin}: its {len(bounds)} request(s) are all replayed by the {n_measured} measured "
                          "prompts, so a priming session would learn the future: give a trace of other requests "
                          "(--warm-routing; e.g. `llamapack trace synth` with another --seed)")
    chosen = []
    for index in free[:max_requests]:
        first, end = bounds[index]
        n_prefill = int(trace.prefill[first:end].sum())
        n_decode = end - first - n_prefill
        chosen.append(dict(request=index, n_prompt=max(1, min(prompt_tokens, n_prefill or 1)),
                           decode_tokens=max(1, min(decode_tokens, n_decode or 1))))
    return chosen


class RoutingReplay:
    """Rows of a trace handed out per request, token and layer (pure: no provider, no I/O)."""

    def __init__(self, trace: RoutingTrace, layers: list[int]):
        if trace.n_layers != len(layers):
            raise ReplayError(f"{trace.origin}: {trace.n_layers} layers in the trace, {len(layers)} MoE layers served")
        if trace.n_tokens == 0:
            raise ReplayError(f"{trace.origin}: the trace holds no token")
        self.trace = trace
        self._position = {layer: index for index, layer in enumerate(layers)}
        self._first_layer = layers[0]
        self._requests = trace.request_bounds()
        self._rows: np.ndarray | None = None   # the current request's rows, prefill then decode
        self._n_prompt = 0
        self._cursor = 0                      # tokens of the current request evaluated, the current ubatch's included
        self.substituted = 0                  # ids replaced so far (a count for the report)

    def start_request(self, index: int, n_prompt: int) -> None:
        """The next tokens are a new request from an empty context: ``n_prompt`` prompt tokens, then decode."""
        first, end = self._requests[index % len(self._requests)]
        prefill = self.trace.prefill[first:end]
        rows = self.trace.experts[first:end]
        self._prompt_rows, self._decode_rows = rows[prefill], rows[~prefill]
        if len(self._prompt_rows) == 0:
            self._prompt_rows = self._decode_rows
        if len(self._decode_rows) == 0:
            self._decode_rows = self._prompt_rows
        self._n_prompt, self._cursor = n_prompt, 0

    def _row(self, token: int) -> np.ndarray:
        if token < self._n_prompt:
            return self._prompt_rows[token % len(self._prompt_rows)]
        return self._decode_rows[(token - self._n_prompt) % len(self._decode_rows)]

    def experts_for(self, layer: int, n_tokens: int) -> np.ndarray:
        """The trace's ids for ``layer`` of the ubatch of ``n_tokens`` tokens now computed, flattened as the
        router's ids are ([n_tokens, top_k] row-major). The first MoE layer of a ubatch moves the cursor; a later
        layer given fewer tokens (llama.cpp's last layer keeps only the tokens it outputs) gets the last ones."""
        if not hasattr(self, "_prompt_rows"):
            raise ReplayError("replay: start_request must be called before the first ubatch")
        if layer == self._first_layer:
            self._cursor += n_tokens
        position = self._position[layer]
        # llama.cpp's last layer computes only the tokens whose outputs are wanted (the ubatch's last ones)
        tokens = range(self._cursor - n_tokens, self._cursor)
        rows = np.array([self._row(t)[position] for t in tokens], dtype=np.int32).reshape(n_tokens, self.trace.top_k)
        self.substituted += rows.size
        return rows.ravel()


def install(provider, trace: RoutingTrace) -> RoutingReplay:
    """Make ``provider`` (a StreamingProvider) serve the trace's experts instead of the router's; returns the
    replay, whose ``start_request`` the caller calls before each request."""
    layers = list(provider._layers)
    check_trace_fits(trace, len(layers), provider._reader.layout.num_experts, provider.n_expert_used,
                     "this model")
    from .. import native

    replay = RoutingReplay(trace, layers)
    start_request = replay.start_request

    def start_native_request(index: int, n_prompt: int) -> None:
        start_request(index, n_prompt)
        native.set_bench_replay(provider._ctx, replay._prompt_rows, replay._decode_rows, n_prompt)

    replay.start_request = start_native_request  # this instance only
    return replay
