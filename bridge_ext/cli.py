"""``nemo llm ...``: recipes by name, plus NeMo-Run passthrough.

This package installs a ``nemo`` command. NeMo-Run (in the NeMo container) installs one too; whatever this
package does not handle (``nemo llm pretrain --factory ...``, ``nemo experiment ...``) is handed to
NeMo-Run's CLI unchanged when it is installed.

Fast paths (``recipes``, ``info``) read the shipped configs only; torch and Megatron load lazily.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import signal
import sys
from pathlib import Path
from typing import Any

from bridge_ext.errors import UserError
from bridge_ext.stack import UpstreamDrift

__all__ = ["main"]

OUR_COMMANDS = ("recipes", "info", "pretrain", "import", "export", "prepare-data", "compare", "muon-plan", "plan",
                "finetune")
# Modules that add subcommands through `register(subparsers)`; each imports its heavy parts lazily.
_COMMAND_MODULES = ("convert", "data", "compare", "muon", "plan", "finetune")


def _err(text: str) -> None:
    print(f"error: {text}", file=sys.stderr)


# ---------------------------------------------------------------------------------------------- recipes
def _task(recipe) -> str:
    return getattr(recipe, "mode", "pretrain")  # fine-tuning recipes: sft or lora


def cmd_recipes(args: argparse.Namespace) -> int:
    from recipes.finetune import ALL_RECIPES

    rows = [(recipe, recipe.layout()) for recipe in ALL_RECIPES.values()]
    if args.json:
        print(json.dumps([_info(recipe, None) for recipe, _ in rows], indent=2))
        return 0
    header = (f"{'recipe':<27} {'model':<17} {'task':<8} {'optimizer':<20} {'default layout':<52} other layouts")
    print(header)
    for recipe, layout in rows:
        p = layout.parallelism()
        shape = f"{layout.cluster}: TP{p['tp']} PP{p['pp']}" + (f" VP{p['vp']}" if p["vp"] else "")
        shape += (f" EP{p['ep']}" if p["ep"] > 1 else "") + f" DP{p['dp']} GBS{layout.global_batch_size}"
        others = ", ".join(name for name in recipe.layouts if name != recipe.default_layout) or "-"
        print(f"{recipe.name:<27} {recipe.model.display:<17} {_task(recipe):<8} {recipe.preset.name:<20} "
              f"{shape:<52} {others}")
    return 0


# ------------------------------------------------------------------------------------------------- info
def _info(recipe, layout_name: str | None) -> dict[str, Any]:
    layout = recipe.layout(layout_name)
    model = recipe.model
    finetune = ({"base_recipe": recipe.base, "lora": dict(recipe.lora) or None,
                 "data": "--data FILE.jsonl or stdlib-signatures; loss on the answer tokens only"}
                if _task(recipe) != "pretrain" else {})
    return {
        "name": recipe.name,
        "task": _task(recipe),
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


def cmd_info(args: argparse.Namespace) -> int:
    from recipes.finetune import get_any_recipe

    recipe = get_any_recipe(args.recipe)
    info = _info(recipe.with_preset(args.preset) if args.preset else recipe, args.layout)
    if args.json:
        print(json.dumps(info, indent=2))
        return 0
    width = max(map(len, info))
    for key, value in info.items():
        if key == "run":
            value = _run_line(**value)
        elif isinstance(value, dict):
            value = ", ".join(f"{k}={v}" for k, v in value.items())
        elif isinstance(value, int) and key.startswith("params"):
            value = f"{value / 1e9:.2f} B ({value:,})"
        print(f"{key:<{width}}  {value}")
    return 0


def _run_line(*, tokens_per_step: int, train_iters: int, warmup_iters: float, decay_start: int | None,
              total_tokens: int) -> str:
    decay = f", decay after iteration {decay_start:,}" if decay_start is not None else ""
    units = ((1e12, "T "), (1e9, "B "), (1e6, "M "), (1e3, "k "), (1, ""))
    scale, unit = next((scale, unit) for scale, unit in units if total_tokens >= scale)
    return (f"{train_iters:,} iterations x {tokens_per_step:,} tokens per step = {total_tokens / scale:.4g} "
            f"{unit}tokens; warm-up {warmup_iters:,.4g} steps{decay}")


# --------------------------------------------------------------------------------------------- pretrain
def _write_atomic(path: Path, text: str, *, overwrite: bool) -> None:
    if path.exists() and not overwrite:
        raise UserError(f"{path} exists; pass --overwrite to replace it")
    if not path.parent.exists():
        raise UserError(f"directory {path.parent} does not exist")
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    tmp.write_text(text)
    tmp.replace(path)


def _summary(recipe, layout: str, cfg, gpus: int) -> str:
    m, o, t = cfg.model, cfg.optimizer, cfg.train
    parallel = (f"TP{m.tensor_model_parallel_size} PP{m.pipeline_model_parallel_size}"
                f" VP{m.virtual_pipeline_model_parallel_size or 1} EP{m.expert_model_parallel_size}"
                f" ETP{m.expert_tensor_parallel_size or 1} CP{m.context_parallel_size}"
                f" DP{cfg.data_parallel_size} on {gpus} GPUs")
    muon = ", ".join(f"{k.removeprefix('muon_')}={getattr(o, k)}" for k in vars(o) if k.startswith("muon_"))
    lines = [
        f"recipe      {recipe.name} (layout {layout}, optimizer preset {recipe.preset.name})",
        f"model       {type(m).__name__}: {m.num_layers} layers, hidden {m.hidden_size}"
        + (f", {m.num_moe_experts} experts top-{m.moe_router_topk}" if m.num_moe_experts else ""),
        f"parallel    {parallel}",
        f"batch       global {t.global_batch_size}, micro {t.micro_batch_size}, seq {m.seq_length}, "
        f"{t.train_iters} iterations",
        f"precision   {cfg.mixed_precision or 'fp32'}",
        f"optimizer   {o.optimizer} lr={o.lr} min_lr={o.min_lr} wd={o.weight_decay} clip={o.clip_grad}",
    ]
    if o.optimizer in ("muon", "dist_muon"):
        lines.append(f"muon        {muon}, coefficients={recipe.preset.ns_coefficients}, "
                     f"split_gate_up={recipe.preset.split_gate_up}")
    if getattr(m, "qk_clip", False):
        lines.append(f"qk-clip     threshold {m.qk_clip_threshold}, alpha {m.qk_clip_alpha}")
    from bridge_ext.build import benchmark_only_fields

    for name, doc in benchmark_only_fields().items():
        if getattr(m, name, None):
            lines.append(f"benchmark   {name}={getattr(m, name)}: throughput only, do not keep the weights "
                         f"(megatron-core: \"{doc}\")")
    if cfg.tokenizer.tokenizer_type == "HuggingFaceTokenizer":  # a model's tokenizer directory: fits the model?
        from bridge_ext.corpus import check_real_data

        described = check_real_data(cfg)
        if described:
            lines.append(f"tokenizer   {described}")
    if cfg.dataset.blend:
        lines.append(f"data        dataset.blend={cfg.dataset.blend}")
    elif recipe.model.proxy_of:
        lines.append("data        the standard-library text corpus, prepared when training starts (--data mock: mock)")
    else:
        lines.append("data        mock data (NullTokenizer); set dataset.blend and the tokenizer for real data")
    sch = cfg.scheduler
    from recipes.budget import run_length

    warmup = f"{sch.lr_warmup_iters:,} steps" if sch.lr_warmup_iters else f"{sch.lr_warmup_fraction or 0:.4%} of decay"
    if t.train_iters:  # iteration-based (sample-based runs have no fixed tokens per iteration count here)
        run = run_length(global_batch_size=t.global_batch_size, seq_length=m.seq_length, train_iters=t.train_iters,
                         lr_warmup_iters=sch.lr_warmup_iters, lr_warmup_fraction=sch.lr_warmup_fraction,
                         lr_decay_iters=sch.lr_decay_iters, lr_decay_style=sch.lr_decay_style,
                         lr_wsd_decay_iters=sch.lr_wsd_decay_iters)
        lines.append(f"run         {_run_line(**run.as_dict())}")
        warmup = f"{run.warmup_iters:,.4g} steps"
    wsd = sch.lr_decay_style == "WSD" and sch.lr_wsd_decay_iters
    decay = f", final {sch.lr_wsd_decay_iters:,} iterations {sch.lr_wsd_decay_style}" if wsd else ""
    lines.append(f"schedule    {sch.lr_decay_style}: warm-up {warmup}{decay}; weight decay "
                 f"{sch.start_weight_decay}->{sch.end_weight_decay}")
    return "\n".join(lines)


def _launched_world_size() -> int | None:
    """The number of ranks when launched by torchrun (or another launcher that sets WORLD_SIZE)."""
    value = os.environ.get("WORLD_SIZE")
    return int(value) if value and value.isdigit() else None


def _is_rank_zero() -> bool:
    return os.environ.get("RANK", "0") == "0"


def _resolve(args: argparse.Namespace):
    """Recipe -> YAML -> command line, with progress on stderr while Megatron loads.

    Validation uses the layout's GPU count, or the launcher's world size when training under torchrun.
    """
    from recipes import get_recipe

    recipe = get_recipe(args.recipe)
    if args.preset:
        recipe = recipe.with_preset(args.preset)
    layout = recipe.layout(args.layout)
    training = not (args.dryrun or args.to_yaml)
    gpus = (_launched_world_size() if training else None) or layout.gpus
    if args.yaml:  # fail before the slow imports
        from bridge_ext.overrides import load_yaml_file

        load_yaml_file(args.yaml)
    from rich.console import Console

    with Console(stderr=True, quiet=not _is_rank_zero()).status(f"building {recipe.name} ({layout.cluster}) ..."):
        from bridge_ext.build import (build_config, megatron_warnings_once, quiet_megatron, resolve_for_run,
                                      validate_for_layout)

        if training:  # a real run keeps Megatron's warnings; only the dry run and --to-yaml are quiet
            megatron_warnings_once()
        else:
            quiet_megatron()
        from bridge_ext.overrides import apply_user_overrides

        cfg = build_config(recipe, layout=args.layout)
        apply_user_overrides(cfg, yaml_path=args.yaml, overrides=args.overrides)
        resolve_for_run(cfg, recipe)
        positions = recipe.model.hf_config.get("max_position_embeddings")
        checked = validate_for_layout(cfg, gpus=gpus, max_positions=positions)
    return recipe, layout, cfg, checked


# Overrides that pick one of the recipe's parts instead of setting a config field.


def cmd_pretrain(args: argparse.Namespace) -> int:
    from bridge_ext.overrides import split_part_selectors

    split_part_selectors(args)
    if args.executor:  # NeMo-Run: local torchrun or Slurm (bridge_ext.launch)
        from bridge_ext.launch import launch

        return launch(args, resolve=_resolve)
    if args.to_yaml and Path(args.to_yaml).exists() and not args.overwrite:
        raise UserError(f"{args.to_yaml} exists; pass --overwrite to replace it")
    recipe, layout, cfg, checked = _resolve(args)
    from bridge_ext.overrides import config_to_yaml

    resolved = config_to_yaml(cfg)
    if args.to_yaml:
        _write_atomic(Path(args.to_yaml), resolved, overwrite=args.overwrite)
        print(f"wrote {args.to_yaml} ({recipe.name}, layout {layout.cluster})", file=sys.stderr)
        return 0
    if args.dryrun:
        print(_summary(recipe, layout.cluster, checked, checked.data_parallel_size * (
            checked.model.tensor_model_parallel_size * checked.model.pipeline_model_parallel_size
            * checked.model.context_parallel_size)))
        print("---")
        print(resolved, end="")
        return 0
    return _train(recipe, cfg, device=args.device, data=args.data)


def _train(recipe, cfg, *, device: str, data: str) -> int:
    from bridge_ext import training

    prepared = training.prepare(recipe, cfg, device=device, data=data)
    say = print if _is_rank_zero() else (lambda *a, **k: None)
    if prepared.use_cpu:
        say("CPU mode: no GPU visible (or --device cpu); a development and testing mode", file=sys.stderr)
    say(f"data: {prepared.data}", file=sys.stderr)
    from bridge_ext.kill_safe import stop_line

    if stop_line(cfg):
        say(stop_line(cfg), file=sys.stderr)
    callbacks = []
    if prepared.use_cpu:  # one process: record the loss curve next to the checkpoints
        run_dir = Path(cfg.checkpoint.save or f"nemo_experiments/{recipe.name}")
        losses = run_dir / "losses.jsonl"
        callbacks.append(training.loss_recorder(losses))
    stopped = training.run_pretrain(cfg, prepared, callbacks=callbacks)
    if stopped:
        from bridge_ext.checkpoints import read_tracker

        step = read_tracker(cfg.checkpoint.save)[0] if cfg.checkpoint.save else None
        say(f"stopped on {signal.Signals(cfg.train.exit_signal).name}"
            + (f" at iteration {step}, saved to {cfg.checkpoint.save}; run the same command to resume"
               if step is not None else " (nothing saved)"), file=sys.stderr)
    if prepared.use_cpu:
        curve = run_dir / "loss.png"
        if training.records_losses_here():  # one writer when several processes train
            training.write_loss_curve(losses, curve, title=f"{recipe.name}, {recipe.preset.name} preset")
        say(f"checkpoint:      {cfg.checkpoint.save or '(not saved: checkpoint.save is unset)'}")
        say(f"TensorBoard log: {cfg.logger.tensorboard_dir}")
        say(f"loss curve:      {curve} (values: {losses})")
    return 0


# ------------------------------------------------------------------------------------------------- main
class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, exit 2, like every other bad input
        raise UserError(f"{message} (see `{self.prog} --help`)")

    def parse_known_args(self, args=None, namespace=None):
        """A command's ``key=value`` overrides may come before, between and after its options
        (``layout=cpu --dryrun train.train_iters=3``): argparse's intermixed parsing, for leaf commands."""
        if self._subparsers is not None or getattr(self, "_intermixing", False):
            return super().parse_known_args(args, namespace)
        self._intermixing = True  # parse_known_intermixed_args calls back into this method
        try:
            return self.parse_known_intermixed_args(args, namespace)
        finally:
            self._intermixing = False


