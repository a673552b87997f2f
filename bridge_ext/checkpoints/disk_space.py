"""A full disk named (issue 50): a checkpoint save that fails for lack of space stops the run with one line, and
a run warns before its first save when fewer than two saves fit; an import, export or prepare-data output that
fails for lack of space is one line too.

torch's checkpoint writer does not say "no space left on device": on a full filesystem its file writer fails in
C++ (``RuntimeError: Worker failure: [enforce fail at inline_container.cc:668] . unexpected pos 704 vs 598``,
measured on 26.02). So a failed save is looked at from the outside: when the filesystem it wrote to has less
room than a save takes (the newest complete iteration's size; before the first one, 16 MiB), or the failure
carries ``ENOSPC`` / ``EDQUOT``, the failure is that, and the line says where, how much, and what is safe.
"""

from __future__ import annotations

import errno
import os
import shutil
from pathlib import Path

from bridge_ext.checkpoints.iterations import is_complete, iteration_dir, iterations
from bridge_ext.errors import UserError
from bridge_ext.units import human_bytes

__all__ = ["NoSpaceLeft", "mount_point", "no_space_error", "no_space_for_output", "space_note",
           "tree_bytes"]

_FULL = {errno.ENOSPC, errno.EDQUOT}
_NEARLY_FULL = 16 * 2**20  # without a complete save to measure: this little room left is a full disk


class NoSpaceLeft(UserError):
    """A write that failed for lack of space (one line, exit 2, as every :class:`UserError`)."""


def mount_point(path: str | Path) -> Path:
    """The mount point of the filesystem ``path`` is on (its nearest existing ancestor's)."""
    path = Path(path).resolve()
    while not path.exists():
        path = path.parent
    while not os.path.ismount(path):
        path = path.parent
    return path


def tree_bytes(path: str | Path) -> int:
    return sum(f.stat().st_size for f in Path(path).rglob("*") if f.is_file())


def _says_full(exc: BaseException | None) -> bool:
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if getattr(exc, "errno", None) in _FULL or "No space left on device" in str(exc):
            return True
        exc = exc.__cause__ or exc.__context__
    return False


def no_space_error(save_dir: str | Path, iteration: int, exc: BaseException) -> NoSpaceLeft | None:
    """The one-line error for a save of ``iteration`` into ``save_dir`` that failed with ``exc`` for lack of
    space; None when the disk is not why (the failure is then raised as it is)."""
    if isinstance(exc, (UserError, KeyboardInterrupt, SystemExit, GeneratorExit)):  # a refusal says its own reason
        return None
    save_dir = Path(save_dir)
    complete = [n for n in iterations(save_dir) if n != iteration and is_complete(iteration_dir(save_dir, n))]
    needed = tree_bytes(iteration_dir(save_dir, complete[-1])) if complete else None
    free = shutil.disk_usage(mount_point(save_dir)).free
    if not (_says_full(exc) or free < (needed or _NEARLY_FULL)):
        return None
    need = f"a save takes {human_bytes(needed, binary=True)}" if needed else "the first save did not fit"
    last = f"the last complete save is iteration {complete[-1]}" if complete else "nothing was saved yet"
    room = human_bytes(free, binary=True)
    return NoSpaceLeft(f"the checkpoint save of iteration {iteration} into {save_dir} failed: no space left on "
                       f"{mount_point(save_dir)} ({room} free; {need}); {last}; free space and run the same command "
                       "to resume")


def space_note(save_dir: str | Path, per_save: int) -> str | None:
    """A one-line warning when fewer than two saves of ``per_save`` bytes fit beside ``save_dir`` (None when
    they do): how many fit, and what to do before the disk fills."""
    free = shutil.disk_usage(mount_point(save_dir)).free
    fit = int(free // per_save) if per_save else 2
    if fit >= 2:
        return None
    room, save = human_bytes(free, binary=True), human_bytes(per_save, binary=True)
    return (f"warning: checkpoint.save {save_dir}: {room} free on {mount_point(save_dir)} and a save takes about "
            f"{save}: {'only 1 save fits' if fit == 1 else 'not one save fits'}; free space or point checkpoint.save "
            "at a larger filesystem before the run needs it")


def no_space_for_output(target: str | Path, exc: BaseException) -> NoSpaceLeft | None:
    """The one-line error for an output (``import``/``export --out``, ``prepare-data --out``) whose writing failed
    with ``exc`` for lack of space: a checkpoint save inside it said so, the failure carries ENOSPC / EDQUOT, or
    under 16 MiB is left where it wrote; None otherwise. Called before the partial output is removed (it still
    takes its room)."""
    full_inside = isinstance(exc, NoSpaceLeft)  # a checkpoint save inside the conversion (iteration 0)
    if not full_inside and isinstance(exc, (UserError, KeyboardInterrupt, SystemExit, GeneratorExit)):
        return None  # a refusal says its own reason
    where = mount_point(target)
    free = shutil.disk_usage(where).free
    if not (full_inside or _says_full(exc) or free < _NEARLY_FULL):
        return None
    room = human_bytes(free, binary=True)
    return NoSpaceLeft(f"writing {target} failed: no space left on {where} ({room} free); nothing of it is kept; "
                       "free space and run the same command again")
