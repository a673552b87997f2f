"""Your own corpus -> Megatron indexed datasets, tokenized with the model's own tokenizer (``nemo llm prepare-data
--input ...``).

Inputs: JSONL (``.jsonl`` / ``.json``, one JSON object per line, the text under ``--text-key``), Parquet (a
string column), plain text (``.txt``/``.md``: one document per file); JSONL and text may be compressed
(``.gz`` by the standard library, ``.zst`` by ``zstandard``). Read as a stream: memory holds one batch of
documents plus Megatron's index (two integers per document), whatever the corpus size.

Each ``--input`` set becomes one indexed dataset (``.bin`` / ``.idx``, written by megatron-core's
``IndexedDatasetBuilder``, plus a ``.json`` record), built in a temporary directory and moved into place
(the record last: a dataset without it is incomplete and never reused). Several sets with ``--weights``
form a blend. Next to the datasets, ``PREFIX.yaml`` holds ``dataset.blend``, ``dataset.split`` and the
tokenizer for ``nemo llm pretrain --yaml``. A dataset is keyed by the bytes of its input files (in order),
the tokenizer files and the options: the same command again reuses it; a different one refuses to replace
it without ``--overwrite``.

Public API: :func:`prepare_corpus`, :class:`Prepared`, :func:`split_documents`, :func:`blend_problems`,
:func:`check_real_data`. The command's options: ``bridge_ext.commands.prepare_data``.
"""

from __future__ import annotations

import glob
import hashlib
import io
import json
import os
import shutil
import time
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from bridge_ext.errors import UserError
from bridge_ext.runtime import publish, write_atomic

__all__ = ["DEFAULT_SPLIT", "Prepared", "blend_problems", "check_real_data", "input_files", "prepare_corpus",
           "split_documents"]

Format = Literal["jsonl", "parquet", "text"]

DEFAULT_SPLIT = "98,1,1"
_FORMAT = 1  # bump when the dataset layout or the key changes
_BATCH_BYTES = 4_000_000  # text per encode call: large enough for the backends' threads, small for memory
_BATCH_DOCS = 4096
_SUFFIXES: dict[str, Format] = {".jsonl": "jsonl", ".json": "jsonl", ".ndjson": "jsonl", ".parquet": "parquet",
                                ".txt": "text", ".md": "text", ".text": "text"}
_COMPRESSION = (".gz", ".zst")
_HASH_CHUNK = 1 << 22


# ---------------------------------------------------------------------------------------------------- inputs
@dataclass(frozen=True)
class InputFile:
    path: Path
    format: Format
    compression: str  # "", ".gz" or ".zst"
    size: int


def _classify(path: Path) -> InputFile | None:
    suffixes = [s.lower() for s in path.suffixes]
    compression = suffixes[-1] if suffixes and suffixes[-1] in _COMPRESSION else ""
    rest = suffixes[:-1] if compression else suffixes
    fmt = _SUFFIXES.get(rest[-1]) if rest else None
    if fmt is None or (fmt == "parquet" and compression):
        return None
    return InputFile(path, fmt, compression, path.stat().st_size)


def input_files(patterns: list[str]) -> list[InputFile]:
    """The files of one ``--input`` set: paths, globs (``**`` too) and directories (their known files), in order.

    Within a glob or a directory, files are sorted by path; the same file named twice is read once.
    """
    known = ", ".join(sorted({*_SUFFIXES})) + " (JSONL and text also .gz / .zst)"
    out: list[InputFile] = []
    seen: set[Path] = set()
    for pattern in patterns:
        expanded = os.path.expanduser(pattern)
        if glob.has_magic(expanded):
            paths = sorted(Path(p) for p in glob.glob(expanded, recursive=True) if Path(p).is_file())
            if not paths:
                raise UserError(f"no file matches --input {pattern}")
        elif Path(expanded).is_dir():
            paths = sorted(p for p in Path(expanded).rglob("*") if p.is_file() and _classify(p))
            if not paths:
                raise UserError(f"--input {pattern} is a directory without corpus files ({known})")
        elif Path(expanded).is_file():
            paths = [Path(expanded)]
        else:
            raise UserError(f"input file {pattern} does not exist")
        for path in paths:
            item = _classify(path)
            if item is None:
                raise UserError(f"{path}: unknown corpus format; use {known}")
            if path.resolve() not in seen:
                seen.add(path.resolve())
                out.append(item)
    return out


