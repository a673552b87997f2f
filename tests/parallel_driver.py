"""Runs several ``nemo llm pretrain`` commands one after another in each process of one launch.

    torchrun --standalone --nproc-per-node 2 tests/parallel_driver.py PLAN.json

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


def main(plan_path: str) -> int:
    import torch

    from bridge_ext import commands
    from bridge_ext.cpu import init_cpu_distributed, reset_megatron_globals

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


def torchrun(script: str, plan_path: Path, cwd: Path, *, nproc: int, timeout: int,
             tail: int = 6000) -> subprocess.CompletedProcess:
    """One ``torchrun`` launch of ``nproc`` processes of ``script PLAN`` from this interpreter's venv on a free port;
    asserts it succeeded (the output's tail as the message). Also tests/layout_matrix_driver.py's launcher."""
    with socket.socket() as s:  # a free port for torchrun's store
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    command = [str(Path(sys.executable).with_name("torchrun")), "--nnodes", "1", "--nproc-per-node", str(nproc),
               "--master-addr", "127.0.0.1", "--master-port", str(port), script, str(plan_path)]
    done = subprocess.run(command, cwd=cwd, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True,
                          text=True, timeout=timeout)  # fmt: skip
    assert done.returncode == 0, (done.stdout + done.stderr)[-tail:]
    return done


def launch(plan: list[list[str]], cwd: Path, *, nproc: int, timeout: int = 1500) -> str:
    """Runs ``plan`` (phases of ``nemo llm pretrain`` arguments) in one ``torchrun`` launch of ``nproc`` processes
    from this interpreter's venv; asserts it succeeded and returns its stdout."""
    path = cwd / f"plan-{nproc}.json"
    path.write_text(json.dumps({"phases": plan}))
    return torchrun(os.path.abspath(__file__), path, cwd, nproc=nproc, timeout=timeout).stdout


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    sys.exit(main(sys.argv[1]))
