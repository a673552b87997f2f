"""What a comparison checks before anything trains: ``--out``, ``--data``, the fine-tuning runs' checkpoint
and data; overrides naming paths made absolute for the workers."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from bridge_ext.compare.runs import Run
from bridge_ext.errors import UserError
from bridge_ext.overrides import value_of
from recipes.selection import key_value

__all__ = ["DEFAULT_FINETUNE_DATA", "OUR_FILES", "absolute_paths", "check_data", "check_finetune_runs", "check_out",
           "check_pretrained"]

OUR_FILES = ("loss.csv", "eval.csv", "loss.png", "summary.json", "runs")
_PRETRAIN_DATA = ("text", "mock")
DEFAULT_FINETUNE_DATA = "stdlib-signatures"
# Paths a worker (its own working directory) must see as the parent does.
_PATH_KEYS = ("checkpoint.pretrained_checkpoint", "tokenizer.tokenizer_model")


def check_out(out: Path, overwrite: bool) -> None:
    if out.exists() and not out.is_dir():
        raise UserError(f"--out {out} is a file; give a directory")
    if out.is_dir() and any(out.iterdir()):
        if not overwrite:
            raise UserError(f"--out {out} exists and is not empty; pass --overwrite or choose another directory")
        strangers = sorted(p.name for p in out.iterdir() if p.name not in OUR_FILES)
        if strangers:
            raise UserError(f"--out {out} holds files compare did not write ({strangers[0]}, ...); "
                            "choose another directory")
    if not out.parent.exists():
        raise UserError(f"directory {out.parent} does not exist")


def absolute_paths(items: Sequence[str]) -> list[str]:
    """Overrides naming a path, made absolute: a worker runs in its own directory."""
    out = []
    for item in items:
        key, value = key_value(item) or ("", "")
        out.append(f"{key}={Path(value).absolute()}" if key in _PATH_KEYS and value else item)
    return out


def check_data(data: str | None, finetune: bool) -> str:
    """The run's data: text/mock for pre-training, a JSONL file or a shipped set for fine-tuning."""
    if not finetune:
        data = data or "text"
        if data not in _PRETRAIN_DATA:
            raise UserError(f"argument --data: invalid choice: {data!r} (pre-training runs: text or mock; "
                            "fine-tuning runs: a JSONL file or stdlib-signatures)")
        return data
    from bridge_ext.finetune.instructions import BUILTIN_SETS

    data = data or DEFAULT_FINETUNE_DATA
    if data in _PRETRAIN_DATA:
        raise UserError(f"--data {data} is pre-training data; fine-tuning runs take a JSONL file or "
                        f"{', '.join(BUILTIN_SETS)}")
    if data in BUILTIN_SETS:
        return data
    from bridge_ext.finetune.data import load_records

    load_records(data)  # a missing, empty or malformed file: one line naming the problem
    return str(Path(data).absolute())


def check_pretrained(runs: list[Run], common: list[str]) -> None:
    """Every fine-tuning run names an existing pretrained checkpoint (checked before anything heavy loads)."""
    for run in runs:
        named = value_of([*common, *run.overrides], "checkpoint.pretrained_checkpoint")
        if not named:
            raise UserError("fine-tuning runs start from a checkpoint: pass checkpoint.pretrained_checkpoint=DIR "
                            "(a pre-training run or `nemo llm import` output)")
        if not Path(named).is_dir():
            raise UserError(f"checkpoint.pretrained_checkpoint={named} does not exist")


def check_finetune_runs(runs: list[Run], configured: dict[str, tuple[Any, Any]], data: str) -> str:
    """Every fine-tuning run has a pretrained checkpoint of its model and reads the same rendered data."""
    from bridge_ext.training import use_finetune_data

    roots, line = {}, ""
    for run in runs:
        cfg, recipe = configured[run.label]
        source, sft, tokenizer = use_finetune_data(recipe, cfg, data)  # renders once into the cache
        roots[run.label] = sft.root
        line = (f"fine-tuning data {source}: {sft.train} training records in the order of seed {cfg.dataset.seed}, "
                f"{sft.validation} held out for the eval loss, rendered with {tokenizer}'s chat template ({sft.root})")
        per_pass = cfg.train.eval_iters * cfg.train.global_batch_size
        if per_pass != sft.validation:  # Megatron Bridge's validation iterator continues from pass to pass
            line += (f"; each eval pass reads {per_pass} held-out records (train.eval_iters {cfg.train.eval_iters} "
                     f"x global batch {cfg.train.global_batch_size}), not the {sft.validation} once: passes at "
                     "different iterations see different records (every run the same ones)")
    if len(set(roots.values())) > 1:
        detail = "; ".join(f"{k}: {v}" for k, v in roots.items())
        raise UserError(f"the runs would read different data ({detail}): their tokenizers differ; compare needs "
                        "the same data for every run")
    return line
