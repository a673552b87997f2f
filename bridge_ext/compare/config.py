"""One run's ``ConfigContainer`` (recipe, overrides, then compare's data, budget and seed) and the settings
``summary.json`` records for it."""

from __future__ import annotations

from typing import Any

from bridge_ext.compare.runs import Run, all_recipes, is_finetune
from recipes.optimizers import is_muon
from recipes.selection import choose_recipe

__all__ = ["configure", "run_settings"]


def configure(run: Run, *, iters: int, seed: int, data: str, common: list[str], quiet: bool):
    """The run's ``ConfigContainer``: recipe, common and per-run overrides, then data, budget and seed.

    A fine-tuning recipe's data is not applied here (``bridge_ext.training.use_finetune_data`` renders
    it from the pretrained checkpoint's tokenizer)."""
    from bridge_ext.build import build_config
    from bridge_ext.data import use_text_corpus

    # preset=NAME / layout=NAME pick recipe parts, as on `nemo llm pretrain`'s command line
    recipe, layout, overrides = choose_recipe(run.recipe, get=all_recipes().__getitem__,
                                              overrides=[*common, *run.overrides])
    finetune = is_finetune(recipe)
    # compare's budget last (the overrides cannot set it): the schedule's fractions follow this train_iters
    cfg = build_config(recipe, layout=layout, overrides=overrides, values={"train.train_iters": iters})
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


def run_settings(cfg, recipe) -> dict[str, Any]:
    """What distinguishes runs, for summary.json: preset, optimizer and schedule values as trained."""
    opt, sched = cfg.optimizer, cfg.scheduler
    keys = ["optimizer", "lr", "min_lr", "weight_decay", "clip_grad", "adam_beta1", "adam_beta2", "adam_eps"]
    if is_muon(opt.optimizer):
        keys += [k for k in vars(opt) if k.startswith("muon_")]
    out = {"preset": recipe.preset.name, **{k: getattr(opt, k) for k in keys}}
    out.update({f"scheduler.{k}": getattr(sched, k, None) for k in (
        "lr_decay_style", "lr_warmup_iters", "lr_decay_iters", "lr_wsd_decay_iters", "start_weight_decay",
        "end_weight_decay")})
    return {k: v if isinstance(v, (int, float, str, bool, type(None))) else str(v) for k, v in out.items()}
