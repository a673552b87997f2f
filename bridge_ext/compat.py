"""Everything that differs between the Megatron stacks we support, in one place, decided by capability.

Product code asks this module instead of testing versions. Each *stack fix* closes a mismatch inside one
installed stack that breaks it on any device (GPU included); it applies only where the installed code needs
it (``needed()`` inspects signatures, call sites and files), is skipped where it does not, and raises
:class:`~bridge_ext.stack.UpstreamDrift` (one line naming the package and version) when the code has a shape
the fix does not know. ``nemo llm`` prints that line and exits 2.

Fixes, and the stacks where they apply (tests/test_compat.py checks both ways on every stack in CI):

* ``muon-nesterov-kwarg``: megatron-core 0.16 ``optimizer/muon.py`` (``TensorParallelMuon.__init__``) passes
  ``use_nesterov=`` to emerging-optimizers' ``OrthogonalizedOptimizer``; 0.3.0 renamed it ``nesterov``.
  Applies with emerging-optimizers 0.3.0; skipped with 0.1.0 (the NeMo 26.02 container's).
* ``muon-tp-mode-kwarg``: the same file (``TensorParallelMuon.orthogonalize``) calls
  ``newton_schulz_tp(..., mode=...)``; emerging-optimizers 0.3.0 renamed it ``tp_mode``. Same stacks.
* ``scheduler-warmup-cap``: megatron-bridge 0.3.1 ``training/config.py`` caps ``lr_warmup_steps`` below
  ``lr_decay_steps`` with a warning (short runs of recipes tuned for long ones); 0.3.0 does not, and
  megatron-core's scheduler asserts at launch. Applies on 0.3.0 (the container's); skipped on 0.3.1.
* ``prebuilt-dataset-helpers``: megatron-bridge 0.3 ``training/initialize.py`` calls megatron-core's
  ``datasets/utils.py`` ``compile_helpers()``, which runs ``make`` in a directory where the PyPI wheel ships
  the prebuilt ``helpers_cpp`` extension but no Makefile -> ``sys.exit(1)``. Applies where the Makefile is
  absent (every PyPI install); skipped where it exists (a source checkout, the container's build).
"""

from __future__ import annotations

import ast
import importlib.util
import inspect
from collections.abc import Callable
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

from bridge_ext.stack import UpstreamDrift, module_source, optimizer_muon_fields, package_of, signature_params

__all__ = [
    "STACK_FIXES",
    "StackFix",
    "apply_stack_fixes",
    "call_keywords",
    "check_optimizer_fields",
    "finetune_template",
    "pretrain_template",
]


def pretrain_template():
    """Megatron Bridge's base pre-training ``ConfigContainer`` (every upstream recipe starts from it).

    megatron-bridge 0.3.1 has it as ``recipes/common.py`` ``_pretrain_common()``; 0.3.0 (the NeMo 26.02
    container's) predates that module, and each of its recipes builds the same container inline: there the
    same template is built from Megatron Bridge's own config classes (:func:`_pretrain_common_inline`).
    """
    from bridge_ext.te_guard import install_te_import_guard

    install_te_import_guard()
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
    from bridge_ext.te_guard import install_te_import_guard

    install_te_import_guard()
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


def check_optimizer_fields(preset: str, fields: dict) -> None:
    """Fail clearly when a preset sets a Muon field the installed megatron-core does not have."""
    from bridge_ext.errors import UserError

    unknown = sorted(k for k in fields if k.startswith("muon_") and k not in optimizer_muon_fields())
    if unknown:
        raise UserError(f"optimizer preset '{preset}' sets {', '.join(unknown)}, which "
                        f"{package_of('megatron.core')} does not have; pick another preset")


@cache
def call_keywords(module_name: str, callee: str, *, inside: str | None = None) -> frozenset[str]:
    """Keyword names passed in calls to ``callee`` (a name or an attribute's last part) in a module's source,
    optionally only inside the class or function named ``inside``."""
    tree = ast.parse(module_source(module_name))
    if inside is not None:
        scopes = [node for node in ast.walk(tree)
                  if isinstance(node, ast.ClassDef | ast.FunctionDef) and node.name == inside]
        tree = ast.Module(body=scopes, type_ignores=[])
    keywords: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            func = node.func
            name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
            if name == callee:
                keywords.update(k.arg for k in node.keywords if k.arg)
    return frozenset(keywords)


