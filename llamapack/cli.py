"""``llamapack`` command line. Commands only parse arguments and call the library.

Any ``LlamapackError`` becomes a one-line ``Error: ...`` on stderr and exit status 1 (handled once,
in ``LlamapackGroup``, so commands added later get the same behaviour).
"""

from __future__ import annotations

import importlib
import math
import sys

import click

from llamapack.errors import InputError, IntegrityError, LlamapackError

# commands defined in other modules, imported only when used (numpy must not load before llama_cpp)
LAZY_COMMANDS = {"synth": "llamapack.synth.command:synth_command", "bench": "llamapack.bench.command:bench_command",
                 "trace": "llamapack.routing.command:trace_group", "plan": "llamapack.plan.command:plan_command"}


class LlamapackGroup(click.Group):
    def invoke(self, ctx: click.Context):
        try:
            return super().invoke(ctx)
        except LlamapackError as exc:
            raise click.ClickException(" ".join(str(exc).split())) from None

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted([*super().list_commands(ctx), *LAZY_COMMANDS])

    def get_command(self, ctx: click.Context, name: str):
        if name in LAZY_COMMANDS:
            module, attr = LAZY_COMMANDS[name].split(":")
            return getattr(importlib.import_module(module), attr)
        return super().get_command(ctx, name)


@click.group(cls=LlamapackGroup)
def main() -> None:
    """Run MoE LLMs with routed experts streamed from NVMe."""


@main.command()
@click.argument("model", type=click.Path(dir_okay=False))
@click.option("-o", "--output", type=click.Path(dir_okay=False), help="Pack path (default: <stem>.expert-pack beside MODEL).")
@click.option("--safety-margin-mib", type=click.IntRange(min=0), default=1024, show_default=True,
              help="Free space to leave on the target filesystem.")
@click.option("--full-hash", is_flag=True, help="Fingerprint the source GGUF with a full sha256 (slow) instead of sampling.")
@click.option("--no-direct-io", is_flag=True, help="Write with buffered I/O (for filesystems without O_DIRECT).")
@click.option("--force", is_flag=True, help="Replace an existing output file that is not a pack.")
@click.option("-q", "--quiet", is_flag=True, help="No progress bar.")
def pack(model: str, output: str | None, safety_margin_mib: int, full_hash: bool, no_direct_io: bool, force: bool,
         quiet: bool) -> None:
    """Build the expert pack of MODEL.gguf."""
    from llamapack.pack import build_pack
    from llamapack.pack.identity import FULL, SAMPLED

    result = build_pack(model, output, safety_margin_mib=safety_margin_mib, progress=not quiet,
                        direct_io=not no_direct_io, fingerprint_mode=FULL if full_hash else SAMPLED, force=force)
    layout = result.manifest.layout
    rate = layout.num_blocks * layout.expert_stride / max(result.seconds, 1e-9) / 1e9
    click.echo(f"wrote {result.pack_path} ({layout.pack_size / 1e9:.3f} GB, {len(layout.layers)} layers x "
               f"{layout.num_experts} experts, stride {layout.expert_stride}, {rate:.2f} GB/s) "
               f"and {result.manifest_path}")


@main.command()
@click.argument("path", type=click.Path(dir_okay=False))
def inspect(path: str) -> None:
    """Summarize a pack (or its manifest), or the pack layout of a GGUF."""
    from llamapack.pack import inspect as inspect_pack

    for line in inspect_pack(path).lines():
        click.echo(line)


@main.command()
@click.argument("pack_path", metavar="PACK", type=click.Path(dir_okay=False))
@click.option("--against", type=click.Path(dir_okay=False), help="Also compare every block with this GGUF's bytes.")
@click.option("--update-source", is_flag=True,
              help="With --against: when every block matches, record that GGUF's modification time in the manifest "
                   "(a copied or touched GGUF then loads with the pack).")
@click.option("--no-direct-io", is_flag=True, help="Read with buffered I/O.")
@click.option("-q", "--quiet", is_flag=True, help="No progress bar.")
def verify(pack_path: str, against: str | None, update_source: bool, no_direct_io: bool, quiet: bool) -> None:
    """Check every block of PACK against its manifest (and a GGUF)."""
    from llamapack.pack import verify as verify_pack

    if update_source and against is None:
        raise click.ClickException("--update-source records the GGUF given with --against: give one")
    report = verify_pack(pack_path, against=against, progress=not quiet, direct_io=not no_direct_io,
                         update_source=update_source)
    extra = f" and match {report.against}" if report.against else ""
    click.echo(f"OK: {report.blocks} blocks ({report.nbytes / 1e9:.3f} GB) pass sha256{extra} "
               f"in {report.seconds:.1f} s" + ("; its modification time is recorded" if update_source else ""))


