"""Runs several ``nemo llm pretrain`` commands one after another in each process of one launch.

    python tests/fork_launch.py --nproc-per-node 2 tests/parallel_driver.py PLAN.json   (or torchrun)

PLAN.json: ``{"phases": [[ARG, ...], ...]}``, each the arguments after ``nemo llm pretrain``. One process
group serves every phase (Megatron's globals are reset between them), so a launch pays Python's and
Megatron's imports once for several layouts of the same world size (tests/test_parallel_cpu.py). Prints
``PHASE i OK <seconds>`` per phase on rank 0; exits with the first failing phase's code.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Literal


def main(plan_path: str) -> int:
    import torch

    from bridge_ext import commands
    from bridge_ext.cpu import init_cpu_distributed
    from bridge_ext.process_state import reset_megatron_globals

    torch.set_num_threads(1)  # tiny models: one thread per process is faster on a shared machine
    phases = json.loads(open(plan_path).read())["phases"]
    init_cpu_distributed()
    rank = torch.distributed.get_rank()
    for index, args in enumerate(phases):
        start = time.time()
        reset_megatron_globals()
        code = commands.main(["llm", "pretrain", *args])
        if code != 0:
            print(f"PHASE {index} FAILED with exit code {code}: {' '.join(args)}", file=sys.stderr, flush=True)
            return code
        torch.distributed.barrier()
        if rank == 0:
            print(f"PHASE {index} OK {time.time() - start:.1f}", flush=True)
    reset_megatron_globals()
    torch.distributed.destroy_process_group()
    return 0


def launch_ranks(script: str | Path, args: list, cwd: Path, *, nproc: int, timeout: int, tail: int = 6000,
                 launcher: Literal["fork", "torchrun"] = "fork", env: dict | None = None) -> subprocess.CompletedProcess:
    """``script *args`` on ``nproc`` ranks from this interpreter's venv; asserts the launch succeeded (the output's
    tail as the message). ``fork``: tests/fork_launch.py (the libraries imported once, the ranks forked, torchrun's
    environment); ``torchrun``: the real launcher on a free port, for tests of what runs under it. ``env`` adds to
    the environment (OMP_NUM_THREADS=1: tiny models)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
    if launcher == "fork":
        command = [sys.executable, str(Path(__file__).with_name("fork_launch.py")), "--nproc-per-node", str(nproc)]
    else:
        with socket.socket() as s:  # a free port for torchrun's store
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        command = [str(Path(sys.executable).with_name("torchrun")), "--nnodes", "1", "--nproc-per-node", str(nproc),
                   "--master-addr", "127.0.0.1", "--master-port", str(port)]
    done = subprocess.run([*command, str(script), *map(str, args)], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=timeout)
    assert done.returncode == 0, (done.stdout + done.stderr)[-tail:]
    return done


def launch(plan: list[list[str]], cwd: Path, *, nproc: int, timeout: int = 1500) -> str:
    """Runs ``plan`` (phases of ``nemo llm pretrain`` arguments) in one launch of ``nproc`` processes
    from this interpreter's venv; asserts it succeeded and returns its stdout."""
    path = cwd / f"plan-{nproc}.json"
    path.write_text(json.dumps({"phases": plan}))
    return launch_ranks(os.path.abspath(__file__), [path], cwd, nproc=nproc, timeout=timeout).stdout


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    sys.exit(main(sys.argv[1]))
