"""``nemo llm compare``: train two or more recipes on the same data, seed and token budget; compare the losses.

Each run is Megatron Bridge's real ``pretrain()`` with ``gpt_step.forward_step`` in its own subprocess
(``python -m bridge_ext.compare --worker SPEC``), so Megatron's process-global state never leaks from one
run into the next; CPU mode (:mod:`bridge_ext.cpu_mode`) is used when no GPU is visible. The training
loss of every iteration is recorded by a Megatron Bridge callback (``on_train_step_end``, the averaged
``lm loss`` of the global batch) and streamed to ``runs/<run>/losses.jsonl``; nothing is scraped from logs.

Outputs in ``--out``: ``loss.csv`` (iteration, one column per run), ``loss.png`` (the curves),
``summary.json`` and ``runs/<run>/{spec.json,losses.jsonl,train.log}``. The console gets, per run, the
final loss and the number of iterations it needed to reach the best (smoothed) loss that the slowest run
reached.

A recipe may carry its own overrides: ``--recipes qwen3_proxy_muon:optimizer.lr=1e-2,qwen3_proxy_adamw``.
``--sweep KEY=V1,V2,...`` runs every recipe once per value (several ``--sweep`` options are zipped): how
the proxies' default learning rates were tuned (docs/cpu.md). The recipes may also be named before the
overrides: ``nemo llm compare qwen3_proxy_muon qwen3_proxy_adamw --out DIR``.

Fine-tuning recipes (``recipes.finetune``: ``<model>_sft_*``, ``<model>_lora_*``) compare the same way, from
one pretrained checkpoint (``checkpoint.pretrained_checkpoint=DIR``, applied to every run) on one instruction
set (``--data FILE.jsonl`` or ``stdlib-signatures``, the default): each worker runs ``nemo llm finetune``'s own
path (``bridge_ext.finetune.run.run_finetune``), the training records in the order of ``--seed``
(``dataset.seed``), the same for every run. Besides the training loss, each run's loss on the held-out split
(``eval.jsonl``, Megatron Bridge's validation ``lm loss`` at every ``train.eval_interval`` and after the last
iteration; also in the run's TensorBoard log ``runs/<run>/tb``) is compared: ``eval.csv`` and the console's
held-out table.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bridge_ext.errors import UserError, closest

__all__ = ["DEFAULT_ITERS", "DEFAULT_SEED", "DEFAULT_SMOOTH", "Run", "RunResult", "iterations_to_reach", "parse_runs",
           "run_compare", "smooth", "summarize"]

DEFAULT_ITERS = 200
DEFAULT_SEED = 1234
DEFAULT_SMOOTH = 10
# Keys that would give runs different token budgets or data; compare sets them itself.
_BUDGET_KEYS = ("train.train_iters", "train.global_batch_size", "train.micro_batch_size", "model.seq_length",
                "dataset.seq_length", "dataset.sequence_length", "rng.seed", "dataset.random_seed",
                "dataset.blend", "dataset.split", "dataset.seed", "dataset.dataset_root")
_OUR_FILES = ("loss.csv", "eval.csv", "loss.png", "summary.json", "runs")
_PRETRAIN_DATA = ("text", "mock")
DEFAULT_FINETUNE_DATA = "stdlib-signatures"
# Paths a worker (its own working directory) must see as the parent does.
_PATH_KEYS = ("checkpoint.pretrained_checkpoint", "tokenizer.tokenizer_model")


@dataclass
class Run:
    """One training run: a recipe and the overrides that distinguish it."""

    recipe: str
    overrides: list[str] = field(default_factory=list)  # KEY=VALUE for this run only (from --sweep)
    label: str = ""

    def __post_init__(self):
        if not self.label:
            tags = [f"{o.split('=', 1)[0].rsplit('.', 1)[-1]}={o.split('=', 1)[1]}" for o in self.overrides]
            self.label = self.recipe + (f"[{','.join(tags)}]" if tags else "")

    @property
    def dirname(self) -> str:
        return re.sub(r"[^A-Za-z0-9_.=-]+", "_", self.label).strip("_")


@dataclass
class RunResult:
    label: str
    losses: list[float]
    seconds: float  # training loop only (first to last iteration callback)
    total_seconds: float  # the whole subprocess


# -------------------------------------------------------------------------------------------------- metrics
def smooth(values: Sequence[float], window: int) -> list[float]:
    """Trailing mean over ``window`` iterations (fewer at the start)."""
    out, acc = [], 0.0
    for i, value in enumerate(values):
        acc += value
        if i >= window:
            acc -= values[i - window]
        out.append(acc / min(i + 1, window))
    return out


def iterations_to_reach(values: Sequence[float], target: float) -> int | None:
    """1-based iteration at which ``values`` first reach ``target`` or below; None if never."""
    for i, value in enumerate(values):
        if value <= target + 1e-12:
            return i + 1
    return None


def summarize(losses: dict[str, list[float]], window: int = DEFAULT_SMOOTH) -> dict[str, Any]:
    """Final loss per run and iterations needed to reach the best smoothed loss the slowest run reached."""
    smoothed = {label: smooth(values, window) for label, values in losses.items()}
    best = {label: min(values) for label, values in smoothed.items()}
    slowest = max(best, key=best.get)
    target = best[slowest]
    rows = {}
    for label, values in losses.items():
        tail = values[-window:]
        rows[label] = {
            "final_loss": values[-1],
            "final_loss_mean": sum(tail) / len(tail),
            "best_smoothed_loss": best[label],
            "iterations_to_target": iterations_to_reach(smoothed[label], target),
        }
    return {"smooth_window": window, "target": target, "slowest": slowest, "runs": rows}


# ---------------------------------------------------------------------------------------------- arguments
def _all_recipes() -> dict[str, Any]:
    """Pre-training and fine-tuning recipes by name (pure data)."""
    from recipes.finetune import ALL_RECIPES

    return ALL_RECIPES


def is_finetune(recipe: Any) -> bool:
    return hasattr(recipe, "mode")  # recipes.finetune.FinetuneRecipe


def parse_runs(recipes_arg: str, sweeps: list[str]) -> list[Run]:
    """The runs of ``--recipes A,B`` (``RECIPE:KEY=VALUE`` gives one run its own overrides) x every ``--sweep``."""
    RECIPES = _all_recipes()

    entries: list[tuple[str, list[str]]] = []  # (recipe, its own overrides)
    for item in (n.strip() for n in recipes_arg.split(",")):
        if not item:
            continue
        name, *own = (part.strip() for part in item.split(":"))
        if name not in RECIPES:
            raise UserError(f"unknown recipe '{name}'{closest(name, RECIPES)}; `nemo llm recipes` lists them")
        for override in own:
            key, sep, value = override.partition("=")
            if not sep or not key or not value:
                raise UserError(f"--recipes entry {item!r}: write RECIPE:KEY=VALUE[:KEY=VALUE...]")
            _check_not_budget(key, "--recipes")
        entries.append((name, own))
    columns: list[tuple[str, list[str]]] = []
    for sweep in sweeps:
        key, sep, values = sweep.partition("=")
        items = [v.strip() for v in values.split(",") if v.strip()]
        if not sep or not key or not items:
            raise UserError(f"--sweep {sweep!r} must look like KEY=V1,V2,... (e.g. optimizer.lr=1e-3,3e-3)")
        _check_not_budget(key, "--sweep")
        columns.append((key, items))
    if len({len(items) for _, items in columns}) > 1:
        raise UserError("--sweep options must have the same number of values (they are zipped)")
    variants = [[]] if not columns else [[f"{k}={items[i]}" for k, items in columns]
                                         for i in range(len(columns[0][1]))]
    runs = [Run(name, [*own, *v]) for name, own in entries for v in variants]
    if len(runs) < 2:
        raise UserError("compare needs two or more runs: --recipes A,B (or one recipe with a --sweep of 2+ values)")
    labels = [r.label for r in runs]
    duplicate = next((label for label in labels if labels.count(label) > 1), None)
    if duplicate:
        raise UserError(f"run {duplicate} is listed twice")
    kinds = {is_finetune(RECIPES[r.recipe]): r.recipe for r in runs}
    if len(kinds) > 1:
        raise UserError(f"compare runs pre-training or fine-tuning recipes, not both: {kinds[True]} fine-tunes, "
                        f"{kinds[False]} pre-trains")
    for recipe in dict.fromkeys(r.recipe for r in runs):
        layout = RECIPES[recipe].layout()
        if layout.gpus != 1:
            raise UserError(
                f"{recipe} needs {layout.gpus} GPUs (layout {layout.cluster}); compare trains each run in one "
                "process: use the proxy recipes (e.g. qwen3_proxy_muon,qwen3_proxy_adamw)"
            )
    return runs


def _check_not_budget(key: str, where: str) -> None:
    if key in _BUDGET_KEYS:
        raise UserError(f"{where} cannot set {key}: compare keeps data, seed and token budget equal "
                        "(use --iters / --seed)")


def _check_out(out: Path, overwrite: bool) -> None:
    if out.exists() and not out.is_dir():
        raise UserError(f"--out {out} is a file; give a directory")
    if out.is_dir() and any(out.iterdir()):
        if not overwrite:
            raise UserError(f"--out {out} exists and is not empty; pass --overwrite or choose another directory")
        strangers = sorted(p.name for p in out.iterdir() if p.name not in _OUR_FILES)
        if strangers:
            raise UserError(f"--out {out} holds files compare did not write ({strangers[0]}, ...); "
                            "choose another directory")
    if not out.parent.exists():
        raise UserError(f"directory {out.parent} does not exist")


# ------------------------------------------------------------------------------------------------- config
def _configure(run: Run, *, iters: int, seed: int, data: str, common: list[str], quiet: bool):
    """The run's ``ConfigContainer``: recipe, common and per-run overrides, then data, budget and seed.

    A fine-tuning recipe's data is not applied here (``bridge_ext.finetune.run.use_finetune_data`` renders
    it from the pretrained checkpoint's tokenizer)."""
    from bridge_ext.build import build_config
    from bridge_ext.data import use_text_corpus

    recipe, overrides = _all_recipes()[run.recipe], []
    for item in [*common, *run.overrides]:
        key, _, value = item.partition("=")
        if key == "preset":  # a recipe part, like `nemo llm pretrain ... preset=NAME`
            recipe = recipe.with_preset(value)
        else:
            overrides.append(item)
    finetune = is_finetune(recipe)
    # compare's budget last (the overrides cannot set it): the schedule's fractions follow this train_iters
    cfg = build_config(recipe, overrides=overrides, values={"train.train_iters": iters})
    cfg.rng.seed = seed
    cfg.checkpoint.save = None
    cfg.checkpoint.load = None
    cfg.checkpoint.save_interval = None
    cfg.logger.tensorboard_dir = None
    if finetune:
        cfg.dataset.seed = seed  # the training records' order (bridge_ext.finetune.data)
        return cfg, recipe, f"fine-tuning data {data}"
    cfg.dataset.random_seed = seed
    description = "mock data (NullTokenizer)"
    if data == "text":
        description = use_text_corpus(cfg, quiet=quiet)
    return cfg, recipe, description


