"""Fine-tuning recipe -> Megatron Bridge's SFT / PEFT ``ConfigContainer``.

Starts from Megatron Bridge's own fine-tuning template (``bridge_ext.patches.adapters.finetune_template``), then the
recipe's three parts exactly as pre-training does (``bridge_ext.build``: model provider from the shipped HF
config, layout, optimizer preset), then the fine-tuning data (``FinetuningDatasetConfig`` over the rendered
JSONL; packed as Megatron Bridge packs when the recipe says so) and, for LoRA, Megatron Bridge's ``LoRA``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from bridge_ext.errors import UserError

if TYPE_CHECKING:
    from megatron.bridge.training.config import ConfigContainer

    from recipes.finetune import FinetuneRecipe

__all__ = ["build_finetune_config", "uses_packing"]

OUTPUT_ROOT = "nemo_experiments"


def uses_packing(recipe: FinetuneRecipe, layout_name: str | None = None) -> bool:
    """Megatron Bridge packs SFT sequences (THD attention, a Transformer Engine kernel); the CPU layout has no
    such kernel (megatron-core's local attention has no packed path), so proxies train unpacked."""
    return recipe.layout(layout_name).cluster != "cpu"


def build_finetune_config(recipe: FinetuneRecipe, *, layout: str | None = None) -> ConfigContainer:
    """The recipe's full SFT/PEFT ``ConfigContainer`` on the named layout (data root and checkpoint unset)."""
    from megatron.bridge.data.datasets.packed_sequence import PackedSequenceSpecs
    from megatron.bridge.training.config import FinetuningDatasetConfig

    from bridge_ext.build import _apply_layout, _apply_preset, model_provider, resolve_for_run
    from bridge_ext.patches.adapters import finetune_template
    from bridge_ext.finetune.data import sft_dataset_kwargs
    from bridge_ext.overrides import set_dotted

    chosen = recipe.layout(layout)
    problems = chosen.problems(recipe.model.num_layers)
    if problems:
        raise UserError(f"layout {chosen.cluster} does not fit {recipe.model.display}: {'; '.join(problems)}")
    cfg = finetune_template(recipe.mode)
    cfg.model = model_provider(recipe)
    packed = uses_packing(recipe, layout)
    cfg.dataset = FinetuningDatasetConfig(
        dataset_root=None, seq_length=chosen.seq_length, seed=5678, memmap_workers=1,
        packed_sequence_specs=PackedSequenceSpecs(packed_sequence_size=chosen.seq_length,
                                                  pad_seq_to_mult=2 * chosen.cp if chosen.cp > 1 else 1)
        if packed else None,
        dataset_kwargs={**sft_dataset_kwargs(), **({"pad_to_max_length": True} if packed else {})},
        do_validation=True, do_test=False, dataloader_type="batch", num_workers=1,
    )
    _apply_layout(cfg, chosen)
    _apply_preset(cfg, recipe)
    cfg.train.train_iters = recipe.train_iters(chosen)
    if recipe.mode == "lora":
        from megatron.bridge.peft.lora import LoRA

        from bridge_ext import patches

        patches.apply("lora")  # LoRA on machines without Transformer Engine (CPU): peft-have-te

        cfg.peft = LoRA(**{k: list(v) if isinstance(v, (list, tuple)) else v for k, v in recipe.lora.items()})
    else:
        cfg.peft = None
    cfg.tokenizer.tokenizer_type = "HuggingFaceTokenizer"
    cfg.tokenizer.tokenizer_model = None  # the checkpoint's (bridge_ext.finetune.run), or the proxies' shipped one
    if recipe.model.proxy_of is not None:
        from bridge_ext.data import PROXY_TOKENIZER_DIR

        cfg.tokenizer.tokenizer_model = str(PROXY_TOKENIZER_DIR)
    run_dir = f"{OUTPUT_ROOT}/{recipe.name}"
    cfg.checkpoint.save = cfg.checkpoint.load = f"{run_dir}/checkpoints"
    cfg.checkpoint.pretrained_checkpoint = None
    cfg.train.exit_signal_handler = True
    cfg.train.exit_signal_handler_for_dataloader = True
    cfg.logger.tensorboard_dir = f"{run_dir}/tb_logs"
    for dotted, value in recipe.overrides.items():
        set_dotted(cfg, dotted, value)
    resolve_for_run(cfg, recipe)
    return cfg


def describe(cfg: Any) -> str:
    """One line on the data and the adapters, for the dry run's summary."""
    d = cfg.dataset
    packing = (f"packed into {d.packed_sequence_specs.packed_sequence_size}-token sequences"
               if d.packed_sequence_specs else "unpacked (padded per batch)")
    peft = cfg.peft
    adapters = (f"LoRA dim {peft.dim} alpha {peft.alpha} on {', '.join(peft.target_modules)}; base frozen"
                if peft is not None else "full fine-tuning (every weight trains)")
    return f"{adapters}; data {d.dataset_root or '--data FILE'}, {packing}, loss on answer tokens only"
