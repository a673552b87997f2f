"""A comparison's files and console text: ``loss.csv``, ``eval.csv``, ``loss.png``, the summary and held-out
tables."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from bridge_ext.compare.metrics import smooth
from bridge_ext.compare.runs import RunResult

__all__ = ["format_evals", "format_summary", "write_csv", "write_eval_csv", "write_plot"]


def write_csv(path: Path, results: list[RunResult]) -> None:
    lines = ["iteration," + ",".join(r.label for r in results)]
    for i in range(len(results[0].losses)):
        lines.append(f"{i + 1}," + ",".join(f"{r.losses[i]:.6f}" for r in results))
    path.write_text("\n".join(lines) + "\n")


def write_eval_csv(path: Path, evals: dict[str, dict[int, float]]) -> None:
    steps = sorted({step for by_step in evals.values() for step in by_step})
    lines = ["iteration," + ",".join(evals)]
    for step in steps:
        lines.append(f"{step}," + ",".join(f"{e[step]:.6f}" if step in e else "" for e in evals.values()))
    path.write_text("\n".join(lines) + "\n")


def write_plot(path: Path, results: list[RunResult], summary: dict[str, Any], title: str,
               evals: dict[str, dict[int, float]] | None = None) -> None:
    from bridge_ext.plots import loss_figure

    window = summary["smooth_window"]
    with loss_figure(path, title=title, size=(8, 5)) as (ax,):
        for i, result in enumerate(results):
            color = f"C{i % 10}"
            steps = range(1, len(result.losses) + 1)
            ax.plot(steps, result.losses, color=color, alpha=0.25, linewidth=0.8)
            ax.plot(steps, smooth(result.losses, window), color=color, linewidth=1.8,
                    label=f"{result.label} (last {window}: {summary['runs'][result.label]['final_loss_mean']:.3f})")
            held = (evals or {}).get(result.label)
            if held:
                steps_e = sorted(held)
                ax.plot(steps_e, [held[s] for s in steps_e], color=color, linestyle="--", marker="o", markersize=4,
                        label=f"{result.label} held-out (final {held[steps_e[-1]]:.3f})")
        ax.axhline(summary["target"], color="gray", linestyle=":", linewidth=1,
                   label=f"best loss of the slowest run ({summary['target']:.3f})")
        ax.set_xlabel("iteration")
        ax.set_ylabel(f"training loss (faint: per iteration; solid: mean of {window})"
                      + ("; dashed: held-out" if evals else ""))
        ax.legend(fontsize=8)


def format_summary(summary: dict[str, Any]) -> str:
    target, window = summary["target"], summary["smooth_window"]
    width = max(len("run"), *map(len, summary["runs"]))
    lines = [f"{'run':<{width}}  {'final loss':>10}  {f'mean last {window}':>12}  {'best (smoothed)':>15}  "
             f"iterations to {target:.3f}"]
    for label, row in summary["runs"].items():
        reach = row["iterations_to_target"]
        timing = summary.get("timing", {}).get(label, {})
        speed = f"   ({timing['iterations_per_second']:.1f} it/s)" if timing.get("iterations_per_second") else ""
        lines.append(f"{label:<{width}}  {row['final_loss']:>10.4f}  {row['final_loss_mean']:>12.4f}  "
                     f"{row['best_smoothed_loss']:>15.4f}  {reach if reach else 'never':>5}{speed}")
    slowest = summary["slowest"]
    iters_slowest = summary["runs"][slowest]["iterations_to_target"]
    for label, row in summary["runs"].items():
        if label != slowest and row["iterations_to_target"] and row["iterations_to_target"] < iters_slowest:
            lines.append(f"{label} reached the best loss of {slowest} ({target:.3f}, mean of {window}) in "
                         f"{row['iterations_to_target']} iterations instead of {iters_slowest} "
                         f"({iters_slowest / row['iterations_to_target']:.2f}x fewer)")
    return "\n".join(lines)


def format_evals(evals: dict[str, dict[int, float]]) -> str:
    """The held-out loss of every run at every eval, the last (final) one marked."""
    steps = sorted({step for by_step in evals.values() for step in by_step})
    width = max(len("run"), *map(len, evals))
    lines = [f"{'held-out loss':<{width}}  " + "  ".join(f"{f'at {s}':>8}" for s in steps)]
    for label, by_step in evals.items():
        lines.append(f"{label:<{width}}  " + "  ".join(f"{by_step[s]:>8.4f}" if s in by_step else f"{'-':>8}"
                                                       for s in steps))
    finals = {label: by_step[max(by_step)] for label, by_step in evals.items() if by_step}
    if len(finals) > 1:
        best = min(finals, key=finals.get)
        lines.append(f"lowest final held-out loss: {best} ({finals[best]:.4f})")
    return "\n".join(lines)
