"""``nemo llm export --ckpt DIR --out HF``: a Megatron checkpoint -> a Hugging Face directory
(``bridge_ext.convert``)."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from bridge_ext.commands.hf_import import add_parallel_arguments, size_in_bytes
from bridge_ext.convert.megatron_to_hf import DEFAULT_SHARD_BYTES

__all__ = ["add_parser", "run"]


def add_parser(subparsers: Any, name: str) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        name,
        help="Megatron checkpoint -> Hugging Face directory",
        description="Convert a Megatron checkpoint (from import or a training run) into a Hugging Face directory: "
        "config.json, safetensors shards with an index, tokenizer and generation files when known.",
    )
    p.add_argument("--ckpt", required=True, type=Path,
                   help="checkpoint root (iter_* directories) or one iter_* directory")
    p.add_argument("--out", required=True, type=Path, help="directory for the Hugging Face model")
    p.add_argument("--iteration", type=int, default=None, help="iteration to export (default: the latest)")
    p.add_argument("--hf-config", type=Path, default=None,
                   help="directory with the model's config.json (default: found from the checkpoint)")
    p.add_argument("--shard-size", type=size_in_bytes, default=DEFAULT_SHARD_BYTES,
                   help="max bytes per shard (default 5GB)")
    p.add_argument("--overwrite", action="store_true", help="replace a non-empty --out")
    p.add_argument("--verbose", action="store_true", help="show Megatron's and transformers' own output")
    p.add_argument("--no-checksums", dest="checksums", action="store_false",
                   help="do not verify the checkpoint's integrity record (sizes are still checked)")
    add_parallel_arguments(p)
    return p


def run(args: argparse.Namespace) -> int:
    from bridge_ext.convert import run_export

    return run_export(ckpt=args.ckpt, out=args.out, iteration=args.iteration, hf_config=args.hf_config,
                      shard_bytes=args.shard_size, overwrite=args.overwrite, tp=args.tp, pp=args.pp, ep=args.ep,
                      verbose=args.verbose, stream=not args.no_stream, checksums=args.checksums)
