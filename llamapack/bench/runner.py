"""Runs the benchmark: the disk probe, then every configuration in its own process, in one go on one
machine (the reference once, the others once per round, optionally shuffled: configs.schedule); results
are rewritten after each run (a bench cut short keeps what it measured).

A ``+warm`` config is two processes, each under the config's memory limit, the page cache dropped before each
(limited runs): a priming session (replay.priming_requests: trace requests the measured prompts do not replay,
at most ``warm_requests`` of them, each cut to ``warm_prompt_tokens`` prompt and ``warm_tokens`` decode tokens
or ``warm_cap_s`` seconds of decode) that saves its popularity at close in a fresh temporary folder, then the
measured run, which starts warm from it (its reads at load, in ``load_s``). A fresh process, so that nothing
else carries over: not the page cache, not the blocks already checked against their sha256."""
from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from ..errors import LlamapackError
from ..pack import default_pack_path, open_gguf
from ..pack.gguf_file import read_gguf_header
from .cgroup import MemoryCage, drop_page_cache
from .configs import BenchConfig, schedule
from .diskbw import random_read_bandwidth
from .replay import ReplayError, check_trace_fits, priming_requests
from .report import write_report
from .workload import DEFAULT_PROMPT_LENGTHS


@dataclass(frozen=True)
class BenchPlan:
    model: str
    out_dir: Path
    configs: tuple[BenchConfig, ...]
    pack: str | None = None               # None: <stem>.expert-pack beside the model
    prompt_lengths: tuple[int, ...] = DEFAULT_PROMPT_LENGTHS
    n_decode: int = 200
    warmup_tokens: int = 16               # a thrown-away prefill before the measured requests (batched-bench's; 0: none)
    decode_cap_s: float = 60.0            # a request stops decoding after this many seconds
    temperature: float = 0.0              # 0: greedy; else sampled with a fixed seed (same logits, same tokens)
    n_ctx: int = 1024
    n_ubatch: int = 512
    stage_slots: int = 4
    read_splits: int = 1
    vanilla_lib: str | None = None        # libllama for vanilla runs (default: the one installed)
    patched_lib: str | None = None        # libllama for pack runs (default: the one installed)
    config_timeout_s: float = 1800.0
    probe_seconds: float = 3.0
    rounds: int = 1                       # every config but the reference runs this many times
    shuffle_seed: int | None = None       # None: each round in the given order; else a seeded shuffle per round
    command: str = ""
    extra_facts: dict = field(default_factory=dict)
    routing: str | None = None            # a routing trace (.npz) the llamapack runs replay (bench/replay.py)
    upstream_bin: str | None = None       # folder of upstream llama.cpp's llama-batched-bench (bench/upstream_build.sh)
    upstream_configs: tuple = ()          # upstream.UpstreamConfig runs, after the llamapack runs
    warm_routing: str | None = None       # +warm priming requests from this trace (None: ``routing``'s unused ones)
    warm_requests: int = 2                # at most this many priming requests per +warm run
    warm_prompt_tokens: int = 32          # each priming request's prompt, at most (the trace request's prefill rows)
    warm_tokens: int = 100                # each priming request's decode tokens, at most (its decode rows)
    warm_cap_s: float | None = None       # a priming request stops decoding after this long (None: decode_cap_s)


def machine_facts() -> dict:
    facts = dict(python=platform.python_version(), cpus=os.cpu_count(), kernel=platform.release(),
                 date=time.strftime("%Y-%m-%d %H:%M:%S %Z"))
    try:
        facts["gpus"] = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=30).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        facts["gpus"] = ""
    try:
        facts["mem_total_kib"] = int(next(line.split()[1] for line in open("/proc/meminfo") if line.startswith("MemTotal")))
    except (OSError, StopIteration):
        pass
    return facts


