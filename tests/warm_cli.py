"""`nemo ...` in a fresh process, without paying Megatron Bridge's import each time (~20 s of CPU).

A test calls :func:`run_nemo` where it would call ``subprocess.run([nemo, ...], capture_output=True,
text=True)``. The command runs in a process forked from a warm one (this file run as a script) that has
imported ``bridge_ext.commands`` and the Megatron / torch / transformers modules the commands use, and nothing
else: no CPU mode, no torch op, no process group. The forked process then does what the ``nemo`` script
does (``bridge_ext.commands.main`` with the test's argv, working directory and environment, stdin/stdout/stderr
to files), runs the interpreter's exit steps (non-daemon threads, ``atexit``) and exits with main's code.

Left to real subprocesses: what happens at import time (warnings printed while importing, the fast
paths that must not import torch), signals sent to the process, and torchrun / NeMo-Run launches.
The warm process is per test process (pytest-xdist worker) and serves one command at a time.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

__all__ = ["run_nemo"]

# What the commands import lazily; importing them up front is what the warm process is for.
WARM_MODULES = (
    "bridge_ext.commands", "megatron.bridge", "megatron.bridge.training.pretrain", "megatron.bridge.training.finetune",
    "megatron.bridge.training.gpt_step", "megatron.bridge.recipes", "megatron.bridge.recipes.common",
    "megatron.bridge.peft.lora", "megatron.core.dist_checkpointing", "megatron.core.optimizer",
    "torch.distributed.checkpoint", "transformers", "safetensors.torch", "matplotlib.figure",
    "bridge_ext.training", "bridge_ext.build", "bridge_ext.convert.cli", "bridge_ext.cpu_mode",
)

_server: subprocess.Popen | None = None


def _start() -> subprocess.Popen:
    global _server
    if _server is None or _server.poll() is not None:
        # unbuffered bytes: readline() then takes no more than its line, so select() sees what is left
        _server = subprocess.Popen([sys.executable, __file__], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                   stderr=subprocess.DEVNULL, bufsize=0, cwd=Path(__file__).parent.parent)
        ready = _server.stdout.readline()
        if ready.strip() != b"ready":
            raise RuntimeError(f"the warm `nemo` process did not start: {ready!r}")
    return _server


def run_nemo(argv: list[str], *, cwd: str | Path | None = None, env: dict[str, str] | None = None,
             timeout: float | None = 900, input: str | None = None) -> subprocess.CompletedProcess:
    """``nemo *argv`` in a fresh (forked) process: a ``CompletedProcess`` with text stdout and stderr."""
    server = _start()
    with tempfile.TemporaryDirectory(prefix="warm-nemo-") as tmp:
        files = {name: str(Path(tmp) / name) for name in ("stdin", "stdout", "stderr")}
        Path(files["stdin"]).write_text(input or "")
        request = {"argv": [str(a) for a in argv], "cwd": str(cwd or os.getcwd()),
                   "env": dict(os.environ if env is None else env), **files}
        server.stdin.write((json.dumps(request) + "\n").encode())
        pid = int(server.stdout.readline())
        try:
            rc = _read_exit(server, timeout)
        except subprocess.TimeoutExpired:
            os.killpg(pid, 9)  # the command and what it started (it leads its own process group)
            _read_exit(server, 60)
            raise subprocess.TimeoutExpired(["nemo", *argv], timeout) from None
        return subprocess.CompletedProcess(["nemo", *argv], rc, Path(files["stdout"]).read_text(),
                                           Path(files["stderr"]).read_text())


def _read_exit(server: subprocess.Popen, timeout: float | None) -> int:
    import selectors

    with selectors.DefaultSelector() as selector:
        selector.register(server.stdout, selectors.EVENT_READ)
        if not selector.select(timeout):
            raise subprocess.TimeoutExpired("nemo", timeout)
    line = server.stdout.readline()
    if not line:
        raise RuntimeError("the warm `nemo` process died")
    return int(line)


# ------------------------------------------------------------------------------------------- the server
def _child(request: dict) -> None:
    """In the forked process: become ``nemo *argv`` and exit like it."""
    os.setsid()  # its own process group, like a command a shell starts
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    if os.environ.get("PYTHONWARNINGS"):  # read at interpreter start-up, which this process did not have
        import warnings

        warnings._processoptions(os.environ["PYTHONWARNINGS"].split(","))
    for fd, name, mode in ((0, "stdin", os.O_RDONLY), (1, "stdout", os.O_WRONLY | os.O_CREAT),
                           (2, "stderr", os.O_WRONLY | os.O_CREAT)):
        target = os.open(request[name], mode)
        os.dup2(target, fd)
        os.close(target)
    sys.stdin = open(0, closefd=False)  # the server's reader may hold buffered requests: a fresh one on the file
    sys.argv = ["nemo", *request["argv"]]
    code = 1
    try:
        from bridge_ext.commands import main

        code = main(request["argv"])
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        if exc.code is not None and not isinstance(exc.code, int):
            print(exc.code, file=sys.stderr)
    except BaseException:  # what the interpreter does with an uncaught exception
        import traceback

        traceback.print_exc()
        code = 1
    finally:
        import atexit
        import threading

        try:  # the interpreter's own exit: wait for non-daemon threads, then atexit
            threading._shutdown()
            atexit._run_exitfuncs()
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code or 0)


def _serve() -> None:
    import importlib
    import importlib.util
    import warnings

    # Importing Megatron Bridge starts native threads (torch's pool, pyarrow's jemalloc), all idle when the
    # server forks; the forked run's losses equal a `nemo` process's bit for bit (tests/test_cli.py).
    warnings.filterwarnings("ignore", message=r".*use of fork\(\) may lead to deadlocks", category=DeprecationWarning)

    for name in WARM_MODULES:
        try:
            if importlib.util.find_spec(name) is not None:
                importlib.import_module(name)
        except ImportError:
            pass  # a module this stack does not have: the command imports what it has
    out = sys.stdout
    out.write("ready\n")
    out.flush()
    for line in sys.stdin:
        request = json.loads(line)
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            _child(request)
        out.write(f"{pid}\n")
        out.flush()
        _, status = os.waitpid(pid, 0)
        out.write(f"{os.waitstatus_to_exitcode(status)}\n")
        out.flush()


if __name__ == "__main__":
    _serve()