def _budget(cfg) -> tuple[int, int, int]:
    return cfg.train.global_batch_size, cfg.dataset.seq_length, cfg.train.train_iters


def _settings(cfg, recipe) -> dict[str, Any]:
    """What distinguishes runs, for summary.json: preset, optimizer and schedule values as trained."""
    opt, sched = cfg.optimizer, cfg.scheduler
    keys = ["optimizer", "lr", "min_lr", "weight_decay", "clip_grad", "adam_beta1", "adam_beta2", "adam_eps"]
    if opt.optimizer in ("muon", "dist_muon"):
        keys += [k for k in vars(opt) if k.startswith("muon_")]
    out = {"preset": recipe.preset.name, **{k: getattr(opt, k) for k in keys}}
    out.update({f"scheduler.{k}": getattr(sched, k, None) for k in (
        "lr_decay_style", "lr_warmup_iters", "lr_decay_iters", "lr_wsd_decay_iters", "start_weight_decay",
        "end_weight_decay")})
    return {k: v if isinstance(v, (int, float, str, bool, type(None))) else str(v) for k, v in out.items()}


# ------------------------------------------------------------------------------------------------- worker
def _worker(spec_path: Path) -> int:
    """Train one run (spec written by the parent) and stream its per-iteration losses to JSON lines."""
    from bridge_ext.build import megatron_warnings_once

    megatron_warnings_once()  # a real run: Megatron's warnings go to train.log, each once
    train_one(json.loads(spec_path.read_text()))
    return 0


