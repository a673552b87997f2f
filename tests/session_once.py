"""``once_per_session``: something expensive made once per test session, shared by pytest-xdist's workers.

pytest-xdist keeps neither a module fixture nor a group's fixture alive across the workers that run its tests
(measured: two workers each ran a module-scoped fixture). In one process the result is kept in memory; under
xdist the first worker to ask makes it under a file lock in the session's shared temporary directory and pickles
it, the others wait and read it.
"""

from __future__ import annotations

import os
import pickle
from collections.abc import Callable
from pathlib import Path
from typing import Any

__all__ = ["once_per_session"]

_made: dict[str, Any] = {}


def once_per_session(factory: Any, key: str, make: Callable[[Path], Any]) -> Any:
    """``make(root)`` once per session for ``key`` (``factory``: pytest's ``tmp_path_factory``); its result."""
    if key in _made:
        return _made[key]
    name = key.replace("/", "-")
    uid = os.environ.get("PYTEST_XDIST_TESTRUNUID")  # one per session, the same in every worker
    if uid is None:  # one process
        _made[key] = make(factory.mktemp(name))
        return _made[key]
    from filelock import FileLock

    root = factory.getbasetemp().parent / f"once-{uid}" / name
    root.mkdir(parents=True, exist_ok=True)
    with FileLock(f"{root}.lock"):
        saved = root / "made.pickle"
        if not saved.exists():
            saved.write_bytes(pickle.dumps(make(root)))
        _made[key] = pickle.loads(saved.read_bytes())
    return _made[key]
