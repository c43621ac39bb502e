"""Upstream llama.cpp b11549 as a baseline of the GPU benchmark: its own VRAM cache of host-resident experts
(``-cmoe --moe-cache-mib N``), measured with its ``llama-batched-bench`` (built by bench/upstream_build.sh;
bench/results/upstream_README.md). Pure command building and output parsing, plus ``run_upstream``.

What batched-bench measures (tools/batched-bench/batched-bench.cpp of b11549): after a warm-up decode of 16
random tokens, for each prompt length P (in ``-npp`` order) it clears the KV cache, decodes P random tokens
(T_PP: the prompt's llama_process calls of ``-b`` tokens, then one llama_synchronize; logits of the last token
only, nothing sampled), then ``-ntg`` T single-token decodes at positions P.., each synchronized, of random
tokens (T_TG: logits every step, nothing sampled). S_PP = P / T_PP and S_TG = T / T_TG. Ours times the same
phases through Python (prefill including the first token's argmax; decode of n_decode - 1 sampled tokens),
after the same warm-up (``--warmup-tokens``, 16 by default: a prompt of the same trace request, thrown away).

What a run lacks next to ours: no logits digests (no bit-exact column), no time to first token other than
T_PP, and cache counters only for the whole process (llama_moe_cache logs them in llama_free, which only the patched
batched-bench flushes before it exits: without bench/upstream/replay.patch they may be lost; "ubatch <= 8" is decode
with -npl 1, "ubatch > 8" the warm-up and prompts of <= 32 tokens, and prompts of more tokens only copy what the
cache holds); they are put on the first request so that the bench's sums over requests come out right.

Routing replay needs the benchmark-only patch bench/upstream/replay.patch (LLAMA_REPLAY_TRACE=FILE): FILE holds
one segment of rows per ubatch that starts at position 0, i.e. one for the warm-up, then one per prompt
length, each the rows of a bench request (``replay_rows``: the mapping of llamapack/bench/replay.py).
"""
from __future__ import annotations

import json
import math
import os
import re
import subprocess
import time
from dataclasses import asdict, dataclass

import numpy as np

MIB = 1 << 20
REPLAY_MAGIC = 0x31505452            # the patch's file magic ("RTP1" little-endian)
BATCHED_BENCH_WARMUP_TOKENS = 16     # batched-bench's warm-up: 16 random tokens at positions 0..15, one ubatch
LOAD_MODES = ("none", "mmap")


class UpstreamError(Exception):
    """A batched-bench run whose output is not what the bench needs (or a config it cannot run)."""


@dataclass(frozen=True)
class UpstreamConfig:
    """One way of running upstream's batched-bench. ``cpu_moe``: routed experts in host memory (-cmoe), else all in
    VRAM. ``cache_mib``: its VRAM expert cache (--moe-cache-mib; needs cpu_moe). ``load_mode``: "none" reads the
    experts into pinned host memory at load (upstream's own advice with -cmoe, the RAM-rich case), "mmap" serves
    them from the page cache (what a memory limit allows). ``memory_limit_mib``: a cgroup memory.max.
    ``n_decode``: tokens decoded after each prompt, when fewer than the bench's (a run expected to be slow, such
    as one that pages experts in under a limit); ``timeout_s``: its own limit, when shorter than the bench's."""

    name: str
    cpu_moe: bool = True
    cache_mib: int = 0
    load_mode: str = "none"
    n_threads: int = 16
    n_gpu_layers: int = 99
    memory_limit_mib: int | None = None
    n_decode: int | None = None
    timeout_s: float | None = None

    def __post_init__(self):
        if (self.n_decode is not None and self.n_decode < 1) or (self.timeout_s is not None and not self.timeout_s > 0):
            raise ValueError(f"{self.name}: n_decode must be >= 1 and timeout_s > 0")
        if self.cache_mib < 0 or (self.cache_mib and not self.cpu_moe):
            raise ValueError(f"{self.name}: --moe-cache-mib caches host-resident experts: it needs cpu_moe and >= 0")
        if self.load_mode not in LOAD_MODES:
            raise ValueError(f"{self.name}: load_mode is one of {LOAD_MODES}, not {self.load_mode!r}")
        if self.memory_limit_mib is not None and self.load_mode != "mmap" and self.cpu_moe:
            raise ValueError(f"{self.name}: under a memory limit the host experts must be mmapped (load_mode mmap); "
                             "pinned host memory would hold them all")

    def as_dict(self) -> dict:
        return dict(asdict(self), source="upstream")


def cache_mib_for_slots(n_slots: int, slot_bytes: int) -> int:
    """The --moe-cache-mib that gives upstream the VRAM of a llamapack pool of ``n_slots`` x ``slot_bytes`` (its
    slots then number about n_slots - 1: it keeps one spare slot and packs experts without our padding)."""
    return max(1, math.ceil(n_slots * slot_bytes / MIB))


