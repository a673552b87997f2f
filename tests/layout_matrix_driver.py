"""Runs several ``nemo`` commands (``llm pretrain``, ``llm export --tp/--pp/--ep``) one after another in each process
of one launch, for tests/test_layout_matrix.py.

    python tests/fork_launch.py --nproc-per-node N tests/layout_matrix_driver.py PLAN.json

PLAN.json: ``{"phases": [[ARG, ...], ...]}``, each the arguments after ``nemo`` (``["llm", "pretrain", ...]``).
One gloo group serves every phase (Megatron's globals are reset between them; a conversion uses the group it
finds), so a launch pays Python's and Megatron's imports once for every family and layout of its world size.
Rank 0 writes ``PLAN.times.json`` (seconds per phase); the launch exits with the first failing phase's code.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path


def main(plan_path: str) -> int:
    import torch

    from bridge_ext import commands
    from bridge_ext.cpu import init_cpu_distributed
    from bridge_ext.process_state import reset_megatron_globals

    torch.set_num_threads(1)  # tiny models: one thread per process is faster on a shared machine
    phases = json.loads(Path(plan_path).read_text())["phases"]
    init_cpu_distributed()
    rank = torch.distributed.get_rank()
    times = []
    for index, args in enumerate(phases):
        start = time.time()
        reset_megatron_globals()
        code = commands.main(args)
        if code != 0:
            print(f"PHASE {index} FAILED with exit code {code}: {' '.join(args)}", file=sys.stderr, flush=True)
            return code
        torch.distributed.barrier()
        times.append(round(time.time() - start, 1))
        if rank == 0:
            print(f"PHASE {index} OK {times[-1]}: {' '.join(args[:4])}", flush=True)
    reset_megatron_globals()
    torch.distributed.destroy_process_group()
    if rank == 0:
        Path(plan_path).with_suffix(".times.json").write_text(json.dumps(times))
    return 0


def launch(plan: list[list[str]], cwd: Path, *, nproc: int, timeout: int = 1800) -> list[float]:
    """Runs ``plan`` (each phase the arguments after ``nemo``) in one launch of ``nproc`` processes
    from this interpreter's venv; asserts it succeeded; returns the seconds of each phase."""
    from parallel_driver import launch_ranks  # the test process's side (tests/ is on its path)

    path = cwd / f"matrix-plan-{nproc}.json"
    path.write_text(json.dumps({"phases": plan}))
    launch_ranks(os.path.abspath(__file__), [path], cwd, nproc=nproc, timeout=timeout, tail=8000)
    return json.loads(path.with_suffix(".times.json").read_text())


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    sys.exit(main(sys.argv[1]))