class FiniteFloat(click.FloatRange):
    """A FloatRange that also refuses nan and inf."""

    def convert(self, value, param, ctx):
        number = super().convert(value, param, ctx)
        if not math.isfinite(number):
            self.fail(f"{value!r} is not a finite number", param, ctx)
        return number


class RamCacheMib(click.ParamType):
    """A size in MiB (> 0), or "auto": half the RAM still available (StreamingSettings.ram_cache_mib)."""

    name = "MIB|auto"

    def convert(self, value, param, ctx):
        if isinstance(value, (int, float)) or value == "auto":
            return value
        try:
            mib = float(value)
        except ValueError:
            mib = 0.0
        if not 0 < mib < float("inf"):
            self.fail(f'{value!r} is neither a size in MiB above 0 nor "auto"', param, ctx)
        return mib


RAM_CACHE_MIB = RamCacheMib()


class HybridMode(click.ParamType):
    """off, on, auto, or the share in [0, 1] of a step's RAM-tier misses still copied to the GPU."""

    name = "off|on|auto|SHARE"

    def convert(self, value, param, ctx):
        from llamapack.provider.hybrid import parse_mode

        try:
            return parse_mode(value)
        except ValueError as exc:
            self.fail(str(exc), param, ctx)


HYBRID_MODE = HybridMode()
HYBRID_HELP = ("Compute some expert-cache misses that are in the RAM tier on the CPU instead of copying them "
               "(decode steps of up to 31 tokens; needs --ram-cache-mib). on: every such miss; auto: the share that "
               "ends copies and CPU work together, measured at start; a number: the share still copied. Exact with "
               "every row on the GPU or every row on the CPU; a mixed step's rows carry the CPU kernels' rounding "
               "(README, Hybrid).")


def pack_options(pack: str | None, gguf_direct: bool, ram_cache_mib: float | str | None, prefetch: bool,
                 ram_preload: bool = False, warm_start: bool | None = None, no_direct_io: bool = False,
                 no_verify: bool = False, hybrid: str | float = "off", hybrid_threads: int | None = None) -> dict:
    """The streaming-provider options given; refused without --pack or --gguf-direct (nothing to serve),
    --ram-preload and --hybrid without --ram-cache-mib (no tier to fill, no RAM copy to compute from)."""
    flags = {"--ram-cache-mib": ram_cache_mib is not None, "--ram-preload": ram_preload, "--prefetch": prefetch,
             "--no-direct-io": no_direct_io, "--no-verify": no_verify, "--hybrid": hybrid != "off",
             "--hybrid-threads": hybrid_threads is not None}
    given = [flag for flag, on in flags.items() if on]
    if given and pack is None and not gguf_direct:
        raise click.ClickException(f"{given[0]} needs --pack or --gguf-direct")
    options = {k: v for k, v in dict(ram_cache_mib=ram_cache_mib, ram_preload=ram_preload or None,
                                     prefetch=prefetch or None, direct_io=False if no_direct_io else None,
                                     verify_pack_sha256=False if no_verify else None).items()
               if v is not None}
    if ram_preload and ram_cache_mib is None:
        raise click.ClickException("--ram-preload fills the RAM tier: give --ram-cache-mib (MiB or auto)")
    if hybrid != "off":
        if ram_cache_mib is None:
            raise click.ClickException("--hybrid computes misses from the RAM tier: give --ram-cache-mib (MiB or auto)")
        options.update(hybrid=hybrid, **({"hybrid_threads": hybrid_threads} if hybrid_threads is not None else {}))
    elif hybrid_threads is not None:
        raise click.ClickException("--hybrid-threads sizes hybrid's CPU pool: give --hybrid too")
    if warm_start is False and (pack is not None or gguf_direct):  # no pack: no expert cache to warm
        options["warm_start"] = False
    return options


