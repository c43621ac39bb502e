"""What ``llamapack run`` and ``llamapack demo`` do besides printing: open a model, stream completions and
chat replies while timing them, and sum up the run in a ``RunStats``.

Timing is libllama's eval calls of each request: the first one evaluates the prompt (prefill, up to the
first token), every later one evaluates one generated token (decode). The last sampled token of a
request is not evaluated, so a request that samples N tokens decodes N - 1. In a chat, a prefix the
context already holds is not evaluated again and is not counted as prefill.
"""
from __future__ import annotations

import json
import os
import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field, fields
from typing import Iterator

import llama_cpp  # noqa: F401 - imported before numpy (see docs/hook.md: static C++ runtime)

from .errors import InputError, LlamapackError, NativeError, PackIOError


def expert_read_bytes(pack_stats: dict) -> int:
    """Expert bytes the provider has read from the pack or the GGUF."""
    return pack_stats.get("pack_read_bytes", 0)


@dataclass(frozen=True)
class RunStats:
    """Counts and seconds of one run (one or more requests)."""

    n_requests: int = 0
    n_prompt: int = 0        # prompt tokens evaluated
    n_generated: int = 0     # tokens sampled
    n_decoded: int = 0       # generated tokens evaluated (one eval each)
    prefill_s: float = 0.0   # request start to the end of the prompt's eval (time to first token)
    decode_s: float = 0.0    # the rest: end of the prompt's eval to the end of the last eval
    read_bytes: int = 0      # expert bytes read from the pack (or GGUF) during the run
    pack: dict = field(default_factory=dict)  # the model's pack_stats() at the end; {} without a pack

    @property
    def prefill_tok_s(self) -> float:
        return self.n_prompt / self.prefill_s if self.prefill_s > 0 else 0.0

    @property
    def decode_tok_s(self) -> float:
        return self.n_decoded / self.decode_s if self.decode_s > 0 else 0.0

    @property
    def hit_rate(self) -> float | None:
        return self.pack.get("hit_rate") if self.pack else None

    @property
    def read_bytes_per_token(self) -> float:
        """Expert bytes read per evaluated token (prompt and decode)."""
        n = self.n_prompt + self.n_decoded
        return self.read_bytes / n if n else 0.0

    def __add__(self, later: RunStats) -> RunStats:
        """Totals of this run followed by ``later`` (whose pack counters are the newer ones)."""
        sums = {f.name: getattr(self, f.name) + getattr(later, f.name) for f in fields(self) if f.name != "pack"}
        return RunStats(**sums, pack=later.pack)

    def as_dict(self) -> dict:
        derived = dict(prefill_tok_s=self.prefill_tok_s, decode_tok_s=self.decode_tok_s, hit_rate=self.hit_rate,
                       read_bytes_per_token=self.read_bytes_per_token)
        return {**asdict(self), **derived}

    def lines(self) -> list[str]:
        lines = [f"prefill: {self.n_prompt} tokens in {self.prefill_s:.3f} s ({self.prefill_tok_s:.1f} tok/s)",
                 f"decode: {self.n_decoded} tokens in {self.decode_s:.3f} s ({self.decode_tok_s:.1f} tok/s)"]
        if not self.pack:
            lines.append("expert cache: none (plain llama.cpp, every expert resident)")
        else:
            p = self.pack
            rate = "n/a" if p["hit_rate"] is None else f"{100 * p['hit_rate']:.1f}%"
            lines.append(f"expert cache: hit rate {rate} ({p['cache_hits']} hits, "
                         f"{p['cache_misses']} misses, {p['cache_evictions']} evictions, {p['n_slots']} slots)")
            if p.get("hybrid"):
                h = p["hybrid"]
                lines.append(f"hybrid {h['mode']}: {p.get('cpu_experts', 0)} expert rows on {h['threads']} CPU threads "
                             f"({p.get('cpu_s', 0.0):.3f} s), upload share {h['upload_share']:g}")
        lines.append(f"expert bytes read per token: {self.read_bytes_per_token / (1 << 20):.3f} MiB "
                     f"({self.read_bytes} bytes for {self.n_prompt + self.n_decoded} tokens)")
        return lines

    def write_json(self, path: str) -> None:
        try:
            with open(path, "w") as f:
                json.dump(self.as_dict(), f, indent=2)
                f.write("\n")
        except OSError as exc:
            raise LlamapackError(f"cannot write the stats file {path}: {exc.strerror}") from None