def train_one(spec: dict[str, Any], *, callbacks: Sequence[Any] = ()) -> None:
    """What a worker process runs for one spec, in this process (``callbacks`` join the run's own)."""
    import torch

    if spec["threads"]:
        torch.set_num_threads(spec["threads"])
    from bridge_ext import data, training

    # the parent's corpus, which it has prepared already
    data.CORPUS_MAX_BYTES = spec.get("corpus_max_bytes", data.CORPUS_MAX_BYTES)
    run = Run(spec["recipe"], spec["overrides"], spec["label"])
    if spec.get("finetune"):
        from bridge_ext.finetune.run import run_finetune

        cfg, recipe, _ = _configure(run, iters=spec["iters"], seed=spec["seed"], data=spec["data"],
                                    common=spec["common"], quiet=True)
        cfg.logger.tensorboard_dir = spec["tensorboard"]  # Megatron Bridge's own record of the losses
        run_finetune(recipe, cfg, data=spec["data"], device=spec["device"], callbacks=list(callbacks), quiet=True,
                     record_dir=Path(spec["losses"]).parent, loss_extra={"config": _settings(cfg, recipe)},
                     telemetry=False)
        return
    # data="mock" here: training.prepare below sets the run's data (text corpus or mock) exactly once
    cfg, recipe, _ = _configure(run, iters=spec["iters"], seed=spec["seed"], data="mock", common=spec["common"],
                                quiet=True)
    prepared = training.prepare(recipe, cfg, device=spec["device"], data=spec["data"], quiet=True, telemetry=False)
    recorder = training.loss_recorder(Path(spec["losses"]), extra={"config": _settings(cfg, recipe)})
    training.run_pretrain(cfg, prepared, callbacks=[recorder, *callbacks])


