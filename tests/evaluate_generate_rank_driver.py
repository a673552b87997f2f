"""Runs several ``nemo`` commands one after another in each process of one torchrun launch, in one gloo group.

    torchrun --standalone --nproc-per-node 2 tests/evaluate_generate_rank_driver.py PLAN.json

PLAN.json: ``{"phases": [[ARG, ...], ...]}``, each the arguments after ``nemo`` (``llm evaluate ...``,
``llm generate ...``). One launch pays Python's and Megatron's imports once for both commands
(tests/test_evaluate_parallel.py); Megatron's globals are reset between phases. Exits with the first failing
phase's code.
"""

from __future__ import annotations

import json
import os
import sys


def main(plan_path: str) -> int:
    import torch

    from bridge_ext import commands
    from bridge_ext.cpu import enable_cpu_mode, init_cpu_distributed
    from bridge_ext.process_state import reset_megatron_globals

    torch.set_num_threads(1)
    enable_cpu_mode()
    init_cpu_distributed()
    for argv in json.loads(open(plan_path).read())["phases"]:
        reset_megatron_globals()
        code = commands.main(argv)
        if code != 0:
            return code
        torch.distributed.barrier()
    reset_megatron_globals()
    torch.distributed.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    sys.exit(main(sys.argv[1]))