def open_model(model: str, *, pack=None, gguf_direct: bool = False, cache_slots: int | None = None,
               cache_mib: float | None = None, **llama_kwargs):
    """A ``llamapack.Llama`` for ``model`` (``pack=True``: the default pack beside it); plain without pack
    or gguf_direct. Failures are ``LlamapackError``s."""
    from .llama import Llama, resolve_settings

    if pack and gguf_direct:
        raise LlamapackError("use either a pack or --gguf-direct, not both")
    if not os.path.isfile(model):
        raise PackIOError(f"GGUF file not found: {model}")
    try:
        resolve_settings(model, pack, gguf_direct, cache_slots=cache_slots, cache_mib=cache_mib)  # validates only
    except ValueError as exc:  # settings out of range
        raise LlamapackError(str(exc)) from None
    try:
        return Llama(model, pack=pack, gguf_direct=gguf_direct, cache_slots=cache_slots, cache_mib=cache_mib,
                     **llama_kwargs)
    except ValueError as exc:  # llama_cpp reports a model it cannot load this way
        raise NativeError(f"llama.cpp could not load {model}: {exc}") from None


def utf8(text: str, what: str) -> bytes:
    """``text`` as UTF-8; InputError naming ``what`` when it holds bytes that were not UTF-8 (surrogates)."""
    try:
        return text.encode("utf-8")
    except UnicodeEncodeError as exc:
        bad = text[exc.start]
        byte = f"byte 0x{ord(bad) - 0xDC00:02x}" if 0xDC80 <= ord(bad) <= 0xDCFF else f"U+{ord(bad):04X}"
        raise InputError(f"{what} is not valid UTF-8 ({byte} at character {exc.start})") from None


def check_prompt(llm, prompt: str, what: str = "the prompt") -> int:
    """The number of tokens ``prompt`` evaluates to (with BOS where the model adds one); InputError when it is
    not UTF-8, empty, or leaves no room in the context for a token (llama_cpp's own checks fail less clearly)."""
    n = len(llm.tokenize(utf8(prompt, what), add_bos=True, special=True))
    if n == 0:
        raise InputError(f"{what} is empty: there is nothing to evaluate")
    if n >= llm.n_ctx():
        raise InputError(f"{what} is {n} tokens; the context holds {llm.n_ctx()} for the prompt and the reply: "
                         "shorten it or raise the context size (n_ctx, -c/--ctx-size)")
    return n


class Runner:
    """Streams completions or chat replies from ``llm`` and keeps the totals in ``stats``."""

    def __init__(self, llm):
        self.llm = llm
        self.stats = RunStats(pack=self._pack_stats())

    def complete(self, prompt: str, **sampling) -> Iterator[str]:
        """Text pieces of the completion of ``prompt`` as they come (``create_completion`` arguments)."""
        check_prompt(self.llm, prompt)
        with self.timed():
            for chunk in self.llm.create_completion(prompt, stream=True, **sampling):
                yield chunk["choices"][0]["text"]

    def chat(self, messages: list[dict], **sampling) -> Iterator[str]:
        """Text pieces of the assistant's reply to ``messages`` (the GGUF's chat template); when the
        reply is complete it is appended to ``messages``."""
        for i, message in enumerate(messages):
            utf8(message.get("content") or "", f"message {i + 1} ({message.get('role')})")
        pieces = []
        with self.timed():
            try:
                for chunk in self.llm.create_chat_completion(messages, stream=True, **sampling):
                    text = chunk["choices"][0]["delta"].get("content")
                    if text:
                        pieces.append(text)
                        yield text
            except ValueError as exc:  # llama_cpp: the conversation no longer fits the context
                raise InputError(f"the conversation does not fit the context: {exc}") from None
        messages.append({"role": "assistant", "content": "".join(pieces)})

    def _pack_stats(self) -> dict:
        return self.llm.pack_stats() if hasattr(self.llm, "pack_stats") else {}

    @contextmanager
    def timed(self):
        """Times the eval calls of one request (the instance's ``eval`` is wrapped while it runs)."""
        llm, ends, counts = self.llm, [], []
        evaluate = llm.eval

        def timed_eval(tokens):
            evaluate(tokens)
            counts.append(len(tokens))
            ends.append(time.perf_counter())

        read0 = expert_read_bytes(self._pack_stats())
        start = time.perf_counter()
        llm.eval = timed_eval
        try:
            yield
        finally:
            del llm.eval
            if ends:
                pack = self._pack_stats()
                self.stats += RunStats(
                    n_requests=1, n_prompt=counts[0], n_generated=len(ends), n_decoded=len(ends) - 1,
                    prefill_s=ends[0] - start, decode_s=ends[-1] - ends[0],
                    read_bytes=expert_read_bytes(pack) - read0, pack=pack)


def demo_lines(result) -> list[str]:
    """The summary of a ``llamapack.demo.DemoResult``: run stats, then whether both runs agree."""
    stats = RunStats(n_requests=1, n_prompt=result.n_prompt, n_generated=result.n_generated,
                     n_decoded=result.n_generated,  # the demo evaluates every token it generates
                     prefill_s=result.n_prompt / result.prefill_tok_s,
                     decode_s=result.n_generated / result.decode_tok_s,
                     read_bytes=expert_read_bytes(result.stats), pack=result.stats)
    yes = {True: "yes", False: "NO"}
    return [f"model: {result.model}", f"pack: {result.pack}", *stats.lines(),
            f"tokens identical: {yes[result.tokens_identical]}", f"logits identical: {yes[result.logits_identical]}"]
