"""Real text for the proxy recipes, offline: the Python standard library's own sources.

Every machine that runs this package has a Python 3.12 standard library, so the corpus needs no download:
its ``.py`` files (test directories excluded), in a fixed order, up to :data:`CORPUS_MAX_BYTES`. They are
tokenized with the byte-level BPE tokenizer shipped in ``recipes/tokenizer/`` (4096 tokens, trained once
by ``python -m bridge_ext.data --train-tokenizer``) into Megatron's indexed dataset format (``.bin`` /
``.idx``, one document per file, end-of-document token appended).

The dataset lives in a cache directory (``$MUON_RECIPES_CACHE`` or ``~/.cache/muon-recipes``) under a
name derived from the corpus bytes and the tokenizer, so it is built once per machine (a few seconds)
and rebuilt only when either changes. It is written to a temporary directory and renamed into place.

Public API: :data:`PROXY_TOKENIZER_DIR`, :func:`prepare_text_corpus`, :func:`ensure_text_corpus`,
:func:`use_text_corpus` (``nemo llm prepare-data``: ``bridge_ext.commands.prepare_data``; with ``--input``, a
user corpus: ``bridge_ext.corpus``). Heavy modules (numpy, tokenizers, Megatron) load lazily.
"""

from __future__ import annotations

import argparse
import functools
import hashlib
import json
import os
import shutil
import sys
import sysconfig
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import recipes
from bridge_ext.cache import ENV_CACHE as _ENV_CACHE
from bridge_ext.cache import cache_root
from bridge_ext.errors import UserError
from bridge_ext.runtime import publish, rename_into_place

__all__ = [
    "CORPUS_MAX_BYTES",
    "EOD_TOKEN",
    "PROXY_TOKENIZER_DIR",
    "PROXY_VOCAB_SIZE",
    "CorpusFile",
    "cache_root",
    "corpus_files",
    "corpus_info",
    "ensure_text_corpus",
    "prepare_text_corpus",
    "train_tokenizer",
    "use_text_corpus",
]

PROXY_TOKENIZER_DIR: Path = Path(recipes.__file__).resolve().parent / "tokenizer"
PROXY_VOCAB_SIZE = 4096  # the proxies' model vocab_size; the tokenizer has exactly this many tokens
EOD_TOKEN = "<|endoftext|>"
PAD_TOKEN = "<|pad|>"
SPECIAL_TOKENS = (EOD_TOKEN, PAD_TOKEN)

# ~12 MB: the whole non-test standard library of CPython 3.12 (11.6 MB, ~3.5 M tokens). Proxies read
# 8 x 128 tokens per iteration, so a 200-iteration run sees ~6 % of it: no repetition.
CORPUS_MAX_BYTES = 12_000_000
_MIN_CORPUS_BYTES = 500_000
_EXCLUDED_DIRS = frozenset({"test", "tests", "idle_test", "site-packages", "dist-packages", "__pycache__"})
_FORMAT = 1  # bump when the dataset layout changes: old cache entries are then ignored
_PREFIX_NAME = "stdlib_text_document"

# Split of the documents into train / validation / test (Megatron's ``split`` string).
DATA_SPLIT = "98,1,1"


# -------------------------------------------------------------------------------------------------- corpus
@dataclass(frozen=True)
class CorpusFile:
    name: str  # path relative to the standard library, POSIX separators
    path: Path
    size: int


def stdlib_dir() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def _order_key(name: str) -> str:
    # A fixed pseudo-random order (not alphabetical), so that a size cap keeps a mix of the library.
    return hashlib.sha256(name.encode()).hexdigest()


