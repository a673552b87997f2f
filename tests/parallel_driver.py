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
import sys
import time


def main(plan_path: str) -> int:
    import torch

    from bridge_ext import commands
    from bridge_ext.cpu_mode import init_cpu_distributed, reset_megatron_globals

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


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    sys.exit(main(sys.argv[1]))
