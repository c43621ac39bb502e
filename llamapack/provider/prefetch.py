"""Router-lookahead prefetch: bookkeeping of the expert reads started ahead of the layer that needs them.

Pure bookkeeping, no I/O. While layer L is computed, libllama hands the provider a guess at layer L+1's
experts (L+1's router applied to L's FFN input). The provider starts a read for each guessed expert that is
in neither the slot pool nor the RAM tier, into one of the book's own buffers, at prefetch priority. At L+1's
acquire, a miss with an entry here ``take``s it: the provider waits only for what is still being read and
copies from that buffer, so a good guess moves the SSD read off the critical path. A wrong guess costs the
read, never correctness: the slots are only ever written, as before, for the router's real choice.

Entries of the acquired layer that the step did not ask for are wrong guesses: ``retire_layer`` moves them
aside and cancels their pieces still queued, and ``reclaim`` gives their buffers back once their reads are
done (a buffer is never handed out while a read may still write it).
"""
from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass

from ..cache_policy import Key


@dataclass(frozen=True)
class PrefetchEntry:
    key: Key
    buffer: int
    pieces: tuple[Future, ...]

    def done(self) -> bool:
        return all(piece.done() for piece in self.pieces)

    def succeeded(self) -> bool:
        return all(piece.done() and not piece.cancelled() and piece.exception() is None for piece in self.pieces)


class PrefetchBook:
    """Lookahead reads by key, over the buffers ``buffer_ids`` (indices into the copier's buffers)."""

    def __init__(self, buffer_ids: range):
        self._free = list(buffer_ids)
        self._entries: dict[Key, PrefetchEntry] = {}
        self._retired: list[PrefetchEntry] = []

    def __contains__(self, key: Key) -> bool:
        return key in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    def free_buffer(self) -> int | None:
        """A buffer no read is writing, or None when every buffer holds a read not yet used or finished."""
        return self._free.pop() if self._free else None

    def add(self, key: Key, buffer: int, pieces) -> None:
        assert key not in self._entries, key
        self._entries[key] = PrefetchEntry(key, buffer, tuple(pieces))

    def take(self, key: Key) -> PrefetchEntry | None:
        """The entry for ``key``, now the caller's (it gives the buffer back with ``release``)."""
        return self._entries.pop(key, None)

    def release(self, buffer: int) -> None:
        """A taken entry's buffer, free again once its read is done and its bytes were copied (or abandoned)."""
        self._free.append(buffer)

    def retire_layer(self, layer: int, requested: set[Key]) -> int:
        """Set aside the entries of ``layer`` not in ``requested`` (wrong guesses) and cancel their pieces not
        started yet; returns how many."""
        wrong = [key for key in self._entries if key[0] == layer and key not in requested]
        for key in wrong:
            entry = self._entries.pop(key)
            for piece in entry.pieces:
                piece.cancel()  # False for a piece running or done: that one finishes, then reclaim frees it
            self._retired.append(entry)
        return len(wrong)

    def reclaim(self) -> list[PrefetchEntry]:
        """Free the buffers of retired entries whose reads are done; returns those entries."""
        finished, running = [], []
        for entry in self._retired:  # one look per entry: a read may finish meanwhile
            (finished if entry.done() else running).append(entry)
        self._retired = running
        self._free.extend(entry.buffer for entry in finished)
        return finished