def batched_bench_command(binary: str, model: str, config: UpstreamConfig, prompt_lengths, n_decode: int,
                          n_ctx: int = 1024, n_batch: int = 512, n_ubatch: int = 512) -> list[str]:
    """llama-batched-bench's command line for our workload: one sequence (-npl 1), each prompt length in order,
    ``n_decode`` decoded tokens after each, flash attention off (as our runs), results as JSON lines."""
    prompt_lengths = [int(p) for p in prompt_lengths]
    if not prompt_lengths or min(prompt_lengths) < 1 or n_decode < 1:
        raise ValueError("prompt lengths and n_decode must be >= 1")
    if max(prompt_lengths) + n_decode > n_ctx:
        # batched-bench silently skips a prompt length whose P + T does not fit the context
        raise ValueError(f"n_ctx {n_ctx} < longest prompt + n_decode = {max(prompt_lengths) + n_decode}")
    threads = str(config.n_threads)
    command = [binary, "-m", model, "-ngl", str(config.n_gpu_layers), "-c", str(n_ctx), "-b", str(n_batch),
               "-ub", str(n_ubatch), "-fa", "off", "-t", threads, "-tb", threads,
               "-npp", ",".join(map(str, prompt_lengths)), "-ntg", str(n_decode), "-npl", "1",
               "--output-format", "jsonl", "-lv", "4"]  # llama's INFO lines log at verbosity 4
    if config.cpu_moe:
        command += ["-cmoe", "--load-mode", config.load_mode]
    if config.cache_mib:
        # the cache copies host experts byte for byte: they must keep llama.cpp's layout (never CPU-repacked)
        command += ["--moe-cache-mib", str(config.cache_mib), "--no-repack"]
    return command


_ANSI = re.compile(r"\x1b\[[0-9;]*m")
_ROW_KEYS = ("pp", "tg", "pl", "n_kv", "t_pp", "speed_pp", "t_tg", "speed_tg", "t", "speed")
# batched-bench.cpp: LOG("|%6d | %6d | %4d | %6d | %8.3f | %8.2f | %8.3f | %8.2f | %8.3f | %8.2f |\n", ...)
_MD_ROW = re.compile(r"^\|" + r"\s*(\d+)\s*\|" * 4 + r"\s*([-\d.]+|nan|inf)\s*\|" * 6 + r"\s*$")


def parse_rows(stdout: str) -> list[dict]:
    """batched-bench's result rows, JSON lines (--output-format jsonl) or its markdown table, in output order."""
    rows = []
    for line in _ANSI.sub("", stdout).splitlines():
        line = line.strip()
        if line.startswith("{") and '"speed_tg"' in line:
            record = json.loads(line)
            rows.append({k: record[k] for k in _ROW_KEYS})
        elif match := _MD_ROW.match(line):
            values = match.groups()
            rows.append({k: (int(v) if i < 4 else float(v)) for i, (k, v) in enumerate(zip(_ROW_KEYS, values))})
    return rows


_NUM = r"([\d.]+)"
_STATS = re.compile(r"llama_moe_cache: ubatch\s+(<=|>) 8: hits = (\d+), misses = (\d+), hit rate = [\d.]+%, "
                    rf"uploaded = {_NUM} MiB")
_COPIED = re.compile(rf"llama_moe_cache: large batches: (\d+) experts copied from the cache, {_NUM} MiB")
_SIZE = re.compile(rf"(\S+) MoE cache size = \s*{_NUM} MiB for {_NUM} MiB of host experts")
_GROUP = re.compile(r":\s+(\d+) layers, (\w+): \s*(\d+) slots \(([\d.]+)%\)")
_LOAD = re.compile(rf"llama_perf_context_print:\s+load time = \s*{_NUM} ms")
_REUSED = re.compile(r"llama_perf_context_print:\s+graphs reused = \s*(\d+)")
_REPLAY = re.compile(r"llama_replay: layers (\d+)\.\.(\d+) take their experts from the trace")
_PROBLEMS = ("MoE cache is disabled", "MoE cache budget is too small", "MoE cache is too small",
             "failed to decode", "unable to load model", "failed to create the llama_context")


