"""Which upstream entry point to call, and with which names, on the installed Megatron Bridge / megatron-core.

Not a patch: nothing upstream is changed (``bridge_ext.patches`` holds what is). Where the installed release has
Megatron Bridge's own function, it is called; where it lacks it, a copy of the release that introduced it stands
in. Every difference between the stacks is decided by what the installed code offers: an attribute that is there
or not, a parameter in a signature, or what a function does on a small probe. Never a version number, never a
regular expression over source text. The decisions, and the upstream code each reads:

* :func:`pretrain_template` — attribute: ``megatron.bridge.recipes.common._pretrain_common``
  (``src/megatron/bridge/recipes/common.py``, megatron-bridge 0.3.1 and later) is called where the module has it;
  else :func:`_pretrain_common_inline`, a copy of it from megatron-bridge v0.3.1 (0.3.0, the NeMo 26.02
  container's, builds the same container inside each recipe).
* :func:`finetune_template` — attribute: ``recipes.common._sft_common`` / ``_peft_common`` (same file and
  releases); else :func:`_finetune_common_inline`, a copy of both from megatron-bridge v0.3.1.
* :func:`batch_split_calculator` — signature: whether megatron-core's
  ``num_microbatches_calculator._build_num_microbatches_calculator`` takes ``rampup_batch_size`` (0.16 does,
  0.19 dropped it).
* :func:`mixed_precision_for_validate` — no decision (was: a regex ``self\\.mixed_precision\\.\\w`` over the
  source of ``ConfigContainer.validate``): a recipe name is resolved for the block on every stack by Megatron
  Bridge's own ``training/mixed_precision.py`` ``get_mixed_precision_config``. 0.6's ``validate()`` reads fields
  of it; 0.3's reads none, so it sees the same check either way.
* :func:`sft_root_for_validate` — behaviour (was: the text ``"dataset_root or hf_dataset"`` searched in the source
  of the dataset config's ``validate``): the installed dataset config's own ``validate()`` is run on two shallow
  copies, one without a source and one with the placeholder; the placeholder is set for the block when the first
  fails and the second does not fail the same way (``GPTSFTDatasetConfig.validate``, megatron-bridge 0.6
  ``data/builders/gpt_sft.py``; 0.3-0.5's ``FinetuningDatasetConfig`` has no ``validate``).
* :func:`lora_merge` — attribute: ``LoRAMerge``'s home (``peft/lora.py`` 0.3-0.5, ``peft/lora_merge.py`` 0.6, by
  ``stack.first_defined``); signature: the keywords ``LoRAMerge.merge`` takes (``tp_size``, ``tp_group``).

Tests: tests/test_upstream_api.py (the copies against upstream's own functions, field by field, where they exist).
"""

from __future__ import annotations

import contextlib
import copy
import importlib
import importlib.util
import os
from collections.abc import Iterator
from typing import Any

from bridge_ext.patching import apply
from bridge_ext.stack import first_defined, signature_params

__all__ = ["batch_split_calculator", "finetune_template", "mixed_precision_for_validate", "pretrain_template",
           "lora_merge", "sft_root_for_validate"]

# Where megatron-bridge 0.3.1 introduced the templates (0.3.0 lacks the module).
RECIPES_COMMON = "megatron.bridge.recipes.common"


def _upstream_template(name: str) -> Any:
    """``recipes/common.py``'s ``name`` where the installed Megatron Bridge has it, else None."""
    if importlib.util.find_spec(RECIPES_COMMON) is None:
        return None
    return getattr(importlib.import_module(RECIPES_COMMON), name, None)


def pretrain_template():
    """Megatron Bridge's base pre-training ``ConfigContainer`` (every upstream recipe starts from it): its own
    ``recipes/common.py`` ``_pretrain_common()`` where installed, else :func:`_pretrain_common_inline`."""
    apply("import")
    upstream = _upstream_template("_pretrain_common")
    return upstream() if upstream is not None else _pretrain_common_inline()


def _output_dirs() -> tuple[str, str]:
    """``(checkpoint_dir, tensorboard_dir)`` as megatron-bridge 0.3.1's templates name them (every recipe of ours
    replaces them)."""
    run_output_dir = os.path.join(os.getcwd(), "nemo_experiments", "default")
    return os.path.join(run_output_dir, "checkpoints"), os.path.join(run_output_dir, "tb_logs")


def _pretrain_common_inline():
    """Copy of megatron-bridge v0.3.1 ``src/megatron/bridge/recipes/common.py`` ``_pretrain_common()``, for
    releases without it (0.3.0). Same classes, same values; tests/test_upstream_api.py compares it with
    upstream's own function field by field wherever that is installed."""
    from megatron.bridge.recipes.utils.optimizer_utils import distributed_fused_adam_with_cosine_annealing
    from megatron.bridge.training.config import (
        CheckpointConfig, ConfigContainer, DistributedDataParallelConfig, DistributedInitConfig, GPTDatasetConfig,
        LoggerConfig, RNGConfig, TokenizerConfig, TrainingConfig,
    )

    checkpoint_dir, tensorboard_dir = _output_dirs()
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
        logger=LoggerConfig(log_interval=10, tensorboard_dir=tensorboard_dir, log_timers_to_tensorboard=True),
        tokenizer=TokenizerConfig(tokenizer_type="HuggingFaceTokenizer", tokenizer_model=None),
        checkpoint=CheckpointConfig(save_interval=500, save=checkpoint_dir, load=checkpoint_dir,
                                    ckpt_format="torch_dist", fully_parallel_save=True),
        rng=RNGConfig(seed=1234),
        dist=DistributedInitConfig(),
        comm_overlap=None,
        mixed_precision="bf16_mixed",
    )


