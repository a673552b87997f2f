"""Time and memory of a rank rehearsal (``nemo llm rehearse``), each in a fresh process.

    .venv/bin/python bench/rehearse.py [--recipe kimi_k2_muon] [--layout gb300x256] [--ranks 0,255] [--no-step]

Runs ``python -m bridge_ext.commands llm rehearse ... --json`` once per rank as a child process (the wall time
includes importing torch, Megatron Bridge and megatron-core, as a user's command does) and reads the child's
peak RSS from ``resource.getrusage(RUSAGE_CHILDREN)``. Prints one line per rank: wall seconds, peak RSS, the
rehearsal's own phases (parallel state, build, step), and plan / rehearsal for every row. The issue's target:
Kimi K2 ``gb300x256`` rank 0 within 5 minutes and 4 GB of RSS on a 2-core CPU machine.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def _one(recipe: str, layout: str | None, rank: int, step: bool) -> tuple[float, float, dict]:
    argv = [sys.executable, "-m", "bridge_ext.commands", "llm", "rehearse", "--recipe", recipe, "--rank", str(rank),
            "--json", *(["--layout", layout] if layout else []), *([] if step else ["--no-step"])]
    before = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    start = time.perf_counter()
    done = subprocess.run(argv, cwd=REPO, capture_output=True, text=True)
    wall = time.perf_counter() - start
    if done.returncode:
        sys.exit(f"rank {rank}: exit {done.returncode}\n{done.stderr[-3000:]}")
    peak = max(before, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss) / 2**20  # KiB -> GiB
    return wall, peak, json.loads(done.stdout)[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--recipe", default="kimi_k2_muon")
    parser.add_argument("--layout", default=None)
    parser.add_argument("--ranks", default="0", help="comma-separated global ranks")
    parser.add_argument("--no-step", action="store_true")
    args = parser.parse_args()
    for rank in (int(r) for r in args.ranks.split(",")):
        wall, peak, result = _one(args.recipe, args.layout, rank, not args.no_step)
        phases = ", ".join(f"{k} {v:.1f} s" for k, v in result["seconds"].items())
        ratios = ", ".join(f"{k} {v:.6f}" for k, v in result["ratios"].items() if v is not None)
        print(f"{result['recipe']} {result['layout']} rank {rank}: wall {wall:.1f} s (imports included), peak RSS "
              f"{peak:.2f} GiB; {phases}; rehearsal/plan: {ratios}", flush=True)


if __name__ == "__main__":
    main()
