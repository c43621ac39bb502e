"""Where llamapack keeps per-user state (warm-start counts, machine probes, plan traces)."""
from __future__ import annotations

import os
from pathlib import Path


def user_cache_dir() -> Path:
    """``$XDG_CACHE_HOME/llamapack``, else ``~/.cache/llamapack``."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "llamapack"
