"""Where ``nemo llm evaluate`` reads its held-out data (``--data``, :func:`use_data`): the run's data, a
prepare-data prefix or blend YAML, a JSONL/text file tokenized on the fly by prepare-data's own code into a cached
indexed dataset, or Megatron's mock dataset."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from bridge_ext.errors import UserError

__all__ = ["use_data"]


_FILE_SUFFIXES = (".jsonl", ".json", ".ndjson", ".txt", ".md", ".text", ".gz", ".zst")


def _as_real_data(cfg: Any) -> Any:
    """``cfg.dataset`` as a GPTDatasetConfig that takes a blend (a MockGPTDatasetConfig refuses one)."""
    dataset = cfg.dataset
    if type(dataset).__name__ != "MockGPTDatasetConfig":
        return dataset
    import dataclasses

    from megatron.bridge.training.config import DataloaderConfig, GPTDatasetConfig

    accepted = {f.name for f in dataclasses.fields(GPTDatasetConfig) if f.init}
    accepted |= set(DataloaderConfig.__dataclass_fields__) | {"seq_length", "skip_getting_attention_mask_from_dataset"}
    fields = {k: v for k, v in vars(dataset).items() if k not in ("blend", "blend_per_split", "mock")}
    fields["seq_length"] = fields.pop("sequence_length", cfg.model.seq_length)
    cfg.dataset = GPTDatasetConfig(**{k: v for k, v in fields.items() if k in accepted})
    return cfg.dataset


def _data_tokenizer(cfg: Any, ckpt: Path, iter_dir: Path, run_config: dict[str, Any]) -> Any:
    """The model's own tokenizer for text given on the fly: the run's tokenizer directory when it trained with
    one, else the checkpoint's (:func:`bridge_ext.inference.model.checkpoint_tokenizer`)."""
    from bridge_ext.inference.model import check_fits, checkpoint_tokenizer
    from bridge_ext.tokenizers import load_tokenizer

    tok_cfg = cfg.tokenizer
    named = getattr(tok_cfg, "tokenizer_model", None)
    if getattr(tok_cfg, "tokenizer_type", None) == "HuggingFaceTokenizer" and named and Path(str(named)).is_dir():
        tok = load_tokenizer(Path(str(named)))
    else:
        tok = checkpoint_tokenizer(ckpt, iter_dir, run_config)
    check_fits(tok, int(cfg.model.vocab_size or tok.vocab_size), f"the model in {iter_dir}")
    return tok


def _prepare_file(path: Path, tok: Any) -> str:
    """A JSONL (``{"text": ...}`` per line) or text file tokenized with the model's tokenizer by prepare-data's
    own code (:func:`bridge_ext.corpus.prepare_corpus`, end-of-document appended) into a Megatron indexed
    dataset under the cache (``evaluate/<hash of the path>/data``); reused while the file and tokenizer are the
    same (prepare_corpus keys the dataset by their bytes), rebuilt when either changes."""
    import hashlib

    from bridge_ext.cache import cache_root
    from bridge_ext.corpus import prepare_corpus

    if not path.is_file():
        raise UserError(f"--data {path} does not exist")
    where = hashlib.sha256(str(path.resolve()).encode()).hexdigest()[:16]
    out = cache_root() / "evaluate" / where / "data"
    prepared = prepare_corpus([[str(path)]], tokenizer=tok.directory, out=out, append_eod=True, overwrite=True,
                              quiet=True)
    record = prepared.records[0] or {}
    if not record.get("tokens"):
        raise UserError(f"--data {path} has no text to evaluate")
    return prepared.prefixes[0]


def _read_blend_yaml(path: Path) -> tuple[list, str | None, str | None]:
    """A prepare-data blend YAML: (blend, split, tokenizer directory)."""
    import yaml

    try:
        body = yaml.safe_load(path.read_text()) or {}
    except (OSError, yaml.YAMLError) as exc:
        raise UserError(f"--data {path} is not readable YAML ({type(exc).__name__})") from None
    dataset = body.get("dataset") if isinstance(body, dict) else None
    blend = dataset.get("blend") if isinstance(dataset, dict) else None
    if not (isinstance(blend, list) and blend and isinstance(blend[0], list) and blend[0]):
        raise UserError(f"--data {path} has no dataset.blend (a YAML written by `nemo llm prepare-data`)")
    tokenizer = (body.get("tokenizer") or {}).get("tokenizer_model")
    return [[str(p) for p in blend[0]], blend[1] if len(blend) > 1 else None], dataset.get("split"), tokenizer


