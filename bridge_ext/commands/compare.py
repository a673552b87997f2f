"""``nemo llm compare A B --out DIR``: train recipes on the same data, seed and token budget; compare the losses
(``bridge_ext.compare``)."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from bridge_ext.compare import DEFAULT_ITERS, DEFAULT_SEED, DEFAULT_SMOOTH
from bridge_ext.errors import UserError

__all__ = ["add_parser", "run"]


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value


def add_parser(subparsers: Any, name: str) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        name, help="train recipes on the same data, seed and token budget; CSV + plot of the losses",
        description="Runs every recipe (x every --sweep value) with Megatron Bridge's pretrain() in its own "
                    "process (CPU mode when no GPU is visible) and compares the per-iteration training loss.",
    )
    p.add_argument("--recipes",
                   help="comma-separated recipes, e.g. qwen3_proxy_muon,qwen3_proxy_adamw (or name them before the "
                        "overrides); RECIPE:KEY=VALUE[:KEY=VALUE] gives one run its own overrides. Fine-tuning "
                        "recipes (e.g. qwen3_proxy_sft_muon,qwen3_proxy_sft_adamw) need "
                        "checkpoint.pretrained_checkpoint=DIR and compare the held-out loss too")
    p.add_argument("--iters", type=_positive, default=None,
                   help=f"iterations per run (default {DEFAULT_ITERS}; fine-tuning: the recipe's own)")
    p.add_argument("--out", required=True, help="output directory (must not exist or be empty)")
    p.add_argument("--overwrite", action="store_true", help="replace the results of an earlier compare in --out")
    p.add_argument("--seed", type=int, default=DEFAULT_SEED,
                   help=f"model init and data order seed (default {DEFAULT_SEED}; fine-tuning: rng.seed and "
                        "dataset.seed, the training records' order)")
    p.add_argument("--data", default=None,
                   help="pre-training: text (default; the standard-library corpus, `nemo llm prepare-data`) or mock "
                        "(random tokens); fine-tuning: FILE.jsonl or stdlib-signatures (default, the shipped set)")
    p.add_argument("--sweep", action="append", metavar="KEY=V1,V2,...",
                   help="run every recipe once per value; repeated --sweep options are zipped")
    p.add_argument("--smooth", type=_positive, default=DEFAULT_SMOOTH,
                   help=f"window of the moving mean used for 'iterations to reach' (default {DEFAULT_SMOOTH})")
    p.add_argument("--device", choices=("auto", "gpu", "cpu"), default="auto",
                   help="auto: CPU mode when no GPU is visible")
    p.add_argument("--threads", type=_positive, help="torch threads per run (default: all cores)")
    p.add_argument("overrides", nargs="*", metavar="KEY=VALUE",
                   help="applied to every run, e.g. optimizer.clip_grad=0.5 (recipe names may come first)")
    return p


def run(args: argparse.Namespace) -> int:
    from bridge_ext.compare import parse_runs, run_compare

    named = [item for item in args.overrides if "=" not in item and not item.startswith("-")]
    if named and args.recipes:
        raise UserError(f"name the recipes once: --recipes {args.recipes} or {' '.join(named)}")
    if not named and not args.recipes:
        raise UserError("name two or more recipes: nemo llm compare A B --out DIR (or --recipes A,B)")
    overrides = [item for item in args.overrides if item not in named]
    runs = parse_runs(args.recipes or ",".join(named), args.sweep or [])
    if args.iters is not None and args.iters < 2:
        raise UserError(f"--iters {args.iters} is too few to compare curves")
    run_compare(runs, out=Path(args.out), iters=args.iters, seed=args.seed, data=args.data, device=args.device,
                common=overrides, overwrite=args.overwrite, smooth_window=args.smooth, threads=args.threads)
    return 0
