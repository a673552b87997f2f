"""``nemo llm finetune``: a fine-tuning recipe, a local JSONL and a pretrained checkpoint -> Megatron Bridge.

    nemo llm finetune --recipe NAME --data FILE.jsonl [--hf DIR | checkpoint.pretrained_checkpoint=DIR]
                      [--yaml FILE] [key=value ...] [--dryrun] [--to-yaml FILE]

Same override grammar and precedence as ``nemo llm pretrain`` (recipe < ``--yaml`` < ``key=value``;
``preset=NAME`` / ``layout=NAME`` pick recipe parts). ``--data stdlib-signatures`` is the shipped instruction
set (``bridge_ext.finetune.instructions``). Where the tokenizer comes from: the proxies' shipped one; else
the checkpoint's ``hf_source/`` (``nemo llm import`` keeps the source's tokenizer files there).

``--hf DIR`` imports the Hugging Face checkpoint on the fly (``bridge_ext.convert.import_hf``) into
``$MUON_RECIPES_CACHE/imports/<key>``, keyed by ``config.json`` and every safetensors file's header and
size (hashing the weights of a 1 T model would take an hour), in one process only: under torchrun, run
``nemo llm import`` first and pass ``checkpoint.pretrained_checkpoint=DIR``.
"""

from __future__ import annotations

import argparse
import copy
import hashlib
import json
import os
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from bridge_ext.errors import UserError

__all__ = ["cmd_finetune", "register", "resolve_finetune", "run_finetune", "use_finetune_data"]

# Architecture fields a pretrained checkpoint must share with the recipe's model (run_config.yaml "model").
_ARCH_FIELDS = ("num_layers", "hidden_size", "num_attention_heads", "num_query_groups", "ffn_hidden_size",
                "num_moe_experts", "multi_latent_attention", "kv_channels")


def _override_value(overrides: list[str], key: str) -> str | None:
    for item in overrides:
        k, sep, value = item.partition("=")
        if sep and k == key:
            return value
    return None


def _is_rank_zero() -> bool:
    return os.environ.get("RANK", "0") == "0"


def resolve_finetune(args: argparse.Namespace):
    """Recipe -> YAML -> command line; returns ``(recipe, layout, cfg, checked)`` as ``nemo llm pretrain``."""
    from recipes.finetune import get_finetune_recipe

    recipe = get_finetune_recipe(args.recipe)
    if args.preset:
        recipe = recipe.with_preset(args.preset)
    layout = recipe.layout(args.layout)
    training = not (args.dryrun or args.to_yaml)
    world = os.environ.get("WORLD_SIZE")
    gpus = (int(world) if training and world and world.isdigit() else None) or layout.gpus
    if args.yaml:
        from bridge_ext.overrides import load_yaml_file

        load_yaml_file(args.yaml)
    from rich.console import Console

    with Console(stderr=True, quiet=not _is_rank_zero()).status(f"building {recipe.name} ({layout.cluster}) ..."):
        from bridge_ext.build import megatron_warnings_once, quiet_megatron, resolve_for_run, validate_for_layout

        megatron_warnings_once() if training else quiet_megatron()
        from bridge_ext.finetune.build import build_finetune_config
        from bridge_ext.overrides import apply_user_overrides

        cfg = build_finetune_config(recipe, layout=args.layout)
        apply_user_overrides(cfg, yaml_path=args.yaml, overrides=args.overrides)
        resolve_for_run(cfg, recipe)
        positions = recipe.model.hf_config.get("max_position_embeddings")
        checked = validate_for_layout(cfg, gpus=gpus, max_positions=positions)
    return recipe, layout, cfg, checked


def _check_architecture(recipe: Any, cfg: Any, ckpt: Path) -> Path:
    """The iteration a pretrained checkpoint loads from, refused when its model is not the recipe's."""
    from bridge_ext.checkpoints import find_iteration

    try:
        iter_dir, _ = find_iteration(ckpt)
    except UserError as exc:
        raise UserError(f"checkpoint.pretrained_checkpoint: {str(exc).removeprefix('--ckpt ')}") from None
    run_config = iter_dir / "run_config.yaml"
    if run_config.is_file():
        import yaml

        model = (yaml.safe_load(run_config.read_text()) or {}).get("model") or {}
        wrong = [f"{name} {model[name]} (recipe: {getattr(cfg.model, name)})" for name in _ARCH_FIELDS
                 if name in model and model[name] != getattr(cfg.model, name, model[name])]
        if wrong:
            raise UserError(f"checkpoint {ckpt} holds another model than {recipe.name}'s {recipe.model.display}: "
                            f"{', '.join(wrong)}; pass a checkpoint of that model or pick its recipe")
    return iter_dir


