"""``nemo llm evaluate --ckpt DIR [--iteration N | --all]``: held-out loss and perplexity of saved checkpoints
through Megatron Bridge's own evaluation (``bridge_ext.evaluate``)."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from bridge_ext.errors import UserError

__all__ = ["add_parser", "run"]


def add_parser(subparsers: Any, name: str) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        name,
        help="held-out loss and perplexity of saved checkpoints",
        description="Held-out loss and perplexity of a checkpoint, computed by Megatron Bridge's own evaluation "
        "(megatron.bridge.training.eval) on the model its run_config.yaml describes (CPU mode without a GPU). "
        "Several --ckpt (a Muon run and its AdamW twin) go in one table; --out writes a CSV and a PNG.",
    )
    p.add_argument("--ckpt", required=True, type=Path, action="append",
                   help="checkpoint root (iter_* directories) or one iter_* directory; repeat to compare runs")
    which = p.add_mutually_exclusive_group()
    which.add_argument("--iteration", type=int, default=None, help="the iteration (default: the latest)")
    which.add_argument("--all", action="store_true", help="every complete saved iteration")
    p.add_argument("--data", default=None,
                   help="held-out data: a prepare-data prefix (PATH.bin/.idx; its validation split under the run's "
                   "dataset.split); default: the run's own data's validation split (docs/evaluate.md)")
    p.add_argument("--tokens", type=int, default=None,
                   help="held-out tokens to evaluate (rounded up to whole global batches; default: the run's "
                   "eval_iters, or 16 batches when it had none)")
    p.add_argument("--out", type=Path, default=None, help="directory for evaluate.csv and evaluate.png")
    p.add_argument("--json", action="store_true", help="one JSON object per evaluated iteration on stdout")
    p.add_argument("--verbose", action="store_true", help="show Megatron's own output")
    p.add_argument("--no-checksums", dest="checksums", action="store_false",
                   help="do not verify the checkpoint's integrity record (sizes are still checked)")
    return p


def run(args: argparse.Namespace) -> int:
    from bridge_ext.evaluate import run_evaluate

    if args.tokens is not None and args.tokens < 1:
        raise UserError("--tokens must be at least 1")
    run_evaluate(ckpts=args.ckpt, iteration=args.iteration, every=args.all, data=args.data, tokens=args.tokens,
                 out=args.out, as_json=args.json, checksums=args.checksums, verbose=args.verbose)
    return 0
