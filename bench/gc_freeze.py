"""What freezing the import-time heap saves a run (``bridge_ext.training``: ``gc.freeze()`` before a process's
first run), measured in one invocation: two processes, each one warm-up run then ``--runs`` timed proxy runs in
CPU mode, one with ``gc.freeze`` made a no-op (every full collection walks the ~680,000 import-time objects), one
as shipped. Prints each one's median seconds per run and the ratio.

    .venv/bin/python bench/gc_freeze.py [--recipe qwen3_moe_proxy_muon] [--iters 3] [--runs 3]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def _runs(recipe: str, iters: int, runs: int, frozen: bool) -> list[float]:
    """Seconds of each timed run (the first, warm-up run imports and prepares the data: not timed)."""
    import gc

    if not frozen:
        gc.freeze = lambda: None  # the baseline: the collector keeps walking the import-time heap

    from bridge_ext import commands
    from bridge_ext.process_state import reset_megatron_globals

    seconds = []
    with tempfile.TemporaryDirectory() as tmp:
        for number in range(runs + 1):
            reset_megatron_globals()
            start = time.perf_counter()
            argv = ["llm", "pretrain", "--recipe", recipe, f"train.train_iters={iters}",
                    f"checkpoint.save={tmp}/{number}", f"logger.tensorboard_dir={tmp}/{number}/tb"]
            if commands.main(argv) != 0:
                raise SystemExit(f"run {number} failed")
            if number:
                seconds.append(time.perf_counter() - start)
    return seconds


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--recipe", default="qwen3_moe_proxy_muon")
    parser.add_argument("--iters", type=int, default=3)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--worker", choices=["frozen", "unfrozen"], help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:  # one side, in its own process: print its seconds
        print(json.dumps(_runs(args.recipe, args.iters, args.runs, args.worker == "frozen")))
        return 0
    median = {}
    for side in ("unfrozen", "frozen"):
        out = subprocess.run([sys.executable, __file__, "--worker", side, "--recipe", args.recipe, "--iters",
                              str(args.iters), "--runs", str(args.runs)], cwd=REPO, capture_output=True, text=True)
        if out.returncode != 0:
            print(f"error: the {side} side failed:\n{out.stderr[-2000:]}", file=sys.stderr)
            return 1
        times = json.loads(out.stdout.strip().splitlines()[-1])
        median[side] = statistics.median(times)
        print(f"{side:9s} {args.recipe}, {args.iters} iterations: median {median[side]:.2f} s per run "
              f"({', '.join(f'{t:.2f}' for t in times)})")
    print(f"frozen / unfrozen: {median['frozen'] / median['unfrozen']:.2f}")
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(REPO))
    sys.exit(main())
