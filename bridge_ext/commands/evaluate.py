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
        "Several --ckpt (a Muon run and its AdamW twin) go in one table; --out writes a CSV and a PNG. "
        "--choices FILE.jsonl: multiple-choice acc / acc_norm as lm-evaluation-harness scores them.",
    )
    p.add_argument("--ckpt", required=True, type=Path, action="append",
                   help="checkpoint root (iter_* directories) or one iter_* directory; repeat to compare runs")
    which = p.add_mutually_exclusive_group()
    which.add_argument("--iteration", type=int, default=None, help="the iteration (default: the latest)")
    which.add_argument("--all", action="store_true", help="every complete saved iteration")
    p.add_argument("--data", default=None,
                   help="held-out data: a prepare-data prefix (PATH.bin/.idx) or blend YAML (their validation "
                   "split), a .jsonl ({\"text\": ...} per line) or .txt file tokenized on the fly with the model's "
                   "tokenizer (all of it), or 'mock' (Megatron's mock dataset); default: the run's own data's "
                   "validation split (docs/evaluate.md)")
    p.add_argument("--split", default=None, metavar="TRAIN,VALID,TEST",
                   help="the document split Megatron applies to --data (its validation part is evaluated; 0,1,0: "
                   "all of it); default: the run's dataset.split, the YAML's, or 0,1,0 for a file")
    p.add_argument("--choices", type=Path, default=None, metavar="FILE.jsonl",
                   help="multiple-choice accuracy instead of loss: {\"context\", \"choices\", \"label\"} per "
                   "line, scored as lm-evaluation-harness does (acc, acc_norm; docs/evaluate.md)")
    p.add_argument("--tokenizer", type=Path, default=None,
                   help="--choices: the model's tokenizer directory (default: the checkpoint's own)")
    p.add_argument("--tokens", type=int, default=None,
                   help="held-out tokens to evaluate (rounded up to whole global batches; default: the run's "
                   "eval_iters, or 16 batches when it had none)")
    p.add_argument("--tp", type=int, default=None,
                   help="under torchrun: tensor-parallel size of the evaluation (default: the run's, where the "
                   "launch holds it); the other processes are data-parallel ranks. The checkpoint is resharded")
    p.add_argument("--out", type=Path, default=None, help="directory for evaluate.csv and evaluate.png")
    p.add_argument("--json", action="store_true", help="one JSON object per evaluated iteration on stdout")
    p.add_argument("--verbose", action="store_true", help="show Megatron's own output")
    p.add_argument("--no-checksums", dest="checksums", action="store_false",
                   help="do not verify the checkpoint's integrity record (sizes are still checked)")
    return p


def run(args: argparse.Namespace) -> int:
    from bridge_ext.evaluate.held_out import run_evaluate

    if args.tokens is not None and args.tokens < 1:
        raise UserError("--tokens must be at least 1")
    if args.tp is not None and args.tp < 1:
        raise UserError("--tp must be at least 1")
    if args.split is not None:
        parts = args.split.replace("/", ",").split(",")
        try:
            weights = [float(x) for x in parts]
        except ValueError:
            weights = []
        if len(weights) != 3 or min(weights) < 0 or weights[1] <= 0:
            raise UserError(f"--split {args.split!r}: three non-negative weights train,valid,test with valid above 0 "
                            "(e.g. 98,1,1; 0,1,0: all of it)")
        args.split = ",".join(p.strip() for p in parts)
    if args.choices is not None:
        from bridge_ext.evaluate.choices import run_choices

        stray = [name for name, value in (("--data", args.data), ("--tokens", args.tokens), ("--out", args.out),
                                          ("--split", args.split), ("--tp", args.tp)) if value is not None]
        if stray:
            raise UserError(f"{stray[0]} does not apply to --choices (accuracy, not loss)")
        from bridge_ext.runtime import launcher_world_size

        if (launcher_world_size() or 1) > 1:
            raise UserError("--choices runs in one process: launch it without torchrun")
        run_choices(ckpts=args.ckpt, choices=args.choices, iteration=args.iteration, every=args.all,
                    as_json=args.json, checksums=args.checksums, verbose=args.verbose, tokenizer=args.tokenizer)
        return 0
    if args.tokenizer is not None:
        raise UserError("--tokenizer applies to --choices (the loss uses the tokenizer of the run or of --data)")
    run_evaluate(ckpts=args.ckpt, iteration=args.iteration, every=args.all, data=args.data, tokens=args.tokens,
                 split=args.split, out=args.out, as_json=args.json, checksums=args.checksums, verbose=args.verbose,
                 tp=args.tp)
    return 0
