"""Training recipes: a model spec, an optimizer preset and a layout, composed by name.

Pure data, importable without torch or Megatron; ``bridge_ext.build`` turns a recipe into Megatron
Bridge's ``ConfigContainer``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from recipes.budget import (UNSTATED_TRAIN_ITERS, RunLength, derived_schedule, iters_for_tokens, run_length,
                            tokens_per_step)
from recipes.errors import UserError, closest
from recipes.families import MUON_PRESET_BY_FAMILY, PROXY_OVERRIDES_BY_MODEL
from recipes.layouts import LAYOUTS, Layout
from recipes.models import MODELS, ModelSpec
from recipes.optimizers import PRESETS, OptimizerPreset, adamw_twin
from recipes.selection import PART_SELECTORS

__all__ = ["PART_SELECTORS", "RECIPES", "Recipe", "get_recipe", "Layout", "ModelSpec", "OptimizerPreset", "RunLength"]



@dataclass(frozen=True, kw_only=True)
class Recipe:
    name: str
    model: ModelSpec
    preset: OptimizerPreset
    layouts: Mapping[str, Layout]  # first one is the default
    twin: str  # the same recipe with the other optimizer, for A/B runs
    # Config values this recipe sets on top of its three parts (dotted keys), and why.
    overrides: Mapping[str, Any] = field(default_factory=dict)
    why: str = ""
    preset_why: str = ""  # why this recipe uses its optimizer preset

    @property
    def default_layout(self) -> str:
        return next(iter(self.layouts))

    def with_preset(self, name: str) -> Recipe:
        """This recipe with another optimizer preset (``preset=NAME`` on the command line)."""
        if name not in PRESETS:
            raise UserError(f"unknown optimizer preset '{name}'{closest(name, PRESETS)}; "
                            f"choose one of: {', '.join(PRESETS)}")
        return replace(self, preset=PRESETS[name], preset_why=f"selected with preset={name}")

    def layout(self, name: str | None = None) -> Layout:
        name = name or self.default_layout
        if name not in self.layouts:
            raise UserError(
                f"layout '{name}' is not defined for {self.name}{closest(name, self.layouts)}; "
                f"choose one of: {', '.join(self.layouts)}"
            )
        return self.layouts[name]

    def train_iters(self, layout: Layout) -> int:
        """Iterations on ``layout``: the recipe's own, else the model's published token budget at the layout's
        tokens per step, else Megatron Bridge's template length."""
        if "train.train_iters" in self.overrides:
            return self.overrides["train.train_iters"]
        if self.model.pretrain_tokens:
            return iters_for_tokens(self.model.pretrain_tokens,
                                    tokens_per_step(layout.global_batch_size, layout.seq_length))
        return UNSTATED_TRAIN_ITERS

    def run_length(self, layout: str | None = None) -> RunLength:
        """Tokens per step, iterations, warm-up and decay start on ``layout``, from recipe data alone: the
        schedule values derived as ``bridge_ext.build`` derives them (``recipes.budget.derived_schedule``)."""
        chosen = self.layout(layout)
        own = {k.removeprefix("scheduler."): v for k, v in self.overrides.items() if k.startswith("scheduler.")}
        sched = {**self.preset.scheduler, **own}
        iters = self.train_iters(chosen)
        sched.update(derived_schedule(sched, self.preset, train_iters=iters, explicit=own))
        return run_length(global_batch_size=chosen.global_batch_size, seq_length=chosen.seq_length, train_iters=iters,
                          lr_warmup_iters=sched.get("lr_warmup_iters"),
                          lr_warmup_fraction=sched.get("lr_warmup_fraction"),
                          lr_decay_iters=sched.get("lr_decay_iters"), lr_decay_style=sched["lr_decay_style"],
                          lr_wsd_decay_iters=sched.get("lr_wsd_decay_iters"))


# Proxies run 50-200 iterations instead of 10^5-10^6: the schedule is shortened (the same shape).
# Learning rates tuned once on qwen3_proxy with `nemo llm compare` over 1e-3..2e-2, 200 iterations, two
# seeds (docs/cpu.md): the best mean loss of the last 10 iterations for each optimizer. Each optimizer
# gets its own best rate, so an A/B compares optimizers at their best, not at one shared rate.
# A proxy whose own sweep found another best rate: its family module's PROXY_OVERRIDES (Moonlight's AdamW).
_PROXY_OVERRIDES = {
    "muon": {"optimizer.lr": 1e-2, "optimizer.min_lr": 1e-3},
    "adamw": {"optimizer.lr": 3e-3, "optimizer.min_lr": 3e-4},
}
_PROXY_COMMON = {"scheduler.lr_warmup_iters": 5, "train.train_iters": 50, "train.eval_interval": 1000,
                 "train.eval_iters": 0, "logger.log_interval": 5, "checkpoint.save_interval": 25}
_PROXY_WHY = ("a tiny model of the same architecture and optimizer preset; only the run length "
              "(warm-up, iterations, intervals) and the learning rate (tuned per optimizer) differ; CPU mode "
              "trains in fp32, on one process or several (layouts cpu-*)")


def _compose() -> dict[str, Recipe]:
    """Each model's ``_muon`` recipe on its family's Muon preset (``recipes/families/<family>.py``, ``MUON_PRESET``)
    and its ``_adamw`` twin, on the model's layouts."""
    recipes = {}
    for model_name, model in MODELS.items():
        preset_name, preset_why = MUON_PRESET_BY_FAMILY[model.family]
        muon = PRESETS[preset_name]
        for suffix, preset, twin in (("muon", muon, "adamw"), ("adamw", adamw_twin(muon), "muon")):
            name = f"{model_name}_{suffix}"
            proxy = model.proxy_of is not None
            recipes[name] = Recipe(
                name=name,
                model=model,
                preset=preset,
                layouts=LAYOUTS[model_name],
                twin=f"{model_name}_{twin}",
                overrides={**_PROXY_COMMON, **_PROXY_OVERRIDES[suffix],
                           **PROXY_OVERRIDES_BY_MODEL.get((model_name, suffix), {})} if proxy else {},
                why=_PROXY_WHY if proxy else "",
                preset_why=preset_why if suffix == "muon" else f"the A/B twin of {model_name}_muon",
            )
    return recipes


RECIPES: dict[str, Recipe] = _compose()


def get_recipe(name: str) -> Recipe:
    """The recipe called ``name``; a ``UserError`` naming the closest one otherwise."""
    if name not in RECIPES:
        raise UserError(f"unknown recipe '{name}'{closest(name, RECIPES)}; `nemo llm recipes` lists them")
    return RECIPES[name]
