"""Warm start: the experts a model used most in its last session, saved at close and loaded before the next.

At close the provider saves, per (layer, expert), the expert's decayed share of its layer's visits
(``NextUsePolicy.popularity``); at the next start with the same pack it seeds the slot pool's policy (and the
RAM tier's) with them and fills the pool (and the tier) with the hottest experts before the first token.
Which experts sit in which slot never changes what is computed, so a warm start stays bit-exact.

The file is ``<folder>/<pack identity>.json``, the folder ``warm_start_dir`` or
``$XDG_CACHE_HOME/llamapack/warm`` (``~/.cache/llamapack/warm``)::

    {"format": "llamapack.warm-start", "version": 1, "identity": "<hex>", "num_experts": E,
     "layers": {"<layer>": [share of expert 0, share of expert 1, ...], ...}}

The identity is the sha256 of the pack's canonical manifest (its layout, block hashes and source), so counts
never cross packs. A file that cannot be read, is not this format, names another identity or another shape,
or holds a share outside [0, 1] is ignored with a warning (the session starts cold and overwrites it at close).
GGUF-direct mode has no manifest: no warm start. ``llamapack.Llama`` and the CLI warm-start unless told not to
(``warm_start=False``, ``--no-warm-start``) or unless the environment sets ``LLAMAPACK_WARM_START=0`` (the test
suite does, so that no test starts from another's counts).
"""
from __future__ import annotations

import json
import logging
import math
import os
from pathlib import Path

from ..cache_dir import user_cache_dir
from typing import Sequence

from ..pack import PackReader
from ..pack.manifest import canonical_sha256, manifest_to_dict

FORMAT = "llamapack.warm-start"
VERSION = 1
log = logging.getLogger(__name__)

Popularity = dict[int, list[float]]  # layer -> share of each expert (index = expert id)


def default_warm_start() -> bool:
    """On, unless the environment sets ``LLAMAPACK_WARM_START=0``."""
    return os.environ.get("LLAMAPACK_WARM_START", "1").strip() != "0"


def warm_folder(setting: str | os.PathLike | None = None) -> Path:
    """``setting``, else ``$XDG_CACHE_HOME/llamapack/warm``, else ``~/.cache/llamapack/warm``."""
    if setting is not None:
        return Path(setting)
    return user_cache_dir() / "warm"


def pack_identity(reader) -> str | None:
    """The sha256 (hex) of a PackReader's canonical manifest; None for a GGUF-direct reader."""
    if not isinstance(reader, PackReader):
        return None
    return canonical_sha256(manifest_to_dict(reader.manifest)).hex()


class WarmFile:
    """The warm-start file of one pack: ``load`` (checked) and ``save`` (atomic)."""

    def __init__(self, folder: str | os.PathLike | None, identity: str, layers: Sequence[int], num_experts: int):
        self.identity, self.layers, self.num_experts = identity, tuple(layers), num_experts
        self.path = warm_folder(folder) / f"{identity}.json"

    def load(self) -> Popularity | None:
        """The saved shares, or None: no file (silently), or a bad one (with a warning naming what is wrong)."""
        try:
            text = self.path.read_text()
        except FileNotFoundError:
            return None
        except (OSError, UnicodeDecodeError) as exc:
            return self._ignore(f"cannot be read ({exc})")
        try:
            document = json.loads(text)
        except ValueError as exc:
            return self._ignore(f"is not JSON ({exc})")
        problem = self._problem(document)
        if problem:
            return self._ignore(problem)
        return {int(layer): [float(x) for x in shares] for layer, shares in document["layers"].items()}

    def _problem(self, document) -> str | None:
        if not isinstance(document, dict) or document.get("format") != FORMAT or document.get("version") != VERSION:
            return f"is not a {FORMAT} v{VERSION} file"
        if document.get("identity") != self.identity:
            return f"belongs to another pack (identity {str(document.get('identity'))[:16]}...)"
        if document.get("num_experts") != self.num_experts or not isinstance(document.get("layers"), dict):
            return f"does not have {self.num_experts} experts per layer"
        known = {str(layer) for layer in self.layers}
        for layer, shares in document["layers"].items():
            if layer not in known:
                return f"names layer {layer!r}, which the model does not serve"
            if not isinstance(shares, list) or len(shares) > self.num_experts or not all(
                    isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) and 0 <= x <= 1
                    for x in shares):
                return f"layer {layer}: shares must be at most {self.num_experts} numbers in [0, 1]"
        return None

    def _ignore(self, problem: str) -> None:
        log.warning("warm start: %s %s; ignored (this session starts cold)", self.path, problem)
        return None

    def save(self, popularity: Popularity) -> bool:
        """Write the shares of the served layers (atomically); a failure is a warning, never an error."""
        layers = {str(layer): [round(x, 6) for x in shares[:self.num_experts]]
                  for layer, shares in sorted(popularity.items()) if layer in self.layers}
        if not layers:
            return False
        document = {"format": FORMAT, "version": VERSION, "identity": self.identity, "num_experts": self.num_experts,
                    "layers": layers}
        tmp = self.path.with_name(f"{self.path.name}.tmp-{os.getpid()}")
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            tmp.write_text(json.dumps(document, separators=(",", ":")))
            os.replace(tmp, self.path)
            return True
        except OSError as exc:
            log.warning("warm start: cannot save %s (%s)", self.path, exc)
            return False
        finally:
            if tmp.exists():
                tmp.unlink()


def hottest(popularity: Popularity, limit: int) -> list[tuple[int, int]]:
    """The ``limit`` (layer, expert) keys of highest share, hottest first (ties: lower layer, lower expert);
    keys never used (share 0) are left out."""
    keys = [(-share, layer, expert) for layer, shares in popularity.items() for expert, share in enumerate(shares)
            if share > 0]
    keys.sort()
    return [(layer, expert) for _, layer, expert in keys[:max(limit, 0)]]
