"""The recipes as Python functions, in Megatron Bridge's convention: each returns the resolved ``ConfigContainer``
(as ``megatron.bridge.recipes.kimi.kimi_k2.kimi_k2_pretrain_config()`` does) for Megatron Bridge's own
``pretrain()`` / ``finetune()`` or a ``run_recipe.py``-style script.

    from megatron.bridge.training.gpt_step import forward_step
    from megatron.bridge.training.pretrain import pretrain

    from bridge_ext.api import kimi_k2_proxy_muon_config, prepare_for_this_machine

    cfg = kimi_k2_proxy_muon_config(overrides=["train.train_iters=4"])
    pretrain(cfg, forward_step, callbacks=prepare_for_this_machine(cfg))

One function per recipe, ``<recipe>_config`` (generated from ``recipes.finetune.ALL_RECIPES``: the pre-training
recipes, then the fine-tuning ones; ``RECIPE_FUNCTIONS``), and :func:`recipe_config` by name. Both run the
pipeline of ``nemo llm pretrain --to-yaml`` (``bridge_ext.build.resolve``: Megatron Bridge's template with the
recipe's model, layout and preset -> the recipe's overrides -> ``yaml`` -> ``overrides`` -> derived values ->
validation for the layout's GPU count), so ``config_to_yaml(recipe_config(...))`` is the file ``--to-yaml``
writes for the same arguments. Bad input is a ``bridge_ext.errors.UserError`` with the command's one line.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from recipes.finetune import ALL_RECIPES, get_any_recipe

if TYPE_CHECKING:
    from megatron.bridge.training.config import ConfigContainer

    from recipes import Recipe

__all__ = ["RECIPE_FUNCTIONS", "prepare_for_this_machine", "recipe_config", "recipe_of"]

_BUILT_FROM: dict[int, Recipe] = {}  # id(config) -> its recipe, while the config lives (prepare_for_this_machine)


def recipe_config(name: str, *, layout: str | None = None, preset: str | None = None,
                  yaml: str | Path | None = None, overrides: Sequence[str] = (),
                  gpus: int | None = None) -> ConfigContainer:
    """The recipe ``name`` resolved as ``nemo llm pretrain --recipe NAME [--layout] [--preset] [--yaml] [KEY=VALUE
    ...] --to-yaml`` resolves it (``nemo llm finetune`` for a fine-tuning recipe): precedence recipe < ``yaml`` <
    ``overrides``; ``preset=NAME`` / ``layout=NAME`` among ``overrides`` pick recipe parts as on the command line.

    Validated for ``gpus`` ranks: default torchrun's ``WORLD_SIZE`` when launched by it, else the layout's GPU
    count. Returns the config itself (not the finalized copy validation makes): ``pretrain()`` validates it again.
    """
    from bridge_ext.build import resolve
    from bridge_ext.runtime import launcher_world_size
    from recipes.selection import choose_recipe

    recipe, layout, rest = choose_recipe(name, get=get_any_recipe, preset=preset, layout=layout, overrides=overrides)
    chosen = recipe.layout(layout)
    # training=True: Megatron's warnings stay visible (each once); the dry run's silencing is process-wide and
    # would hide them from the pretrain() this config is for
    resolved = resolve(recipe, layout=layout, yaml_path=yaml, overrides=rest,
                       gpus=gpus or launcher_world_size() or chosen.gpus, training=True)
    cfg = resolved.cfg
    _BUILT_FROM[id(cfg)] = resolved.recipe
    weakref.finalize(cfg, _BUILT_FROM.pop, id(cfg), None)
    return cfg


def recipe_of(cfg: ConfigContainer) -> Recipe | None:
    """The recipe (with the preset it was built with) of a config :func:`recipe_config` returned; None otherwise."""
    return _BUILT_FROM.get(id(cfg))


def prepare_for_this_machine(cfg: ConfigContainer, *, recipe: str | None = None,
                             device: Literal["auto", "gpu", "cpu"] = "auto",
                             data: Literal["auto", "text", "mock"] = "auto") -> list[Any]:
    """Make ``cfg`` ready for Megatron Bridge's ``pretrain()`` in this process; returns the callbacks to pass it.

    What ``nemo llm pretrain`` does before its ``pretrain()`` call (``bridge_ext.training.prepare``): the
    installed stack's fixes, the optimizer preset's run-time parts (Newton-Schulz coefficients, QK-clip, Muon
    telemetry: the callbacks), the data (``auto``: a proxy trains on the shipped text corpus), and without a GPU
    (``device``) CPU mode, with the one-process group it runs on. Then the checkpointing fixes
    (``bridge_ext.patches`` scope ``checkpointing``: atomic saves, the optimizer's parameter groups on load).
    The command's extras stay with the command: a stop on SIGTERM that saves first, resuming in another layout,
    the loss curve. ``recipe``: the recipe's name, for a config that :func:`recipe_config` did not build.
    """
    import torch

    from bridge_ext import patches
    from bridge_ext.errors import UserError
    from bridge_ext.training import prepare

    chosen = get_any_recipe(recipe) if recipe else recipe_of(cfg)
    if chosen is None:
        raise UserError("prepare_for_this_machine: this config was not built by recipe_config(); "
                        "pass recipe=NAME")
    prepared = prepare(chosen, cfg, device=device, data=data)
    patches.apply("checkpointing")
    if prepared.use_cpu and not torch.distributed.is_initialized():
        from bridge_ext.cpu import init_cpu_distributed  # CPU mode only: a GPU run loads nothing of bridge_ext.cpu

        init_cpu_distributed()  # one process: an in-memory store; under torchrun its rendezvous, over gloo
    return prepared.callbacks


def _recipe_function(name: str) -> Callable[..., ConfigContainer]:
    def config(*, layout: str | None = None, preset: str | None = None, yaml: str | Path | None = None,
               overrides: Sequence[str] = (), gpus: int | None = None) -> ConfigContainer:
        return recipe_config(name, layout=layout, preset=preset, yaml=yaml, overrides=overrides, gpus=gpus)

    recipe = ALL_RECIPES[name]
    config.__name__ = config.__qualname__ = f"{name}_config"
    config.__module__ = __name__
    config.__doc__ = (f"``{name}``: {recipe.model.display}, optimizer preset {recipe.preset.name}, layouts "
                      f"{', '.join(recipe.layouts)} (default {recipe.default_layout}). "
                      f"``recipe_config({name!r}, ...)``; see :func:`recipe_config`.")
    return config


# `<recipe>_config` for every recipe, from the registry (a new recipe gets its function without an edit here)
RECIPE_FUNCTIONS: dict[str, Callable[..., ConfigContainer]] = {
    f"{name}_config": _recipe_function(name) for name in ALL_RECIPES}
globals().update(RECIPE_FUNCTIONS)
__all__ += list(RECIPE_FUNCTIONS)