def parse_log(log: str) -> dict:
    """What the log (stderr) says of the cache, the replay, the load time and problems."""
    info: dict = dict(cache=None, decode=None, batch=None, copied=None, load_s=None, graphs_reused=None,
                      replayed_layers=None, problems=[])
    for line in _ANSI.sub("", log).splitlines():
        if m := _STATS.search(line):
            info["decode" if m[1] == "<=" else "batch"] = dict(hits=int(m[2]), misses=int(m[3]),
                                                              uploaded_bytes=float(m[4]) * MIB)
        elif m := _COPIED.search(line):
            info["copied"] = dict(experts=int(m[1]), bytes=float(m[2]) * MIB)
        elif m := _SIZE.search(line):
            info["cache"] = dict(buffer=m[1], size_mib=float(m[2]), host_experts_mib=float(m[3]), groups=[])
        elif (m := _GROUP.search(line)) and "MoE cache" not in line and info["cache"] is not None:
            info["cache"]["groups"].append(dict(layers=int(m[1]), type=m[2], slots=int(m[3]), percent=float(m[4])))
        elif m := _LOAD.search(line):
            info["load_s"] = float(m[1]) / 1e3
        elif m := _REUSED.search(line):
            info["graphs_reused"] = int(m[1])
        elif m := _REPLAY.search(line):
            info["replayed_layers"] = (int(m[1]), int(m[2]))
        if any(p in line for p in _PROBLEMS):
            info["problems"].append(line.strip())
    return info


def to_run(config: UpstreamConfig, rows: list[dict], log: dict, prompt_lengths, n_decode: int,
           replayed: bool = False) -> dict:
    """A bench run (llamapack/bench/report.py's shape) from batched-bench's rows and log; UpstreamError when they
    do not hold every prompt length, or the cache or the replay asked for did not happen."""
    prompt_lengths = [int(p) for p in prompt_lengths]
    got = [(r["pp"], r["tg"], r["pl"]) for r in rows]
    if got != [(p, n_decode, 1) for p in prompt_lengths]:
        expected = [(p, n_decode, 1) for p in prompt_lengths]
        raise UpstreamError(f"{config.name}: batched-bench rows (pp, tg, pl) {got}, expected {expected}")
    if log["problems"]:
        raise UpstreamError(f"{config.name}: {log['problems'][0]}")
    if config.cache_mib and log["cache"] is None:
        raise UpstreamError(f"{config.name}: --moe-cache-mib {config.cache_mib} but no MoE cache in the log")
    if replayed and log["replayed_layers"] is None:
        raise UpstreamError(f"{config.name}: LLAMA_REPLAY_TRACE set but the binary did not replay "
                            "(not built with bench/upstream/replay.patch, or the trace's top-k is not the model's)")
    requests = [dict(n_prompt=r["pp"], prefill_s=r["t_pp"], ttft_s=r["t_pp"], n_decoded=r["tg"], decode_s=r["t_tg"],
                     decode_eval_s=r["t_tg"], decode_capped=False, tokens=[], digests=[], prefill_counters={}, decode_counters={})
                for r in rows]
    if log["decode"] is not None:  # process totals, on the first request (the bench sums over requests)
        d = log["decode"]
        requests[0]["decode_counters"] = dict(cache_hits=d["hits"], cache_misses=d["misses"],
                                              h2d_bytes=d["uploaded_bytes"])
    provider = {}
    if log["cache"] is not None:
        groups = log["cache"]["groups"]
        provider = dict(device=log["cache"]["buffer"], pool_bytes=log["cache"]["size_mib"] * MIB,
                        n_slots=sum(g["slots"] for g in groups))
    return dict(config=config.as_dict(), load_s=log["load_s"], requests=requests, provider=provider,
                routing="replayed" if replayed else "own", counters_scope="process",
                upstream=dict(rows=rows, cache=log["cache"], decode=log["decode"], batch=log["batch"],
                              copied=log["copied"], graphs_reused=log["graphs_reused"],
                              replayed_layers=log["replayed_layers"]))


def replay_rows(trace, request: int, n_prompt: int, n_tokens: int) -> np.ndarray:
    """The trace's rows a bench request replays, int32 [n_tokens, n_layers, top_k]: trace request ``request`` mod
    its requests; tokens below ``n_prompt`` take its prefill rows, the others its decode rows, each cycled
    (llamapack/bench/replay.py's mapping; a request with no rows of one kind uses the other kind)."""
    bounds = trace.request_bounds()
    first, end = bounds[request % len(bounds)]
    rows, prefill = trace.experts[first:end], trace.prefill[first:end]
    prompt_rows, decode_rows = rows[prefill], rows[~prefill]
    if len(prompt_rows) == 0:
        prompt_rows = decode_rows
    if len(decode_rows) == 0:
        decode_rows = prompt_rows
    picked = [prompt_rows[t % len(prompt_rows)] if t < n_prompt else decode_rows[(t - n_prompt) % len(decode_rows)]
              for t in range(n_tokens)]
    return np.asarray(picked, dtype=np.int32).reshape(n_tokens, trace.n_layers, trace.top_k)


