"""One writer per checkpoint directory (issue 50): a run holds an exclusive lock on its ``checkpoint.save`` for as
long as it trains, and a second run pointed there is refused in one line that names the holder.

The lock is ``flock(2)`` on ``<checkpoint.save>/.writer.lock``, taken by rank 0 for the job (the one process
that writes the tracker and the run's records). The kernel drops it when the holding process ends, however it
ends, so a lock left by a dead run never blocks the same command's resume: a SIGKILL, a crash, a Slurm requeue
(the previous attempt's processes are gone before the next starts). The file keeps the holder's host, pid, Slurm
job and start time for the refusal's line; an unlocked file is a note of the last run, not a lock.

What it relies on (docs/checkpoints.md): local disks, NFSv4 (Linux emulates ``flock`` with the server's byte-range
locks; a client that dies keeps the lock until its lease expires, ~90 s) and Lustre mounted with ``-o flock``.
A filesystem that takes no locks (Lustre's ``noflock``, NFSv3 without ``lockd``) refuses nothing: the run says so
in one line and goes on.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import socket
import sys
import time
from collections.abc import Iterator
from pathlib import Path

from bridge_ext.errors import UserError
from bridge_ext.runtime import is_rank_zero

__all__ = ["LOCK_NAME", "hold", "holder", "run_scope"]

LOCK_NAME = ".writer.lock"
_NO_LOCKS = {errno.ENOLCK, errno.ENOSYS, errno.EOPNOTSUPP, errno.EINVAL}
_held: dict[Path, int] = {}  # checkpoint directory -> the open, locked file (this process)
_scopes: list[set[Path]] = []  # what each open run_scope() took, innermost last


def holder(save_dir: str | Path) -> dict:
    """What the lock file says of the run that holds it, or held it last ({} when there is none)."""
    try:
        return json.loads((Path(save_dir) / LOCK_NAME).read_text() or "{}")
    except (OSError, ValueError):
        return {}


def _describe(who: dict) -> str:
    parts = [f"host {who.get('host', '?')}", f"pid {who.get('pid', '?')}"]
    if who.get("slurm_job"):
        parts.append(f"Slurm job {who['slurm_job']}")
    if who.get("started"):
        parts.append(f"since {who['started']}")
    return ", ".join(parts)


def hold(save_dir: str | Path | None) -> bool:
    """Take the lock on ``save_dir`` for this run (rank 0 only; again in the same process: already held).

    Raises :class:`UserError` naming the holder when another process holds it; writes nothing then. Returns
    whether this process holds it now (False: not rank 0, no directory, or a filesystem without locks)."""
    if not save_dir or not is_rank_zero():
        return False
    root = Path(save_dir).resolve()
    if root in _held:
        return True
    try:
        root.mkdir(parents=True, exist_ok=True)
        fd = os.open(root / LOCK_NAME, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as exc:
        raise UserError(f"checkpoint.save {root}: cannot write there ({exc.strerror}); point it at a writable "
                        "directory") from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise UserError(f"checkpoint.save {root} is being written by another run ({_describe(holder(root))}); "
                        "wait for it to end, or point checkpoint.save at another directory") from None
    except OSError as exc:
        os.close(fd)
        if exc.errno not in _NO_LOCKS:
            raise
        print(f"note: checkpoint.save {root}: its filesystem takes no locks ({os.strerror(exc.errno)}), so a second "
              "run writing there is not refused", file=sys.stderr, flush=True)
        return False
    who = {"host": socket.gethostname(), "pid": os.getpid(), "slurm_job": os.environ.get("SLURM_JOB_ID"),
           "started": time.strftime("%Y-%m-%d %H:%M:%S"), "command": " ".join(sys.argv)}
    os.ftruncate(fd, 0)
    os.pwrite(fd, (json.dumps(who) + "\n").encode(), 0)
    _held[root] = fd
    if _scopes:
        _scopes[-1].add(root)
    return True


@contextlib.contextmanager
def run_scope() -> Iterator[None]:
    """The locks taken inside the block are given up when it ends (a command's run in a process that goes on:
    ``nemo`` called in-process, ``nemo llm compare``'s runs). Outside any scope a lock lasts as long as its
    process."""
    _scopes.append(set())
    try:
        yield
    finally:
        for root in _scopes.pop():
            fd = _held.pop(root, None)
            if fd is not None:
                os.close(fd)  # closing the only descriptor drops the flock
