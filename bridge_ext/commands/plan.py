"""``nemo llm plan --recipe NAME``: memory per GPU, FLOPs, tokens and GPU-hours of a recipe (``bridge_ext.plan``;
no torch, no GPU)."""

from __future__ import annotations

import argparse
import json
from typing import Any

from recipes.selection import split_part_selectors
from bridge_ext.errors import UserError
from bridge_ext.plan import OVERRIDE_KEYS

__all__ = ["add_parser", "run"]


def add_parser(subparsers: Any, name: str) -> argparse.ArgumentParser:
    p = subparsers.add_parser(name, help="memory per GPU, FLOPs, tokens and GPU-hours of a recipe (no GPU)",
                              description="From the recipe's shipped HF config, preset and layout; no torch.")
    p.add_argument("--recipe", required=True)
    p.add_argument("--layout", help="a layout name from the recipe's list (default: its first); or layout=NAME")
    p.add_argument("--preset", help="another optimizer preset; or preset=NAME")
    p.add_argument("--tflops-per-gpu", type=float, help="throughput for GPU-hours (default: NVIDIA's measured "
                   "figure where one exists: Kimi K2 1,080 / Qwen3-30B-A3B 721 on GB300 with Muon)")
    p.add_argument("--spec", choices=("te", "local"),
                   help="layer spec: te (GPUs) or local (CPU runs); default: local for cpu* layouts, else te")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("overrides", nargs="*", metavar="KEY=VALUE",
                   help=f"layout=, preset=, or one of: {', '.join(OVERRIDE_KEYS)}")
    return p


def run(args: argparse.Namespace) -> int:
    from bridge_ext.plan import format_plan, plan

    parts, overrides = split_part_selectors(args.overrides)  # layout=NAME / preset=NAME, as for pretrain
    if args.tflops_per_gpu is not None and args.tflops_per_gpu <= 0:
        raise UserError(f"--tflops-per-gpu must be positive, got {args.tflops_per_gpu}")
    result = plan(args.recipe, layout=parts.get("layout", args.layout), preset=parts.get("preset", args.preset),
                  overrides=overrides, tflops_per_gpu=args.tflops_per_gpu, spec=args.spec)
    print(json.dumps(result.to_json(), indent=2) if args.json else format_plan(result))
    return 0
