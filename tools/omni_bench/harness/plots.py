"""Figures against concurrency (log x axis, one tick per level), written as PNG files.

matplotlib is imported only when a figure is made, with the Agg backend: no display needed.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any


def figure(height: float = 3.6) -> tuple[Any, Any]:
    """A new (figure, axes), 6 inches wide."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt.subplots(figsize=(6, height), dpi=100)


def finish(ax: Any, levels: Sequence[float], *, plain_y: bool = False) -> None:
    """Ticks at the concurrency levels written as plain numbers (and the y axis too with
    `plain_y`, for log y axes), a light grid and the legend."""
    from matplotlib.ticker import ScalarFormatter

    ax.set_xticks(list(levels))
    ax.xaxis.set_major_formatter(ScalarFormatter())
    if plain_y:
        ax.yaxis.set_major_formatter(ScalarFormatter())
    ax.minorticks_off()
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=7)


def save(fig: Any, path: Path) -> Path:
    import matplotlib.pyplot as plt

    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
    return path