def auto_options(model: str, pack: str | None, gguf_direct: bool, ctx_size: int, n_gpu_layers: int,
                 given: dict[str, object]) -> dict:
    """--auto: ``llamapack plan``'s cache_vram_mib, ram_cache_mib and n_ubatch for this run, printed to stderr.
    Refused without --pack/--gguf-direct and beside an option it chooses (``given``: flag -> value or None)."""
    if pack is None and not gguf_direct:
        raise click.ClickException("--auto sizes the expert cache: give --pack or --gguf-direct")
    clash = [flag for flag, value in given.items() if value is not None]
    if clash:
        raise click.ClickException(f"--auto chooses {clash[0]}: give one or the other")
    from llamapack.plan.planner import make_plan  # after llama_cpp (the caller imported llamapack.run)

    plan = make_plan(model, None if gguf_direct else pack, n_ctx=ctx_size, use_gpu=n_gpu_layers != 0,
                     progress=sys.stderr.isatty())
    chosen = plan.settings()
    click.echo("--auto (llamapack plan): " + ", ".join(f"{k}={v}" for k, v in chosen.items())
               + f"; predicted decode {plan.recommended.decode_tok_s:.1f} tok/s", err=True)
    return chosen


def read_line(stream) -> str:
    """One chat line from ``stream``, stripped; InputError when it is not UTF-8."""
    try:
        return stream.readline().strip()
    except UnicodeDecodeError as exc:
        raise InputError(f"stdin is not valid UTF-8 ({exc.reason} at byte {exc.start} of the line)") from None


@main.command()
@click.argument("model", type=click.Path(dir_okay=False))
@click.option("--pack", "pack", is_flag=False, flag_value="", default=None, metavar="[PACK]",
              help="Serve routed experts from PACK (no value: <stem>.expert-pack beside MODEL).")
@click.option("--gguf-direct", is_flag=True, help="Serve routed experts straight from MODEL (no pack).")
@click.option("-p", "--prompt", help="Prompt (with --chat: the system message).")
@click.option("-n", "--max-tokens", type=click.IntRange(min=1), default=128, show_default=True)
@click.option("--temp", type=FiniteFloat(min=0.0), default=0.8, show_default=True, help="0: greedy.")
@click.option("--seed", type=click.IntRange(min=0), help="Sampling seed (default: random).")
@click.option("-c", "--ctx-size", type=click.IntRange(min=1), default=4096, show_default=True)
@click.option("-t", "--threads", type=click.IntRange(min=1), help="CPU threads (default: llama-cpp-python's).")
@click.option("-ngl", "--n-gpu-layers", type=int, default=0, show_default=True, help="Layers on the GPU (-1: all).")
@click.option("-ub", "--ubatch-size", type=click.IntRange(min=1), help="Physical batch size (default 512).")
@click.option("--cache-slots", type=click.IntRange(min=1), help="Experts the cache holds.")
@click.option("--cache-vram-mib", type=FiniteFloat(min=0.0, min_open=True),
              help="Expert cache size in MiB (GPU memory with -ngl, else host memory).")
@click.option("--ram-cache-mib", type=RAM_CACHE_MIB,
              help='Host-RAM tier between the SSD and the expert cache, in MiB; "auto": half the spare RAM.')
@click.option("--ram-preload", is_flag=True,
              help="Fill the RAM tier from the SSD at start-up (slower start, no SSD waits while it holds every expert).")
@click.option("--prefetch", is_flag=True, help="Router lookahead: read the next layer's likely experts ahead, in idle disk time (slower on the measured H200 machine: bench/results/gpu_prefetch_README.md).")
@click.option("--no-warm-start", "warm_start", is_flag=True, flag_value=False, default=None,
              help="Start with an empty expert cache, and save no expert counts at exit (default: fill the cache "
                   "with the experts this pack used most last time, from ~/.cache/llamapack/warm).")
@click.option("--hybrid", type=HYBRID_MODE, default="off", show_default=True, help=HYBRID_HELP)
@click.option("--hybrid-threads", type=click.IntRange(min=1),
              help="CPU threads for --hybrid's expert rows (default: the cores -t leaves free).")
@click.option("--no-direct-io", is_flag=True, help="Read experts through the page cache (filesystems without O_DIRECT).")
@click.option("--no-verify", is_flag=True,
              help="Do not check each pack block's sha256 the first time it is read (on by default).")
@click.option("--auto", is_flag=True,
              help="Choose --cache-vram-mib, --ram-cache-mib and the ubatch size with `llamapack plan` (printed).")
