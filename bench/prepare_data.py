"""``nemo llm prepare-data --input`` against the tokenizer's own batch encode, on the same text in one run.

    .venv/bin/python bench/prepare_data.py [--tokenizer DIR] [--mb 8] [--workers 2] [--repeats 2]

The corpus is a JSONL of the Python standard library's sources (``--mb`` megabytes of text, one document per
file, cycled if needed). Without ``--tokenizer`` the shipped byte-level BPE is saved as a Qwen-style
directory (transformers' ``Qwen2TokenizerFast``); pass a real model directory (Qwen3's ``tokenizer.json``
or Kimi K2's ``tiktoken.model``) to measure that one.

- **baseline**: the texts already in memory, encoded by the tokenizer's own batch call with ``--workers``
  threads where it takes a thread count: the Rust backend's ``encode_batch_fast`` for Hugging Face
  tokenizers (it parallelizes over the machine's cores itself), ``tiktoken.Encoding.encode_batch(...,
  num_threads=workers)`` for tiktoken; ids only, nothing written.
- **prepare-data**: ``bridge_ext.corpus.prepare_corpus`` on the JSONL file with ``workers=--workers``: content
  hash, reading and JSON parsing, encoding, Megatron's ``IndexedDatasetBuilder`` writing ``.bin``/``.idx``;
  each repeat into a new prefix (no reuse).

Both run ``--repeats`` times, alternating, after one warm-up encode; the best of each is compared (a busy
shared machine only ever slows a run down). Prints tokens/s of both and the ratio prepare-data / baseline
(target: at least 0.8 with ``--workers 2``).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def _corpus(path: Path, megabytes: float) -> list[str]:
    files = sorted(Path(os.__file__).parent.rglob("*.py"))
    texts, size = [], 0
    while size < megabytes * 1e6:
        for file in files:
            try:
                text = file.read_text(encoding="utf-8")
            except (UnicodeDecodeError, OSError):
                continue
            texts.append(text)
            size += len(text.encode())
            if size >= megabytes * 1e6:
                break
    with path.open("w", encoding="utf-8") as handle:
        for text in texts:
            handle.write(json.dumps({"text": text}) + "\n")
    return texts


def _qwen_style(out: Path) -> Path:
    from tokenizers import Tokenizer
    from transformers import Qwen2TokenizerFast

    from bridge_ext.data import PROXY_TOKENIZER_DIR

    Qwen2TokenizerFast(tokenizer_object=Tokenizer.from_file(str(PROXY_TOKENIZER_DIR / "tokenizer.json")),
                       eos_token="<|endoftext|>", pad_token="<|pad|>", unk_token=None,
                       bos_token=None).save_pretrained(str(out))
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokenizer", type=Path, help="a model directory (default: the shipped BPE, Qwen-style)")
    parser.add_argument("--mb", type=float, default=8.0, help="megabytes of text (default 8)")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args(argv)

    from bridge_ext import corpus
    from bridge_ext.build import quiet_megatron
    from bridge_ext.tokenizers import load_tokenizer

    quiet_megatron()
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        os.environ["MUON_RECIPES_CACHE"] = str(work / "cache")
        tokenizer_dir = args.tokenizer or _qwen_style(work / "qwen-style")
        source = work / "corpus.jsonl"
        texts = _corpus(source, args.mb)
        tok = load_tokenizer(tokenizer_dir)
        if tok.kind == "huggingface":
            def baseline() -> int:
                return sum(len(e.ids) for e in tok._backend.encode_batch_fast(texts, add_special_tokens=False))
        else:
            def baseline() -> int:
                return sum(map(len, tok._backend.encode_batch(texts, num_threads=args.workers, allowed_special="all")))
        baseline_tokens = baseline()  # warm-up (and the token count)
        best_base = best_prep = float("inf")
        prepared_tokens = 0
        for repeat in range(args.repeats):
            start = time.perf_counter()
            baseline()
            best_base = min(best_base, time.perf_counter() - start)
            start = time.perf_counter()
            prepared = corpus.prepare_corpus([[str(source)]], tokenizer=tokenizer_dir, out=work / f"out{repeat}",
                                             workers=args.workers, quiet=True)
            best_prep = min(best_prep, time.perf_counter() - start)
            prepared_tokens = prepared.records[0]["tokens"]
        assert prepared_tokens == baseline_tokens, (prepared_tokens, baseline_tokens)
        mb = source.stat().st_size / 1e6
        base_rate, prep_rate = baseline_tokens / best_base, prepared_tokens / best_prep
        print(f"tokenizer     {tok.description} ({tokenizer_dir})")
        print(f"corpus        {len(texts):,} documents, {mb:.1f} MB JSONL, {baseline_tokens:,} tokens; "
              f"workers {args.workers}, {os.cpu_count()} CPUs, best of {args.repeats}")
        print(f"baseline      {base_rate:,.0f} tokens/s ({best_base:.2f} s: the tokenizer's own batch encode, "
              "text in memory)")
        print(f"prepare-data  {prep_rate:,.0f} tokens/s ({best_prep:.2f} s: read, hash, encode, write .bin/.idx)")
        print(f"ratio         {prep_rate / base_rate:.2f} (prepare-data / baseline; target >= 0.8)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
