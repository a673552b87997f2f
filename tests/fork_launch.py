"""A ``torchrun`` stand-in for the tests' multi-process CPU launches: it imports once and forks the ranks.

    python tests/fork_launch.py --nproc-per-node N SCRIPT ARG...

Each rank is a real process: its own pid, its own gloo connections over TCP, its own exit code. It gets
``torchrun``'s environment for a one-node job (``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``, ``LOCAL_WORLD_SIZE``,
``GROUP_RANK``, ``MASTER_ADDR``, ``MASTER_PORT`` on a free local port). It runs ``SCRIPT`` as ``__main__`` with
``ARG...`` as ``python SCRIPT ARG...`` would.

Why a stand-in: on this 2-core machine, most of a launch's cost was imports. ``torchrun`` imports torch (~3 s
of CPU), then each rank imports torch, Megatron Bridge and bridge_ext again (~8-10 s of CPU each). Here they are
imported once, before the fork, in the order the drivers use (``bridge_ext`` first: its import-time patches come
before Megatron Bridge's modules). The ranks share those pages copy-on-write.

It is for tests about layouts and ranks, not about the launcher. Tests of what ``torchrun`` itself does (its
agent store, ``nemo`` under ``torchrun``) launch the real one (``tests/parallel_driver.py``'s ``launch_ranks``,
``launcher="torchrun"``).

As with ``torchrun``:
- the ranks' output goes to this process's stdout and stderr;
- when a rank fails, the others are stopped (SIGTERM, then SIGKILL after 30 s);
- the launch exits with 1, after one line per failed rank on stderr.

A rank also dies with this process (``PR_SET_PDEATHSIG``): a test's timeout that kills the launch leaves no
orphaned rank behind.

The same preloaded process also serves runs one after another (:class:`ForkServer`, ``--serve``): each request
forks one real process in a new session, with its own working directory, environment, log file and exit status
(tests/test_kill_safe.py's killed runs: the kills and what a process leaves behind are what it tests, not the
imports before them).
"""

from __future__ import annotations

import ctypes
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import warnings
from pathlib import Path

# What every driver's ranks import anyway, in the drivers' order.
PRELOAD = ("bridge_ext", "torch", "torch.distributed", "bridge_ext.commands", "bridge_ext.training",
           "megatron.bridge.training.pretrain")
GRACE_S = 30


def _preload() -> None:
    import importlib

    for name in PRELOAD:
        importlib.import_module(name)
    # A fork copies only this thread: another thread's locks could hang a rank. jemalloc's purging thread (a
    # library that bundles jemalloc starts it) is safe: jemalloc takes its locks around a fork (pthread_atfork).
    others = [name for name in _thread_names() if name != "jemalloc_bg_thd"][1:]
    if threading.active_count() != 1 or others:
        raise SystemExit(f"fork_launch: threads {others} after the imports; forking is unsafe: use torchrun")


def _thread_names() -> list[str]:
    """This process's threads by name, this one first."""
    names = []
    for tid in sorted(os.listdir("/proc/self/task"), key=lambda t: int(t) != os.getpid()):
        with open(f"/proc/self/task/{tid}/comm") as f:
            names.append(f.read().strip())
    return names


def _run_rank(rank: int, nproc: int, port: int, script: str, args: list[str]) -> int:
    """The forked rank: torchrun's environment, then SCRIPT as __main__. Returns its exit code."""
    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG: die with the launcher
    if os.getppid() == 1:  # the launcher died before prctl took effect
        return 1
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(nproc), LOCAL_WORLD_SIZE=str(nproc),
                      GROUP_RANK="0", ROLE_RANK=str(rank), ROLE_WORLD_SIZE=str(nproc), GROUP_WORLD_SIZE="1",
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    return _run_script(script, args)


def _run_script(script: str, args: list[str]) -> int:
    """``python SCRIPT ARGS`` in this (forked) process; returns its exit code."""
    import runpy

    sys.argv = [script, *args]
    sys.path[0] = os.path.dirname(os.path.abspath(script))  # as `python SCRIPT` puts it first
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit as stop:
        code = stop.code
        if code is None or isinstance(code, int):
            return code or 0
        print(code, file=sys.stderr)
        return 1
    return 0


def _wait(pids: dict[int, int]) -> int:
    """Waits for every rank; the first failure stops the others. Returns the launch's exit code."""
    failed: list[str] = []
    deadline = None
    while pids:
        if deadline is None:
            pid, status = os.waitpid(-1, 0)
        else:
            pid, status = os.waitpid(-1, os.WNOHANG)
            if pid == 0:
                if time.monotonic() > deadline:
                    for other in pids:
                        os.kill(other, signal.SIGKILL)
                    deadline = float("inf")
                time.sleep(0.1)
                continue
        rank = pids.pop(pid, None)
        if rank is None:
            continue
        code = os.waitstatus_to_exitcode(status)
        if code != 0:
            failed.append(f"fork_launch: rank {rank} (pid {pid}) exited with {code}")
            if deadline is None:
                for other in pids:
                    os.kill(other, signal.SIGTERM)
                deadline = time.monotonic() + GRACE_S
    for line in failed:
        print(line, file=sys.stderr, flush=True)
    return 1 if failed else 0


