"""The hit-rate figure: hit rate against cache fraction, one line per policy (matplotlib, Agg backend)."""
from __future__ import annotations

from pathlib import Path

from .hitrate import HitRates


def plot_hit_rates(result: HitRates, path: str | Path, title: str = "") -> bool:
    """Write the figure of ``result`` to ``path`` (PNG); False when matplotlib is missing."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    figure, axis = plt.subplots(figsize=(6.4, 4.2))
    percent = [100 * f for f in result.fractions]
    for name, rates in result.rates.items():
        points = [(x, 100 * r) for x, r in zip(percent, rates) if r is not None]
        if points:
            wide = name == "default"  # drawn wide, so a policy equal to it still shows on top
            axis.plot(*zip(*points), marker="o", label=name, linestyle="--" if name == "belady" else "-",
                      linewidth=5 if wide else 1.8, alpha=0.45 if wide else 1.0)
    axis.set_xlabel("cache size, % of all (layer, expert) pairs")
    axis.set_ylabel(f"hit rate, % ({result.phase} tokens)")
    axis.set_ylim(0, 100)
    axis.set_xticks(percent)
    axis.grid(alpha=0.3)
    axis.legend()
    axis.set_title(title, fontsize=9)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return True
