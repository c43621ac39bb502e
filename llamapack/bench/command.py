"""``llamapack bench``: the side-by-side benchmark (registered lazily by llamapack/cli.py)."""
from __future__ import annotations

import os
import shlex
import subprocess
import sys
from pathlib import Path

import click

from .configs import default_matrix, schedule, select
from .runner import BenchPlan, run_bench


def _numbers(kind):
    def parse(ctx, param, value):
        try:
            return tuple(kind(v) for v in value.split(",") if v.strip()) if value else ()
        except ValueError:
            raise click.BadParameter(f"a comma-separated list of numbers, not {value!r}") from None
    return parse


def has_gpu() -> bool:
    """Whether the libllama llama_cpp loads can offload, asked in a child process: this process stays free of
    libllama (the runs load their own, each with the libllama its configuration needs)."""
    probe = "import llama_cpp, sys; sys.exit(0 if llama_cpp.llama_supports_gpu_offload() else 1)"
    return subprocess.run([sys.executable, "-c", probe], capture_output=True).returncode == 0


def upstream_configs(model: str, pack: str | None, fractions, memory_limit_mib: int | None = None) -> tuple:
    """Upstream's runs: every expert in VRAM (its base speed, to tell its llama.cpp's speed from its cache's),
    -cmoe (experts in pinned RAM, CPU compute), then its VRAM cache at each pack fraction's
    VRAM (the pool's slots x the pack's block stride), same RAM-rich setting; with a memory limit, also its cache
    at the smallest fraction under that limit, experts mmapped (the SSD regime: misses page experts in and are
    computed on the CPU), decoding ``LIMITED_UPSTREAM_DECODE`` tokens per prompt within
    ``LIMITED_UPSTREAM_TIMEOUT_S`` (such a run may page for minutes)."""
    from ..pack import open_gguf
    from .upstream import UpstreamConfig, cache_mib_for_slots

    layout = open_gguf(model).layout
    threads = os.cpu_count() or 1
    cache_mib = {f: cache_mib_for_slots(max(1, round(f * layout.num_blocks)), layout.expert_stride) for f in fractions}
    configs = [UpstreamConfig("upstream-vram", n_threads=threads, cpu_moe=False),
               UpstreamConfig("upstream-cmoe", n_threads=threads)]
    configs += [UpstreamConfig(f"upstream-cache-{100 * f:g}%", n_threads=threads, cache_mib=cache_mib[f])
                for f in fractions]
    if memory_limit_mib is not None and fractions:
        f = min(fractions)
        limit = f"{memory_limit_mib // 1024}G" if memory_limit_mib % 1024 == 0 else f"{memory_limit_mib}M"
        configs.append(UpstreamConfig(f"upstream-cache-{100 * f:g}%@{limit}", n_threads=threads, cache_mib=cache_mib[f],
                                      load_mode="mmap", memory_limit_mib=memory_limit_mib,
                                      n_decode=LIMITED_UPSTREAM_DECODE, timeout_s=LIMITED_UPSTREAM_TIMEOUT_S))
    return tuple(configs)


LIMITED_UPSTREAM_DECODE, LIMITED_UPSTREAM_TIMEOUT_S = 32, 240.0


@click.command("bench")
@click.argument("model", type=click.Path(exists=True, dir_okay=False))
@click.option("--pack", "pack", type=click.Path(dir_okay=False), help="Expert pack (default: beside MODEL).")
@click.option("-o", "--out", "out_dir", type=click.Path(file_okay=False, path_type=Path), default=Path("bench-results"),
              show_default=True, help="Folder for bench.json, bench.md and bench.png.")
@click.option("--memory-limit-mib", type=click.IntRange(min=64),
              help="cgroup memory.max for the low-RAM runs (needs root and cgroups); none: no limited runs.")
@click.option("--fractions", callback=_numbers(float), default="0.25,0.5", show_default=True,
              help="VRAM expert cache sizes, as fractions of all routed experts.")
@click.option("--configs", "names", help="Only these runs (comma-separated names; see --list), or any combination "
              "such as pack-25%+ram25%+prefetch-top2@8G; +pyhot: every step through the Python provider (no native "
              "hot path); +warm: start from a priming session's popularity (needs --routing; see --warm-*).")