def build_parser() -> argparse.ArgumentParser:
    root = _Parser(prog="nemo", description="Megatron Bridge recipes for Kimi K2 and Qwen3 with Muon.")
    groups = root.add_subparsers(dest="group", required=True, parser_class=_Parser)
    llm = groups.add_parser("llm", help="LLM recipes")
    sub = llm.add_subparsers(dest="command", required=True, parser_class=_Parser)

    p = sub.add_parser("recipes", help="list every recipe (pre-training, then fine-tuning: sft, lora): model, "
                                       "optimizer preset, default layout")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_recipes)

    p = sub.add_parser("info", help="one recipe's model, parameter counts, optimizer and layout")
    p.add_argument("--recipe", required=True)
    p.add_argument("--layout", help="a layout name from the recipe's list (default: its first)")
    p.add_argument("--preset", help="another optimizer preset (default: the recipe's)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=cmd_info)

    p = sub.add_parser("pretrain", help="pre-train a recipe (--dryrun: validate and print the config)",
                       description="Precedence: recipe < --yaml < command-line key=value overrides.")
    p.add_argument("--recipe", required=True)
    p.add_argument("--layout", help="a layout name from the recipe's list (default: its first); or layout=NAME")
    p.add_argument("--preset", help="another optimizer preset (default: the recipe's); or preset=NAME")
    p.add_argument("--yaml", help="YAML file of config values (full dump or partial)")
    p.add_argument("--dryrun", action="store_true", help="validate, print a summary and the resolved YAML")
    p.add_argument("--to-yaml", metavar="FILE", help="write the resolved config to FILE and exit")
    p.add_argument("--overwrite", action="store_true", help="let --to-yaml replace an existing file")
    p.add_argument("--device", choices=("auto", "gpu", "cpu"), default="auto",
                   help="auto: CPU mode when no GPU is visible")
    p.add_argument("--data", choices=("auto", "text", "mock"), default="auto",
                   help="auto: proxy recipes train on the standard-library text corpus (`nemo llm prepare-data`), "
                        "other recipes on mock data unless dataset.blend is set")
    p.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="e.g. optimizer.lr=2e-4")
    from bridge_ext.launch import add_launch_arguments

    add_launch_arguments(p)
    p.set_defaults(func=cmd_pretrain)

    for name in _COMMAND_MODULES:
        importlib.import_module(f"bridge_ext.{name}").register(sub)
    return root