# ------------------------------------------------------------------------------------------------- parent
def _read_settings(path: Path) -> dict[str, Any]:
    from bridge_ext.training import read_records

    return next((r["config"] for r in read_records(path) if "config" in r), {})


def _read_losses(path: Path) -> tuple[list[float], list[float], bool]:
    from bridge_ext.training import read_records

    records = read_records(path)
    steps = [r for r in records if "loss" in r]
    return [r["loss"] for r in steps], [r["time"] for r in steps], any(r.get("done") for r in records)


def _tail(path: Path, lines: int = 1) -> str:
    if not path.exists():
        return ""
    text = [ln.strip() for ln in path.read_text(errors="replace").splitlines() if ln.strip()]
    errors = [ln for ln in text if ln.startswith("error:") or "Error" in ln]
    return (errors or text)[-1][:300] if text else ""


def _run_worker(run: Run, spec: dict, run_dir: Path, progress, task) -> RunResult:
    run_dir.mkdir(parents=True)
    spec_path = run_dir / "spec.json"
    spec_path.write_text(json.dumps(spec, indent=1) + "\n")
    losses_path = Path(spec["losses"])
    env = dict(os.environ)
    root = str(Path(__file__).resolve().parent.parent)
    env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    for key, value in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1"), ("MASTER_ADDR", "127.0.0.1")):
        env[key] = value
    env["MASTER_PORT"] = str(_free_port())
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    start = time.time()
    with open(run_dir / "train.log", "w") as log:
        proc = _launch_worker(spec_path, run_dir, env, log)
        try:
            while proc.poll() is None:
                time.sleep(0.25)
                losses, _, _ = _read_losses(losses_path)
                if losses:
                    progress.update(task, completed=len(losses), loss=f"{losses[-1]:.3f}")
        except BaseException:
            proc.terminate()
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
            raise
    losses, times, done = _read_losses(losses_path)
    progress.update(task, completed=len(losses), loss=f"{losses[-1]:.3f}" if losses else "-")
    if proc.returncode != 0 or not done or len(losses) != spec["iters"]:
        reason = _tail(run_dir / "train.log") or f"exit code {proc.returncode}"
        raise UserError(f"run {run.label} failed after {len(losses)} of {spec['iters']} iterations: {reason} "
                        f"(log: {run_dir / 'train.log'})")
    loop = times[-1] - times[0] if len(times) > 1 else 0.0
    return RunResult(run.label, losses, loop, time.time() - start)