def _tokenizer_dir(recipe: Any, cfg: Any, ckpt: Path, iter_dir: Path) -> Path:
    if cfg.tokenizer.tokenizer_model and Path(str(cfg.tokenizer.tokenizer_model)).is_dir():
        return Path(str(cfg.tokenizer.tokenizer_model))
    for candidate in (ckpt / "hf_source", iter_dir / "tokenizer"):
        if (candidate / "tokenizer_config.json").is_file() or (candidate / "tokenizer.json").is_file():
            return candidate
    raise UserError(f"no tokenizer for {recipe.name}: {ckpt} has no hf_source/ tokenizer files; import the model "
                    "with `nemo llm import` (it keeps them) or set tokenizer.tokenizer_model=DIR")


def _import_key(hf: Path) -> str:
    from bridge_ext.convert import read_safetensors_header

    digest = hashlib.sha256((hf / "config.json").read_bytes())
    for file in sorted(hf.glob("*.safetensors")):
        header = read_safetensors_header(file)
        digest.update(f"{file.name}\0{file.stat().st_size}\0".encode())
        digest.update(json.dumps({k: [str(v.dtype), list(v.shape)] for k, v in sorted(header.items())}).encode())
    return digest.hexdigest()[:20]


def _import_target(hf: Path) -> Path:
    """Where ``--hf DIR`` is imported to (checked first: the config names it before validation)."""
    from bridge_ext.cache import cache_root

    if not (hf / "config.json").is_file():
        raise UserError(f"--hf {hf} is not a Hugging Face model directory (no config.json)")
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        raise UserError("--hf imports in one process; under torchrun run `nemo llm import --hf DIR --out CKPT` "
                        "first and pass checkpoint.pretrained_checkpoint=CKPT")
    return cache_root() / "imports" / _import_key(hf)


def _import_on_the_fly(hf: Path, target: Path) -> Path:
    if (target / "latest_checkpointed_iteration.txt").is_file():
        print(f"--hf: using the import cached at {target}", file=sys.stderr)
        return target
    from bridge_ext.convert import import_hf

    target.parent.mkdir(parents=True, exist_ok=True)
    summary = import_hf(hf, target, console=lambda line: print(line, file=sys.stderr))
    print(summary.line(), file=sys.stderr)
    from bridge_ext.cpu_config import reset_megatron_globals

    reset_megatron_globals()  # the import's Megatron globals (rerun state machine, ...) must not reach the run
    return target


def cmd_finetune(args: argparse.Namespace) -> int:
    if args.list:
        return _list()
    if not args.recipe:
        raise UserError("--recipe is required (`nemo llm finetune --list` lists the fine-tuning recipes)")
    from bridge_ext.overrides import split_part_selectors

    split_part_selectors(args)
    from recipes.finetune import get_finetune_recipe

    get_finetune_recipe(args.recipe)  # an unknown name first: the cheapest check
    if args.to_yaml and Path(args.to_yaml).exists() and not args.overwrite:
        raise UserError(f"{args.to_yaml} exists; pass --overwrite to replace it")
    training = not (args.dryrun or args.to_yaml)
    if args.data:
        from bridge_ext.finetune.instructions import BUILTIN_SETS

        if args.data not in BUILTIN_SETS:
            from bridge_ext.finetune.data import load_records

            load_records(args.data)  # a bad file is refused before anything slow or written
    elif training:
        raise UserError("--data FILE.jsonl is required to train (or --data stdlib-signatures, the shipped set)")
    pretrained = _override_value(args.overrides, "checkpoint.pretrained_checkpoint")
    if args.hf and pretrained:
        raise UserError("pass either --hf DIR or checkpoint.pretrained_checkpoint=DIR, not both")
    if args.hf and not Path(args.hf).is_dir():
        raise UserError(f"--hf {args.hf} does not exist")
    if pretrained and not Path(pretrained).is_dir():
        raise UserError(f"checkpoint.pretrained_checkpoint={pretrained} does not exist")
    target = _import_target(Path(args.hf)) if args.hf else None
    if target is not None:  # named before validation: Megatron Bridge validates PEFT only with a base checkpoint
        args.overrides.append(f"checkpoint.pretrained_checkpoint={target}")
    recipe, layout, cfg, checked = resolve_finetune(args)
    from bridge_ext.overrides import config_to_yaml

    if args.to_yaml:
        from bridge_ext.cli import _write_atomic

        _write_atomic(Path(args.to_yaml), config_to_yaml(cfg), overwrite=args.overwrite)
        print(f"wrote {args.to_yaml} ({recipe.name}, layout {layout.cluster})", file=sys.stderr)
        return 0
    if args.dryrun:
        from bridge_ext.cli import _summary
        from bridge_ext.finetune.build import describe

        m = checked.model
        gpus = checked.data_parallel_size * m.tensor_model_parallel_size * m.pipeline_model_parallel_size \
            * m.context_parallel_size
        shown = copy.copy(checked)  # the pre-training summary's data line reads dataset.blend: ours replaces it
        shown.dataset = SimpleNamespace(blend=None)
        lines = _summary(recipe, layout.cluster, shown, gpus).splitlines()
        lines = [line for line in lines if not line.startswith("data ")]
        lines.insert(1, f"finetune    {recipe.mode}: {describe(checked)}")
        source = f"--hf {args.hf} (imported to {target})" if target else pretrained
        lines.insert(2, f"checkpoint  {source or '(set checkpoint.pretrained_checkpoint=DIR or --hf DIR)'}")
        print("\n".join(lines))
        print("---")
        print(config_to_yaml(cfg), end="")
        return 0
    if target is not None:
        pretrained = str(_import_on_the_fly(Path(args.hf), target))
    if not pretrained and not cfg.checkpoint.load:
        raise UserError("fine-tuning starts from a checkpoint: pass checkpoint.pretrained_checkpoint=DIR or --hf DIR")
    run_finetune(recipe, cfg, data=args.data, device=args.device)
    return 0