def corpus_files(max_bytes: int | None = None, root: Path | None = None) -> list[CorpusFile]:
    """The corpus: standard-library ``.py`` files (no test directories) in a fixed order, up to ``max_bytes``.

    Files that are not UTF-8 are skipped; a file that would cross the cap is skipped and the next ones
    are still considered, so the result depends only on the files themselves.
    """
    root = stdlib_dir() if root is None else Path(root)
    limit = CORPUS_MAX_BYTES if max_bytes is None else max_bytes
    candidates = []
    for path in root.rglob("*.py"):
        rel = path.relative_to(root)
        if any(part in _EXCLUDED_DIRS for part in rel.parts[:-1]) or not path.is_file():
            continue
        candidates.append(CorpusFile(rel.as_posix(), path, path.stat().st_size))
    candidates.sort(key=lambda f: _order_key(f.name))
    chosen, total = [], 0
    for item in candidates:
        if item.size == 0 or total + item.size > limit:
            continue
        try:
            item.path.read_bytes().decode("utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        chosen.append(item)
        total += item.size
    return chosen


def read_document(item: CorpusFile) -> str:
    """A corpus file's text exactly as stored (no newline translation)."""
    return item.path.read_bytes().decode("utf-8")


def _corpus_key(files: Sequence[CorpusFile], tokenizer_dir: Path) -> str:
    digest = hashlib.sha256(f"format={_FORMAT}\n".encode())
    for item in files:
        digest.update(f"{item.name}\0{item.size}\0".encode())
        digest.update(hashlib.sha256(item.path.read_bytes()).digest())
    digest.update(b"tokenizer\0")
    digest.update((tokenizer_dir / "tokenizer.json").read_bytes())
    return digest.hexdigest()


def _stdlib_corpus() -> tuple[tuple[CorpusFile, ...], str]:
    """The standard-library corpus and its key, once per process for one library, cap and tokenizer: their
    files do not change under a running process, and listing, reading and hashing ~700 files again costs
    0.15-0.4 s per run (every phase of a multi-run launch)."""
    return _stdlib_corpus_of(stdlib_dir(), CORPUS_MAX_BYTES, PROXY_TOKENIZER_DIR)


@functools.cache
def _stdlib_corpus_of(root: Path, max_bytes: int, tokenizer_dir: Path) -> tuple[tuple[CorpusFile, ...], str]:
    files = tuple(corpus_files(max_bytes, root))
    return files, _corpus_key(files, tokenizer_dir)


def _check_tokenizer_dir(tokenizer_dir: Path) -> None:
    if not (tokenizer_dir / "tokenizer.json").is_file():
        raise UserError(
            f"no tokenizer at {tokenizer_dir}; restore recipes/tokenizer/ from the repository "
            "or run `python -m bridge_ext.data --train-tokenizer`"
        )


def _console():
    from rich.console import Console

    return Console(stderr=True)


def corpus_info(prefix: str | Path) -> dict[str, Any]:
    """What ``prepare_text_corpus`` recorded about a dataset: files, bytes, documents, tokens, ..."""
    meta = Path(f"{prefix}.json")
    if not meta.is_file():
        raise UserError(f"{prefix} is not a dataset prepared by `nemo llm prepare-data` (no {meta.name})")
    return json.loads(meta.read_text())


def prepare_text_corpus(*, force: bool = False, quiet: bool = False) -> str:
    """Tokenize the standard-library corpus into a Megatron indexed dataset; returns its path prefix.

    The prefix (``<cache>/text/stdlib-<hash>/stdlib_text_document``) is what goes into ``dataset.blend``.
    Built once per corpus and tokenizer; ``force`` rebuilds. Progress goes to stderr unless ``quiet``.
    """
    return ensure_text_corpus(force=force, quiet=quiet)[0]


def ensure_text_corpus(*, force: bool = False, quiet: bool = False) -> tuple[str, bool]:
    """:func:`prepare_text_corpus` as ``(prefix, built)``: built is False when the cached dataset was reused."""
    _check_tokenizer_dir(PROXY_TOKENIZER_DIR)
    files, key = _stdlib_corpus()
    total = sum(f.size for f in files)
    needed = min(_MIN_CORPUS_BYTES, CORPUS_MAX_BYTES // 2)
    if total < needed:
        raise UserError(
            f"the Python standard library at {stdlib_dir()} has only {total:,} bytes of UTF-8 .py sources "
            f"(need {needed:,}); install the full Python 3.12 standard library, or use mock data"
        )
    parent = cache_root() / "text"
    final = parent / f"stdlib-{key[:16]}"
    prefix = final / _PREFIX_NAME
    if not force and Path(f"{prefix}.json").is_file():
        return str(prefix), False
    try:
        parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise UserError(f"cannot create the data cache {parent} ({exc.strerror}); set ${_ENV_CACHE}") from None
    tmp = parent / f".tmp-{key[:16]}-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        _build_dataset(files, tmp / _PREFIX_NAME, key=key, quiet=quiet)
        if final.exists():
            if not force and Path(f"{prefix}.json").is_file():  # a concurrent build finished first
                return str(prefix), True
            old = parent / f".old-{key[:16]}-{os.getpid()}"  # --force, or a half-deleted entry
            publish(final, old)
            shutil.rmtree(old, ignore_errors=True)
        rename_into_place(tmp, final, marker=f"{_PREFIX_NAME}.json")  # or another process's identical build
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return str(prefix), True


def _build_dataset(files: Sequence[CorpusFile], prefix: Path, *, key: str, quiet: bool) -> None:
    from bridge_ext.upstream_output import quiet_megatron

    quiet_megatron()
    import numpy as np
    from megatron.core.datasets.indexed_dataset import DType, IndexedDatasetBuilder
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn
    from tokenizers import Tokenizer

    start = time.perf_counter()
    tokenizer = Tokenizer.from_file(str(PROXY_TOKENIZER_DIR / "tokenizer.json"))
    eod = tokenizer.token_to_id(EOD_TOKEN)
    vocab = tokenizer.get_vocab_size(with_added_tokens=True)
    dtype = DType.optimal_dtype(vocab)
    builder = IndexedDatasetBuilder(f"{prefix}.bin", dtype=dtype)
    tokens = 0
    total_bytes = sum(f.size for f in files)
    progress = Progress(
        TextColumn("tokenizing the standard library"), BarColumn(), MofNCompleteColumn(),
        TextColumn("files"), TimeRemainingColumn(), console=_console(), disable=quiet, transient=True,
    )
    with progress:
        task = progress.add_task("tokenize", total=len(files))
        batch = 64
        for first in range(0, len(files), batch):
            chunk = files[first:first + batch]
            encodings = tokenizer.encode_batch([read_document(f) for f in chunk], add_special_tokens=False)
            for encoding in encodings:
                ids = np.asarray([*encoding.ids, eod], dtype=dtype)
                builder.add_document(ids, [len(ids)])
                tokens += len(ids)
            progress.advance(task, len(chunk))
    builder.finalize(f"{prefix}.idx")
    seconds = time.perf_counter() - start
    meta = {
        "format": _FORMAT,
        "key": key,
        "source": f"Python {sys.version.split()[0]} standard library sources ({stdlib_dir()})",
        "files": [f.name for f in files],
        "documents": len(files),
        "bytes": total_bytes,
        "tokens": tokens,
        "tokenizer": str(PROXY_TOKENIZER_DIR),
        "vocab_size": vocab,
        "eod": eod,
        "build_seconds": round(seconds, 2),
    }
    Path(f"{prefix}.json").write_text(json.dumps(meta, indent=1) + "\n")
    if not quiet:
        _console().print(f"tokenized {len(files)} files, {total_bytes / 1e6:.1f} MB -> {tokens / 1e6:.2f} M tokens "
                         f"in {seconds:.1f} s")


def use_text_corpus(cfg: Any, *, quiet: bool = False) -> str:
    """Point a Megatron Bridge ``ConfigContainer`` at the standard-library corpus; returns a one-line description.

    Sets ``dataset.blend`` to the prepared dataset (built first if needed), ``dataset.split`` to
    :data:`DATA_SPLIT` and the tokenizer to the shipped ``HuggingFaceTokenizer``. The model's
    ``vocab_size`` must be at least the tokenizer's (4096: every proxy).
    """
    vocab = getattr(cfg.model, "vocab_size", None)
    if vocab is not None and vocab < PROXY_VOCAB_SIZE:
        raise UserError(
            f"the model's vocab_size {vocab} is smaller than the text tokenizer's {PROXY_VOCAB_SIZE}; "
            "use mock data for this model"
        )
    prefix = prepare_text_corpus(quiet=quiet)
    info = corpus_info(prefix)
    dataset = cfg.dataset
    if type(dataset).__name__ == "MockGPTDatasetConfig":  # it refuses a blend: make a real-data config
        from megatron.bridge.training.config import GPTDatasetConfig

        fields = {k: v for k, v in vars(dataset).items() if k not in ("blend", "blend_per_split", "mock")}
        fields["seq_length"] = fields.pop("sequence_length", dataset.seq_length)
        dataset = cfg.dataset = GPTDatasetConfig(**{k: v for k, v in fields.items()
                                                    if k in _gpt_dataset_init_fields()})
    dataset.blend = [[prefix], None]
    dataset.blend_per_split = None
    dataset.split = DATA_SPLIT
    tok = cfg.tokenizer
    tok.tokenizer_type = "HuggingFaceTokenizer"
    tok.tokenizer_model = str(PROXY_TOKENIZER_DIR)
    tok.vocab_size = None
    return (f"text: {info['source'].split(' (')[0]}, {info['documents']} files, "
            f"{info['tokens'] / 1e6:.2f} M tokens, byte-level BPE {info['vocab_size']} ({prefix})")


def _gpt_dataset_init_fields() -> set[str]:
    import dataclasses

    from megatron.bridge.training.config import DataloaderConfig, GPTDatasetConfig

    names = {f.name for f in dataclasses.fields(GPTDatasetConfig) if f.init}
    names |= set(DataloaderConfig.__dataclass_fields__)
    return names | {"seq_length", "skip_getting_attention_mask_from_dataset"}


# ----------------------------------------------------------------------------------------------- tokenizer
def train_tokenizer(out_dir: Path, files: list[CorpusFile] | None = None, *,
                    vocab_size: int = PROXY_VOCAB_SIZE) -> Path:
    """Train the proxies' byte-level BPE tokenizer on ``files`` (default: the corpus) and save it to ``out_dir``.

    Deterministic: the same files give the same ``tokenizer.json``. Writes ``tokenizer.json``,
    ``tokenizer_config.json``, ``special_tokens_map.json`` (what ``AutoTokenizer.from_pretrained`` reads)
    and ``training.json`` (what it was trained on).

    The files are the same whichever transformers is installed, and every stack's transformers loads them:
    ``tokenizer.json`` is the ``tokenizers`` library's own serialization of the trained tokenizer, the two
    configs are written here as transformers 4's ``PreTrainedTokenizerFast.save_pretrained`` writes them.
    transformers 5's ``save_pretrained`` instead adds the post-processor its loader gives a tokenizer without
    one (``TokenizersBackend.update_post_processor``) and names the class ``TokenizersBackend``, which
    transformers 4 cannot load; transformers 5 loads ``PreTrainedTokenizerFast`` (its alias of that class).
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    files = corpus_files() if files is None else files
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, min_frequency=2, special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False,
    )
    tokenizer.train_from_iterator((read_document(f) for f in files), trainer=trainer, length=len(files))
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(out_dir / "tokenizer.json"))
    named = {"bos_token": EOD_TOKEN, "eos_token": EOD_TOKEN, "pad_token": PAD_TOKEN, "unk_token": EOD_TOKEN}
    added = {str(i): {"content": t.content, "lstrip": t.lstrip, "normalized": t.normalized, "rstrip": t.rstrip,
                      "single_word": t.single_word, "special": t.special}
             for i, t in sorted(tokenizer.get_added_tokens_decoder().items())}
    config = {"added_tokens_decoder": added, **named, "clean_up_tokenization_spaces": False,
              "extra_special_tokens": {}, "model_max_length": 1 << 20, "tokenizer_class": "PreTrainedTokenizerFast"}
    for name, content in (("tokenizer_config.json", config), ("special_tokens_map.json", named)):
        (out_dir / name).write_text(json.dumps(content, indent=2, sort_keys=True, ensure_ascii=False) + "\n",
                                    encoding="utf-8")
    record = {
        "command": "python -m bridge_ext.data --train-tokenizer",
        "python": sys.version.split()[0],
        "corpus_files": len(files),
        "corpus_bytes": sum(f.size for f in files),
        "corpus_sha256": corpus_sha256(files),
        "vocab_size": tokenizer.get_vocab_size(with_added_tokens=True),
        "special_tokens": list(SPECIAL_TOKENS),
    }
    (out_dir / "training.json").write_text(json.dumps(record, indent=1) + "\n")
    return out_dir


def corpus_sha256(files: list[CorpusFile]) -> str:
    digest = hashlib.sha256()
    for item in files:
        digest.update(hashlib.sha256(item.path.read_bytes()).digest())
    return digest.hexdigest()


# ------------------------------------------------------------------------------------- maintainers' entry
def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bridge_ext.data", description=__doc__.split("\n")[0])
    parser.add_argument("--train-tokenizer", action="store_true",
                        help=f"re-train the shipped tokenizer into --out (default {PROXY_TOKENIZER_DIR})")
    parser.add_argument("--out", type=Path, default=PROXY_TOKENIZER_DIR)
    parser.add_argument("--force", action="store_true")
    args = parser.parse_args(argv)
    try:
        if args.train_tokenizer:
            start = time.perf_counter()
            out = train_tokenizer(args.out)
            print(f"wrote {out} ({time.perf_counter() - start:.1f} s)")
            return 0
        prefix = prepare_text_corpus(force=args.force)
        print(prefix)
        return 0
    except UserError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