@dataclass(frozen=True, kw_only=True)
class StackFix:
    name: str
    upstream: str  # the upstream code it works around
    why: str
    needed: Callable[[], bool]  # inspects the installed code; raises UpstreamDrift on an unknown shape
    apply: Callable[[], None]


# --- megatron-core 0.16 optimizer/muon.py vs emerging-optimizers 0.3.0 ------------------------------------
_MUON = "megatron.core.optimizer.muon"


def _renamed_kwarg(caller_passes: frozenset[str], callee: Callable, *, old: str, new: str, what: str) -> bool:
    """True when the caller passes ``old=`` but the callee now takes ``new=``; False when nothing to fix."""
    if old not in caller_passes:
        return False
    params = signature_params(callee)
    if old in params:
        return False
    if new in params:
        return True
    raise UpstreamDrift(f"{package_of(callee.__module__)}: {what} takes neither {old}= nor {new}=, which "
                        f"{package_of(_MUON)} passes; bridge_ext.compat needs updating for this pair")


def _orthogonalized_optimizer() -> Any:
    from emerging_optimizers.orthogonalized_optimizers import OrthogonalizedOptimizer

    return OrthogonalizedOptimizer


def _newton_schulz_tp() -> Any:
    from emerging_optimizers.orthogonalized_optimizers.muon_utils import newton_schulz_tp

    return newton_schulz_tp


def _nesterov_needed() -> bool:
    return _renamed_kwarg(call_keywords(_MUON, "__init__", inside="TensorParallelMuon"),
                          _orthogonalized_optimizer().__init__, old="use_nesterov", new="nesterov",
                          what="OrthogonalizedOptimizer.__init__")


def _tp_mode_needed() -> bool:
    return _renamed_kwarg(call_keywords(_MUON, "newton_schulz_tp"), _newton_schulz_tp(), old="mode",
                          new="tp_mode", what="newton_schulz_tp")


def _apply_nesterov_kwarg() -> None:
    base = _orthogonalized_optimizer()
    tp_muon = importlib.import_module(_MUON).TensorParallelMuon
    if tp_muon.__bases__ != (base,):
        if getattr(tp_muon.__bases__[0], "_bridge_ext_fix", False):
            return  # already applied
        raise UpstreamDrift(f"{package_of(_MUON)}: TensorParallelMuon no longer derives from "
                            "OrthogonalizedOptimizer alone; bridge_ext.compat needs updating")

    class _OrthogonalizedOptimizerKwargs(base):
        """Accepts megatron-core 0.16's ``use_nesterov=`` for emerging-optimizers 0.3.0's ``nesterov=``."""

        _bridge_ext_fix = True

        def __init__(self, *args: Any, use_nesterov: bool, **kwargs: Any) -> None:
            super().__init__(*args, nesterov=use_nesterov, **kwargs)

    tp_muon.__bases__ = (_OrthogonalizedOptimizerKwargs,)


def _apply_tp_mode_kwarg() -> None:
    muon = importlib.import_module(_MUON)
    newton_schulz_tp = _newton_schulz_tp()
    if getattr(muon.newton_schulz_tp, "_bridge_ext_fix", False):
        return

    def newton_schulz_tp_mode(*args: Any, mode: str = "duplicated", **kwargs: Any) -> Any:
        return newton_schulz_tp(*args, tp_mode=mode, **kwargs)

    newton_schulz_tp_mode._bridge_ext_fix = True  # type: ignore[attr-defined]
    muon.newton_schulz_tp = newton_schulz_tp_mode


# --- megatron-bridge 0.3 training/initialize.py -> megatron-core datasets/utils.py compile_helpers() -------
_INITIALIZE = "megatron.bridge.training.initialize"


def _compile_helpers_needed() -> bool:
    if "compile_helpers" not in {node.func.id for node in ast.walk(ast.parse(module_source(_INITIALIZE)))
                                 if isinstance(node, ast.Call) and isinstance(node.func, ast.Name)}:
        return False  # upstream no longer builds the helpers at start-up
    datasets = importlib.import_module("megatron.core.datasets")
    if (Path(datasets.__file__).parent / "Makefile").exists():
        return False  # a source tree: `make` works (given a compiler)
    if importlib.util.find_spec("megatron.core.datasets.helpers_cpp") is None:
        raise UpstreamDrift(f"{package_of('megatron.core')}: megatron.core.datasets ships neither a Makefile "
                            "nor the prebuilt helpers_cpp; reinstall megatron-core from its wheel")
    return True