def use_data(cfg: Any, data: str | None, *, split: str | None, ckpt: Path, iter_dir: Path,
             run_config: dict[str, Any]) -> str:
    """Point ``cfg.dataset`` at the held-out data; returns its one-line description."""
    blend = getattr(cfg.dataset, "blend", None)
    if data is None:
        if getattr(cfg.dataset, "mock", False) or blend is None:
            if split is not None:
                cfg.dataset.split = split
            return "mock data (as the run)"
        prefixes = blend[0] if blend else []
        missing = [p for p in prefixes if not Path(f"{p}.idx").is_file()]
        if missing:
            raise UserError(f"the run's data {missing[0]} is gone (no .idx); pass --data PATH or --data mock")
        if split is not None:
            cfg.dataset.split = split
        return f"the run's data, validation split {cfg.dataset.split} ({', '.join(map(str, prefixes))})"
    if data == "mock":
        # Megatron's mock dataset, as `--data mock` trains on it: no blend (megatron-core then sets mock=True and
        # builds MockGPTDataset: documents 1, 2, ..., n-1 followed by the tokenizer's end of document).
        cfg.dataset.blend = None
        cfg.dataset.blend_per_split = None
        if split is not None:
            cfg.dataset.split = split
        return f"mock data (Megatron's MockGPTDataset, seed {cfg.dataset.random_seed})"
    path = Path(data)
    tokenizer_dir = None
    if path.suffix in (".yaml", ".yml"):
        if not path.is_file():
            raise UserError(f"--data {path} does not exist")
        new_blend, yaml_split, tokenizer_dir = _read_blend_yaml(path)
        split = split or yaml_split
        what = f"{path} (blend of {len(new_blend[0])})"
    elif path.suffix in (".bin", ".idx") or Path(f"{path}.idx").is_file():
        prefix = path.with_suffix("") if path.suffix in (".bin", ".idx") else path
        if not Path(f"{prefix}.idx").is_file() or not Path(f"{prefix}.bin").is_file():
            raise UserError(f"--data {data}: no {prefix}.bin/.idx (a prefix from `nemo llm prepare-data`)")
        new_blend, what = [[str(prefix)], None], str(prefix)
    elif path.suffix in _FILE_SUFFIXES or path.is_file():
        if path.suffix == ".parquet":
            raise UserError(f"--data {path}: a Parquet file; run `nemo llm prepare-data` on it first")
        tok = _data_tokenizer(cfg, ckpt, iter_dir, run_config)
        new_blend = [[_prepare_file(path, tok)], None]
        tokenizer_dir = str(tok.directory)
        split = split or "0,1,0"  # the whole file is held-out text
        what = f"{path}, tokenized with {tok.directory} ({new_blend[0][0]})"
    else:
        raise UserError(f"--data {data}: no {path}.bin/.idx (a prefix from `nemo llm prepare-data`), and not a "
                        ".jsonl/.txt file or a blend .yaml")
    dataset = _as_real_data(cfg)
    dataset.blend = new_blend
    dataset.blend_per_split = None
    if split is not None:
        dataset.split = split
    elif not getattr(dataset, "split", None):
        from bridge_ext.corpus import DEFAULT_SPLIT

        dataset.split = DEFAULT_SPLIT
    if tokenizer_dir is not None or getattr(cfg.tokenizer, "tokenizer_type", None) != "HuggingFaceTokenizer":
        if tokenizer_dir is None:
            tokenizer_dir = str(_data_tokenizer(cfg, ckpt, iter_dir, run_config).directory)
        cfg.tokenizer.tokenizer_type = "HuggingFaceTokenizer"
        cfg.tokenizer.tokenizer_model = tokenizer_dir
        cfg.tokenizer.vocab_size = None
    from bridge_ext.corpus import check_real_data

    check_real_data(cfg)  # the tokenizer fits the model; every prefix exists and came from that tokenizer
    weights = [float(w) for w in str(dataset.split).replace("/", ",").split(",")]
    which = "all of it" if len(weights) == 3 and weights[0] == weights[2] == 0 else "validation split"
    return f"{what}, {which} ({dataset.split})"