def _launch_worker(spec_path: Path, run_dir: Path, env: dict[str, str], log: Any) -> subprocess.Popen:
    """The worker process of one run (a seam: tests may run the same worker in their own process)."""
    return subprocess.Popen([sys.executable, "-m", "bridge_ext.compare", "--worker", str(spec_path)],
                            cwd=run_dir, env=env, stdout=log, stderr=subprocess.STDOUT)


def _free_port() -> int:
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def write_csv(path: Path, results: list[RunResult]) -> None:
    lines = ["iteration," + ",".join(r.label for r in results)]
    for i in range(len(results[0].losses)):
        lines.append(f"{i + 1}," + ",".join(f"{r.losses[i]:.6f}" for r in results))
    path.write_text("\n".join(lines) + "\n")


def write_plot(path: Path, results: list[RunResult], summary: dict[str, Any], title: str,
               evals: dict[str, dict[int, float]] | None = None) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    window = summary["smooth_window"]
    fig, ax = plt.subplots(figsize=(8, 5), dpi=110)
    for i, result in enumerate(results):
        color = f"C{i % 10}"
        steps = range(1, len(result.losses) + 1)
        ax.plot(steps, result.losses, color=color, alpha=0.25, linewidth=0.8)
        ax.plot(steps, smooth(result.losses, window), color=color, linewidth=1.8,
                label=f"{result.label} (last {window}: {summary['runs'][result.label]['final_loss_mean']:.3f})")
        held = (evals or {}).get(result.label)
        if held:
            steps_e = sorted(held)
            ax.plot(steps_e, [held[s] for s in steps_e], color=color, linestyle="--", marker="o", markersize=4,
                    label=f"{result.label} held-out (final {held[steps_e[-1]]:.3f})")
    ax.axhline(summary["target"], color="gray", linestyle=":", linewidth=1,
               label=f"best loss of the slowest run ({summary['target']:.3f})")
    ax.set_xlabel("iteration")
    ax.set_ylabel(f"training loss (faint: per iteration; solid: mean of {window})"
                  + ("; dashed: held-out" if evals else ""))
    ax.set_title(title, fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def _absolute(items: Sequence[str]) -> list[str]:
    """Overrides naming a path, made absolute: a worker runs in its own directory."""
    out = []
    for item in items:
        key, _, value = item.partition("=")
        out.append(f"{key}={Path(value).absolute()}" if key in _PATH_KEYS and value else item)
    return out


def _check_data(data: str | None, finetune: bool) -> str:
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


def _check_pretrained(runs: list[Run], common: list[str]) -> None:
    """Every fine-tuning run names an existing pretrained checkpoint (checked before anything heavy loads)."""
    for run in runs:
        named = [v for k, _, v in (o.partition("=") for o in [*common, *run.overrides])
                 if k == "checkpoint.pretrained_checkpoint"]
        if not named or not named[-1]:
            raise UserError("fine-tuning runs start from a checkpoint: pass checkpoint.pretrained_checkpoint=DIR "
                            "(a pre-training run or `nemo llm import` output)")
        if not Path(named[-1]).is_dir():
            raise UserError(f"checkpoint.pretrained_checkpoint={named[-1]} does not exist")


def _check_finetune_runs(runs: list[Run], configured: dict[str, tuple[Any, Any]], data: str) -> str:
    """Every fine-tuning run has a pretrained checkpoint of its model and reads the same rendered data."""
    from bridge_ext.finetune.run import use_finetune_data

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


def write_eval_csv(path: Path, evals: dict[str, dict[int, float]]) -> None:
    steps = sorted({step for by_step in evals.values() for step in by_step})
    lines = ["iteration," + ",".join(evals)]
    for step in steps:
        lines.append(f"{step}," + ",".join(f"{e[step]:.6f}" if step in e else "" for e in evals.values()))
    path.write_text("\n".join(lines) + "\n")


def format_evals(evals: dict[str, dict[int, float]]) -> str:
    """The held-out loss of every run at every eval, the last (final) one marked."""
    steps = sorted({step for by_step in evals.values() for step in by_step})
    width = max(len("run"), *map(len, evals))
    lines = [f"{'held-out loss':<{width}}  " + "  ".join(f"{f'at {s}':>8}" for s in steps)]
    for label, by_step in evals.items():
        lines.append(f"{label:<{width}}  " + "  ".join(f"{by_step[s]:>8.4f}" if s in by_step else f"{'-':>8}"
                                                       for s in steps))
    finals = {label: by_step[max(by_step)] for label, by_step in evals.items() if by_step}
    if len(finals) > 1:
        best = min(finals, key=finals.get)
        lines.append(f"lowest final held-out loss: {best} ({finals[best]:.4f})")
    return "\n".join(lines)


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
    _check_out(out, overwrite)
    common = list(common)
    for item in common:
        key, sep, _ = item.partition("=")
        if not sep or item.startswith("-"):
            raise UserError(f"unknown option or malformed override {item!r}; overrides look like KEY=VALUE")
        _check_not_budget(key, "an override")
    first = _all_recipes()[runs[0].recipe]
    finetune = is_finetune(first)
    data = _check_data(data, finetune)
    if iters is None:
        iters = first.train_iters(first.layout()) if finetune else DEFAULT_ITERS
    if finetune:
        _check_pretrained(runs, common)
    common = _absolute(common)
    runs = [Run(r.recipe, _absolute(r.overrides), r.label) for r in runs]

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
            cfg, recipe, description = _configure(run, iters=iters, seed=seed, data=data, common=common, quiet=True)
            # Megatron's and Megatron Bridge's own checks, before anything is written
            validate_for_layout(cfg, gpus=1, max_positions=recipe.model.hf_config.get("max_position_embeddings"))
            budgets[run.label] = _budget(cfg)
            configured[run.label] = (cfg, recipe)
        if finetune:
            description = _check_finetune_runs(runs, configured, data)
    if len(set(budgets.values())) > 1:
        detail = "; ".join(f"{k}: GBS {b[0]} seq {b[1]}" for k, b in budgets.items())
        raise UserError(f"the runs have different token budgets ({detail}); compare needs equal ones")
    gbs, seq, _ = next(iter(budgets.values()))

    # Replace only what an earlier compare wrote (checked by _check_out).
    out.mkdir(exist_ok=True)
    for name in _OUR_FILES:
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
            results.append(_run_worker(run, spec, run_dir, progress, task))

    losses = {r.label: r.losses for r in results}
    if finetune:
        from bridge_ext.finetune.run import read_eval  # the last pass per iteration (the final one at the end)

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
                   settings={run.label: _read_settings(out / "runs" / run.dirname / "losses.jsonl") for run in runs})
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


