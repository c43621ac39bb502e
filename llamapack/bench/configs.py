"""The benchmark's configurations: pure data, no I/O.

One ``BenchConfig`` is one way of running the same model on the same prompts. ``default_matrix`` gives the
issue's side-by-side set: vanilla llama.cpp with every expert on the GPU (upper bound), vanilla with the
experts in RAM computed on the CPU (``--cpu-moe``, what users have), the same under a memory limit the
experts do not fit in, and llamapack (pack and GGUF-direct) with VRAM expert caches of a few sizes under
the same limit.
"""
from __future__ import annotations

import random
import re
from dataclasses import asdict, dataclass, replace

VANILLA, PACK, GGUF_DIRECT = "vanilla", "pack", "gguf_direct"
MIB = 1 << 20
AHEAD_MIN_TOKENS = 64  # +ahead: load-ahead after steps of at least this many tokens (prefill ubatches)


@dataclass(frozen=True)
class BenchConfig:
    """``source``: vanilla (libllama holds every expert), pack or gguf_direct (llamapack's provider).
    ``cpu_moe``: vanilla with routed experts in host memory, computed on the CPU. ``repack``: llama.cpp's
    CPU weight repacking (``use_extra_bufts``; off means the experts stay mmapped). ``vram_fraction``: the
    expert cache's share of all routed experts (pack modes). ``memory_limit_mib``: a cgroup ``memory.max``
    the run is held to (None: no limit). ``ram_fraction``: a host-RAM tier holding that share of the experts;
    ``ram_auto``: one the provider sizes from the spare RAM (``ram_cache_mib="auto"``); ``ram_preload``: that
    tier filled from the SSD at load (its time is in the run's load time). ``own_routing``: a llamapack run that
    keeps the model's router when the bench replays a routing trace (to compare with runs that cannot
    replay, such as vanilla llama.cpp's). ``prefetch``: router
    lookahead (pack modes). ``native_reads``: pack reads on the native read pool (True) or Python threads
    (False); None: the provider's default. ``verify``: each pack block's sha256 checked on its first read (the
    default; ``+noverify`` turns it off). ``cache_policy``: the pool's and tier's policy (``+lfulru`` and ``+lru``
    run the older ones, to measure the default against them). ``native_hot_path``: all-hit steps (and steps whose
    misses the RAM tier holds) served inside libllama without entering Python (the default; ``+pyhot`` turns it
    off: every step through the Python provider, the "before" of the native hot path). ``warm_start``: the run
    starts from the popularity a priming session saved (``+warm``, pack runs only): before the measured process,
    the runner runs a priming process with the same settings on trace requests the measured prompts do not
    replay, which saves the popularity at close into a temporary folder; the measured process loads it and
    fills the pool (and tier) at load. Other runs start cold. ``hybrid``: hybrid execution (``+hybrid``: "on",
    every RAM-tier miss of a native step computed on the CPU; ``+hybridauto``; ``+hybridU%``: that upload share),
    llamapack runs with a RAM tier only. ``slot_lookup``: decode steps remapped by the slot lookup on the GPU
    (the default; ``+oppath`` runs every step through the CPU remap op instead, the "before" of the lookup).
    ``whole_pool``: once the pool holds every expert, whole-pool graphs (static maps on the device, no split per
    layer; the default; ``+nowhole`` keeps the slot lookup or the op, the "before"). ``load_ahead``: ``+ahead``
    loads a prefill ubatch's next layer from the RAM tier while the layer computes (load_ahead_min_tokens
    ``AHEAD_MIN_TOKENS``; needs a RAM tier and the native hot path). ``layer_windows``: ``+windows`` reads a
    prefill ubatch's experts from two windows of the pool, the next layer's loaded from the RAM tier meanwhile
    (layer_windows_min_tokens ``AHEAD_MIN_TOKENS``; needs a RAM tier, filled at start: +preload).
    ``reference``: the run other runs' logits are compared with."""

    name: str
    source: str = VANILLA
    cpu_moe: bool = False
    repack: bool = True
    vram_fraction: float | None = None
    ram_fraction: float | None = None
    ram_auto: bool = False
    ram_preload: bool = False
    prefetch: bool = False
    prefetch_top: int | None = None
    prefetch_depth: int = 1
    prefetch_in_flight: int | None = None
    read_splits: int | None = None
    native_reads: bool | None = None
    memory_limit_mib: int | None = None
    n_threads: int = 4
    n_gpu_layers: int = 99
    reference: bool = False
    own_routing: bool = False
    verify: bool = True
    cache_policy: str = "next-use"
    native_hot_path: bool = True
    warm_start: bool = False
    hybrid: str | float = "off"
    slot_lookup: bool = True
    whole_pool: bool = True
    load_ahead: bool = False
    layer_windows: bool = False

    def __post_init__(self):
        if self.hybrid != "off" and (self.source == VANILLA or (self.ram_fraction is None and not self.ram_auto)
                                     or not self.native_hot_path or self.prefetch):
            raise ValueError(f"{self.name}: hybrid is a llamapack setting that needs a RAM tier (+ram...) and the "
                             "native hot path (not +pyhot, not +prefetch)")
        if self.source not in (VANILLA, PACK, GGUF_DIRECT):
            raise ValueError(f"{self.name}: unknown source {self.source!r}")
        if (self.source == VANILLA) == (self.vram_fraction is not None):
            raise ValueError(f"{self.name}: vram_fraction is for pack and gguf_direct runs only, and needed there")
        if (self.prefetch or self.read_splits is not None or self.native_reads is not None) and self.source == VANILLA:
            raise ValueError(f"{self.name}: prefetch, read_splits and native_reads are llamapack settings")
        if self.cache_policy != "next-use" and self.source == VANILLA:
            raise ValueError(f"{self.name}: the cache policy is a llamapack setting")
        if not self.slot_lookup and self.source == VANILLA:
            raise ValueError(f"{self.name}: oppath (the CPU remap op instead of the slot lookup) is a llamapack setting")
        if not self.whole_pool and self.source == VANILLA:
            raise ValueError(f"{self.name}: nowhole (no whole-pool graphs) is a llamapack setting")
        if self.load_ahead and (self.source == VANILLA or (self.ram_fraction is None and not self.ram_auto)
                                or not self.native_hot_path):
            raise ValueError(f"{self.name}: ahead (load-ahead) is a llamapack setting that needs a RAM tier (+ram...) "
                             "and the native hot path (not +pyhot)")
        if self.layer_windows and (self.source == VANILLA or not self.ram_preload or not self.native_hot_path):
            raise ValueError(f"{self.name}: windows (layer windows) is a llamapack setting that needs a RAM tier filled "
                             "at start (+ram...+preload) and the native hot path (not +pyhot)")
        if not self.native_hot_path and self.source == VANILLA:
            raise ValueError(f"{self.name}: pyhot (every step through the Python provider) is a llamapack setting")
        if self.warm_start and (self.source != PACK or self.own_routing or self.cache_policy != "next-use"):
            raise ValueError(f"{self.name}: warm (a start from a priming session's popularity) is a pack setting "
                             "(GGUF-direct has no pack identity to save it under), with the next-use policy (the one "
                             "that saves and loads popularity) and replayed routing (the priming session replays "
                             "trace requests the measured prompts do not), not +ownrouting")
        if not self.verify and self.source != PACK:
            raise ValueError(f"{self.name}: noverify (no sha256 check on first read) is a pack setting")
        if self.ram_auto and (self.ram_fraction is not None or self.source == VANILLA):
            raise ValueError(f"{self.name}: ram_auto (a RAM tier sized by the spare RAM) is a llamapack setting, "
                             "instead of ram_fraction")
        if self.ram_preload and self.ram_fraction is None and not self.ram_auto:
            raise ValueError(f"{self.name}: ram_preload fills a RAM tier: it needs ram_fraction or ram_auto")
        if self.own_routing and self.source == VANILLA:
            raise ValueError(f"{self.name}: own_routing is a llamapack setting (vanilla runs always route themselves)")
        if self.cpu_moe and self.source != VANILLA:
            raise ValueError(f"{self.name}: cpu_moe is a vanilla llama.cpp setting")
        if not 1 <= self.prefetch_depth <= 8 or (self.read_splits is not None and self.read_splits < 1):
            raise ValueError(f"{self.name}: prefetch_depth must be in [1, 8] and read_splits >= 1")
        for field in ("vram_fraction", "ram_fraction"):
            value = getattr(self, field)
            if value is not None and not 0 < value <= 1:
                raise ValueError(f"{self.name}: {field} must be in (0, 1], got {value}")

    @property
    def uses_provider(self) -> bool:
        return self.source != VANILLA

    def cache_slots(self, n_experts: int) -> int | None:
        """Experts the VRAM cache holds, for a model of ``n_experts`` routed experts (all layers)."""
        return None if self.vram_fraction is None else max(1, round(self.vram_fraction * n_experts))

    def ram_cache_mib(self, expert_bytes: int) -> float | str | None:
        """The provider's ``ram_cache_mib``: the tier's share of ``expert_bytes``, "auto", or None (no tier)."""
        if self.ram_auto:
            return "auto"
        return None if self.ram_fraction is None else self.ram_fraction * expert_bytes / MIB

    def as_dict(self) -> dict:
        return asdict(self)