@click.option("--rounds", type=click.IntRange(min=1), default=1, show_default=True,
              help="Run every config but the reference this many times; the report gives the median decode.")
@click.option("--shuffle-seed", type=int, help="Shuffle each round's order with this seed (default: the listed order).")
@click.option("--no-gguf-direct", is_flag=True, help="Leave out the GGUF-direct runs.")
@click.option("--ram-tier", is_flag=True, help="Add pack runs with a host-RAM tier holding every expert.")
@click.option("--prefetch", is_flag=True, help="Add limited pack runs with router-lookahead prefetch (+prefetch).")
@click.option("--prefetch-top", "prefetch_tops", callback=_numbers(int), default="",
              help="Also runs prefetching only each token's best R guesses (+prefetch-topR), e.g. 1,2.")
@click.option("--prefetch-depth", "prefetch_depths", callback=_numbers(int), default="",
              help="Add limited pack runs that guess each of these many layers ahead (+prefetch-dD; comma-separated).")
@click.option("--read-splits", "read_splits", callback=_numbers(int), default="",
              help="Add limited pack runs reading each expert in this many parallel pieces (+splitN; comma-separated).")
@click.option("--prefetch-in-flight", "prefetch_in_flights", callback=_numbers(int), default="",
              help="Add limited pack runs reading at most this many lookahead pieces at once (+prefetch-cN).")
@click.option("--ram-fractions", "ram_fractions", callback=_numbers(float), default="",
              help="Add limited pack runs with a host-RAM tier of these shares of the experts (+ramR%), e.g. 0.25.")
@click.option("--read-engines", is_flag=True,
              help="Add twins of each limited pack run reading on the native pool (+native) and on Python threads (+pyreads).")
@click.option("--prompt-lengths", callback=_numbers(int), default="32,512", show_default=True)
@click.option("--warmup-tokens", type=click.IntRange(min=0), default=16, show_default=True,
              help="Before the measured requests, each run evaluates a prompt of this many tokens and throws it away, "
                   "as upstream's llama-batched-bench does (first-use costs: CUDA modules, cuBLAS); 0: none (e.g. to "
                   "measure a +warm run's first request as a process's first).")
@click.option("-n", "--n-decode", type=click.IntRange(min=1), default=200, show_default=True)
@click.option("--decode-cap-s", type=click.FloatRange(min=0.1), default=60.0, show_default=True,
              help="A request stops decoding after this many seconds (slow runs still give a rate).")
@click.option("--temperature", type=click.FloatRange(min=0.0), default=0.0, show_default=True,
              help="0: greedy decode. Above 0: sample from softmax(logits / T) with a fixed seed per request, so runs "
                   "with identical logits decode identical tokens (a random-weights model's greedy decode loops, "
                   "which flatters the cache).")
@click.option("-ub", "--ubatch-size", type=click.IntRange(min=1), default=512, show_default=True)
@click.option("--vanilla-lib", type=click.Path(file_okay=False), help="Folder of an unpatched libllama for vanilla runs.")
@click.option("--patched-lib", type=click.Path(file_okay=False), help="Folder of the patched libllama for pack runs.")
@click.option("--routing", type=click.Path(exists=True, dir_okay=False),
              help="Replay this routing trace (.npz, `llamapack trace`) in the llamapack runs instead of the model's "
                   "router (a model of the trace's shape; no bit-exact column; vanilla runs keep their own routing).")
@click.option("--upstream-bin", type=click.Path(file_okay=False),
              help="Folder of upstream llama.cpp's llama-batched-bench (bench/upstream_build.sh): adds its -cmoe run and "
                   "its --moe-cache-mib runs at the VRAM of each pack fraction, RAM-rich (experts in pinned RAM), and with "
                   "--memory-limit-mib one at the smallest fraction under the limit (experts mmapped).")
@click.option("--upstream-runs", "upstream_names",
              help="Only these of upstream's runs (comma-separated names, e.g. upstream-cmoe,upstream-cache-25%).")
