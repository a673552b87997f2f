"""Safe output: a temporary directory beside the target, renamed into place only when complete."""

from __future__ import annotations

import contextlib
import shutil
import signal
import tempfile
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

from bridge_ext.convert.parallel import barrier, is_rank0, shared_path
from bridge_ext.errors import UserError
from bridge_ext.runtime import publish

__all__ = ["check_target", "staged_output"]


def check_target(target: Path, *, overwrite: bool, inputs: Iterable[Path]) -> None:
    """Refuse targets that would clobber data or inputs, before any work is done."""
    if target.exists() and not target.is_dir():
        raise UserError(f"output {target} exists and is not a directory; choose another --out")
    for source in inputs:
        source = source.resolve()
        resolved = target.resolve()
        if resolved == source or source in resolved.parents or resolved in source.parents:
            raise UserError(f"output {target} overlaps the input {source}; choose an --out outside it")
    if target.is_dir() and any(target.iterdir()) and not overwrite:
        raise UserError(f"output {target} exists and is not empty; pass --overwrite to replace it")


@contextlib.contextmanager
def staged_output(target: Path) -> Iterator[Path]:
    """Yield a temporary directory beside ``target``; on success it replaces ``target``, else it is removed.

    Beside the target (same filesystem) so the final step is a rename, not a copy. SIGTERM is turned into
    SystemExit for the duration so an interrupted conversion also cleans up.
    """
    target = target.absolute()
    created: list[Path] = []
    parent = target.parent
    while not parent.exists():
        created.append(parent)
        parent = parent.parent
    previous = None
    if _is_main_thread():  # before the directory exists, so no window leaves it behind
        previous = signal.signal(signal.SIGTERM, _raise_system_exit)
    staging: Path | None = None
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        staging = shared_path(lambda: tempfile.mkdtemp(prefix=f".{target.name}.partial-", dir=target.parent))
        yield staging
        barrier()  # every rank has written its part
        if is_rank0():
            if target.exists():
                old = Path(tempfile.mkdtemp(prefix=f".{target.name}.old-", dir=target.parent))
                publish(target, old / "x")
                publish(staging, target)
                shutil.rmtree(old, ignore_errors=True)
            else:
                publish(staging, target)
        barrier()  # and every rank returns with the output in place (e.g. to export it next)
    except BaseException as exc:
        from bridge_ext.checkpoints.disk_space import no_space_for_output

        full = no_space_for_output(target, exc)  # before the partial output frees its room
        if staging is not None:
            shutil.rmtree(staging, ignore_errors=True)
        for path in created:  # parents we made for a conversion that produced nothing
            with contextlib.suppress(OSError):
                path.rmdir()
        if full is not None:
            raise full from None
        raise
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)


def _is_main_thread() -> bool:
    import threading

    return threading.current_thread() is threading.main_thread()


def _raise_system_exit(signum: int, frame: Any) -> None:
    raise SystemExit(128 + signum)
