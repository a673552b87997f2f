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
* :func:`installed_optimizer_fields` / :func:`canonical_optimizer_fields` — attribute: the installed
  ``OptimizerConfig``'s dataclass fields. Presets (``recipes.optimizers``) name every setting as megatron-core
  0.19's ``OptimizerConfig`` does (the canonical vocabulary); a renamed field takes the installed name
  (:data:`RENAMED`: ``muon_nesterov`` is ``muon_use_nesterov`` in 0.16/0.17), a field the release lacks is dropped
  where the preset asks for what that release always does (:data:`WHERE_ABSENT`) and is a one-line ``UserError``
  otherwise; ``muon_coefficient_type`` (0.17+) is the only way the preset's set reaches the optimizer where it
  exists, and ``bridge_ext.muon.presets.install_ns_coefficients`` supplies it at run time where it does not (0.16).
  Read back in the canonical vocabulary, one reference describes the run on every stack
  (tests/test_same_run_across_stacks.py).

Tests: tests/test_upstream_api.py (the copies against upstream's own functions, field by field, where they exist).
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import importlib
import importlib.util
import os
from collections.abc import Iterator, Mapping
from functools import cache
from typing import Any

from bridge_ext.errors import UserError
from bridge_ext.stack import first_defined, package_of, signature_params
from bridge_ext.upstream_patch import apply

__all__ = ["batch_split_calculator", "finetune_template", "mixed_precision_for_validate", "pretrain_template",
           "lora_merge", "sft_root_for_validate"]
__all__ += ["RENAMED", "RUN_TIME", "WHERE_ABSENT", "canonical_optimizer_fields", "config_has_coefficient_type",
            "installed_optimizer_fields", "optimizer_config_fields"]

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


# --- optimizer presets in one vocabulary, megatron-core's OptimizerConfig in the installed one ----------------
# canonical name -> the names older megatron-core releases give the same setting (newest first)
RENAMED: Mapping[str, tuple[str, ...]] = {
    "muon_nesterov": ("muon_use_nesterov",),  # megatron-core 0.16/0.17; renamed in 0.18 (no alias)
}

RUN_TIME = "run time"  # WHERE_ABSENT marker: bridge_ext.muon.presets supplies the value when the optimizer is built

# Canonical fields older releases lack: (what that release always runs instead, where upstream fixes it).
# A preset asking for that value loses nothing when the field is dropped; asking for another is refused.
WHERE_ABSENT: Mapping[str, tuple[Any, str]] = {
    # 0.16 optimizer/muon.py get_megatron_muon_optimizer: `config.optimizer = 'adam'` for every non-Muon param
    "muon_scalar_optimizer": ("adam", "megatron-core optimizer/muon.py routes every non-Muon parameter to Adam"),
    # 0.16/0.17: only the optimizer name makes Muon layer-wise (Megatron Bridge training/optim.py
    # `layer_wise_distributed_optimizer="dist" in optimizer_config.optimizer`); 0.18+ keeps that for "dist_muon"
    # (optimizer/__init__.py maps it to "muon" + layer-wise) and adds this field
    "use_layer_wise_distributed_optimizer": (False, "only the name dist_muon makes Muon layer-wise"),
    # 0.16 builds TensorParallelMuon without coefficient_type; bridge_ext.muon.presets.install_ns_coefficients
    # makes the preset's set the one it gets
    "muon_coefficient_type": (RUN_TIME, "bridge_ext.muon.presets.install_ns_coefficients sets it at run time"),
}


@cache
def optimizer_config_fields() -> frozenset[str]:
    """The fields of Megatron Bridge's ``OptimizerConfig`` (megatron-core's, with deferred validation)."""
    from megatron.bridge.training.config import OptimizerConfig

    return frozenset(f.name for f in dataclasses.fields(OptimizerConfig))


def config_has_coefficient_type() -> bool:
    """Whether megatron-core takes the Newton-Schulz coefficient set from ``OptimizerConfig`` (0.17+)."""
    return "muon_coefficient_type" in optimizer_config_fields()


def _installed_name(canonical: str, available: frozenset[str]) -> str | None:
    for name in (canonical, *RENAMED.get(canonical, ())):
        if name in available:
            return name
    return None


def installed_optimizer_fields(preset: str, fields: Mapping[str, Any], *,
                               available: frozenset[str] | None = None) -> dict[str, Any]:
    """``fields`` (canonical names) as the installed ``OptimizerConfig`` takes them; ``preset`` names it in errors.

    ``available``: the installed field names (default: :func:`optimizer_config_fields`).
    """
    available = optimizer_config_fields() if available is None else available
    out: dict[str, Any] = {}
    for canonical, value in fields.items():
        name = _installed_name(canonical, available)
        if name is not None:
            out[name] = value
            continue
        fixed, where = WHERE_ABSENT.get(canonical, (None, ""))
        if fixed == RUN_TIME or (where and value == fixed):
            continue  # the release runs this value anyway (WHERE_ABSENT says how)
        always = f" (it always runs {fixed!r}: {where})" if where else ""
        raise UserError(f"optimizer preset '{preset}' sets {canonical}={value!r}, which {package_of('megatron.core')} "
                        f"does not have{always}; pick another preset or another stack")
    return out


def canonical_optimizer_fields(config: Any, names: Any, *, run_time: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The values of ``names`` (canonical) in an installed ``OptimizerConfig``; an absent field reads as what
    its release runs instead (:data:`WHERE_ABSENT`), a run-time one as ``run_time[name]``."""
    available = frozenset(f.name for f in dataclasses.fields(config))
    out: dict[str, Any] = {}
    for canonical in names:
        name = _installed_name(canonical, available)
        if name is not None:
            out[canonical] = getattr(config, name)
        elif canonical in WHERE_ABSENT:
            fixed = WHERE_ABSENT[canonical][0]
            out[canonical] = (run_time or {}).get(canonical) if fixed == RUN_TIME else fixed
        else:
            raise KeyError(f"{canonical}: not in {package_of(type(config).__module__)}'s OptimizerConfig")
    return out