class _Counting(io.RawIOBase):
    """A raw file that counts the bytes read from disk (progress for compressed files too)."""

    def __init__(self, raw, counter: list[int]):
        self.raw, self.counter = raw, counter

    def readable(self):
        return True

    def readinto(self, buffer):
        n = self.raw.readinto(buffer)
        self.counter[0] += n or 0
        return n

    def close(self):
        self.raw.close()
        super().close()


def _open_binary(item: InputFile, counter: list[int]):
    raw = _Counting(open(item.path, "rb", buffering=0), counter)
    if item.compression == ".gz":
        import gzip

        return gzip.GzipFile(fileobj=io.BufferedReader(raw, 1 << 20))
    if item.compression == ".zst":
        import zstandard

        return io.BufferedReader(zstandard.ZstdDecompressor().stream_reader(raw, read_size=1 << 20), 1 << 20)
    return io.BufferedReader(raw, 1 << 20)


def _documents(item: InputFile, text_key: str, counter: list[int]) -> Iterator[str]:
    """The documents of one file; a problem names the file and its line (or row)."""
    where = str(item.path)
    if item.format == "parquet":
        yield from _parquet_documents(item, text_key, counter)
        return
    try:
        with _open_binary(item, counter) as binary:
            if item.format == "text":
                yield binary.read().decode("utf-8")
                return
            for number, line in enumerate(io.TextIOWrapper(binary, encoding="utf-8", newline="\n"), 1):
                if not line.strip():
                    continue
                try:
                    record = json.loads(line)
                except json.JSONDecodeError as exc:
                    raise UserError(f"{where} line {number}: not JSON ({exc.msg}); "
                                    "each line must be one JSON object") from None
                if not isinstance(record, dict) or text_key not in record:
                    keys = ", ".join(map(repr, list(record)[:8])) if isinstance(record, dict) else type(record).__name__
                    raise UserError(f"{where} line {number}: no {text_key!r} key (has {keys}); "
                                    "name the text field with --text-key")
                text = record[text_key]
                if not isinstance(text, str):
                    raise UserError(f"{where} line {number}: {text_key!r} is {type(text).__name__}, not a string")
                yield text
    except UnicodeDecodeError as exc:
        raise UserError(f"{where}: not UTF-8 text ({exc.reason} at byte {exc.start}); convert it to UTF-8") from None
    except (OSError, EOFError) as exc:
        detail = getattr(exc, "strerror", None) or str(exc) or type(exc).__name__
        raise UserError(f"{where}: cannot read it ({detail})") from None
    except Exception as exc:  # zstandard.ZstdError and friends: a corrupt compressed file
        if type(exc).__module__.startswith("zstandard"):
            raise UserError(f"{where}: cannot decompress it ({exc})") from None
        raise


def _parquet_documents(item: InputFile, text_key: str, counter: list[int]) -> Iterator[str]:
    import pyarrow.parquet as pq

    try:
        reader = pq.ParquetFile(item.path)
    except Exception as exc:  # pyarrow.lib.ArrowInvalid
        raise UserError(f"{item.path}: not a Parquet file ({' '.join(str(exc).split())[:120]})") from None
    names = reader.schema_arrow.names
    if text_key not in names:
        raise UserError(f"{item.path}: no column {text_key!r} (has {', '.join(map(repr, names[:8]))}); "
                        "name the text column with --text-key")
    rows, total, row = reader.metadata.num_rows or 1, item.size, 0
    for batch in reader.iter_batches(batch_size=1024, columns=[text_key]):
        for text in batch.column(0).to_pylist():
            row += 1
            if not isinstance(text, str):
                raise UserError(f"{item.path} row {row}: {text_key!r} is {type(text).__name__}, not a string")
            yield text
        counter[0] = total * row // rows


