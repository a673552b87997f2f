"""``nemo llm import --hf DIR --out CKPT``: a Hugging Face directory -> a Megatron checkpoint
(``bridge_ext.convert``)."""

from __future__ import annotations

import argparse
import re
from pathlib import Path
from typing import Any

from bridge_ext.convert.verify import VERIFY_TOLERANCE
from recipes.families import FAMILIES

__all__ = ["add_parallel_arguments", "add_parser", "positive", "run", "size_in_bytes"]


def positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError("must be >= 1")
    return value


def size_in_bytes(text: str) -> int:
    match = re.fullmatch(r"(\d+(?:\.\d+)?)\s*([KMG]?B?)", text.strip().upper())
    if not match:
        raise argparse.ArgumentTypeError("a size such as 5GB, 500MB or 1000000")
    scale = {"": 1, "B": 1, "K": 10**3, "KB": 10**3, "M": 10**6, "MB": 10**6, "G": 10**9, "GB": 10**9}[match.group(2)]
    return int(float(match.group(1)) * scale)


def add_parallel_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("distributed conversion (launched with torchrun; GPUs, or CPU with gloo)")
    group.add_argument("--tp", type=positive, default=1, help="tensor-parallel size (default 1)")
    group.add_argument("--pp", type=positive, default=1, help="pipeline-parallel size (default 1)")
    group.add_argument("--ep", type=positive, default=1, help="expert-parallel size (default 1)")
    parser.add_argument("--no-stream", action="store_true",
                        help="convert through the built Megatron model (AutoBridge) instead of tensor by tensor; "
                        "a --tp/--pp/--ep layout converts that way too")


def add_parser(subparsers: Any, name: str) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        name,
        help="Hugging Face directory -> Megatron checkpoint",
        description=f"Convert a Hugging Face model directory ({', '.join(f.display for f in FAMILIES.values())}) "
        "into a Megatron torch_dist checkpoint that recipes load with checkpoint.pretrained_checkpoint=OUT.",
    )
    p.add_argument("--hf", required=True, type=Path, help="Hugging Face model directory (config.json + safetensors)")
    p.add_argument("--out", required=True, type=Path, help="directory for the Megatron checkpoint")
    p.add_argument("--verify", action="store_true", help="compare transformers and Megatron logits in fp32")
    p.add_argument("--tolerance", type=float, default=VERIFY_TOLERANCE,
                   help=f"largest |logit difference| --verify accepts (default {VERIFY_TOLERANCE:g})")
    p.add_argument("--overwrite", action="store_true", help="replace a non-empty --out")
    p.add_argument("--verbose", action="store_true", help="show Megatron's and transformers' own output")
    add_parallel_arguments(p)
    return p


def run(args: argparse.Namespace) -> int:
    from bridge_ext.convert import run_import

    return run_import(hf=args.hf, out=args.out, verify=args.verify, overwrite=args.overwrite, tolerance=args.tolerance,
                      tp=args.tp, pp=args.pp, ep=args.ep, verbose=args.verbose, stream=not args.no_stream)
