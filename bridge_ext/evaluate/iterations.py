"""The iterations ``nemo llm evaluate`` evaluates: one (``--iteration``, else the latest) or every complete one
(``--all``), each found and vetted by :func:`bridge_ext.checkpoints.find_iteration`."""

from __future__ import annotations

from pathlib import Path

from bridge_ext.errors import UserError

__all__ = ["select_iterations"]


def select_iterations(ckpt: Path, *, iteration: int | None, every: bool) -> list[tuple[Path, int]]:
    """The iterations to evaluate, each found (and vetted) by :func:`bridge_ext.checkpoints.find_iteration`."""
    from bridge_ext.checkpoints import find_iteration, is_complete, iterations

    if not every:
        return [find_iteration(ckpt, iteration)]
    if not ckpt.is_dir():
        find_iteration(ckpt)  # its one-line error
    complete = [n for n, path in iterations(ckpt).items() if is_complete(path)]
    if not complete:
        find_iteration(ckpt)  # not a checkpoint / nothing complete: its error
        raise UserError(f"--ckpt {ckpt} has no complete iteration")
    return [find_iteration(ckpt, n) for n in complete]