def _hash_files(files: list[InputFile]) -> str:
    digest = hashlib.sha256()
    for item in files:
        digest.update(f"{item.format}{item.compression}\0{item.size}\0".encode())
        file_digest = hashlib.sha256()
        with open(item.path, "rb") as handle:
            while chunk := handle.read(_HASH_CHUNK):
                file_digest.update(chunk)
        digest.update(file_digest.digest())
    return digest.hexdigest()


# ----------------------------------------------------------------------------------------------- datasets
@dataclass
class Prepared:
    """What :func:`prepare_corpus` made: one dataset per input set, the blend YAML and the override line."""

    prefixes: list[str]
    weights: list[float] | None
    split: str
    yaml_path: Path
    tokenizer_dir: Path
    records: list[dict[str, Any]]
    built: list[bool]

    def blend(self) -> list:
        return [self.prefixes, self.weights]

    def overrides(self) -> str:
        """The same settings as ``nemo llm pretrain`` overrides for a POSIX shell (what the YAML holds); the
        split is quoted for Hydra, which would read ``98,1,1`` as a sweep."""
        blend = json.dumps(self.blend()).replace(" ", "")
        return (f"dataset.blend='{blend}' \"dataset.split='{self.split}'\" tokenizer.tokenizer_type=HuggingFaceTokenizer "
                f"tokenizer.tokenizer_model={self.tokenizer_dir}")


def _parse_split(split: str) -> str:
    parts = split.replace("/", ",").split(",")
    try:
        values = [float(p) for p in parts]
    except ValueError:
        values = []
    if len(values) != 3 or min(values, default=-1) < 0 or values[0] <= 0:
        raise UserError(f"--split {split!r}: give three non-negative weights train,valid,test (e.g. 98,1,1), "
                        "train above 0")
    return ",".join(p.strip() for p in parts)


def _set_prefixes(out: Path, count: int) -> list[Path]:
    return [out] if count == 1 else [out.with_name(f"{out.name}-{i}") for i in range(count)]


def _record(prefix: Path) -> dict[str, Any] | None:
    meta = Path(f"{prefix}.json")
    if not meta.is_file():
        return None
    try:
        return json.loads(meta.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError):
        return None


def _yaml_text(prepared: Prepared) -> str:
    import yaml

    body = {"dataset": {"blend": prepared.blend(), "split": prepared.split},
            "tokenizer": {"tokenizer_type": "HuggingFaceTokenizer", "tokenizer_model": str(prepared.tokenizer_dir)}}
    head = (f"# written by `nemo llm prepare-data`; use: nemo llm pretrain --recipe RECIPE --yaml {prepared.yaml_path}\n")
    return head + yaml.safe_dump(body, sort_keys=False, width=1 << 16)


