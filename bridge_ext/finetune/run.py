"""Fine-tuning runs: a recipe's config, a local JSONL and a pretrained checkpoint -> Megatron Bridge.

``nemo llm finetune`` (``bridge_ext.commands.finetune``) and ``nemo llm compare``'s fine-tuning workers use
:func:`run_finetune`: the pretrained checkpoint is checked against the recipe's model, the data is rendered with
the tokenizer (the proxies' shipped one; else the checkpoint's ``hf_source/``, where ``nemo llm import`` keeps
the source's tokenizer files) in the order of ``dataset.seed``, then Megatron Bridge's fine-tuning run.

A Hugging Face checkpoint (``--hf DIR``) is imported on the fly (``bridge_ext.convert.import_hf``) into
``$MUON_RECIPES_CACHE/imports/<key>`` (:func:`import_target`), keyed by ``config.json`` and every safetensors
file's header and size (hashing the weights of a 1 T model would take an hour), in one process only: under
torchrun, run ``nemo llm import`` first and pass ``checkpoint.pretrained_checkpoint=DIR``.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
from pathlib import Path
from typing import Any

from bridge_ext.errors import UserError
from bridge_ext.runtime import is_rank_zero

__all__ = ["eval_recorder", "import_on_the_fly", "import_target", "read_eval", "run_finetune", "use_finetune_data"]

# Architecture fields a pretrained checkpoint must share with the recipe's model (run_config.yaml "model").
_ARCH_FIELDS = ("num_layers", "hidden_size", "num_attention_heads", "num_query_groups", "ffn_hidden_size",
                "num_moe_experts", "multi_latent_attention", "kv_channels")


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


def import_target(hf: Path) -> Path:
    """Where ``--hf DIR`` is imported to (checked first: the config names it before validation)."""
    from bridge_ext.cache import cache_root

    if not (hf / "config.json").is_file():
        raise UserError(f"--hf {hf} is not a Hugging Face model directory (no config.json)")
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        raise UserError("--hf imports in one process; under torchrun run `nemo llm import --hf DIR --out CKPT` "
                        "first and pass checkpoint.pretrained_checkpoint=CKPT")
    return cache_root() / "imports" / _import_key(hf)


def import_on_the_fly(hf: Path, target: Path) -> Path:
    if (target / "latest_checkpointed_iteration.txt").is_file():
        print(f"--hf: using the import cached at {target}", file=sys.stderr)
        return target
    from bridge_ext.convert import import_hf

    target.parent.mkdir(parents=True, exist_ok=True)
    summary = import_hf(hf, target, console=lambda line: print(line, file=sys.stderr))
    print(summary.line(), file=sys.stderr)
    from bridge_ext.cpu.config import reset_megatron_globals

    reset_megatron_globals()  # the import's Megatron globals (rerun state machine, ...) must not reach the run
    return target


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

    say = print if is_rank_zero() and not quiet else (lambda *a, **k: None)
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
