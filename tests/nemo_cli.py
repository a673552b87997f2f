"""How tests run the `nemo` command: in this process (the ``nemo`` fixture), or as a real process.

In this process, :func:`call_nemo` calls the ``nemo`` script's ``main(argv)`` with pytest's capture for its output
and ``MonkeyPatch`` for its working directory, environment and ``sys.argv``; Megatron Bridge is imported once per
test process. What a command leaves in Megatron's process globals is the product's own cleanup (Megatron Bridge's
``pretrain()`` ends a run with ``destroy_global_state``, a conversion ends with ``reset_megatron_globals``): a run
here computes a real process's losses bit for bit (tests/test_cli.py checks it).

A real process (:func:`nemo_process`, :func:`start_nemo`) only where that is what a test is about: what happens
at import time, signals sent to the process, torchrun launches, the installed script itself.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

__all__ = ["NEMO", "Result", "call_nemo", "nemo_process", "start_nemo"]

NEMO = Path(sys.executable).with_name("nemo")  # the venv's installed script (ours replaces NeMo-Run's)


@dataclass(frozen=True)
class Result:
    """What a `nemo` command returned and printed."""

    code: int
    stdout: str
    stderr: str


def call_nemo(argv: Sequence[Any], *, capture: Any, cwd: str | Path | None = None,
              env: dict[str, str] | None = None, input: str = "") -> Result:
    """``nemo *argv`` in this process; ``capture`` is pytest's ``capfd`` or ``capsys`` (None: output not kept).

    ``env`` adds to the environment; ``input`` is its stdin (a file: NeMo-Run's slurm dry run reads it, which
    pytest's own stdin refuses). The environment, working directory, ``sys.argv`` and ``sys.stdin`` are the
    test's again afterwards, as they would be after a process. Output the test printed before is dropped.
    """
    from bridge_ext.commands import main

    argv = [str(a) for a in argv]
    if capture is not None:
        capture.readouterr()
    environ = dict(os.environ)
    with pytest.MonkeyPatch.context() as patch, tempfile.TemporaryFile("w+") as stdin:
        stdin.write(input)
        stdin.seek(0)
        patch.setattr(sys, "stdin", stdin)
        patch.chdir(cwd if cwd is not None else os.getcwd())
        patch.setattr(sys, "argv", ["nemo", *argv])
        for key, value in (env or {}).items():
            patch.setenv(key, value)
        try:
            code = main(argv)
        except SystemExit as exc:  # what the interpreter makes of it
            code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
            if exc.code is not None and not isinstance(exc.code, int):
                print(exc.code, file=sys.stderr)
        finally:  # variables the command set (library settings) end with it, as with a process
            os.environ.clear()
            os.environ.update(environ)
    out, err = capture.readouterr() if capture is not None else ("", "")
    return Result(code or 0, out, err)


def start_nemo(argv: Sequence[Any], *, cwd: str | Path | None = None, env: dict[str, str] | None = None,
               driver: Sequence[Any] = (), **popen: Any) -> subprocess.Popen:
    """A real ``nemo *argv`` process: the installed script, or ``python *driver *argv`` where a test script
    prepares the process before it calls ``main`` (tests/kill_driver.py). ``env`` adds to the environment."""
    command = [sys.executable, *map(str, driver)] if driver else [str(NEMO)]
    return subprocess.Popen([*command, *map(str, argv)], cwd=cwd, env={**os.environ, **(env or {})}, **popen)


def nemo_process(argv: Sequence[Any], *, cwd: str | Path | None = None, env: dict[str, str] | None = None,
                 timeout: float = 900) -> Result:
    """``nemo *argv`` as a real process: its exit code and text output."""
    proc = start_nemo(argv, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                      start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, 9)  # the command and what it started
        proc.communicate()
        raise
    return Result(proc.returncode, out, err)