def prepare_corpus(inputs: list[list[str]], *, tokenizer: str | Path, out: str | Path, text_key: str = "text",
                   weights: list[float] | None = None, split: str = DEFAULT_SPLIT, workers: int = 1,
                   append_eod: bool = False, overwrite: bool = False, quiet: bool = False) -> Prepared:
    """Tokenize each input set into ``out`` (one set) or ``out-0``, ``out-1``, ... and write ``out.yaml``.

    Every check (inputs, tokenizer, weights, split, existing outputs) runs before anything is written; a
    failure while reading leaves nothing behind. See the module docstring for formats and reuse.
    """
    from bridge_ext.tokenizers import load_tokenizer

    if not inputs:
        raise UserError("no --input given")
    if workers < 1:
        raise UserError(f"--workers must be at least 1, got {workers}")
    if weights is not None:
        if len(weights) != len(inputs):
            raise UserError(f"{len(weights)} --weights for {len(inputs)} --input sets; give one weight per set")
        if any(w <= 0 for w in weights):
            raise UserError(f"--weights must be positive, got {' '.join(map(str, weights))}")
    split = _parse_split(split)
    sets = [input_files(patterns) for patterns in inputs]
    tok = load_tokenizer(tokenizer)
    out_given = str(out)
    out = Path(out).expanduser().absolute()
    if out.name.endswith((".bin", ".idx", ".yaml")) or out_given.endswith(("/", os.sep)):
        raise UserError(f"--out {out} must be a path prefix (it becomes PREFIX.bin / .idx / .yaml), not a file "
                        "name or a directory")
    prefixes = _set_prefixes(out, len(sets))
    keys = []
    for files in sets:
        digest = hashlib.sha256(f"format={_FORMAT}\ntokenizer={tok.fingerprint}\ntext_key={text_key}\n"
                                f"append_eod={append_eod}\n".encode())
        digest.update(_hash_files(files).encode())
        keys.append(digest.hexdigest())
    todo = []
    for prefix, key in zip(prefixes, keys):
        record = _record(prefix)
        if record is not None and record.get("key") == key:
            continue  # the same inputs, tokenizer and options: reuse
        existing = [p for p in (Path(f"{prefix}{s}") for s in (".bin", ".idx", ".json")) if p.exists()]
        if existing and not overwrite:
            raise UserError(f"{existing[0]} exists (made from other inputs or options); pass --overwrite to "
                            "replace it, or choose another --out")
        todo.append((prefix, key))
    yaml_path = out.with_name(f"{out.name}.yaml")
    prepared = Prepared([str(p) for p in prefixes], weights, split, yaml_path, tok.directory, [], [])
    text = _yaml_text(prepared)
    if yaml_path.exists() and yaml_path.read_text() != text and not overwrite:
        raise UserError(f"{yaml_path} exists with other settings; pass --overwrite to replace it, or choose another "
                        "--out")
    created = _make_parents(out.parent)
    try:
        for index, (prefix, files, key) in enumerate(zip(prefixes, sets, keys)):
            if (prefix, key) in todo:
                label = f"set {index + 1}/{len(sets)}" if len(sets) > 1 else "corpus"
                _build(files, prefix, tok=tok, key=key, text_key=text_key, workers=workers, append_eod=append_eod,
                       label=label, quiet=quiet)
            prepared.built.append((prefix, key) in todo)
            prepared.records.append(_record(prefix))
        write_atomic(yaml_path, text)
    except BaseException:
        for directory in reversed(created):  # only what this call created, and only when empty
            try:
                directory.rmdir()
            except OSError:
                pass
        raise
    return prepared


def _make_parents(parent: Path) -> list[Path]:
    created, missing = [], []
    probe = parent
    while not probe.exists():
        missing.append(probe)
        probe = probe.parent
    if not probe.is_dir():
        raise UserError(f"cannot write under {probe}: it is a file")
    for directory in reversed(missing):
        try:
            directory.mkdir()
        except OSError as exc:
            raise UserError(f"cannot create {directory} ({exc.strerror})") from None
        created.append(directory)
    return created


def _batches(files: list[InputFile], text_key: str, counter: list[int], stats: dict[str, int]) -> Iterator[list[str]]:
    batch: list[str] = []
    size = 0
    for item in files:
        for text in _documents(item, text_key, counter):
            stats["read"] += 1
            batch.append(text)
            size += len(text)
            if size >= _BATCH_BYTES or len(batch) >= _BATCH_DOCS:
                yield batch
                batch, size = [], 0
        stats["bytes_done"] += item.size
        counter[0] = 0
    if batch:
        yield batch


