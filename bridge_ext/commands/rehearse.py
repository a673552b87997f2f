"""``nemo llm rehearse --recipe NAME``: one process acts as a rank of the recipe's real layout and builds that
rank's model and optimizer through Megatron Bridge on fake tensors; what Megatron allocates beside ``nemo llm
plan`` (``bridge_ext.rehearse``; no GPU)."""

from __future__ import annotations

import argparse
import json
from typing import Any

from recipes.selection import choose_recipe

__all__ = ["add_parser", "run"]


def add_parser(subparsers: Any, name: str) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        name, help="build one rank of a recipe's real layout on fake tensors: memory and NS FLOPs vs plan (no GPU)",
        description="One process acts as rank R of the layout's world: Megatron's parallel state, the rank's model "
                    "chunks, DDP buffers and optimizer (Megatron Bridge's setup_optimizer), on fake tensors; one "
                    "optimizer step is counted, and one micro-batch forward + backward (peak activation bytes, model FLOPs). "
                    "Each row beside nemo llm plan's number for the same rank.")
    p.add_argument("--recipe", required=True)
    p.add_argument("--layout", help="a layout name from the recipe's list (default: its first); or layout=NAME")
    p.add_argument("--preset", help="another optimizer preset; or preset=NAME")
    which = p.add_mutually_exclusive_group()
    which.add_argument("--rank", type=int, action="append", help="a global rank (repeatable; default 0)")
    which.add_argument("--ranks", help="comma-separated global ranks and first, last, all-pp (the first rank of every "
                                       "pipeline stage)")
    p.add_argument("--no-step", action="store_true",
                   help="no optimizer step: the optimizer state as megatron-core allocates it before a checkpoint "
                        "load (no step counters); no Newton-Schulz FLOPs")
    p.add_argument("--no-activations", action="store_true",
                   help="skip the micro-batch forward + backward (peak activation bytes and model FLOPs of one "
                        "micro-batch beside plan's; seconds on the proxies, minutes on the largest ranks)")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                   help="cpu: fake tensors (default); cuda: real tensors on this GPU with the recipe's own layer spec "
                        "(a rank that fits one GPU), reporting torch.cuda.max_memory_allocated")
    p.add_argument("--json", action="store_true", help="print one JSON object (a list with one entry per rank)")
    p.add_argument("overrides", nargs="*", metavar="KEY=VALUE",
                   help="layout=NAME, preset=NAME, or a layout size as nemo llm plan takes it "
                        "(model.tensor_model_parallel_size=2, gpus=16, ...)")
    return p


def run(args: argparse.Namespace) -> int:
    from bridge_ext.rehearse import format_rehearsal, rehearse, select_ranks, with_layout_overrides
    from recipes import get_recipe

    recipe, layout_name, overrides = choose_recipe(args.recipe, get=get_recipe, preset=args.preset,
                                                   layout=args.layout, overrides=args.overrides)
    recipe, layout = with_layout_overrides(recipe, layout_name, overrides)
    if args.ranks is not None:
        ranks = select_ranks(args.ranks, world=layout.gpus, pp=layout.pp)
    else:
        ranks = tuple(args.rank or (0,))
    results = rehearse(recipe, layout=layout.cluster, ranks=ranks, device=args.device, step=not args.no_step,
                       activations=not args.no_activations)
    if args.json:
        print(json.dumps([r.to_json() for r in results], indent=2))
    else:
        print("\n\n".join(format_rehearsal(r) for r in results))
    return 0