def _cache() -> Path:
    from bridge_ext.cache import cache_root

    return cache_root()


def use_finetune_data(recipe: Any, cfg: Any, data: str | Path) -> tuple[Path, Any, Path]:
    """Check the pretrained checkpoint, render ``data`` with its tokenizer in the order of ``dataset.seed`` and
    point ``cfg`` at it. Returns ``(data file, SFTData, tokenizer directory)``.

    ``data``: a JSONL path or the name of a shipped set (``stdlib-signatures``)."""
    from bridge_ext.finetune.data import prepare_sft_data
    from bridge_ext.finetune.instructions import BUILTIN_SETS

    pretrained = cfg.checkpoint.pretrained_checkpoint
    ckpt = Path(str(pretrained)) if pretrained else None
    iter_dir = _check_architecture(recipe, cfg, ckpt) if ckpt else None
    tokenizer = _tokenizer_dir(recipe, cfg, ckpt or Path(str(cfg.checkpoint.load)), iter_dir or Path("."))
    data = BUILTIN_SETS[str(data)](_cache()) if str(data) in BUILTIN_SETS else Path(data)
    prepared_data = prepare_sft_data(data, tokenizer, cache=_cache(), seed=cfg.dataset.seed)
    cfg.dataset.dataset_root = str(prepared_data.root)
    cfg.tokenizer.tokenizer_model = str(tokenizer)
    return data, prepared_data, tokenizer


def run_finetune(recipe: Any, cfg: Any, *, data: str | Path, device: str = "auto", callbacks: list[Any] = (),
                 quiet: bool = False, record_dir: Path | None = None, loss_extra: dict[str, Any] | None = None,
                 telemetry: bool = True) -> Path:
    """Check the checkpoint, render the data, then Megatron Bridge's fine-tuning run. Returns the run's directory.

    ``data``: a JSONL path or the name of a shipped set (``stdlib-signatures``). On CPU the training and
    held-out losses go to ``losses.jsonl`` / ``eval.jsonl`` in ``record_dir`` (default: the run directory;
    ``loss_extra`` is the first line of ``losses.jsonl``, as ``nemo llm compare`` writes it)."""
    from bridge_ext import training

    say = print if _is_rank_zero() and not quiet else (lambda *a, **k: None)
    data, prepared_data, tokenizer = use_finetune_data(recipe, cfg, data)
    say(f"data: {data}: {prepared_data.train} training and {prepared_data.validation} held-out records, rendered "
        f"with {tokenizer}'s chat template, training order of seed {cfg.dataset.seed} ({prepared_data.root})",
        file=sys.stderr)
    prepared = training.prepare(recipe, cfg, device=device, quiet=quiet, telemetry=telemetry)
    if prepared.use_cpu:
        say("CPU mode: no GPU visible (or --device cpu); a development and testing mode", file=sys.stderr)
    run_dir = Path(cfg.checkpoint.save or f"nemo_experiments/{recipe.name}")
    records = Path(record_dir) if record_dir is not None else run_dir
    recorders = []
    if prepared.use_cpu or record_dir is not None:
        recorders = [training.loss_recorder(records / "losses.jsonl", extra=loss_extra),
                     eval_recorder(records / "eval.jsonl")]
    # megatron.bridge.training.finetune.finetune() is this check followed by pretrain(config, forward_step); it
    # takes no callbacks, so the same check is made here and pretrain() runs with them (bridge_ext.training).
    if cfg.checkpoint.pretrained_checkpoint is None and cfg.checkpoint.load is None:
        raise UserError("fine-tuning needs checkpoint.pretrained_checkpoint or checkpoint.load")
    if recipe.mode == "lora" and recipe.preset.kind == "muon":
        from bridge_ext.finetune.lora import muon_without_adam_part

        muon_without_adam_part()
    # The merge reads one process's full model: with several processes (shards) it would write a partial one.
    merge_lora = recipe.mode == "lora" and prepared.use_cpu and cfg.checkpoint.save and \
        int(os.environ.get("WORLD_SIZE", "1")) == 1
    if merge_lora:
        from bridge_ext.finetune.lora import MERGED_DIR, merged_lora_saver

        recorders.append(merged_lora_saver(Path(cfg.checkpoint.save) / MERGED_DIR, tokenizer_dir=tokenizer))
    training.run_pretrain(cfg, prepared, callbacks=[*recorders, *callbacks])
    if prepared.use_cpu:
        evals = read_eval(records / "eval.jsonl")
        if evals:
            first, last = next(iter(evals.items())), list(evals.items())[-1]
            say(f"eval loss (held-out): {first[1]:.4f} at iteration {first[0]} -> {last[1]:.4f} at {last[0]}")
        say(f"checkpoint:      {cfg.checkpoint.save or '(not saved: checkpoint.save is unset)'}")
        if merge_lora:
            say(f"merged LoRA:     {Path(cfg.checkpoint.save) / 'merged'} (`nemo llm export --ckpt` it)")
        elif recipe.mode == "lora" and cfg.checkpoint.save:
            say("merged LoRA:     not written (the merge reads one process's whole model; this run had several)")
    return run_dir