def _build(files: list[InputFile], prefix: Path, *, tok, key: str, text_key: str, workers: int, append_eod: bool,
           label: str, quiet: bool) -> None:
    from bridge_ext.upstream_output import quiet_megatron

    quiet_megatron()
    import numpy as np
    from megatron.core.datasets.indexed_dataset import DType, IndexedDatasetBuilder
    from rich.console import Console
    from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn

    tmp = prefix.parent / f".{prefix.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        dtype = DType.optimal_dtype(tok.vocab_size)
        builder = IndexedDatasetBuilder(str(tmp / "data.bin"), dtype=dtype)
        stats = {"read": 0, "bytes_done": 0}
        documents = tokens = empty = 0
        max_id = -1
        counter = [0]
        total_bytes = sum(f.size for f in files)
        eod = [tok.eod] if append_eod else []
        if append_eod and tok.eod is None:
            raise UserError(f"the tokenizer in {tok.directory} has no eos_token; drop --append-eod")
        start = time.perf_counter()
        progress = Progress(TextColumn(f"tokenizing {label}"), BarColumn(), TextColumn("{task.percentage:>3.0f}%"),
                            TextColumn("{task.fields[docs]:,} docs, {task.fields[tokens]:,} tokens, "
                                       "{task.fields[rate]} tokens/s"), TimeRemainingColumn(),
                            console=Console(stderr=True), disable=quiet, transient=True)
        pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="encode")
        with progress, pool:
            task = progress.add_task("tokenize", total=max(total_bytes, 1), docs=0, tokens=0, rate="-")
            pending: Future | None = None

            def write(encoded: list[list[int]]) -> None:
                nonlocal documents, tokens, empty, max_id
                for ids in encoded:
                    if not ids.size:
                        empty += 1
                        continue
                    array = np.empty(ids.size + len(eod), dtype=dtype)
                    array[:ids.size] = ids
                    array[ids.size:] = eod
                    max_id = max(max_id, int(array.max()))
                    builder.add_document(array, [array.size])
                    documents += 1
                    tokens += array.size
                seconds = time.perf_counter() - start
                progress.update(task, completed=stats["bytes_done"] + counter[0], docs=documents, tokens=tokens,
                                rate=f"{tokens / max(seconds, 1e-9):,.0f}")

            for batch in _batches(files, text_key, counter, stats):
                future = pool.submit(tok.encode_batch_numpy, batch, threads=workers)  # overlaps with reading the next
                if pending is not None:
                    write(pending.result())
                pending = future
            if pending is not None:
                write(pending.result())
        if documents == 0:
            where = ", ".join(str(f.path) for f in files[:3]) + (" ..." if len(files) > 3 else "")
            raise UserError(f"no text in {where} ({stats['read']} documents, all empty); check the files and --text-key")
        builder.finalize(str(tmp / "data.idx"))
        seconds = time.perf_counter() - start
        record = {
            "format": _FORMAT, "key": key, "files": [str(f.path) for f in files], "bytes": total_bytes,
            "documents": documents, "empty_documents_skipped": empty, "tokens": tokens, "max_token_id": max_id,
            "tokenizer": str(tok.directory), "tokenizer_kind": tok.kind, "tokenizer_fingerprint": tok.fingerprint,
            "vocab_size": tok.vocab_size, "eod": tok.eod, "append_eod": append_eod, "text_key": text_key,
            "build_seconds": round(seconds, 3), "tokens_per_second": round(tokens / max(seconds, 1e-9)),
        }
        (tmp / "data.json").write_text(json.dumps(record, indent=1) + "\n")
        for suffix in (".bin", ".idx", ".json"):  # the record last: it marks a complete dataset
            publish(tmp / f"data{suffix}", f"{prefix}{suffix}")
    except BaseException as exc:
        from bridge_ext.checkpoints.disk_space import no_space_for_output

        full = no_space_for_output(prefix, exc)  # before the partial files free their room
        if full is not None:
            raise full from None
        raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


# ---------------------------------------------------------------------------------------- pretrain checks
_SPLITS = ("train", "valid", "test")


def split_documents(split: str, documents: int) -> dict[str, int | None]:
    """Documents of each split as Megatron's builder cuts a dataset of ``documents`` documents (``None``: the
    split is off). megatron-core's own parsing; bounds ``round(fraction x documents)`` as in
    ``BlendedMegatronDatasetBuilder._build_megatron_dataset_splits``."""
    from megatron.core.datasets.blended_megatron_dataset_config import (convert_split_vector_to_split_matrix,
                                                                         parse_and_normalize_split)

    matrix = convert_split_vector_to_split_matrix(parse_and_normalize_split(split))
    return {name: None if bounds is None else int(round(bounds[1] * documents)) - int(round(bounds[0] * documents))
            for name, bounds in zip(_SPLITS, matrix)}


