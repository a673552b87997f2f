"""Loss curves compared: trailing mean, the iteration a curve reaches a loss, the per-run summary."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from bridge_ext.compare.runs import DEFAULT_SMOOTH

__all__ = ["iterations_to_reach", "smooth", "summarize"]


def smooth(values: Sequence[float], window: int) -> list[float]:
    """Trailing mean over ``window`` iterations (fewer at the start)."""
    out, acc = [], 0.0
    for i, value in enumerate(values):
        acc += value
        if i >= window:
            acc -= values[i - window]
        out.append(acc / min(i + 1, window))
    return out


def iterations_to_reach(values: Sequence[float], target: float) -> int | None:
    """1-based iteration at which ``values`` first reach ``target`` or below; None if never."""
    for i, value in enumerate(values):
        if value <= target + 1e-12:
            return i + 1
    return None


def summarize(losses: dict[str, list[float]], window: int = DEFAULT_SMOOTH) -> dict[str, Any]:
    """Final loss per run and iterations needed to reach the best smoothed loss the slowest run reached."""
    smoothed = {label: smooth(values, window) for label, values in losses.items()}
    best = {label: min(values) for label, values in smoothed.items()}
    slowest = max(best, key=best.get)
    target = best[slowest]
    rows = {}
    for label, values in losses.items():
        tail = values[-window:]
        rows[label] = {
            "final_loss": values[-1],
            "final_loss_mean": sum(tail) / len(tail),
            "best_smoothed_loss": best[label],
            "iterations_to_target": iterations_to_reach(smoothed[label], target),
        }
    return {"smooth_window": window, "target": target, "slowest": slowest, "runs": rows}
