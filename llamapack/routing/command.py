"""``llamapack trace``: routing traces (hit rates, the routing model, conversion); registered lazily by
llamapack/cli.py. The commands parse arguments and call ``llamapack.routing``."""
from __future__ import annotations

import json
import os

import click

from .counts import load_counts, resolve_shipped
from .hitrate import DEFAULT_FRACTIONS, POLICIES, check_request, hit_rates
from .model import RoutingModel
from .trace import RoutingTrace, load_trace, save_trace, trace_from_granite_json

def _open_trace(name: str) -> RoutingTrace:
    return load_trace(resolve_shipped(name))


def _fractions(ctx, param, value: str) -> tuple[float, ...]:
    try:
        fractions = tuple(float(v) for v in value.split(",") if v.strip())
        check_request(fractions, ["lru"])
    except ValueError:
        raise click.ClickException(f"--fractions: a comma-separated list of numbers in (0, 1], not {value!r}") from None
    return fractions


def _policies(ctx, param, value: str) -> tuple[str, ...]:
    names = tuple(v.strip() for v in value.split(",") if v.strip())
    unknown = [name for name in names if name not in POLICIES]
    if unknown or not names:
        raise click.ClickException(f"--policies: unknown policy {', '.join(unknown) or '(none given)'}; "
                                   f"known: {', '.join(POLICIES)}")
    return names


@click.group("trace")
def trace_group() -> None:
    """Routing traces: hit rates of the cache policies, the routing model, conversion."""


@trace_group.command("hitrate")
@click.argument("trace")
@click.option("--fractions", callback=_fractions, default=",".join(map(str, DEFAULT_FRACTIONS)), show_default=True,
              help="Cache sizes, as fractions of all (layer, expert) pairs.")
@click.option("--policies", callback=_policies, default=",".join(POLICIES), show_default=True)
@click.option("--phase", type=click.Choice(["decode", "prefill", "all"]), default="decode", show_default=True,
              help="Which tokens to replay.")
@click.option("--json", "as_json", is_flag=True, help='Print only {"fractions": [...], "policies": {...}}.')
@click.option("--png", type=click.Path(dir_okay=False), help="Also draw hit rate against cache fraction here.")
def hitrate_command(trace: str, fractions: tuple[float, ...], policies: tuple[str, ...], phase: str, as_json: bool,
                    png: str | None) -> None:
    """Hit rate of each cache policy on TRACE (a trace .npz or a shipped name: granite-3.0-1b-a400m), one
    cache step per (token, layer), one pool shared by all layers."""
    routing = _open_trace(trace)
    result = hit_rates(routing, fractions, policies, phase)
    if png:
        from .plot import plot_hit_rates

        title = (f"{os.path.basename(trace)}: {routing.n_layers} layers x {routing.n_experts} experts, "
                 f"top-{routing.top_k}, {routing.select(phase).n_tokens} {phase} tokens")
        if not plot_hit_rates(result, png, title):
            raise click.ClickException("--png needs matplotlib, which is not installed")
    if as_json:
        click.echo(json.dumps(result.as_json()))
        return
    click.echo(f"{routing.source or trace}")
    click.echo(f"{phase} tokens: {routing.select(phase).n_tokens}, {result.steps} cache steps; "
               f"{routing.n_layers} layers x {routing.n_experts} experts, top-{routing.top_k}")
    width = max(len(name) for name in (*result.rates, "policy"))
    click.echo(f"{'cache':{width}} " + " ".join(f"{100 * f:>7.1f}%" for f in result.fractions))
    click.echo(f"{'slots':{width}} " + " ".join(f"{n:>8}" for n in result.n_slots))
    for name, rates in result.rates.items():
        cells = (f"{100 * r:>7.1f}%" if r is not None else f"{'-':>8}" for r in rates)
        click.echo(f"{name:{width}} " + " ".join(cells))
    if png:
        click.echo(f"wrote {png}")


@trace_group.command("synth")
@click.option("--counts", "counts_source", required=True,
              help="Counts: a counts .json/.npz, a trace .npz, or a shipped name (qwen3-30b-a3b, "
                   "qwen3-next-80b-a3b, granite-3.0-1b-a400m).")
@click.option("--tokens", type=click.IntRange(min=1), required=True, help="Decode tokens, all requests together.")
@click.option("-o", "--output", required=True, type=click.Path(dir_okay=False), help="Trace .npz to write.")
@click.option("--requests", type=click.IntRange(min=1), default=1, show_default=True)
@click.option("--prefill-tokens", type=click.IntRange(min=0), default=0, show_default=True,
              help="Prompt tokens at the start of each request.")
@click.option("--seed", type=click.IntRange(min=0), default=0, show_default=True, help="Same seed, same bytes.")
@click.option("--no-reuse", is_flag=True, help="No temporal reuse: tokens drawn independently (a lower bound).")
def synth_command(counts_source: str, tokens: int, output: str, requests: int, prefill_tokens: int, seed: int,
                  no_reuse: bool) -> None:
    """Write a routing trace drawn from the calibrated routing model of COUNTS' shape."""
    if requests > tokens:
        raise click.ClickException(f"--requests {requests} exceeds --tokens {tokens}: each request needs a token")
    counts = load_counts(counts_source)
    model = RoutingModel(counts, reuse=None) if no_reuse else RoutingModel(counts)
    routing = model.synthesize(tokens, requests, prefill_tokens, seed)
    save_trace(routing, output)
    click.echo(f"wrote {output}: {routing.n_tokens} tokens ({tokens} decode) in {requests} requests, "
               f"{routing.n_layers} layers x {routing.n_experts} experts, top-{routing.top_k}")


@trace_group.command("convert")
@click.argument("source", type=click.Path(dir_okay=False))
@click.option("-o", "--output", required=True, type=click.Path(dir_okay=False), help="Trace .npz to write.")
def convert_command(source: str, output: str) -> None:
    """Convert a per-token router trace JSON (prompts.NAME.{prefill,decode}[token][layer] = ids) to a trace .npz."""
    routing = trace_from_granite_json(source)
    save_trace(routing, output)
    click.echo(f"wrote {output}: {routing.n_tokens} tokens in {routing.n_requests} requests")


@trace_group.command("show")
@click.argument("trace")
def show_command(trace: str) -> None:
    """Summarize TRACE (a trace .npz or a shipped name: granite-3.0-1b-a400m)."""
    routing = _open_trace(trace)
    n_prefill = int(routing.prefill.sum())
    lengths = [end - start for start, end in routing.request_bounds()]
    click.echo(f"file:     {routing.origin}")
    click.echo(f"source:   {routing.source or '(none)'}")
    click.echo(f"shape:    {routing.n_tokens} tokens x {routing.n_layers} layers x top-{routing.top_k} "
               f"of {routing.n_experts} experts")
    click.echo(f"tokens:   {n_prefill} prefill, {routing.n_tokens - n_prefill} decode")
    click.echo(f"requests: {routing.n_requests} (tokens each: {', '.join(map(str, lengths))})")
