"""The fine-tuning parts of a recipe's Megatron Bridge SFT / PEFT ``ConfigContainer``.

``bridge_ext.build.template`` starts from Megatron Bridge's own fine-tuning template
(``bridge_ext.upstream_api.finetune_template``) and applies the recipe's three parts exactly as for pre-training
(model provider from the shipped HF config, layout, optimizer preset); this module adds the fine-tuning data
(``FinetuningDatasetConfig`` over the rendered JSONL; packed as Megatron Bridge packs when the recipe says so),
the tokenizer and, for LoRA, Megatron Bridge's ``LoRA``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from recipes import Layout
    from recipes.finetune import FinetuneRecipe

__all__ = ["describe", "finetune_dataset", "finetune_tokenizer_dir", "lora_config", "uses_packing"]


def uses_packing(recipe: FinetuneRecipe, layout_name: str | None = None) -> bool:
    """Megatron Bridge packs SFT sequences (THD attention, a Transformer Engine kernel); the CPU layout has no
    such kernel (megatron-core's local attention has no packed path), so proxies train unpacked."""
    return recipe.layout(layout_name).cluster != "cpu"


def finetune_dataset(recipe: FinetuneRecipe, layout: Layout) -> Any:
    """``FinetuningDatasetConfig`` for ``layout`` (its root is set when the data is rendered)."""
    from megatron.bridge.training.config import FinetuningDatasetConfig

    from bridge_ext.finetune.data import sft_dataset_kwargs
    from bridge_ext.stack import first_defined

    PackedSequenceSpecs = first_defined("PackedSequenceSpecs", "megatron.bridge.data.datasets.packed_sequence",
                                        "megatron.bridge.data.packing.config")

    packed = uses_packing(recipe, layout.cluster)
    specs = PackedSequenceSpecs(packed_sequence_size=layout.seq_length,
                                pad_seq_to_mult=2 * layout.cp if layout.cp > 1 else 1) if packed else None
    return FinetuningDatasetConfig(
        dataset_root=None, seq_length=layout.seq_length, seed=5678, memmap_workers=1, **_packing_fields(specs),
        dataset_kwargs={**sft_dataset_kwargs(), **({"pad_to_max_length": True} if packed else {})},
        do_validation=True, do_test=False, dataloader_type="batch", num_workers=1,
    )


def _packing_fields(specs: Any) -> dict[str, Any]:
    """Packing as the installed ``FinetuningDatasetConfig`` takes it: ``packed_sequence_specs`` (megatron-bridge
    0.3-0.5), ``enable_offline_packing`` + ``offline_packing_specs`` (0.6, where it became ``GPTSFTDatasetConfig``)."""
    import dataclasses

    from megatron.bridge.training.config import FinetuningDatasetConfig

    if "packed_sequence_specs" in {f.name for f in dataclasses.fields(FinetuningDatasetConfig)}:
        return {"packed_sequence_specs": specs}
    return {"enable_offline_packing": specs is not None, "offline_packing_specs": specs}


def packing_specs(dataset: Any) -> Any:
    """The dataset config's packing specs, or None (unpacked), under either release's field name."""
    return getattr(dataset, "packed_sequence_specs", None) or getattr(dataset, "offline_packing_specs", None)


def lora_config(recipe: FinetuneRecipe) -> Any:
    """Megatron Bridge's ``LoRA`` with the recipe's settings (LoRA recipes), else ``None`` (full SFT)."""
    if recipe.mode != "lora":
        return None
    from megatron.bridge.peft.lora import LoRA

    from bridge_ext import patches

    patches.apply("lora")  # LoRA on machines without Transformer Engine (CPU): peft-have-te
    return LoRA(**{k: list(v) if isinstance(v, (list, tuple)) else v for k, v in recipe.lora.items()})


def finetune_tokenizer_dir(recipe: FinetuneRecipe) -> str | None:
    """The proxies' shipped tokenizer; ``None`` for full models: the checkpoint's (``bridge_ext.training``)."""
    if recipe.model.proxy_of is None:
        return None
    from bridge_ext.data import PROXY_TOKENIZER_DIR

    return str(PROXY_TOKENIZER_DIR)


def describe(cfg: Any) -> str:
    """One line on the data and the adapters, for the dry run's summary."""
    d = cfg.dataset
    specs = packing_specs(d)
    packing = f"packed into {specs.packed_sequence_size}-token sequences" if specs else "unpacked (padded per batch)"
    peft = cfg.peft
    adapters = (f"LoRA dim {peft.dim} alpha {peft.alpha} on {', '.join(peft.target_modules)}; base frozen"
                if peft is not None else "full fine-tuning (every weight trains)")
    return f"{adapters}; data {d.dataset_root or '--data FILE'}, {packing}, loss on answer tokens only"
