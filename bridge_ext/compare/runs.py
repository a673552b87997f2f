"""The runs of a comparison: ``--recipes`` and ``--sweep`` parsed into :class:`Run` s, what a run's result
holds, and the settings a comparison keeps equal between runs."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from bridge_ext.errors import UserError, closest
from recipes.selection import key_value

__all__ = ["DEFAULT_ITERS", "DEFAULT_SEED", "DEFAULT_SMOOTH", "Run", "RunResult", "all_recipes", "check_not_budget",
           "is_finetune", "parse_runs"]

DEFAULT_ITERS = 200
DEFAULT_SEED = 1234
DEFAULT_SMOOTH = 10
# Keys that would give runs different token budgets or data; compare sets them itself.
_BUDGET_KEYS = ("train.train_iters", "train.global_batch_size", "train.micro_batch_size", "model.seq_length",
                "dataset.seq_length", "dataset.sequence_length", "rng.seed", "dataset.random_seed",
                "dataset.blend", "dataset.split", "dataset.seed", "dataset.dataset_root")


@dataclass
class Run:
    """One training run: a recipe and the overrides that distinguish it."""

    recipe: str
    overrides: list[str] = field(default_factory=list)  # KEY=VALUE for this run only (from --sweep)
    label: str = ""

    def __post_init__(self):
        if not self.label:
            pairs = [key_value(o) or (o, "") for o in self.overrides]
            tags = [f"{key.rsplit('.', 1)[-1]}={value}" for key, value in pairs]
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


def all_recipes() -> dict[str, Any]:
    """Pre-training and fine-tuning recipes by name (pure data)."""
    from recipes.finetune import ALL_RECIPES

    return ALL_RECIPES


def is_finetune(recipe: Any) -> bool:
    return hasattr(recipe, "mode")  # recipes.finetune.FinetuneRecipe


def parse_runs(recipes_arg: str, sweeps: list[str]) -> list[Run]:
    """The runs of ``--recipes A,B`` (``RECIPE:KEY=VALUE`` gives one run its own overrides) x every ``--sweep``."""
    RECIPES = all_recipes()

    entries: list[tuple[str, list[str]]] = []  # (recipe, its own overrides)
    for item in (n.strip() for n in recipes_arg.split(",")):
        if not item:
            continue
        name, *own = (part.strip() for part in item.split(":"))
        if name not in RECIPES:
            raise UserError(f"unknown recipe '{name}'{closest(name, RECIPES)}; `nemo llm recipes` lists them")
        for override in own:
            pair = key_value(override)
            if pair is None or not pair[1]:
                raise UserError(f"--recipes entry {item!r}: write RECIPE:KEY=VALUE[:KEY=VALUE...]")
            check_not_budget(pair[0], "--recipes")
        entries.append((name, own))
    columns: list[tuple[str, list[str]]] = []
    for sweep in sweeps:
        key, values = key_value(sweep) or ("", "")
        items = [v.strip() for v in values.split(",") if v.strip()]
        if not key or not items:
            raise UserError(f"--sweep {sweep!r} must look like KEY=V1,V2,... (e.g. optimizer.lr=1e-3,3e-3)")
        check_not_budget(key, "--sweep")
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


def check_not_budget(key: str, where: str) -> None:
    if key in _BUDGET_KEYS:
        raise UserError(f"{where} cannot set {key}: compare keeps data, seed and token budget equal "
                        "(use --iters / --seed)")
