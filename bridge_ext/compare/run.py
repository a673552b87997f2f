"""``run_compare``: every run on the same data, seed and token budget, each in its worker process; then the
CSV, plot and summary."""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from bridge_ext.compare.checks import (
    OUR_FILES,
    absolute_paths,
    check_data,
    check_finetune_runs,
    check_out,
    check_pretrained,
)
from bridge_ext.compare.config import configure
from bridge_ext.compare.metrics import summarize
from bridge_ext.compare.output import format_evals, format_summary, write_csv, write_eval_csv, write_plot
from bridge_ext.compare.runs import (
    DEFAULT_ITERS,
    DEFAULT_SEED,
    DEFAULT_SMOOTH,
    Run,
    RunResult,
    all_recipes,
    check_not_budget,
    is_finetune,
)
from bridge_ext.compare.worker import read_settings, run_worker
from bridge_ext.errors import UserError
from recipes.selection import key_value

__all__ = ["run_compare"]


def _budget(cfg) -> tuple[int, int, int]:
    return cfg.train.global_batch_size, cfg.dataset.seq_length, cfg.train.train_iters


def run_compare(runs: list[Run], *, out: Path, iters: int | None = None, seed: int = DEFAULT_SEED,
                data: str | None = None, device: str = "auto", common: Sequence[str] = (), overwrite: bool = False,
                smooth_window: int = DEFAULT_SMOOTH, threads: int | None = None, quiet: bool = False
                ) -> dict[str, Any]:
    """Train every run on the same data, seed and token budget; write the CSV, plot and summary to ``out``.

    ``iters``: default 200 for pre-training, the recipe's own length for fine-tuning. ``data``: text (default)
    or mock for pre-training; a JSONL file or ``stdlib-signatures`` (default) for fine-tuning."""
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    console = Console(stderr=True, quiet=quiet)
    out = Path(out)
    check_out(out, overwrite)
    common = list(common)
    for item in common:
        pair = key_value(item)
        if pair is None or item.startswith("-"):
            raise UserError(f"unknown option or malformed override {item!r}; overrides look like KEY=VALUE")
        check_not_budget(pair[0], "an override")
    first = all_recipes()[runs[0].recipe]
    finetune = is_finetune(first)
    data = check_data(data, finetune)
    if iters is None:
        iters = first.train_iters(first.layout()) if finetune else DEFAULT_ITERS
    if finetune:
        check_pretrained(runs, common)
    common = absolute_paths(common)
    runs = [Run(r.recipe, absolute_paths(r.overrides), r.label) for r in runs]

    with console.status("loading Megatron Bridge and validating the runs ..."):
        from bridge_ext.build import quiet_megatron

        quiet_megatron()
        import torch

        if device == "gpu" and not torch.cuda.is_available():
            raise UserError("--device gpu but no GPU is visible; use --device cpu (or auto)")
        use_device = "gpu" if device == "gpu" or (device == "auto" and torch.cuda.is_available()) else "cpu"
    if data == "text":
        from bridge_ext.data import prepare_text_corpus

        prepare_text_corpus(quiet=quiet)
    with console.status("validating the runs ..."):
        from bridge_ext.build import validate_for_layout

        budgets, description, configured = {}, "", {}
        for run in runs:
            cfg, recipe, description = configure(run, iters=iters, seed=seed, data=data, common=common, quiet=True)
            # Megatron's and Megatron Bridge's own checks, before anything is written
            validate_for_layout(cfg, gpus=1, max_positions=recipe.model.hf_config.get("max_position_embeddings"))
            budgets[run.label] = _budget(cfg)
            configured[run.label] = (cfg, recipe)
        if finetune:
            description = check_finetune_runs(runs, configured, data)
    if len(set(budgets.values())) > 1:
        detail = "; ".join(f"{k}: GBS {b[0]} seq {b[1]}" for k, b in budgets.items())
        raise UserError(f"the runs have different token budgets ({detail}); compare needs equal ones")
    gbs, seq, _ = next(iter(budgets.values()))

    # Replace only what an earlier compare wrote (checked by check_out).
    out.mkdir(exist_ok=True)
    for name in OUR_FILES:
        target = out / name
        if target.is_dir():
            shutil.rmtree(target)
        elif target.exists():
            target.unlink()
    tokens = gbs * seq * iters
    console.print(f"compare: {len(runs)} runs x {iters} iterations x {gbs} x {seq} tokens = {tokens:,} tokens "
                  f"each, seed {seed}, {'CPU mode' if use_device == 'cpu' else 'GPU'}")
    console.print(f"data: {description}")
    threads = threads or (os.cpu_count() or 1)
    from bridge_ext import data as data_module

    corpus_max_bytes = data_module.CORPUS_MAX_BYTES
    results: list[RunResult] = []
    progress = Progress(TextColumn("{task.description:<40}"), BarColumn(), MofNCompleteColumn(),
                        TextColumn("loss {task.fields[loss]}"), TimeElapsedColumn(), console=console)
    with progress:
        tasks = [progress.add_task(run.label, total=iters, loss="-") for run in runs]
        for run, task in zip(runs, tasks):
            run_dir = out / "runs" / run.dirname
            spec = {"recipe": run.recipe, "overrides": run.overrides, "label": run.label, "iters": iters,
                    "seed": seed, "data": data, "common": common, "device": use_device, "threads": threads,
                    "corpus_max_bytes": corpus_max_bytes,
                    "losses": str((run_dir / "losses.jsonl").resolve())}
            if finetune:
                spec.update(finetune=True, tensorboard=str((run_dir / "tb").resolve()))
            results.append(run_worker(run, spec, run_dir, progress, task))

    losses = {r.label: r.losses for r in results}
    if finetune:
        from bridge_ext.training import read_eval  # the last pass per iteration (the final one at the end)

        evals = {run.label: read_eval(out / "runs" / run.dirname / "eval.jsonl") for run in runs}
    else:
        evals = None
    summary = summarize(losses, smooth_window)
    summary.update(iters=iters, global_batch_size=gbs, seq_length=seq, tokens_per_run=tokens, seed=seed,
                   data=description, device=use_device,
                   timing={r.label: {"train_seconds": round(r.seconds, 2), "total_seconds": round(r.total_seconds, 2),
                                     "iterations_per_second": round((iters - 1) / r.seconds, 2) if r.seconds else None}
                           for r in results},
                   overrides={r.label: [*common, *next(x.overrides for x in runs if x.label == r.label)]
                              for r in results},
                   settings={run.label: read_settings(out / "runs" / run.dirname / "losses.jsonl") for run in runs})
    if evals is not None:
        summary["eval"] = {label: {str(k): v for k, v in by_step.items()} for label, by_step in evals.items()}
        summary["eval_final"] = {label: by_step[max(by_step)] if by_step else None
                                 for label, by_step in evals.items()}
        write_eval_csv(out / "eval.csv", evals)
    write_csv(out / "loss.csv", results)
    names = " vs ".join(r.label for r in results)
    names = names if len(names) <= 90 else f"{len(results)} runs"
    title = f"{names}\n{iters} iterations x {gbs} x {seq} tokens, seed {seed}"
    write_plot(out / "loss.png", results, summary, title, evals=evals)
    (out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    if not quiet:
        print(format_summary(summary))
        if evals is not None:
            print(format_evals(evals))
        written = ["loss.csv", *(["eval.csv"] if evals is not None else []), "loss.png", "summary.json"]
        print(f"wrote {', '.join(str(out / name) for name in written)}")
    return summary