def finetune_template(mode: str):
    """Megatron Bridge's base fine-tuning ``ConfigContainer``: its own ``recipes/common.py`` ``_sft_common()``
    (``mode="sft"``) or ``_peft_common()`` (``"lora"``) where installed, else :func:`_finetune_common_inline`."""
    apply("import")
    upstream = _upstream_template("_sft_common" if mode == "sft" else "_peft_common")
    return upstream() if upstream is not None else _finetune_common_inline(mode)


def _finetune_common_inline(mode: str):
    """Copy of megatron-bridge v0.3.1 ``src/megatron/bridge/recipes/common.py`` ``_sft_common()`` (``"sft"``) and
    ``_peft_common()`` (``"lora"``: the same but ``max_lr`` and ``peft``), for releases without them (0.3.0)."""
    from megatron.bridge.peft.lora import LoRA
    from megatron.bridge.recipes.utils.finetune_utils import default_squad_config
    from megatron.bridge.recipes.utils.optimizer_utils import distributed_fused_adam_with_cosine_annealing
    from megatron.bridge.training.config import (
        CheckpointConfig, ConfigContainer, DistributedDataParallelConfig, DistributedInitConfig, LoggerConfig,
        RNGConfig, TokenizerConfig, TrainingConfig,
    )

    checkpoint_dir, tensorboard_dir = _output_dirs()
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
        logger=LoggerConfig(log_interval=1, tensorboard_dir=tensorboard_dir, log_timers_to_tensorboard=True),
        tokenizer=TokenizerConfig(tokenizer_type="HuggingFaceTokenizer", tokenizer_model=None),
        checkpoint=CheckpointConfig(save_interval=100, save=checkpoint_dir, load=checkpoint_dir,
                                    pretrained_checkpoint=None, ckpt_format="torch_dist", fully_parallel_save=True),
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
    """``cfg.mixed_precision`` resolved from its recipe name for the block, as ``ConfigContainer.validate()`` of
    megatron-bridge 0.6 reads it, and put back after.

    0.6's ``validate()`` reads fields of ``self.mixed_precision`` (``fp8_param_gather``; a name has none:
    AttributeError), which its ``runtime_config_update`` resolves from the name just before; 0.3's reads none.
    Resolving on every stack (Megatron Bridge's own ``get_mixed_precision_config``) needs no test of which
    ``validate()`` is installed: one that reads no field sees the same, and a bad name fails the dry run on every
    stack. The checked config keeps naming its recipe; ``setup()`` stays for the launch.
    """
    name = cfg.mixed_precision
    if not isinstance(name, str):
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


def _validate_error(dataset: Any, dataset_root: Any) -> tuple[type, str] | None:
    """What the dataset config's own ``validate()`` raises on a shallow copy with ``dataset_root`` (None: passes)."""
    probe = copy.copy(dataset)
    probe.dataset_root = dataset_root
    try:
        probe.validate()
    except Exception as error:  # noqa: BLE001 (any refusal: compared below, never swallowed from the real config)
        return type(error), str(error)
    return None


def _requires_sft_source(dataset: Any) -> bool:
    """Whether the dataset config's own ``validate()`` refuses it without a source and the placeholder source
    lifts that refusal (run on two shallow copies; the config itself is not touched)."""
    if not callable(getattr(dataset, "validate", None)) or not hasattr(dataset, "dataset_root"):
        return False
    without = _validate_error(dataset, None)
    return without is not None and _validate_error(dataset, UNRENDERED_SFT_ROOT) != without


@contextlib.contextmanager
def sft_root_for_validate(cfg: Any) -> Iterator[None]:
    """``cfg.dataset.dataset_root`` named for the block where the installed SFT dataset config's ``validate()``
    requires a source and none is rendered yet (the dry run: the data is rendered only at launch).

    megatron-bridge 0.6's ``GPTSFTDatasetConfig.validate()`` (``FinetuningDatasetConfig`` became its deprecated
    subclass) raises "Exactly one text-only SFT source must be set: dataset_root or hf_dataset"; 0.3-0.5's config
    has no ``validate()``. Decided by :func:`_requires_sft_source`. The placeholder is put back to None after, so
    nothing reaches a run."""
    dataset = getattr(cfg, "dataset", None)
    if (getattr(dataset, "dataset_root", "") is not None or getattr(dataset, "hf_dataset", None)
            or not _requires_sft_source(dataset)):
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
    merge = first_defined("LoRAMerge", "megatron.bridge.peft.lora", "megatron.bridge.peft.lora_merge")()
    return merge, {k: v for k, v in (("tp_size", 1), ("tp_group", None)) if k in signature_params(merge.merge)}
