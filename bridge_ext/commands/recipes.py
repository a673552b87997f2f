"""``nemo llm recipes``: every recipe (pre-training, then fine-tuning), from the shipped configs alone (no torch)."""

from __future__ import annotations

import argparse
import json
from typing import Any

from bridge_ext.commands.info import recipe_info, task

__all__ = ["add_parser", "run"]


def add_parser(subparsers: Any, name: str) -> argparse.ArgumentParser:
    p = subparsers.add_parser(name, help="list every recipe (pre-training, then fine-tuning: sft, lora): model, "
                                         "optimizer preset, default layout")
    p.add_argument("--json", action="store_true")
    return p


def run(args: argparse.Namespace) -> int:
    from recipes.finetune import ALL_RECIPES

    rows = [(recipe, recipe.layout()) for recipe in ALL_RECIPES.values()]
    if args.json:
        print(json.dumps([recipe_info(recipe, None) for recipe, _ in rows], indent=2))
        return 0
    wide, model_w = max(len(r.name) for r, _ in rows), max(len(r.model.display) for r, _ in rows)  # longest names
    header = (f"{'recipe':<{wide}} {'model':<{model_w}} {'task':<8} {'optimizer':<20} {'default layout':<52} "
              "other layouts")
    print(header)
    for recipe, layout in rows:
        p = layout.parallelism()
        shape = f"{layout.cluster}: TP{p['tp']} PP{p['pp']}" + (f" VP{p['vp']}" if p["vp"] else "")
        shape += (f" EP{p['ep']}" if p["ep"] > 1 else "") + f" DP{p['dp']} GBS{layout.global_batch_size}"
        others = ", ".join(name for name in recipe.layouts if name != recipe.default_layout) or "-"
        print(f"{recipe.name:<{wide}} {recipe.model.display:<{model_w}} {task(recipe):<8} {recipe.preset.name:<20} "
              f"{shape:<52} {others}")
    return 0