def percent(fraction: float) -> str:
    return f"{100 * fraction:g}%"


def default_matrix(n_cores: int, memory_limit_mib: int | None, fractions=(0.25, 0.5), *, gpu: bool = True,
                   gguf_direct: bool = True, full_cache: bool = True, ram_tier: bool = False,
                   prefetch: bool = False, prefetch_tops=(), prefetch_depths=(), read_splits=(),
                   prefetch_in_flights=(), ram_fractions=(), read_engines: bool = False) -> list[BenchConfig]:
    """The side-by-side set, reference first.

    ``memory_limit_mib`` None leaves out the limited runs (a machine without cgroup v2). ``full_cache`` adds
    a pack run whose cache holds every expert: no reads, so its gap to the reference is the hook's own cost.
    ``ram_tier`` adds pack runs with a host-RAM tier holding every expert (no limit: the RAM-rich case).
    ``prefetch`` adds, beside each limited pack run, the same run with router lookahead (``+prefetch``), and
    each r of ``prefetch_tops`` one that prefetches only each token's best r guesses (``+prefetch-top{r}``),
    each d of ``prefetch_depths`` one that guesses d layers ahead (``+prefetch-d{d}``), and each n of
    ``read_splits`` one that reads each expert in n parallel pieces, without prefetch (``+split{n}``), each c
    of ``prefetch_in_flights`` one that reads at most c lookahead pieces at once (``+prefetch-c{c}``), each r
    of ``ram_fractions`` one with a host-RAM tier holding that share of the experts (``+ram{r}``: the spare
    RAM of the low-RAM case, under the same limit). With
    ``read_engines`` each limited pack run gets two twins: reading on the native pool (``+native``) and on Python
    threads (``+pyreads``).
    Without a GPU (``gpu=False``) the reference runs with repacking off, as a host slot pool does, so that
    its logits can be compared exactly. Under a memory limit the ``--cpu-moe`` run cannot repack (repacking copies every expert into RAM,
    which the limit does not hold): it runs with the experts mmapped, as ``--no-repack`` does.
    """
    configs = [BenchConfig("vanilla-vram" if gpu else "vanilla", reference=True, repack=gpu),
               BenchConfig("cpu-moe", cpu_moe=True, n_threads=n_cores)]
    if full_cache:
        configs.append(BenchConfig("pack-100%", source=PACK, vram_fraction=1.0))
    if ram_tier:
        configs += [BenchConfig(f"pack-{percent(f)}+ram", source=PACK, vram_fraction=f, ram_fraction=1.0)
                    for f in fractions]
    limited = [BenchConfig("cpu-moe", cpu_moe=True, repack=False, n_threads=n_cores)]
    for f in fractions:
        limited.append(BenchConfig(f"pack-{percent(f)}", source=PACK, vram_fraction=f))
        if prefetch:
            limited.append(BenchConfig(f"pack-{percent(f)}+prefetch", source=PACK, vram_fraction=f, prefetch=True))
        limited += [BenchConfig(f"pack-{percent(f)}+prefetch-top{r}", source=PACK, vram_fraction=f, prefetch=True,
                                prefetch_top=r) for r in prefetch_tops]
        limited += [BenchConfig(f"pack-{percent(f)}+prefetch-d{d}", source=PACK, vram_fraction=f, prefetch=True,
                                prefetch_depth=d) for d in prefetch_depths]
        limited += [BenchConfig(f"pack-{percent(f)}+split{n}", source=PACK, vram_fraction=f, read_splits=n)
                    for n in read_splits]
        limited += [BenchConfig(f"pack-{percent(f)}+prefetch-c{c}", source=PACK, vram_fraction=f, prefetch=True,
                                prefetch_in_flight=c) for c in prefetch_in_flights]
        limited += [BenchConfig(f"pack-{percent(f)}+ram{percent(r)}", source=PACK, vram_fraction=f, ram_fraction=r)
                    for r in ram_fractions]
    if read_engines:
        packed = [c for c in limited if c.source == PACK]
        limited += [replace(c, name=f"{c.name}+{suffix}", native_reads=native) for native, suffix in
                    ((True, "native"), (False, "pyreads")) for c in packed]
    if gguf_direct:
        limited += [BenchConfig(f"gguf-direct-{percent(f)}", source=GGUF_DIRECT, vram_fraction=f) for f in fractions]
    if memory_limit_mib is not None:
        configs += [replace(c, name=f"{c.name}@{memory_limit_mib // 1024}G" if memory_limit_mib % 1024 == 0
                            else f"{c.name}@{memory_limit_mib}M", memory_limit_mib=memory_limit_mib)
                    for c in limited]
    else:
        configs += limited[1:]
    return configs