def run_bench(plan: BenchPlan, echo: Callable[[str], None] = print) -> dict:
    """Measure every configuration of ``plan``; returns the results (also written to ``plan.out_dir``)."""
    model = open_gguf(plan.model)
    layout = model.layout
    expert_bytes = layout.num_blocks * layout.expert_stride
    needs_pack = any(c.source == "pack" for c in plan.configs)
    pack_path = plan.pack or default_pack_path(model)
    if needs_pack and not os.path.exists(pack_path):
        raise LlamapackError(f"no expert pack at {pack_path}: build it first with `llamapack pack {plan.model}`")
    routing = describe_routing(plan, model) if plan.routing else None
    warm = describe_priming(plan, model) if any(c.warm_start for c in plan.configs) else None
    plan.out_dir.mkdir(parents=True, exist_ok=True)
    results = dict(command=plan.command, machine={**machine_facts(), **plan.extra_facts},
                   model=dict(path=plan.model, size_bytes=sum(os.path.getsize(p) for p in model.paths),
                              expert_bytes=expert_bytes, n_moe_layers=len(layout.layers),
                              n_expert=layout.num_experts, expert_stride=layout.expert_stride, top_k=top_k_of(model)),
                   workload=dict(prompt_lengths=list(plan.prompt_lengths), n_decode=plan.n_decode,
                                 warmup_tokens=plan.warmup_tokens,
                                 decode_cap_s=plan.decode_cap_s, temperature=plan.temperature, n_ctx=plan.n_ctx, n_ubatch=plan.n_ubatch,
                                 stage_slots=plan.stage_slots, read_splits=plan.read_splits,
                                 rounds=plan.rounds, shuffle_seed=plan.shuffle_seed, routing=routing,
                                 **({"warm": warm} if warm else {})),
                   runs=[])
    probe_path, first, n_blocks = ((pack_path, layout.data_start, layout.num_blocks) if needs_pack
                                   else (model.paths[0], 0, os.path.getsize(model.paths[0]) // layout.expert_stride))
    echo(f"disk probe: O_DIRECT random {layout.expert_stride / 2**20:.2f} MiB reads of {probe_path}")

    def probe_disk(name: str, when: str) -> None:
        disk = random_read_bandwidth(probe_path, layout.expert_stride, first, n_blocks,
                                     threads=plan.stage_slots * plan.read_splits, seconds=plan.probe_seconds)
        results[name] = disk.as_dict()
        echo(f"disk {when}: {disk.bytes_per_s / 1e9:.2f} GB/s")

    probe_disk("disk", "before the runs")
    with tempfile.TemporaryDirectory(prefix="llamapack-bench-") as tmp:
        order = schedule(plan.configs, plan.rounds, plan.shuffle_seed)
        for index, (round_, config) in enumerate(order):
            echo(f"[{index + 1}/{len(order)}] {config.name}" + (f" (round {round_})" if plan.rounds > 1 else "") + " ...")
            run = run_config(plan, config, expert_bytes, layout.num_blocks, pack_path, Path(tmp) / f"spec-{index}.json",
                             warm=warm)
            run.update(round=round_, position=index + 1)
            results["runs"].append(run)
            echo(f"    {summary_line(run)}")
            write_report(results, plan.out_dir)
        run_upstream_configs(plan, results, Path(tmp), echo)
    probe_disk("disk_after", "after the runs")
    write_report(results, plan.out_dir)
    return results


def run_upstream_configs(plan: BenchPlan, results: dict, tmp: Path, echo: Callable[[str], None]) -> None:
    """Upstream llama.cpp's runs (llama-batched-bench), each once, replaying the same trace when there is one."""
    if not plan.upstream_configs:
        return
    from ..routing.trace import load_trace
    from .upstream import run_upstream

    trace = load_trace(plan.routing) if plan.routing else None
    binary = os.path.join(plan.upstream_bin, "llama-batched-bench")
    for config in plan.upstream_configs:
        echo(f"[upstream] {config.name} ...")
        run = run_upstream(binary, plan.model, config, plan.prompt_lengths, config.n_decode or plan.n_decode, tmp,
                           trace=trace, timeout_s=min(plan.config_timeout_s, config.timeout_s or plan.config_timeout_s),
                           n_ctx=plan.n_ctx, n_ubatch=plan.n_ubatch)
        run.update(round=1, position=len(results["runs"]) + 1)
        results["runs"].append(run)
        echo(f"    {summary_line(run)}")
        write_report(results, plan.out_dir)


def top_k_of(model) -> int:
    """The experts each token uses per MoE layer (``<arch>.expert_used_count``; 0 when the header lacks it)."""
    return int(read_gguf_header(model.paths[0]).kv.get(f"{model.arch}.expert_used_count", ("", 0))[1])


def describe_routing(plan: BenchPlan, model) -> dict:
    """The trace the llamapack runs replay, checked against the model's shape before any run starts."""
    from ..routing.trace import load_trace

    trace = load_trace(plan.routing)
    check_trace_fits(trace, len(model.layout.layers), model.layout.num_experts, top_k_of(model), plan.model)
    if any(c.prefetch and not c.own_routing for c in plan.configs if c.source != "vanilla"):
        raise ReplayError("--routing replaces the router's choice; router lookahead guesses from the router, so "
                          "prefetch runs cannot replay a trace")
    return dict(path=os.path.abspath(plan.routing), source=trace.source, n_tokens=trace.n_tokens,
                n_requests=trace.n_requests, n_decode_tokens=int((~trace.prefill).sum()))


def describe_priming(plan: BenchPlan, model) -> dict:
    """The priming requests of the +warm runs (replay.priming_requests), checked before any run starts."""
    from ..routing.trace import load_trace

    if not plan.routing:
        raise ReplayError("+warm runs prime on trace requests the measured prompts do not replay: they need --routing")
    source = plan.warm_routing or plan.routing
    same = os.path.abspath(source) == os.path.abspath(plan.routing)
    trace = load_trace(source)
    check_trace_fits(trace, len(model.layout.layers), model.layout.num_experts, top_k_of(model), plan.model)
    requests = priming_requests(trace, len(plan.prompt_lengths) if same else 0, plan.warm_requests,
                                plan.warm_prompt_tokens, plan.warm_tokens)
    return dict(routing=os.path.abspath(source), same_trace=same, requests=requests,
                cap_s=plan.warm_cap_s if plan.warm_cap_s is not None else plan.decode_cap_s)


def summary_line(run: dict) -> str:
    if "error" in run:
        return f"failed: {run['error'][-300:]}"
    decoded = sum(r["n_decoded"] for r in run["requests"])
    decode_s = sum(r["decode_s"] for r in run["requests"])
    prefill = ", ".join(f"{r['n_prompt']} tok in {r['prefill_s']:.2f} s" for r in run["requests"])
    return f"prefill {prefill}; decode {decoded} tok at {decoded / decode_s if decode_s else 0:.2f} tok/s"


def run_config(plan: BenchPlan, config: BenchConfig, expert_bytes: int, n_experts: int, pack_path: str,
               spec_path: Path, warm: dict | None = None) -> dict:
    """One configuration in a worker process (under its memory limit, if any); a +warm one after its priming
    process (``warm``: describe_priming's), whose record is the run's ``priming``."""
    spec = dict(config=config.as_dict(), model=plan.model, pack=pack_path, expert_bytes=expert_bytes,
                n_experts=n_experts,
                prompt_lengths=list(plan.prompt_lengths), n_decode=plan.n_decode, decode_cap_s=plan.decode_cap_s,
                temperature=plan.temperature, warmup_tokens=plan.warmup_tokens,
                n_ctx=plan.n_ctx, n_batch=max(plan.n_ubatch, 512), n_ubatch=plan.n_ubatch,
                stage_slots=plan.stage_slots, read_splits=plan.read_splits, routing=plan.routing)
    env = dict(os.environ)
    lib = plan.vanilla_lib if config.source == "vanilla" else plan.patched_lib
    if lib:
        env["LLAMA_CPP_LIB_PATH"] = lib
    priming = None
    if config.warm_start:
        warm_dir = spec_path.with_name(spec_path.stem + "-warm")
        warm_dir.mkdir()
        spec["warm_start_dir"] = str(warm_dir)
        prime_path = spec_path.with_name(spec_path.stem + "-prime.json")
        priming = _worker(plan, config, dict(spec, phase="prime", warm=warm), prime_path, env)
        if "error" not in priming and not priming.get("saved"):
            priming["error"] = "the priming session saved no warm-start file (was its popularity empty?)"
        if "error" in priming:
            return dict(config=config.as_dict(), error=f"priming: {priming['error']}", priming=priming)
    run = _worker(plan, config, spec, spec_path, env)
    return dict(run, priming=priming) if priming is not None else run


def _worker(plan: BenchPlan, config: BenchConfig, spec: dict, spec_path: Path, env: dict) -> dict:
    """Run the worker on ``spec`` (under the config's memory limit, the page cache dropped first); its JSON
    with wall time, cgroup peak and OOM kills, or {config, error, ...}."""
    spec_path.write_text(json.dumps(spec))
    command = [sys.executable, "-m", "llamapack.bench.worker", str(spec_path)]
    extra: dict = {}
    started = time.perf_counter()
    if config.memory_limit_mib is None:
        proc = _run(command, env, plan.config_timeout_s)
    else:
        extra["page_cache_dropped"] = drop_page_cache()
        with MemoryCage(config.memory_limit_mib << 20) as cage:
            proc = _run(command, env, plan.config_timeout_s, preexec_fn=cage.join)
            extra.update(cgroup_peak_mib=(cage.peak_bytes() or 0) / 2**20, oom_kills=cage.oom_kills())
    extra["wall_s"] = time.perf_counter() - started
    if isinstance(proc, str):
        return dict(config=config.as_dict(), error=proc, **extra)
    if proc.returncode != 0:
        return dict(config=config.as_dict(), error=f"worker exit {proc.returncode}: {proc.stderr[-3000:]}", **extra)
    return {**json.loads(proc.stdout.strip().splitlines()[-1]), **extra}


def _run(command: list[str], env: dict, timeout: float, preexec_fn=None):
    try:
        return subprocess.run(command, capture_output=True, text=True, env=env, timeout=timeout,
                              preexec_fn=preexec_fn)
    except subprocess.TimeoutExpired:
        return f"timed out after {timeout:g} s"
