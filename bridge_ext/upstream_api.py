"""Stack adapters: where our code meets an API that differs between the stacks we support, decided by what
the installed code offers. Not patches (nothing upstream is changed): choices of which upstream entry point
to call, and which names to use.

* :func:`pretrain_template`, :func:`finetune_template`: Megatron Bridge's base ``ConfigContainer`` for a task,
  from ``recipes/common.py`` where it exists (megatron-bridge 0.3.1), else built from the same classes and
  values (0.3.0, whose recipes build it inline).
* ``optimizer_fields``: a preset's optimizer fields under the names the installed ``OptimizerConfig`` uses.
* :func:`lora_merge`: Megatron Bridge's ``LoRAMerge`` and the keywords its ``merge`` needs for one process.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import inspect
import re
from collections.abc import Iterator
from typing import Any

from bridge_ext.stack import signature_params

__all__ = ["batch_split_calculator", "finetune_template", "mixed_precision_for_validate", "pretrain_template",
           "lora_merge", "sft_root_for_validate"]


def pretrain_template():
    """Megatron Bridge's base pre-training ``ConfigContainer`` (every upstream recipe starts from it).

    megatron-bridge 0.3.1 has it as ``recipes/common.py`` ``_pretrain_common()``; 0.3.0 (the NeMo 26.02
    container's) predates that module, and each of its recipes builds the same container inline: there the
    same template is built from Megatron Bridge's own config classes (:func:`_pretrain_common_inline`).
    """
    from bridge_ext.patching import apply

    apply("import")
    if importlib.util.find_spec("megatron.bridge.recipes.common") is not None:
        recipes_common = importlib.import_module("megatron.bridge.recipes.common")
        if hasattr(recipes_common, "_pretrain_common"):
            return recipes_common._pretrain_common()
    return _pretrain_common_inline()


def _pretrain_common_inline():
    """``_pretrain_common()`` of megatron-bridge 0.3.1, for releases without ``recipes/common.py``.

    Values as upstream's, except the output directories, which every recipe of ours replaces anyway.
    """
    from megatron.bridge.recipes.utils.optimizer_utils import distributed_fused_adam_with_cosine_annealing
    from megatron.bridge.training.config import (
        CheckpointConfig, ConfigContainer, DistributedDataParallelConfig, DistributedInitConfig, GPTDatasetConfig,
        LoggerConfig, RNGConfig, TokenizerConfig, TrainingConfig,
    )

    optimizer, scheduler = distributed_fused_adam_with_cosine_annealing(
        lr_warmup_iters=500, lr_decay_iters=None, max_lr=3e-4, min_lr=3e-5)
    return ConfigContainer(
        model=None,  # type: ignore[arg-type]
        train=TrainingConfig(train_iters=300000, eval_interval=500, eval_iters=32, global_batch_size=32,
                             micro_batch_size=2, manual_gc=True, manual_gc_interval=100, manual_gc_eval=100),
        optimizer=optimizer,
        scheduler=scheduler,
        ddp=DistributedDataParallelConfig(
            check_for_nan_in_grad=True, grad_reduce_in_fp32=True, overlap_grad_reduce=True,
            overlap_param_gather=True, average_in_collective=True,
            data_parallel_sharding_strategy="optim_grads_params", use_distributed_optimizer=True),
        dataset=GPTDatasetConfig(
            random_seed=1234, reset_attention_mask=False, reset_position_ids=False, eod_mask_loss=False,
            seq_length=4096, num_dataset_builder_threads=1, blend=None, blend_per_split=None, split="9999,8,2",
            data_sharding=True, dataloader_type="single", skip_getting_attention_mask_from_dataset=True),
        logger=LoggerConfig(log_interval=10, tensorboard_dir="nemo_experiments/default/tb_logs",
                            log_timers_to_tensorboard=True),
        tokenizer=TokenizerConfig(tokenizer_type="HuggingFaceTokenizer", tokenizer_model=None),
        checkpoint=CheckpointConfig(save_interval=500, save="nemo_experiments/default/checkpoints",
                                    load="nemo_experiments/default/checkpoints", ckpt_format="torch_dist",
                                    fully_parallel_save=True),
        rng=RNGConfig(seed=1234),
        dist=DistributedInitConfig(),
        comm_overlap=None,
        mixed_precision="bf16_mixed",
    )


def finetune_template(mode: str):
    """Megatron Bridge's base fine-tuning ``ConfigContainer``: ``_sft_common()`` (``mode="sft"``) or
    ``_peft_common()`` (``"lora"``) of megatron-bridge 0.3.1 ``recipes/common.py``; on 0.3.0, which builds the
    same container inside each recipe's ``_*_finetune_common``, from the same classes and values.
    """
    from bridge_ext.patching import apply

    apply("import")
    if importlib.util.find_spec("megatron.bridge.recipes.common") is not None:
        recipes_common = importlib.import_module("megatron.bridge.recipes.common")
        name = "_sft_common" if mode == "sft" else "_peft_common"
        if hasattr(recipes_common, name):
            return getattr(recipes_common, name)()
    return _finetune_common_inline(mode)


def _finetune_common_inline(mode: str):
    """``_sft_common()`` / ``_peft_common()`` of megatron-bridge 0.3.1 (output directories: ours replace them)."""
    from megatron.bridge.peft.lora import LoRA
    from megatron.bridge.recipes.utils.finetune_utils import default_squad_config
    from megatron.bridge.recipes.utils.optimizer_utils import distributed_fused_adam_with_cosine_annealing
    from megatron.bridge.training.config import (
        CheckpointConfig, ConfigContainer, DistributedDataParallelConfig, DistributedInitConfig, LoggerConfig,
        RNGConfig, TokenizerConfig, TrainingConfig,
    )

    optimizer, scheduler = distributed_fused_adam_with_cosine_annealing(
        lr_warmup_iters=50, lr_decay_iters=None, max_lr=5e-6 if mode == "sft" else 1e-4, min_lr=0.0, adam_beta2=0.98)
    peft = None if mode == "sft" else LoRA(
        target_modules=["linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"], dim=32, alpha=32, dropout=0.0,
        dropout_position="pre", lora_A_init_method="xavier", lora_B_init_method="zero", a2a_experimental=False,
        lora_dtype=None)
    return ConfigContainer(
        model=None,  # type: ignore[arg-type]
        train=TrainingConfig(train_iters=1000, global_batch_size=128, micro_batch_size=1, eval_interval=100,
                             eval_iters=32),
        optimizer=optimizer,
        scheduler=scheduler,
        ddp=DistributedDataParallelConfig(check_for_nan_in_grad=True, grad_reduce_in_fp32=True),
        dataset=default_squad_config(seq_length=2048, packed_sequence=True, pad_seq_to_mult=1),
        logger=LoggerConfig(log_interval=1, tensorboard_dir="nemo_experiments/default/tb_logs",
                            log_timers_to_tensorboard=True),
        tokenizer=TokenizerConfig(tokenizer_type="HuggingFaceTokenizer", tokenizer_model=None),
        checkpoint=CheckpointConfig(save_interval=100, save="nemo_experiments/default/checkpoints",
                                    load="nemo_experiments/default/checkpoints", pretrained_checkpoint=None,
                                    ckpt_format="torch_dist", fully_parallel_save=True),
        rng=RNGConfig(seed=5678),
        dist=DistributedInitConfig(),
        comm_overlap=None,
        mixed_precision="bf16_mixed",
        peft=peft,
    )



def batch_split_calculator(*, global_batch_size: int, micro_batch_size: int, data_parallel_size: int,
                           decrease_batch_size_if_needed: bool, rampup_batch_size: Any = None) -> Any:
    """megatron-core's micro-batch calculator for these sizes, as Megatron Bridge's initialize builds it at
    launch (rank 1: it logs on rank 0 only), without setting the global one.

    ``num_microbatches_calculator._build_num_microbatches_calculator`` takes ``rampup_batch_size`` second in
    megatron-core 0.16; 0.19 dropped it (deprecated: its ``init_num_microbatches_calculator`` warns and ignores
    it) and added ``step_batch_size_schedule``. Called by keyword, with the rampup where it is taken.
    """
    from megatron.core import num_microbatches_calculator

    build = num_microbatches_calculator._build_num_microbatches_calculator
    sizes = {"global_batch_size": global_batch_size, "micro_batch_size": micro_batch_size,
             "data_parallel_size": data_parallel_size, "decrease_batch_size_if_needed": decrease_batch_size_if_needed}
    if "rampup_batch_size" in signature_params(build):
        sizes["rampup_batch_size"] = rampup_batch_size
    return build(1, **sizes)


@contextlib.contextmanager
def mixed_precision_for_validate(cfg: Any) -> Iterator[None]:
    """``cfg.mixed_precision`` as ``ConfigContainer.validate()`` reads it, for the duration of the block.

    megatron-bridge 0.6's ``validate()`` reads fields of ``self.mixed_precision`` (``fp8_param_gather``; a name
    has none: AttributeError), which its ``runtime_config_update`` resolves from a recipe name just before;
    0.3 reads none. Where the installed ``validate()`` reads them, a name is resolved for the block (Megatron
    Bridge's own ``get_mixed_precision_config``) and put back after, so the checked config names its recipe on
    every stack; nothing else changes (``setup()`` stays for the launch).
    """
    from megatron.bridge.training.config import ConfigContainer

    name = cfg.mixed_precision
    reads_fields = re.search(r"self\.mixed_precision\.\w", inspect.getsource(ConfigContainer.validate))
    if not isinstance(name, str) or not reads_fields:
        yield
        return
    from megatron.bridge.training.mixed_precision import get_mixed_precision_config

    cfg.mixed_precision = get_mixed_precision_config(name)
    try:
        yield
    finally:
        cfg.mixed_precision = name


# What a fine-tuning dry run validates before ``--data`` is rendered (bridge_ext.training sets the root then).
UNRENDERED_SFT_ROOT = "<rendered from --data at launch>"


@contextlib.contextmanager
def sft_root_for_validate(cfg: Any) -> Iterator[None]:
    """``cfg.dataset.dataset_root`` named for the block where the installed SFT dataset config's ``validate()``
    requires a source and none is rendered yet (the dry run: the data is rendered only at launch).

    megatron-bridge 0.6's ``GPTSFTDatasetConfig.validate()`` (``FinetuningDatasetConfig`` became its deprecated
    subclass) raises "Exactly one text-only SFT source must be set: dataset_root or hf_dataset"; 0.3-0.5 validate no
    source. The placeholder is put back to None after, so nothing reaches a run."""
    dataset = getattr(cfg, "dataset", None)
    validate = getattr(type(dataset), "validate", None)
    requires = validate is not None and "dataset_root or hf_dataset" in inspect.getsource(validate)
    if not requires or getattr(dataset, "dataset_root", "") is not None or getattr(dataset, "hf_dataset", None):
        yield
        return
    dataset.dataset_root = UNRENDERED_SFT_ROOT
    try:
        yield
    finally:
        dataset.dataset_root = None


def lora_merge() -> tuple[Any, dict[str, Any]]:
    """``(LoRAMerge(), keywords)``: ``merge(...)`` of one process (TP 1) on the installed release. megatron-bridge
    0.3-0.5 define it in peft/lora.py, 0.6 in peft/lora_merge.py; 0.5 requires the keywords ``tp_size`` and
    ``tp_group``, 0.6 ``tp_group`` only (None: TP 1)."""
    from bridge_ext.stack import first_defined

    merge = first_defined("LoRAMerge", "megatron.bridge.peft.lora", "megatron.bridge.peft.lora_merge")()
    return merge, {k: v for k, v in (("tp_size", 1), ("tp_group", None)) if k in signature_params(merge.merge)}