NAME_GRAMMAR = ("vanilla-vram | vanilla | cpu-moe | pack-F% | gguf-direct-F%, then any of +ram, +ramR%, +ramauto, "
                "+preload, +prefetch, +prefetch-topR, +prefetch-dD, +prefetch-cN, +splitN, +native, +pyreads, +ownrouting, +noverify, "
                "+lfulru, +lru, +pyhot, +oppath, +nowhole, +ahead, +windows, +warm, +hybrid, +hybridauto, +hybridU%, then @NG or @NM")
_SUFFIX = re.compile(r"\+(ram(?P<ram>[\d.]+)%|ramauto|ram|prefetch-top(?P<top>\d+)|prefetch-d(?P<depth>\d+)"
                     r"|prefetch-c(?P<flight>\d+)|prefetch|preload|split(?P<split>\d+)|native|pyreads|ownrouting|noverify|lfulru|lru|pyhot|oppath|nowhole|ahead|windows|warm"
                     r"|hybridauto|hybrid(?P<hshare>[\d.]+)%|hybrid)(?=\+|$)")


def parse_config(name: str, n_cores: int) -> BenchConfig:
    """The configuration a name of ``NAME_GRAMMAR`` describes, as ``default_matrix`` would build it (so that
    any combination can be run, e.g. ``pack-25%+ram25%+prefetch-top2@8G``); ValueError for another name."""
    body, _, limit = name.partition("@")
    fields: dict = {}
    if limit:
        match = re.fullmatch(r"(\d+)([GM])", limit)
        if not match:
            raise ValueError(f"{name}: a memory limit is @<n>G or @<n>M")
        fields["memory_limit_mib"] = int(match[1]) * (1024 if match[2] == "G" else 1)
    base, _, suffixes = body.partition("+")
    if base in ("vanilla-vram", "vanilla"):
        fields.update(reference=True, repack=base == "vanilla-vram")
    elif base == "cpu-moe":
        fields.update(cpu_moe=True, n_threads=n_cores, repack=not limit)  # a limit cannot hold a repack
    else:
        match = re.fullmatch(r"(pack|gguf-direct)-([\d.]+)%", base)
        if not match:
            raise ValueError(f"{name}: unknown run {base!r}")
        fields.update(source=PACK if match[1] == "pack" else GGUF_DIRECT, vram_fraction=float(match[2]) / 100)
    rest = "+" + suffixes if suffixes else ""
    while rest:
        match = _SUFFIX.match(rest)
        if not match:
            raise ValueError(f"{name}: unknown option {rest[1:].split('+')[0]!r}")
        option, rest = match[1], rest[match.end():]
        if option == "ramauto":
            fields["ram_auto"] = True
        elif option == "preload":
            fields["ram_preload"] = True
        elif option == "ownrouting":
            fields["own_routing"] = True
        elif option == "noverify":
            fields["verify"] = False
        elif option == "pyhot":
            fields["native_hot_path"] = False
        elif option == "oppath":
            fields["slot_lookup"] = False
        elif option == "nowhole":
            fields["whole_pool"] = False
        elif option == "ahead":
            fields["load_ahead"] = True
        elif option == "windows":
            fields["layer_windows"] = True
        elif option == "warm":
            fields["warm_start"] = True
        elif option.startswith("hybrid"):
            fields["hybrid"] = "auto" if option == "hybridauto" else float(match["hshare"]) / 100 if match["hshare"] else "on"
        elif option in ("lfulru", "lru"):
            fields["cache_policy"] = {"lfulru": "lfu-lru", "lru": "lru"}[option]
        elif option == "ram" or match["ram"]:
            fields["ram_fraction"] = float(match["ram"]) / 100 if match["ram"] else 1.0
        elif option.startswith("prefetch"):
            fields["prefetch"] = True
            for group, field in (("top", "prefetch_top"), ("depth", "prefetch_depth"), ("flight", "prefetch_in_flight")):
                if match[group]:
                    fields[field] = int(match[group])
        elif match["split"]:
            fields["read_splits"] = int(match["split"])
        else:
            fields["native_reads"] = option == "native"
    return BenchConfig(name, **fields)