@click.option("--chat", is_flag=True, help="Chat: one user message per stdin line, until EOF or an empty line.")
@click.option("--stats-json", type=click.Path(dir_okay=False), help="Write the run's numbers here as JSON.")
def run(model: str, pack: str | None, gguf_direct: bool, prompt: str | None, max_tokens: int, temp: float,
        seed: int | None, ctx_size: int, threads: int | None, n_gpu_layers: int, ubatch_size: int | None,
        cache_slots: int | None, cache_vram_mib: float | None, ram_cache_mib: float | str | None,
        ram_preload: bool, prefetch: bool, warm_start: bool | None, hybrid: str | float, hybrid_threads: int | None,
        no_direct_io: bool, no_verify: bool, auto: bool, chat: bool, stats_json: str | None) -> None:
    """Generate text with MODEL.gguf, streaming it; then print speed and expert-cache numbers."""
    from llamapack.run import Runner, open_model

    if prompt is None and not chat:
        raise click.ClickException("give a prompt with -p/--prompt, or use --chat")
    if auto:
        chosen = auto_options(model, pack, gguf_direct, ctx_size, n_gpu_layers,
                              {"--cache-slots": cache_slots, "--cache-vram-mib": cache_vram_mib,
                               "--ram-cache-mib": ram_cache_mib, "--ubatch-size": ubatch_size})
        cache_vram_mib, ram_cache_mib, ubatch_size = (chosen[k] for k in ("cache_vram_mib", "ram_cache_mib", "n_ubatch"))
    params = dict(n_ctx=ctx_size, n_gpu_layers=n_gpu_layers, verbose=False)
    if threads is not None:
        params.update(n_threads=threads, n_threads_batch=threads)
    params.update(pack_options(pack, gguf_direct, ram_cache_mib, prefetch, ram_preload, warm_start, no_direct_io, no_verify,
                               hybrid, hybrid_threads))
    if ubatch_size is not None:
        params.update(n_ubatch=ubatch_size, n_batch=max(512, ubatch_size))
    if seed is not None:
        params.update(seed=seed)
    sampling = dict(max_tokens=max_tokens, temperature=temp, seed=seed)

    with open_model(model, pack=True if pack == "" else pack, gguf_direct=gguf_direct, cache_slots=cache_slots,
                    cache_mib=cache_vram_mib, **params) as llm:
        runner = Runner(llm)
        if not chat:
            for piece in runner.complete(prompt, **sampling):
                click.echo(piece, nl=False)
            click.echo()
        else:
            messages = [{"role": "system", "content": prompt}] if prompt else []
            while True:
                if sys.stdin.isatty():
                    click.echo("> ", nl=False, err=True)
                line = read_line(sys.stdin)
                if not line:
                    break
                messages.append({"role": "user", "content": line})
                for piece in runner.chat(messages, **sampling):
                    click.echo(piece, nl=False)
                click.echo()
    for line in runner.stats.lines():
        click.echo(line, err=True)
    if stats_json:
        runner.stats.write_json(stats_json)


@main.command()
@click.argument("model", type=click.Path(dir_okay=False))
@click.option("--pack", "pack", is_flag=False, flag_value="", default=None, metavar="[PACK]",
              help="Serve routed experts from PACK (no value: <stem>.expert-pack beside MODEL).")
@click.option("--gguf-direct", is_flag=True, help="Serve routed experts straight from MODEL (no pack).")
@click.option("--host", default="127.0.0.1", show_default=True)
@click.option("--port", type=click.IntRange(0, 65535), default=8080, show_default=True)
@click.option("--api-key", envvar="LLAMAPACK_API_KEY", help="Require Authorization: Bearer KEY (env LLAMAPACK_API_KEY).")
@click.option("--queue-size", type=click.IntRange(min=1), default=4, show_default=True,
              help="Generation requests admitted at once (running + waiting); more get 429.")
@click.option("--embedding", is_flag=True, help="Also serve /v1/embeddings (loads the model with embedding=True).")
@click.option("--max-body-mib", type=FiniteFloat(min=0.0, min_open=True), default=8, show_default=True,
              help="Largest request body; a larger one is answered 413.")
@click.option("-c", "--ctx-size", type=click.IntRange(min=1), default=4096, show_default=True)
@click.option("-t", "--threads", type=click.IntRange(min=1), help="CPU threads (default: llama-cpp-python's).")
@click.option("-ngl", "--n-gpu-layers", type=int, default=0, show_default=True, help="Layers on the GPU (-1: all).")
@click.option("--cache-slots", type=click.IntRange(min=1), help="Experts the cache holds.")
@click.option("--ram-cache-mib", type=RAM_CACHE_MIB,
              help='Host-RAM tier between the SSD and the expert cache, in MiB; "auto": half the spare RAM.')
