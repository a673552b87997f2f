"""Loss figures, one maker for all of them: a training run's ``loss.png``, a comparison's ``loss.png`` and
``nemo llm evaluate``'s ``evaluate.png`` (matplotlib, Agg: no display is needed).

The margins are fixed rather than measured: ``tight_layout`` draws the figure once more only to measure its labels,
a third of a plot's ~0.2 s, which every training run paid.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

__all__ = ["loss_figure"]

_DPI = 110


@contextmanager
def loss_figure(path: Path, *, title: str, panels: int = 1, size: tuple[float, float] = (7, 4)) -> Iterator[list[Any]]:
    """Yield ``panels`` matplotlib axes side by side; on exit grid them and save the figure to ``path`` (PNG).

    ``title`` heads the figure; the caller draws its lines and labels."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, panels, figsize=size, dpi=_DPI, squeeze=False)
    axes = list(axes[0])
    fig.subplots_adjust(left=0.09 if panels == 1 else 0.07, right=0.97, bottom=0.13, top=0.9,
                        wspace=0.25)
    try:
        yield axes
        for ax in axes:
            ax.grid(alpha=0.3)
        fig.suptitle(title, fontsize=10)
        fig.savefig(path)
    finally:
        plt.close(fig)