def _empty_splits(split: str, documents: int) -> list[str]:
    return [name for name, count in split_documents(split, documents).items() if count == 0]


def blend_problems(cfg: Any) -> list[str]:
    """What is wrong with ``cfg.dataset``'s blend for this model and tokenizer (empty when nothing).

    Every prefix needs ``.bin`` and ``.idx``; a dataset this package prepared must hold only ids below
    ``model.vocab_size`` and, when the run names a tokenizer directory, come from that tokenizer.
    """
    dataset = cfg.dataset
    prefixes: list[str] = []
    split_of: dict[str, str] = {}  # a blend_per_split prefix -> the split it alone feeds
    for blend in [getattr(dataset, "blend", None), *(getattr(dataset, "blend_per_split", None) or [])]:
        if blend:
            prefixes.extend(str(p) for p in blend[0])
    for name, blend in zip(_SPLITS, getattr(dataset, "blend_per_split", None) or []):
        for prefix in (blend[0] if blend else []):
            split_of.setdefault(str(prefix), name)
    out = []
    vocab = getattr(cfg.model, "vocab_size", None)
    tok = cfg.tokenizer
    configured = None
    if tok.tokenizer_type == "HuggingFaceTokenizer" and tok.tokenizer_model and Path(str(tok.tokenizer_model)).is_dir():
        from bridge_ext.tokenizers import load_tokenizer

        configured = load_tokenizer(tok.tokenizer_model)
    for prefix in prefixes:
        missing = [s for s in (".bin", ".idx") if not Path(f"{prefix}{s}").is_file()]
        if missing:
            out.append(f"dataset.blend: {prefix}{missing[0]} does not exist (make it with `nemo llm prepare-data`)")
            continue
        split = getattr(dataset, "split", None)
        if prefix in split_of:  # its split takes the whole dataset
            from megatron.core.datasets.indexed_dataset import IndexedDataset

            if len(IndexedDataset(prefix).document_indices) - 1 == 0:
                out.append(f"dataset.blend_per_split: {prefix} ({split_of[prefix]} split) holds no documents, "
                           "which Megatron cannot build; prepare it from more text or leave it out")
        elif split and getattr(dataset, "blend", None):
            from megatron.core.datasets.indexed_dataset import IndexedDataset

            documents = len(IndexedDataset(prefix).document_indices) - 1
            empty = _empty_splits(split, documents)
            if empty:  # megatron-core's GPTDataset._get_num_epochs never ends on a split without tokens
                out.append(f"dataset.split {split} leaves the {' and '.join(empty)} split of {prefix} "
                           f"({documents} documents) empty, which Megatron cannot build; use more documents or a "
                           "split with 0 for it (e.g. \"dataset.split='98,2,0'\")")
        record = _record(Path(prefix))
        if not record:
            continue
        if vocab is not None and record.get("max_token_id", -1) >= vocab:
            out.append(f"dataset.blend: {prefix} holds token id {record['max_token_id']}, model.vocab_size is {vocab}")
        if configured is not None and record.get("tokenizer_fingerprint") not in (None, configured.fingerprint):
            out.append(f"dataset.blend: {prefix} was tokenized with {record.get('tokenizer')}, not with "
                       f"tokenizer.tokenizer_model {configured.directory}; prepare it again with that tokenizer")
    return out


def check_real_data(cfg: Any) -> str | None:
    """Before a run or in the dry run: the tokenizer fits the model and the blend is usable (one-line
    :class:`UserError` otherwise). Returns the tokenizer's description for a tokenizer directory, else None."""
    from bridge_ext.tokenizers import check_tokenizer_fits

    line = check_tokenizer_fits(cfg)
    problems = blend_problems(cfg)
    if problems:
        raise UserError("; ".join(problems))
    return line
