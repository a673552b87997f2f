"""``nemo llm import`` / ``nemo llm export``: argparse registration and the two commands."""

from __future__ import annotations

import argparse
import re
from pathlib import Path
from typing import Any

from bridge_ext.convert.hf_to_megatron import import_hf
from bridge_ext.convert.megatron_to_hf import DEFAULT_SHARD_BYTES, export_hf
from bridge_ext.convert.parallel import _is_rank0
from bridge_ext.convert.report import ConversionSummary, _quiet_upstream
from bridge_ext.convert.verify import VERIFY_TOLERANCE

__all__ = ['register', 'run_export', 'run_import']


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError("must be >= 1")
    return value


def _bytes_arg(text: str) -> int:
    match = re.fullmatch(r"(\d+(?:\.\d+)?)\s*([KMG]?B?)", text.strip().upper())
    if not match:
        raise argparse.ArgumentTypeError("a size such as 5GB, 500MB or 1000000")
    scale = {"": 1, "B": 1, "K": 10**3, "KB": 10**3, "M": 10**6, "MB": 10**6, "G": 10**9, "GB": 10**9}[match.group(2)]
    return int(float(match.group(1)) * scale)


def _parallel_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("distributed conversion (launched with torchrun; GPUs, or CPU with gloo)")
    group.add_argument("--tp", type=_positive, default=1, help="tensor-parallel size (default 1)")
    group.add_argument("--pp", type=_positive, default=1, help="pipeline-parallel size (default 1)")
    group.add_argument("--ep", type=_positive, default=1, help="expert-parallel size (default 1)")


def register(subparsers: Any) -> None:
    """Add ``import`` and ``export`` to an argparse subparsers object (``nemo llm ...``)."""
    imp = subparsers.add_parser(
        "import",
        help="Hugging Face directory -> Megatron checkpoint",
        description="Convert a Hugging Face model directory (Qwen3, Qwen3-MoE, DeepSeek-V3 / Kimi K2) into a "
        "Megatron torch_dist checkpoint that recipes load with checkpoint.pretrained_checkpoint=OUT.",
    )
    imp.add_argument("--hf", required=True, type=Path, help="Hugging Face model directory (config.json + safetensors)")
    imp.add_argument("--out", required=True, type=Path, help="directory for the Megatron checkpoint")
    imp.add_argument("--verify", action="store_true", help="compare transformers and Megatron logits in fp32")
    imp.add_argument("--tolerance", type=float, default=VERIFY_TOLERANCE,
                     help=f"largest |logit difference| --verify accepts (default {VERIFY_TOLERANCE:g})")  # fmt: skip
    imp.add_argument("--overwrite", action="store_true", help="replace a non-empty --out")
    imp.add_argument("--verbose", action="store_true", help="show Megatron's and transformers' own output")
    _parallel_args(imp)
    imp.set_defaults(func=run_import)

    exp = subparsers.add_parser(
        "export",
        help="Megatron checkpoint -> Hugging Face directory",
        description="Convert a Megatron checkpoint (from import or a training run) into a Hugging Face directory: "
        "config.json, safetensors shards with an index, tokenizer and generation files when known.",
    )
    exp.add_argument("--ckpt", required=True, type=Path,
                     help="checkpoint root (iter_* directories) or one iter_* directory")  # fmt: skip
    exp.add_argument("--out", required=True, type=Path, help="directory for the Hugging Face model")
    exp.add_argument("--iteration", type=int, default=None, help="iteration to export (default: the latest)")
    exp.add_argument("--hf-config", type=Path, default=None,
                     help="directory with the model's config.json (default: found from the checkpoint)")  # fmt: skip
    exp.add_argument("--shard-size", type=_bytes_arg, default=DEFAULT_SHARD_BYTES,
                     help="max bytes per shard (default 5GB)")  # fmt: skip
    exp.add_argument("--overwrite", action="store_true", help="replace a non-empty --out")
    exp.add_argument("--verbose", action="store_true", help="show Megatron's and transformers' own output")
    _parallel_args(exp)
    exp.set_defaults(func=run_export)


def _finish(summary: ConversionSummary) -> int:
    if _is_rank0():
        for note in summary.notes:
            print(f"note: {note}")
        print(summary.line())
    return 0


def run_import(args: argparse.Namespace) -> int:
    """``nemo llm import``: exit code 0, or :class:`UserError` for bad input."""
    with _quiet_upstream(verbose=getattr(args, "verbose", False)) as say:
        summary = import_hf(args.hf, args.out, verify=args.verify, overwrite=args.overwrite, tolerance=args.tolerance,
                            tp=args.tp, pp=args.pp, ep=args.ep, progress=True, console=say)  # fmt: skip
    return _finish(summary)


def run_export(args: argparse.Namespace) -> int:
    """``nemo llm export``: exit code 0, or :class:`UserError` for bad input."""
    with _quiet_upstream(verbose=getattr(args, "verbose", False)) as say:
        summary = export_hf(args.ckpt, args.out, iteration=args.iteration, overwrite=args.overwrite,
                            hf_config=args.hf_config, shard_bytes=args.shard_size, tp=args.tp, pp=args.pp,
                            ep=args.ep, progress=True, console=say)  # fmt: skip
    return _finish(summary)
