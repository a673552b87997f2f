"""``nemo llm finetune``: a fine-tuning recipe, a local JSONL and a pretrained checkpoint -> Megatron Bridge.

    nemo llm finetune --recipe NAME --data FILE.jsonl [--hf DIR | checkpoint.pretrained_checkpoint=DIR]
                      [--yaml FILE] [key=value ...] [--dryrun] [--to-yaml FILE]

Same pipeline, override grammar and precedence as ``nemo llm pretrain`` (recipe < ``--yaml`` < ``key=value``;
``preset=NAME`` / ``layout=NAME`` pick recipe parts). ``--data stdlib-signatures`` is the shipped instruction
set (``bridge_ext.finetune.instructions``); ``--hf DIR`` imports a Hugging Face checkpoint into the cache first
(``bridge_ext.training.import_on_the_fly``). The run itself is ``bridge_ext.training.run_finetune``.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from bridge_ext.commands.common import add_training_arguments, check_new_file, resolve, select_recipe, show_or_write
from bridge_ext.errors import UserError
from bridge_ext.overrides import value_of
from bridge_ext.upstream_output import log_file, run_console

__all__ = ["add_parser", "run"]


def add_parser(subparsers: Any, name: str) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        name, help="full SFT or LoRA of a pretrained checkpoint on a local JSONL (--dryrun: validate)",
        description="Precedence: recipe < --yaml < command-line key=value overrides. Data: JSONL of "
                    '{"input", "output"} or {"messages": [...]}; loss on the answer tokens only.')
    p.add_argument("--recipe", help="a fine-tuning recipe (`--list`)")
    p.add_argument("--list", action="store_true", help="list the fine-tuning recipes")
    p.add_argument("--data", help="JSONL file, or `stdlib-signatures` (the shipped instruction set)")
    p.add_argument("--hf", metavar="DIR", help="Hugging Face checkpoint to start from (imported into the cache)")
    add_training_arguments(p, preset_help="another fine-tuning optimizer preset; or preset=NAME",
                           overrides_help="e.g. checkpoint.pretrained_checkpoint=DIR")
    p.add_argument("--verbose", action="store_true",
                   help="a run shows everything Megatron and its libraries print (default: our lines and Megatron's "
                        "iteration lines; the rest goes to upstream.log next to the checkpoints)")
    return p


def _check_data(data: str | None, *, training: bool) -> None:
    if data:
        from bridge_ext.finetune.instructions import BUILTIN_SETS

        if data not in BUILTIN_SETS:
            from bridge_ext.finetune.data import load_records

            load_records(data)  # a bad file is refused before anything slow or written
    elif training:
        raise UserError("--data FILE.jsonl is required to train (or --data stdlib-signatures, the shipped set)")


def run(args: argparse.Namespace) -> int:
    if args.list:
        return _list()
    if not args.recipe:
        raise UserError("nemo llm finetune needs --recipe NAME (see nemo llm recipes)")
    from recipes.finetune import get_finetune_recipe

    recipe = select_recipe(args, get_finetune_recipe)  # an unknown name first: the cheapest check
    check_new_file(args.to_yaml, overwrite=args.overwrite)
    training = not (args.dryrun or args.to_yaml)
    _check_data(args.data, training=training)
    pretrained = value_of(args.overrides, "checkpoint.pretrained_checkpoint")
    if args.hf and pretrained:
        raise UserError("pass either --hf DIR or checkpoint.pretrained_checkpoint=DIR, not both")
    if args.hf and not Path(args.hf).is_dir():
        raise UserError(f"--hf {args.hf} does not exist")
    if pretrained and not Path(pretrained).is_dir():
        raise UserError(f"checkpoint.pretrained_checkpoint={pretrained} does not exist")
    from bridge_ext.training import import_target

    target = import_target(Path(args.hf)) if args.hf else None
    if target is not None:  # named before validation: Megatron Bridge validates PEFT only with a base checkpoint
        args.overrides.append(f"checkpoint.pretrained_checkpoint={target}")
    # a run's console: our lines and Megatron's progress; upstream's setup lines and known warnings in a log file
    with run_console(verbose=args.verbose or not training, device=args.device) as console:
        resolved = resolve(args, get=get_finetune_recipe)
        from bridge_ext.finetune.config import describe

        source = f"--hf {args.hf} (imported to {target})" if target else pretrained
        task_lines = [f"finetune    {recipe.mode}: {describe(resolved.checked)}",
                      f"checkpoint  {source or '(set checkpoint.pretrained_checkpoint=DIR or --hf DIR)'}"]
        if not training:
            show_or_write(resolved, args, task_lines=task_lines)
            return 0
        from bridge_ext.training import import_on_the_fly, run_finetune

        if target is not None:
            pretrained = str(import_on_the_fly(Path(args.hf), target))
        if not pretrained and not resolved.cfg.checkpoint.load:
            raise UserError("fine-tuning starts from a checkpoint: pass checkpoint.pretrained_checkpoint=DIR or "
                            "--hf DIR")
        if console is not None:
            console.log_to(log_file(resolved.cfg.checkpoint.save or f"nemo_experiments/{resolved.recipe.name}"))
        run_finetune(resolved.recipe, resolved.cfg, data=args.data, device=args.device, checksums=args.checksums,
                     init=args.init)
    return 0


def _list() -> int:
    from recipes.finetune import FINETUNE_RECIPES

    print(f"{'recipe':<28} {'model':<17} {'mode':<5} {'optimizer preset':<26} {'default layout':<12} base recipe")
    for recipe in FINETUNE_RECIPES.values():
        print(f"{recipe.name:<28} {recipe.model.display:<17} {recipe.mode:<5} {recipe.preset.name:<26} "
              f"{recipe.default_layout:<12} {recipe.base}")
    return 0