def _apply_compile_helpers() -> None:
    initialize = importlib.import_module(_INITIALIZE)

    def use_prebuilt_helpers() -> None:
        importlib.import_module("megatron.core.datasets.helpers_cpp")

    initialize.compile_helpers = use_prebuilt_helpers


# --- megatron-bridge 0.3.0 training/config.py ConfigContainer._calculate_scheduler_steps -------------------
# 0.3.1 caps lr_warmup_steps at lr_decay_steps - 1 with a warning (a short run of a recipe tuned for a long
# one); 0.3.0 leaves it, and megatron-core's OptimizerParamScheduler then fails with a bare AssertionError
# (`assert self.lr_warmup_steps < self.lr_decay_steps`) at launch. Same behaviour on both: cap and warn.
_MB_CONFIG = "megatron.bridge.training.config"


def _warmup_cap_needed() -> bool:
    from megatron.bridge.training.config import ConfigContainer

    if not hasattr(ConfigContainer, "_calculate_scheduler_steps"):
        raise UpstreamDrift(f"{package_of(_MB_CONFIG)}: ConfigContainer has no _calculate_scheduler_steps; "
                            "bridge_ext.compat's warm-up cap needs updating")
    return "lr_warmup_steps >= self.scheduler.lr_decay_steps" not in inspect.getsource(
        ConfigContainer._calculate_scheduler_steps)


def _apply_warmup_cap() -> None:
    from megatron.bridge.training.config import ConfigContainer
    from megatron.bridge.utils.common_utils import warn_rank_0

    original = ConfigContainer._calculate_scheduler_steps
    if getattr(original, "_bridge_ext_fix", False):
        return

    def _calculate_scheduler_steps(self) -> None:
        original(self)
        scheduler = self.scheduler
        if scheduler.lr_decay_steps > 0 and scheduler.lr_warmup_steps >= scheduler.lr_decay_steps:
            capped = scheduler.lr_decay_steps - 1
            warn_rank_0(f"lr_warmup_steps ({scheduler.lr_warmup_steps}) >= lr_decay_steps ({scheduler.lr_decay_steps}); "
                        f"capping lr_warmup_steps to {capped}. Reduce lr_warmup_iters (or lr_warmup_samples) for "
                        "short training runs.")
            scheduler.lr_warmup_steps = capped

    _calculate_scheduler_steps._bridge_ext_fix = True  # type: ignore[attr-defined]
    ConfigContainer._calculate_scheduler_steps = _calculate_scheduler_steps


STACK_FIXES: tuple[StackFix, ...] = (
    StackFix(
        name="muon-nesterov-kwarg",
        upstream="megatron/core/optimizer/muon.py TensorParallelMuon.__init__ -> OrthogonalizedOptimizer",
        why="megatron-core passes use_nesterov=; emerging-optimizers 0.3.0 takes nesterov=",
        needed=_nesterov_needed,
        apply=_apply_nesterov_kwarg,
    ),
    StackFix(
        name="muon-tp-mode-kwarg",
        upstream="megatron/core/optimizer/muon.py TensorParallelMuon.orthogonalize -> newton_schulz_tp",
        why="megatron-core passes mode=; emerging-optimizers 0.3.0 takes tp_mode=",
        needed=_tp_mode_needed,
        apply=_apply_tp_mode_kwarg,
    ),
    StackFix(
        name="prebuilt-dataset-helpers",
        upstream="megatron/bridge/training/initialize.py compile_helpers() -> megatron/core/datasets/utils.py",
        why="the PyPI wheel has no Makefile for compile_helpers(); its prebuilt helpers_cpp works",
        needed=_compile_helpers_needed,
        apply=_apply_compile_helpers,
    ),
    StackFix(
        name="scheduler-warmup-cap",
        upstream="megatron/bridge/training/config.py ConfigContainer._calculate_scheduler_steps",
        why="0.3.0 leaves lr_warmup_steps >= lr_decay_steps for megatron-core's scheduler to assert on; "
            "0.3.1 caps it with a warning",
        needed=_warmup_cap_needed,
        apply=_apply_warmup_cap,
    ),
)

_applied: list[str] | None = None


def apply_stack_fixes() -> tuple[str, ...]:
    """Apply every fix the installed stack needs (idempotent); returns their names.

    Raises :class:`~bridge_ext.stack.UpstreamDrift` when installed code has a shape no fix knows.
    """
    global _applied
    if _applied is None:
        needed = [fix for fix in STACK_FIXES if fix.needed()]  # decide all before changing anything
        for fix in needed:
            fix.apply()
        _applied = [fix.name for fix in needed]
    return tuple(_applied)
