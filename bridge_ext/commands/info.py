"""``nemo llm info --recipe NAME``: one recipe's model, parameter counts, optimizer and layout (no torch)."""

from __future__ import annotations

import argparse
import json
from typing import Any

from bridge_ext.commands.common import run_line

__all__ = ["add_parser", "recipe_info", "run", "task"]


def task(recipe: Any) -> str:
    return getattr(recipe, "mode", "pretrain")  # fine-tuning recipes: sft or lora


def recipe_info(recipe: Any, layout_name: str | None) -> dict[str, Any]:
    """What ``info --json`` (and ``recipes --json``, per recipe) prints."""
    layout = recipe.layout(layout_name)
    model = recipe.model
    finetune = ({"base_recipe": recipe.base, "lora": dict(recipe.lora) or None,
                 "data": "--data FILE.jsonl or stdlib-signatures; loss on the answer tokens only"}
                if task(recipe) != "pretrain" else {})
    return {
        "name": recipe.name,
        "task": task(recipe),
        **finetune,
        "model": model.display,
        "model_type": model.hf_config["model_type"],
        "architecture": model.hf_config["architectures"][0],
        "num_layers": model.num_layers,
        "hidden_size": model.hf_config["hidden_size"],
        "params_total": model.params.total,
        "params_active": model.params.active,
        "optimizer": {"preset": recipe.preset.name, **recipe.preset.optimizer,
                      "ns_coefficients": recipe.preset.ns_coefficients, "split_gate_up": recipe.preset.split_gate_up},
        "scheduler": {**recipe.preset.scheduler, **recipe.preset.schedule_fractions},
        "optimizer_model_settings": dict(recipe.preset.model),  # e.g. QK-clip
        "layout": {"name": layout.cluster, **layout.parallelism()},
        "micro_batch_size": layout.micro_batch_size,
        "global_batch_size": layout.global_batch_size,
        "seq_length": layout.seq_length,
        "run": recipe.run_length(layout.cluster).as_dict(),  # warm-up, tokens per step, total tokens
        "precision": layout.precision,
        "twin": recipe.twin,
        "layouts": list(recipe.layouts),
        "recipe_overrides": dict(recipe.overrides),
    }


def add_parser(subparsers: Any, name: str) -> argparse.ArgumentParser:
    p = subparsers.add_parser(name, help="one recipe's model, parameter counts, optimizer and layout")
    p.add_argument("--recipe", required=True)
    p.add_argument("--layout", help="a layout name from the recipe's list (default: its first)")
    p.add_argument("--preset", help="another optimizer preset (default: the recipe's)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    return p


def run(args: argparse.Namespace) -> int:
    from recipes.finetune import get_any_recipe

    recipe = get_any_recipe(args.recipe)
    info = recipe_info(recipe.with_preset(args.preset) if args.preset else recipe, args.layout)
    if args.json:
        print(json.dumps(info, indent=2))
        return 0
    width = max(map(len, info))
    for key, value in info.items():
        if key == "run":
            value = run_line(**value)
        elif isinstance(value, dict):
            value = ", ".join(f"{k}={v}" for k, v in value.items())
        elif isinstance(value, int) and key.startswith("params"):
            value = f"{value / 1e9:.2f} B ({value:,})"
        print(f"{key:<{width}}  {value}")
    return 0