@click.option("--ram-preload", is_flag=True,
              help="Fill the RAM tier from the SSD at start-up (slower start, no SSD waits while it holds every expert).")
@click.option("--prefetch", is_flag=True, help="Router lookahead: read the next layer's likely experts ahead, in idle disk time (slower on the measured H200 machine: bench/results/gpu_prefetch_README.md).")
@click.option("--no-warm-start", "warm_start", is_flag=True, flag_value=False, default=None,
              help="Start with an empty expert cache, and save no expert counts at exit (default: fill the cache "
                   "with the experts this pack used most last time, from ~/.cache/llamapack/warm).")
@click.option("--hybrid", type=HYBRID_MODE, default="off", show_default=True, help=HYBRID_HELP)
@click.option("--hybrid-threads", type=click.IntRange(min=1),
              help="CPU threads for --hybrid's expert rows (default: the cores -t leaves free).")
@click.option("--no-direct-io", is_flag=True, help="Read experts through the page cache (filesystems without O_DIRECT).")
@click.option("--no-verify", is_flag=True,
              help="Do not check each pack block's sha256 the first time it is read (on by default).")
@click.option("--auto", is_flag=True,
              help="Choose --cache-vram-mib, --ram-cache-mib and the ubatch size with `llamapack plan` (printed).")
def serve(model: str, pack: str | None, gguf_direct: bool, host: str, port: int, api_key: str | None,
          queue_size: int, embedding: bool, max_body_mib: float, ctx_size: int, threads: int | None, n_gpu_layers: int, cache_slots: int | None,
          ram_cache_mib: float | str | None, ram_preload: bool, prefetch: bool, no_direct_io: bool,
          no_verify: bool, warm_start: bool | None, hybrid: str | float, hybrid_threads: int | None,
          auto: bool) -> None:
    """Serve MODEL.gguf over an OpenAI-compatible HTTP API (/v1/...), with /stats and a chat page at /."""
    from llamapack.run import open_model
    from llamapack.server import create_app
    from llamapack.server.wsgi import make_server

    if api_key is not None and not api_key.strip():
        raise click.ClickException("--api-key is empty: give a non-empty key, or none to serve without one")
    params = dict(n_ctx=ctx_size, n_gpu_layers=n_gpu_layers, verbose=False, **({"embedding": True} if embedding else {}))
    if threads is not None:
        params.update(n_threads=threads, n_threads_batch=threads)
    cache_mib = None
    if auto:
        chosen = auto_options(model, pack, gguf_direct, ctx_size, n_gpu_layers,
                              {"--cache-slots": cache_slots, "--ram-cache-mib": ram_cache_mib})
        cache_mib, ram_cache_mib = chosen["cache_vram_mib"], chosen["ram_cache_mib"]
        params.update(n_ubatch=chosen["n_ubatch"], n_batch=max(512, chosen["n_ubatch"]))
    params.update(pack_options(pack, gguf_direct, ram_cache_mib, prefetch, ram_preload, warm_start, no_direct_io, no_verify,
                               hybrid, hybrid_threads))
    with open_model(model, pack=True if pack == "" else pack, gguf_direct=gguf_direct, cache_slots=cache_slots,
                    cache_mib=cache_mib, **params) as llm:
        max_body_bytes = int(max_body_mib * (1 << 20))
        app = create_app(llm, api_key=api_key, queue_size=queue_size, max_body_bytes=max_body_bytes)
        server = make_server(app, host, port, queue_size=queue_size, max_body_bytes=max_body_bytes)
        click.echo(f"serving {app.extensions['llamapack'].model_name} on http://{host}:{server.port}/v1", err=True)
        server.run()


@main.command()
@click.option("-n", "--max-tokens", type=click.IntRange(min=1), default=48, show_default=True)
def demo(max_tokens: int) -> None:
    """Make a small synthetic MoE model and its pack, run it from the pack and check it against llama.cpp."""
    from llamapack.run import demo_lines  # imports llama_cpp before the demo imports numpy
    from llamapack.demo import run_demo

    result = run_demo(max_tokens, echo=lambda piece: click.echo(piece, nl=False))
    click.echo()
    for line in demo_lines(result):
        click.echo(line)
    if not (result.tokens_identical and result.logits_identical):
        raise IntegrityError("the pack run differs from the reference run")