@click.option("--warm-routing", type=click.Path(exists=True, dir_okay=False),
              help="+warm runs: the priming session replays this trace's requests (a trace of the same shape, other "
                   "requests; default: the --routing trace's requests that no measured prompt replays).")
@click.option("--warm-requests", type=click.IntRange(min=1), default=2, show_default=True,
              help="+warm runs: at most this many priming requests.")
@click.option("--warm-prompt-tokens", type=click.IntRange(min=1), default=32, show_default=True,
              help="+warm runs: each priming request's prompt, at most (and at most its trace request's prompt).")
@click.option("--warm-tokens", type=click.IntRange(min=1), default=100, show_default=True,
              help="+warm runs: each priming request's decode tokens, at most (and at most its trace request's).")
@click.option("--warm-cap-s", type=click.FloatRange(min=0.1),
              help="+warm runs: a priming request stops decoding after this many seconds (default: --decode-cap-s).")
@click.option("--list", "list_only", is_flag=True, help="List the runs this would make, then exit.")
def bench_command(model, pack, out_dir, memory_limit_mib, fractions, names, rounds, shuffle_seed, no_gguf_direct, ram_tier, prefetch,
                  prefetch_tops, prefetch_depths, read_splits, prefetch_in_flights, ram_fractions, read_engines,
                  prompt_lengths, warmup_tokens, n_decode, decode_cap_s, temperature, ubatch_size, vanilla_lib, patched_lib, routing,
                  upstream_bin, upstream_names, warm_routing, warm_requests, warm_prompt_tokens, warm_tokens, warm_cap_s,
                  list_only) -> None:
    """Measure MODEL.gguf under vanilla llama.cpp and llamapack, side by side, and report ratios."""
    matrix = default_matrix(os.cpu_count() or 1, memory_limit_mib, fractions, gpu=has_gpu(),
                            gguf_direct=not no_gguf_direct, ram_tier=ram_tier, prefetch=prefetch,
                            prefetch_tops=prefetch_tops or (), prefetch_depths=prefetch_depths or (),
                            read_splits=read_splits or (), prefetch_in_flights=prefetch_in_flights or (),
                            ram_fractions=ram_fractions or (), read_engines=read_engines)
    try:
        configs = select(matrix, names.split(",") if names else None, n_cores=os.cpu_count() or 1)
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint="--configs") from None
    upstream = upstream_configs(model, pack, fractions, memory_limit_mib) if upstream_bin else ()
    if upstream_names:
        wanted = [n.strip() for n in upstream_names.split(",") if n.strip()]
        unknown = sorted(set(wanted) - {c.name for c in upstream})
        if unknown:
            raise click.BadParameter(f"unknown upstream run(s) {', '.join(unknown)} (known: "
                                     f"{', '.join(c.name for c in upstream) or 'none without --upstream-bin'})",
                                     param_hint="--upstream-runs")
        upstream = tuple(c for c in upstream if c.name in wanted)
    if list_only:
        for round_, config in schedule(configs, rounds, shuffle_seed):
            click.echo(config.name if rounds == 1 else f"{round_}\t{config.name}")
        for config in upstream:
            click.echo(config.name)
        return
    plan = BenchPlan(model=model, out_dir=out_dir, configs=tuple(configs), pack=pack,
                     prompt_lengths=prompt_lengths or (32, 512), warmup_tokens=warmup_tokens, n_decode=n_decode, decode_cap_s=decode_cap_s,
                     temperature=temperature, n_ctx=max(1024, max(prompt_lengths or (512,)) + n_decode + 8), n_ubatch=ubatch_size,
                     vanilla_lib=vanilla_lib, patched_lib=patched_lib, rounds=rounds, shuffle_seed=shuffle_seed,
                     routing=routing, upstream_bin=upstream_bin, warm_routing=warm_routing, warm_requests=warm_requests,
                     warm_prompt_tokens=warm_prompt_tokens, warm_tokens=warm_tokens, warm_cap_s=warm_cap_s,
                     upstream_configs=upstream, command=" ".join(shlex.quote(a) for a in ["llamapack", *sys.argv[1:]]))
    run_bench(plan, echo=lambda line: click.echo(line, err=True))
    click.echo(f"wrote {out_dir / 'bench.md'}, bench.json and bench.png")