def _is_ours(argv: list[str]) -> bool:
    if not argv or argv[0] in ("-h", "--help") or argv == ["llm"]:
        return True
    if argv[0] != "llm":
        return False
    command = argv[1]
    if command == "pretrain":
        return any(a == "--recipe" or a.startswith("--recipe=") for a in argv[2:])
    if command == "finetune":  # NeMo-Run's `nemo llm finetune --factory ...` stays NeMo-Run's
        factory = any(a == "--factory" or a.startswith("--factory=") for a in argv[2:])
        return not factory or any(a == "--recipe" or a.startswith("--recipe=") for a in argv[2:])
    return command in OUR_COMMANDS or command in ("-h", "--help")


def _nemo_run_app():
    try:
        from nemo_run.__main__ import app
    except ImportError:
        return None
    return app


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not _is_ours(argv):
        app = _nemo_run_app()
        if app is not None:  # NeMo-Run's `nemo` (e.g. `nemo llm pretrain --factory ...`), argv unchanged
            return app(args=argv, prog_name="nemo")
        _err(f"`nemo {' '.join(argv[:2])}` is not a command of this package "
             "(`nemo llm pretrain` needs --recipe; NeMo-Run, which serves --factory, is not installed)")
        return 2
    try:
        args = build_parser().parse_args(argv)
        return args.func(args)
    except (UserError, UpstreamDrift) as exc:  # bad input, or installed code that a fix does not know
        _err(str(exc))
        return 2
    except KeyboardInterrupt:
        _err("interrupted")
        return 130
    except BrokenPipeError:  # e.g. `nemo llm pretrain ... --dryrun | head`
        sys.stdout = open(os.devnull, "w")
        return 0


if __name__ == "__main__":
    sys.exit(main())