def replay_segments(trace, prompt_lengths, n_decode: int) -> list[np.ndarray]:
    """The segments batched-bench walks through, one per ubatch at position 0: its warm-up (the trace request after
    the bench's, so that the warm-up fills the cache with other experts than the measured requests use, as
    random tokens would), then one per prompt length, request r replaying trace request r."""
    prompt_lengths = [int(p) for p in prompt_lengths]
    warmup = replay_rows(trace, len(prompt_lengths), BATCHED_BENCH_WARMUP_TOKENS, BATCHED_BENCH_WARMUP_TOKENS)
    return [warmup] + [replay_rows(trace, r, p, p + n_decode) for r, p in enumerate(prompt_lengths)]


def encode_replay(segments: list[np.ndarray], first_layer: int = 0) -> bytes:
    """The replay patch's file: int32 magic, n_segments, n_layers, top_k, first_layer, the row count of each
    segment, then each segment's rows [rows][n_layers][top_k], little-endian."""
    if not segments:
        raise ValueError("a replay file needs at least one segment")
    shapes = {s.shape[1:] for s in segments}
    if len(shapes) != 1 or any(s.ndim != 3 or len(s) == 0 for s in segments):
        raise ValueError(f"segments must be non-empty [rows, n_layers, top_k] of one shape, got {shapes}")
    n_layers, top_k = shapes.pop()
    head = np.array([REPLAY_MAGIC, len(segments), n_layers, top_k, first_layer] + [len(s) for s in segments], "<i4")
    return head.tobytes() + b"".join(np.ascontiguousarray(s, dtype="<i4").tobytes() for s in segments)


def decode_replay(data: bytes) -> tuple[list[np.ndarray], int]:
    """``encode_replay``'s inverse: (segments, first_layer); ValueError on a malformed file."""
    words = np.frombuffer(data, dtype="<i4")
    if len(words) < 5 or words[0] != REPLAY_MAGIC or min(words[1:4]) < 1 or words[4] < 0:
        raise ValueError("not a routing replay file")
    n_segments, n_layers, top_k, first_layer = (int(w) for w in words[1:5])
    counts = words[5:5 + n_segments]
    offset, segments = 5 + n_segments, []
    for count in counts:
        size = int(count) * n_layers * top_k
        segments.append(words[offset:offset + size].reshape(int(count), n_layers, top_k).copy())
        offset += size
    if offset != len(words):
        raise ValueError("routing replay file: size does not match its header")
    return segments, first_layer


def run_upstream(binary: str, model: str, config: UpstreamConfig, prompt_lengths, n_decode: int, work_dir,
                 trace=None, timeout_s: float = 1800.0, n_ctx: int = 1024, n_ubatch: int = 512) -> dict:
    """Run batched-bench once (under the config's memory limit, if any) and return the bench run, or a run with
    ``error``. ``trace``: a RoutingTrace to replay (its file is written into ``work_dir``)."""
    from .cgroup import MemoryCage, drop_page_cache  # noqa: PLC0415  (I/O only here)

    command = batched_bench_command(binary, model, config, prompt_lengths, n_decode, n_ctx=n_ctx,
                                    n_batch=max(512, n_ubatch), n_ubatch=n_ubatch)
    env = {k: v for k, v in os.environ.items() if not k.startswith("LLAMA_ARG_") and k != "LLAMA_REPLAY_TRACE"}
    if trace is not None:
        path = os.path.join(os.fspath(work_dir), f"replay-{config.name}.i32")
        with open(path, "wb") as handle:
            handle.write(encode_replay(replay_segments(trace, prompt_lengths, n_decode)))
        env["LLAMA_REPLAY_TRACE"] = path
    extra: dict = dict(command=command)
    started = time.perf_counter()
    try:
        if config.memory_limit_mib is None:
            proc = subprocess.run(command, capture_output=True, text=True, env=env, timeout=timeout_s)
        else:
            extra["page_cache_dropped"] = drop_page_cache()
            with MemoryCage(config.memory_limit_mib << 20) as cage:
                proc = subprocess.run(command, capture_output=True, text=True, env=env, timeout=timeout_s,
                                      preexec_fn=cage.join)
                extra.update(cgroup_peak_mib=(cage.peak_bytes() or 0) / MIB, oom_kills=cage.oom_kills())
    except subprocess.TimeoutExpired:
        return dict(config=config.as_dict(), error=f"timed out after {timeout_s:g} s", **extra)
    except OSError as exc:
        return dict(config=config.as_dict(), error=f"cannot run {binary}: {exc}", **extra)
    extra["wall_s"] = time.perf_counter() - started
    if proc.returncode != 0:
        return dict(config=config.as_dict(), error=f"batched-bench exit {proc.returncode}: {proc.stderr[-3000:]}",
                    **extra)
    try:
        run = to_run(config, parse_rows(proc.stdout), parse_log(proc.stderr), prompt_lengths, n_decode,
                     replayed=trace is not None)
    except UpstreamError as exc:
        return dict(config=config.as_dict(), error=str(exc), log_tail=proc.stderr[-3000:], **extra)
    return {**run, **extra}
