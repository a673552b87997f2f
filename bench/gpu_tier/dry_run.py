"""``bench/gpu_check.sh --dry-run`` (any machine, CPU): each step printed, every recipe and layout it names built and
validated as the run builds them; with ``--te`` each config checked as the TE spec a GPU with TE trains, without
importing Transformer Engine."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from gpu_tier.plan import FP8_PRECISIONS, REFERENCE, REPO, plan_steps, step_values

__all__ = ["dry_run"]


def _te_spec_problems(step: dict[str, Any], cfg: Any) -> tuple[list[str], str]:
    """--te: the config a GPU with TE would train (checked on CPU without importing transformer_engine)."""
    import functools

    problems: list[str] = []
    model = cfg.model
    impl = getattr(model, "transformer_impl", "transformer_engine")
    if impl != "transformer_engine":
        problems.append(f"{step['recipe']}: transformer_impl={impl!r}, not the TE spec")
    spec = getattr(model, "transformer_layer_spec", None)
    if isinstance(spec, functools.partial) and spec.keywords.get("use_transformer_engine") is False:
        problems.append(f"{step['recipe']}: its layer spec is built without Transformer Engine")
    note = "TE spec"
    if step["step"] == "fp8":
        precision = getattr(cfg, "mixed_precision", None)
        if isinstance(precision, str) and precision != step["precision"]:
            problems.append(f"{step['recipe']}: mixed_precision {precision!r} != {step['precision']!r}")
    if step["step"] == "qk_clip":
        if not getattr(model, "qk_clip", False):
            problems.append(f"{step['recipe']}: qk_clip is off")
        mla = bool(getattr(model, "multi_latent_attention", False))
        if mla != (step["attention"] == "MLA"):
            problems.append(f"{step['recipe']}: attention is {'MLA' if mla else 'GQA'}, expected {step['attention']}")
        note += f", {step['attention']}, qk_clip tau {getattr(model, 'qk_clip_threshold', '?')}"
    if step["step"] == "round_trip":
        from recipes import get_recipe

        config_dir = Path(get_recipe(step["recipe"]).model.config_dir)
        if not (config_dir / "config.json").exists():
            problems.append(f"{step['recipe']}: no HF config at {config_dir}")
        note += f", HF config {config_dir.name}"
    return problems, note


def _mixed_precision_names() -> set[str]:
    """The mixed-precision recipes Megatron Bridge registers, read from its source (importing it imports TE)."""
    import importlib.util
    import re

    spec = importlib.util.find_spec("megatron.bridge")
    if spec is None or not spec.submodule_search_locations:
        return set()
    source = Path(list(spec.submodule_search_locations)[0]) / "training" / "mixed_precision.py"
    return set(re.findall(r"^def (\w+)\(\) -> \"?MixedPrecisionConfig", source.read_text(), flags=re.M))


def dry_run(*, iters: int, steps: int, te: bool = False) -> int:
    """Print each step and check every recipe and layout it names (built and validated as the run builds them).
    ``te``: also that each config is the TE spec a GPU with TE trains, that the fp8 recipes exist, that QK-clip is
    on for MLA and GQA, and that the TE carrier (bench/te) is there; transformer_engine itself is never imported."""
    from bridge_ext.build import build_config, validate_for_layout
    from recipes import get_recipe

    problems = []
    if te:
        names = _mixed_precision_names()
        for precision in FP8_PRECISIONS:
            if precision not in names:
                problems.append(f"megatron-bridge has no mixed-precision recipe {precision}")
        for path in ("bench/te/te.py", "bench/te/probe.py", "bench/te/workers.py"):
            if not (REPO / path).exists():
                problems.append(f"{path} is missing")
    for step in plan_steps(iters=iters, steps=steps, te=te):
        line = f"{step['step']:<11} {step.get('recipe', ''):<24} {step.get('layout', ''):<7} {step['what']}"
        if "recipe" in step:
            recipe = get_recipe(step["recipe"])
            layout = recipe.layout(step["layout"])
            values: dict[str, Any] = {"train.train_iters": step.get("iters", 1)}
            if "precision" in step:
                values["mixed_precision"] = step["precision"]
            values.update(step_values(step))
            cfg = build_config(recipe, layout=layout.cluster, values=values)
            checked = validate_for_layout(cfg, gpus=layout.gpus)
            if "precision" not in step and (checked.mixed_precision != "bf16_mixed" or not checked.optimizer.bf16):
                problems.append(f"{step['recipe']} at {layout.cluster} is not bf16")
            extra = ""
            if te:
                found, note = _te_spec_problems(step, checked)
                problems += found
                extra = f", {note}"
            precision = "bf16" if "precision" not in step else step["precision"].replace("bf16_with_", "")
            line += (f"  [ok: {layout.gpus} GPU, {checked.train.global_batch_size} x {checked.model.seq_length}, "
                     f"{precision}{extra}]")
        print(line, flush=True)
    if not (REPO / "bench" / "gpu_check.sh").exists():
        problems.append("bench/gpu_check.sh is missing")
    print(f"reference curves: {REFERENCE.relative_to(REPO)} "
          f"({'present' if REFERENCE.exists() else 'absent: the first GPU run writes them'})")
    if te:
        if "transformer_engine" in sys.modules:
            problems.append("the dry run imported transformer_engine")
        print("transformer_engine: not imported (the TE configs are checked as config objects)")
    for problem in problems:
        print(f"error: {problem}", file=sys.stderr)
    return 1 if problems else 0