def eval_recorder(path: Path):
    """A callback appending ``{"iteration", "eval_loss"}`` lines after each validation pass."""
    import torch
    from megatron.bridge.training.callbacks import Callback

    class EvalRecorder(Callback):
        def __init__(self):
            path.parent.mkdir(parents=True, exist_ok=True)
            self.sink = path.open("a", buffering=1)

        def on_eval_end(self, context):
            loss = (context.total_loss_dict or {}).get("lm loss")
            if loss is None:
                return
            value = float(loss.item() if torch.is_tensor(loss) else loss)
            self.sink.write(json.dumps({"iteration": context.state.train_state.step, "eval_loss": value}) + "\n")

    return EvalRecorder()


def read_eval(path: Path) -> dict[int, float]:
    """Iteration -> held-out loss from an :func:`eval_recorder` file (the last value per iteration)."""
    from bridge_ext.training import read_records

    return {r["iteration"]: r["eval_loss"] for r in read_records(path) if "eval_loss" in r}


def _list() -> int:
    from recipes.finetune import FINETUNE_RECIPES

    print(f"{'recipe':<28} {'model':<17} {'mode':<5} {'optimizer preset':<26} {'default layout':<12} base recipe")
    for recipe in FINETUNE_RECIPES.values():
        print(f"{recipe.name:<28} {recipe.model.display:<17} {recipe.mode:<5} {recipe.preset.name:<26} "
              f"{recipe.default_layout:<12} {recipe.base}")
    return 0


def register(subparsers: Any) -> None:
    """Add ``nemo llm finetune`` to the ``nemo llm`` sub-command parser."""
    p = subparsers.add_parser(
        "finetune", help="full SFT or LoRA of a pretrained checkpoint on a local JSONL (--dryrun: validate)",
        description="Precedence: recipe < --yaml < command-line key=value overrides. Data: JSONL of "
                    '{"input", "output"} or {"messages": [...]}; loss on the answer tokens only.')
    p.add_argument("--recipe", help="a fine-tuning recipe (`--list`)")
    p.add_argument("--list", action="store_true", help="list the fine-tuning recipes")
    p.add_argument("--data", help="JSONL file, or `stdlib-signatures` (the shipped instruction set)")
    p.add_argument("--hf", metavar="DIR", help="Hugging Face checkpoint to start from (imported into the cache)")
    p.add_argument("--layout", help="a layout name from the recipe's list (default: its first); or layout=NAME")
    p.add_argument("--preset", help="another fine-tuning optimizer preset; or preset=NAME")
    p.add_argument("--yaml", help="YAML file of config values (full dump or partial)")
    p.add_argument("--dryrun", action="store_true", help="validate, print a summary and the resolved YAML")
    p.add_argument("--to-yaml", metavar="FILE", help="write the resolved config to FILE and exit")
    p.add_argument("--overwrite", action="store_true", help="let --to-yaml replace an existing file")
    p.add_argument("--device", choices=("auto", "gpu", "cpu"), default="auto",
                   help="auto: CPU mode when no GPU is visible")
    p.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="e.g. checkpoint.pretrained_checkpoint=DIR")
    p.set_defaults(func=cmd_finetune)
