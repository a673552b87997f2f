"""``nemo llm prepare-data``: the proxies' offline corpus (``bridge_ext.data``), or with ``--input`` your corpus
tokenized with the model's tokenizer (``bridge_ext.corpus``)."""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any

from bridge_ext.cache import ENV_CACHE
from bridge_ext.errors import UserError

__all__ = ["add_parser", "run"]

def add_parser(subparsers: Any, name: str) -> argparse.ArgumentParser:
    from bridge_ext.corpus import DEFAULT_SPLIT

    p = subparsers.add_parser(
        name, help="tokenize a corpus into Megatron indexed datasets (default: the proxies' offline corpus)",
        description="With --input: tokenize your corpus (JSONL, Parquet, text) with the model's tokenizer into "
                    "Megatron indexed datasets and a YAML for `nemo llm pretrain --yaml` (docs/data.md). Without: "
                    "tokenize the Python standard library's sources with the shipped tokenizer into a Megatron "
                    f"indexed dataset under ${ENV_CACHE} (default ~/.cache/muon-recipes); built once, reused after.",
    )
    p.add_argument("--input", action="append", nargs="+", metavar="PATH|GLOB",
                   help="corpus files (JSONL, Parquet, text; .gz/.zst); repeat --input for a blend of sets")
    p.add_argument("--tokenizer", metavar="DIR", help="the model's directory with its tokenizer files "
                   "(tokenizer.json, or tiktoken.model for Kimi K2)")
    p.add_argument("--out", metavar="PREFIX", help="output prefix: PREFIX.bin/.idx/.json and PREFIX.yaml")
    p.add_argument("--text-key", default="text", help="JSON key / Parquet column of the text (default: text)")
    p.add_argument("--weights", type=float, nargs="+", metavar="W", help="one weight per --input set (blend)")
    p.add_argument("--split", default=DEFAULT_SPLIT,
                   help=f"train,valid,test document split Megatron applies (default {DEFAULT_SPLIT})")
    p.add_argument("--workers", type=int, default=2, help="tokenizer threads (default 2; tiktoken: its encode_batch "
                   "threads, Hugging Face: the Rust backend uses every core, RAYON_NUM_THREADS limits it)")
    p.add_argument("--append-eod", action="store_true", help="end every document with the eos token")
    p.add_argument("--overwrite", action="store_true", help="replace existing outputs made differently")
    p.add_argument("--force", action="store_true", help="standard-library corpus: rebuild even when cached")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    return p


def run(args: argparse.Namespace) -> int:
    if args.input:
        return _user_corpus(args)
    stray = [f"--{name.replace('_', '-')}" for name in ("tokenizer", "out", "weights") if getattr(args, name)]
    if stray:
        raise UserError(f"{stray[0]} needs --input (without --input, prepare-data builds the standard-library corpus)")
    from bridge_ext.data import corpus_info, ensure_text_corpus

    start = time.perf_counter()
    prefix_path, built = ensure_text_corpus(force=args.force, quiet=args.quiet)
    info = corpus_info(prefix_path)
    elapsed = time.perf_counter() - start
    print(f"dataset   {prefix_path}  (dataset.blend prefix: .bin/.idx)")
    print(f"source    {info['source']}")
    print(f"size      {info['tokens']:,} tokens in {info['documents']} documents ({info['bytes'] / 1e6:.1f} MB)")
    print(f"tokenizer {info['tokenizer']} (vocab {info['vocab_size']}, end of document id {info['eod']})")
    print(f"status    {'built' if built else 'cached'} ({elapsed:.1f} s)")
    return 0


def _user_corpus(args: argparse.Namespace) -> int:
    """``--input``: a user corpus with the model's tokenizer."""
    from bridge_ext.corpus import prepare_corpus, split_documents

    if not args.tokenizer or not args.out:
        raise UserError("--input needs --tokenizer DIR and --out PREFIX")
    start = time.perf_counter()
    prepared = prepare_corpus(args.input, tokenizer=args.tokenizer, out=args.out, text_key=args.text_key,
                              weights=args.weights, split=args.split, workers=args.workers,
                              append_eod=args.append_eod, overwrite=args.overwrite, quiet=args.quiet)
    elapsed = time.perf_counter() - start
    for prefix, record, built in zip(prepared.prefixes, prepared.records, prepared.built):
        how = (f"built in {record['build_seconds']:.1f} s, {record['tokens_per_second']:,} tokens/s" if built
               else "cached: same inputs, tokenizer and options")
        print(f"dataset   {prefix} (.bin/.idx): {record['documents']:,} documents, {record['tokens']:,} tokens, "
              f"{record['bytes'] / 1e6:.1f} MB in {len(record['files'])} files ({how})")
    for prefix, record in zip(prepared.prefixes, prepared.records):
        counts = split_documents(prepared.split, record["documents"])
        shown = " / ".join("off" if c is None else f"{c:,}" for c in counts.values())
        empty = [name for name, c in counts.items() if c == 0]
        note = f"; {' and '.join(empty)} empty: pretrain refuses this split, pass another --split" if empty else ""
        print(f"split     {prepared.split}: {shown} documents (train / valid / test) of {Path(prefix).name}{note}")
    first = prepared.records[0]
    print(f"tokenizer {prepared.tokenizer_dir} ({first['tokenizer_kind']}, {first['vocab_size']:,} tokens, "
          f"end of document id {first['eod']}{', appended' if first['append_eod'] else ''})")
    print(f"yaml      {prepared.yaml_path}  ->  nemo llm pretrain --recipe RECIPE --yaml {prepared.yaml_path}")
    print(f"overrides {prepared.overrides()}")
    print(f"done      {elapsed:.1f} s")
    return 0