def select(configs: list[BenchConfig], names: list[str] | None, n_cores: int = 1) -> list[BenchConfig]:
    """The configs named, the reference first, then in the order given: a name in ``configs`` is that
    config, another is parsed (``parse_config``); a name neither knows is a ValueError listing the known ones."""
    if not names:
        return configs
    known = {c.name: c for c in configs}
    chosen, unknown = [], []
    for name in dict.fromkeys(names):
        try:
            chosen.append(known[name] if name in known else parse_config(name, n_cores))
        except ValueError as exc:
            unknown.append(str(exc))
    if unknown:
        raise ValueError(f"unknown config(s): {'; '.join(unknown)}. Known: {', '.join(known)}; or any "
                         f"{NAME_GRAMMAR}")
    return sorted(chosen, key=lambda c: not c.reference)


def schedule(configs, rounds: int = 1, shuffle_seed: int | None = None) -> list[tuple[int, BenchConfig]]:
    """(round, config) in the order to run: the reference once, first; then every other config once per
    round, in the given order or, with ``shuffle_seed``, in a fresh seeded shuffle each round (so that no
    run always follows the same one: the disk and the page cache carry state from run to run)."""
    if rounds < 1:
        raise ValueError(f"rounds must be >= 1 (got {rounds})")
    references = [c for c in configs if c.reference]
    others = [c for c in configs if not c.reference]
    order = [(1, c) for c in references]
    for round_ in range(1, rounds + 1):
        this_round = list(others)
        if shuffle_seed is not None:
            random.Random(f"{shuffle_seed}:{round_}").shuffle(this_round)
        order += [(round_, c) for c in this_round]
    return order