def format_summary(summary: dict[str, Any]) -> str:
    target, window = summary["target"], summary["smooth_window"]
    width = max(len("run"), *map(len, summary["runs"]))
    lines = [f"{'run':<{width}}  {'final loss':>10}  {f'mean last {window}':>12}  {'best (smoothed)':>15}  "
             f"iterations to {target:.3f}"]
    for label, row in summary["runs"].items():
        reach = row["iterations_to_target"]
        timing = summary.get("timing", {}).get(label, {})
        speed = f"   ({timing['iterations_per_second']:.1f} it/s)" if timing.get("iterations_per_second") else ""
        lines.append(f"{label:<{width}}  {row['final_loss']:>10.4f}  {row['final_loss_mean']:>12.4f}  "
                     f"{row['best_smoothed_loss']:>15.4f}  {reach if reach else 'never':>5}{speed}")
    slowest = summary["slowest"]
    iters_slowest = summary["runs"][slowest]["iterations_to_target"]
    for label, row in summary["runs"].items():
        if label != slowest and row["iterations_to_target"] and row["iterations_to_target"] < iters_slowest:
            lines.append(f"{label} reached the best loss of {slowest} ({target:.3f}, mean of {window}) in "
                         f"{row['iterations_to_target']} iterations instead of {iters_slowest} "
                         f"({iters_slowest / row['iterations_to_target']:.2f}x fewer)")
    return "\n".join(lines)


# ------------------------------------------------------------------------------------------------ worker
def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) == 2 and argv[0] == "--worker":
        try:
            return _worker(Path(argv[1]))
        except UserError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
    print("usage: nemo llm compare --recipes A,B --out DIR (this module's own entry is for its workers)",
          file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