def _fork() -> int:
    sys.stdout.flush()
    sys.stderr.flush()
    with warnings.catch_warnings():  # "multi-threaded, fork() may deadlock": jemalloc's thread, see _preload
        warnings.simplefilter("ignore", DeprecationWarning)
        return os.fork()


def _serve() -> int:
    """Requests on stdin, one JSON line each: ``{"script", "args", "cwd", "env", "log"}``. For each, one forked
    process in a new session runs ``SCRIPT ARGS`` (stdin /dev/null, stdout and stderr to ``log``); the replies
    on stdout are ``{"pid"}`` at its start and ``{"pid", "status"}`` (its exit code, or -signal) at its end."""
    _preload()
    replies = os.fdopen(os.dup(1), "w")
    for line in sys.stdin:
        request = json.loads(line)
        pid = _fork()
        if pid == 0:
            replies.close()
            return _run_request(request)
        print(json.dumps({"pid": pid}), file=replies, flush=True)
        _, status = os.waitpid(pid, 0)
        print(json.dumps({"pid": pid, "status": os.waitstatus_to_exitcode(status)}), file=replies, flush=True)
    return 0


def _run_request(request: dict) -> int:
    os.setsid()
    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG: die with the server
    os.chdir(request["cwd"])
    os.environ.update(request.get("env") or {})
    log = os.open(request["log"], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    null = os.open(os.devnull, os.O_RDONLY)
    for fd, to in ((0, null), (1, log), (2, log)):
        os.dup2(to, fd)
    sys.stdin = open(0, closefd=False)
    return _run_script(request["script"], request["args"])


class ForkServer:
    """A preloaded process that forks runs on request (``--serve``): ``with ForkServer(env=...) as server:
    pid, status = server.run(script, args, cwd=..., log=...)``. ``env`` adds to the server's environment (what
    the interpreter reads at start, e.g. ``PYTHONWARNINGS``, goes here)."""

    def __init__(self, *, env: dict[str, str] | None = None):
        self.env = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}

    def __enter__(self) -> ForkServer:
        self.proc = subprocess.Popen([sys.executable, __file__, "--serve"], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True, env=self.env)
        return self

    def __exit__(self, *exc) -> None:
        self.proc.stdin.close()
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()

    def run(self, script: str | Path, args: list, *, cwd: str | Path, log: str | Path,
            env: dict[str, str] | None = None) -> tuple[int, int]:
        """Runs ``script *args`` as a forked process in a new session; returns its pid and exit status."""
        pid = self.start(script, args, cwd=cwd, log=log, env=env)
        return pid, self.wait(pid)

    def start(self, script: str | Path, args: list, *, cwd: str | Path, log: str | Path,
              env: dict[str, str] | None = None) -> int:
        """Starts ``script *args`` as a forked process in a new session (its process group: the pid); returns the
        pid. One run at a time: :meth:`wait` for it before the next."""
        request = {"script": str(script), "args": [str(a) for a in args], "cwd": str(cwd), "env": env or {},
                   "log": str(log)}
        self.proc.stdin.write(json.dumps(request) + "\n")
        self.proc.stdin.flush()
        return json.loads(self._reply())["pid"]

    def wait(self, pid: int) -> int:
        """The exit status (an exit code, or -signal) of the run :meth:`start` started."""
        done = json.loads(self._reply())
        assert done["pid"] == pid, done
        return done["status"]

    def _reply(self) -> str:
        line = self.proc.stdout.readline()
        assert line, f"the fork server ended (exit code {self.proc.poll()})"
        return line


def main(argv: list[str]) -> int:
    if argv == ["--serve"]:
        return _serve()
    if len(argv) < 3 or argv[0] != "--nproc-per-node":
        print("usage: fork_launch.py --nproc-per-node N SCRIPT ARG... | fork_launch.py --serve", file=sys.stderr)
        return 2
    nproc, script, args = int(argv[1]), argv[2], argv[3:]
    _preload()
    with socket.socket() as s:  # a free port for rank 0's store
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    pids = {}
    for rank in range(nproc):
        pid = _fork()
        if pid == 0:
            return _run_rank(rank, nproc, port, script, args)  # the rank's interpreter then exits as usual
        pids[pid] = rank
    return _wait(pids)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
