"""``nemo llm generate (--ckpt DIR | --hf DIR) (--prompt TEXT | --prompts FILE)``: text from a checkpoint
(``bridge_ext.inference``)."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from bridge_ext.errors import UserError

__all__ = ["add_parser", "run"]


def add_parser(subparsers: Any, name: str) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        name,
        help="text from a Megatron checkpoint or a Hugging Face directory",
        description="Continue prompts with a saved model and its own tokenizer: a Megatron checkpoint (built from "
        "its run config, CPU mode without a GPU) or a Hugging Face directory (transformers). Greedy by default; "
        "--temperature > 0 samples. One prompt streams to the console; --prompts FILE writes JSONL.",
    )
    source = p.add_mutually_exclusive_group(required=True)
    source.add_argument("--ckpt", type=Path, help="Megatron checkpoint root (iter_* directories) or one iter_* directory")
    source.add_argument("--hf", type=Path, help="Hugging Face model directory (safetensors)")
    prompt = p.add_mutually_exclusive_group(required=True)
    prompt.add_argument("--prompt", help="one prompt")
    prompt.add_argument("--prompts", type=Path, help="a file of prompts: JSONL with \"prompt\", or one per line")
    p.add_argument("--iteration", type=int, default=None, help="with --ckpt: the iteration (default: the latest)")
    p.add_argument("--tokenizer", type=Path, default=None, help="tokenizer directory (default: the model's own)")
    p.add_argument("--max-new-tokens", type=int, default=32, help="tokens to add at most (default 32)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 (default): greedy; > 0: sample")
    p.add_argument("--top-k", type=int, default=0, help="sample among the k likeliest tokens (0: all)")
    p.add_argument("--top-p", type=float, default=1.0, help="sample within this probability mass (1: all)")
    p.add_argument("--seed", type=int, default=1234, help="the sampler's seed")
    p.add_argument("--tp", type=int, default=1,
                   help="with --ckpt under torchrun: tensor-parallel size, the number of processes (default 1)")
    p.add_argument("--batch-size", type=int, default=8,
                   help="--out/--json: prompts decoded together (default 8); the console streams one at a time")
    p.add_argument("--out", type=Path, default=None, help="write the continuations as JSONL here")
    p.add_argument("--json", action="store_true", help="JSONL on stdout instead of streamed text")
    p.add_argument("--verbose", action="store_true", help="show Megatron's and transformers' own output")
    p.add_argument("--no-checksums", dest="checksums", action="store_false",
                   help="do not verify the checkpoint's integrity record (sizes are still checked)")
    return p


def run(args: argparse.Namespace) -> int:
    from bridge_ext.inference.generate import Sampling, read_prompts, run_generate

    if args.hf is not None and args.iteration is not None:
        raise UserError("--iteration applies to --ckpt, not --hf")
    if args.batch_size < 1:
        raise UserError("--batch-size must be at least 1")
    from bridge_ext.runtime import launcher_world_size

    world = launcher_world_size() or 1
    if args.tp < 1 or args.tp != world:
        raise UserError(f"--tp {args.tp} with {world} process{'es' if world > 1 else ''}: generate runs one "
                        f"tensor-parallel group, --tp must equal the number of processes (torchrun --nproc-per-node "
                        f"{args.tp})")
    if args.tp > 1 and args.hf is not None:
        raise UserError("--tp applies to --ckpt (a Hugging Face directory runs in one process)")
    prompts = [args.prompt] if args.prompt is not None else read_prompts(args.prompts)
    sampling = Sampling(max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_k=args.top_k,
                        top_p=args.top_p, seed=args.seed)
    run_generate(ckpt=args.ckpt, hf=args.hf, prompts=prompts, sampling=sampling, iteration=args.iteration,
                 tokenizer=args.tokenizer, out=args.out, as_json=args.json, checksums=args.checksums,
                 verbose=args.verbose, batch_size=args.batch_size, tp=args.tp)
    return 0
