"""Recipe -> Megatron Bridge ``ConfigContainer``.

The model comes from the recipe's shipped HF ``config.json`` through ``AutoBridge`` (no hub id, no
weights); the base template, optimizer and scheduler configs are Megatron Bridge's own classes.
"""

from __future__ import annotations

import copy
import functools
from typing import TYPE_CHECKING

from bridge_ext.te_guard import install_te_import_guard
from bridge_ext.errors import UserError
from bridge_ext.hf import apply_config_stated_fields, load_hf_config

if TYPE_CHECKING:
    from megatron.bridge.training.config import ConfigContainer

    from recipes import Layout, Recipe

__all__ = ["build_config", "model_provider", "quiet_megatron", "resolve_for_run", "validate_for_layout"]

OUTPUT_ROOT = "nemo_experiments"  # relative, so resolved YAML is the same on every machine


def quiet_megatron() -> None:
    """Megatron warns at import about every optional kernel it lacks; users need none of that."""
    import logging
    import os
    import warnings

    for category in (UserWarning, FutureWarning, DeprecationWarning):
        warnings.filterwarnings("ignore", category=category)
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("MEGATRON_SUPPRESS_FUSION_WARNINGS", "1")
    import torch  # noqa: F401  (configures torch's loggers; ours must come after)

    logging.getLogger("torch.utils.cpp_extension").setLevel(logging.ERROR)  # "No CUDA runtime is found"
    for name in ("megatron", "transformers"):
        logging.getLogger(name).setLevel(logging.ERROR)


def model_provider(recipe: Recipe):
    """Megatron provider for the recipe's model, from its shipped HF config (no weights)."""
    install_te_import_guard()
    from megatron.bridge import AutoBridge

    hf_config = load_hf_config(recipe.model.config_dir)
    provider = AutoBridge.from_hf_config(hf_config).to_megatron_provider(load_weights=False)
    apply_config_stated_fields(provider, hf_config)
    spec = provider.transformer_layer_spec
    if isinstance(spec, functools.partial) and "use_transformer_engine" in spec.keywords:
        # megatron/bridge/models/deepseek/deepseek_v3_bridge.py:51 bakes the *building* machine's TE
        # availability into the spec; a recipe targets GPUs with TE wherever it is built (CPU mode
        # switches to the local spec itself).
        provider.transformer_layer_spec = functools.partial(spec.func, *spec.args,
                                                            **{**spec.keywords, "use_transformer_engine": True})
    # megatron/bridge/models/gpt_provider.py:186 defaults this to "is the fused kernel importable here";
    # the GPU target has it (CPU mode turns it off).
    provider.gradient_accumulation_fusion = True
    if provider.num_moe_experts:
        # TE's fused token permutation: megatron-bridge 0.3.1's bridges turn it on, 0.3.0's DeepSeek-V3
        # provider leaves it off; the GPU target has TE (CPU mode turns it off).
        provider.moe_permute_fusion = True
    return provider


def _apply_layout(cfg: ConfigContainer, layout: Layout) -> None:
    import torch

    model = cfg.model
    model.tensor_model_parallel_size = layout.tp
    model.pipeline_model_parallel_size = layout.pp
    model.virtual_pipeline_model_parallel_size = layout.vp
    model.expert_model_parallel_size = layout.ep
    model.expert_tensor_parallel_size = layout.etp
    model.context_parallel_size = layout.cp
    model.sequence_parallel = layout.sequence_parallel
    model.pipeline_dtype = torch.bfloat16 if layout.pp > 1 else None
    model.pipeline_model_parallel_layout = layout.pipeline_layout
    if layout.pipeline_layout:  # an explicit layout replaces the embedding/loss accounting heuristics
        model.account_for_embedding_in_pipeline_split = False
        model.account_for_loss_in_pipeline_split = False
    model.seq_length = layout.seq_length
    for key, value in layout.model.items():
        if not hasattr(model, key):
            raise AttributeError(f"layout {layout.cluster} sets unknown provider field {key}")
        setattr(model, key, copy.deepcopy(value))
    cfg.dataset.seq_length = layout.seq_length
    cfg.train.micro_batch_size = layout.micro_batch_size
    cfg.train.global_batch_size = layout.global_batch_size
    cfg.mixed_precision = None if layout.precision == "fp32" else layout.precision


def _apply_preset(cfg: ConfigContainer, recipe: Recipe) -> None:
    from megatron.bridge.training.config import OptimizerConfig, SchedulerConfig

    from bridge_ext.compat import check_optimizer_fields
    from bridge_ext.muon import apply_preset

    preset = recipe.preset
    check_optimizer_fields(preset.name, preset.optimizer)
    bf16 = isinstance(cfg.mixed_precision, str) and cfg.mixed_precision.startswith("bf16")
    cfg.optimizer = OptimizerConfig(**preset.optimizer, bf16=bf16, fp16=False)
    cfg.scheduler = SchedulerConfig(**preset.scheduler)
    for key, value in preset.ddp.items():
        setattr(cfg.ddp, key, value)
    apply_preset(cfg, preset, runtime=False)  # QK-clip and other model-level fields


def resolve_for_run(cfg: ConfigContainer, recipe: Recipe) -> None:
    """What must follow every override: schedule fractions become iteration counts for train_iters."""
    from bridge_ext.muon import resolve_schedule

    resolve_schedule(cfg, recipe.preset)


def build_config(recipe: Recipe, *, layout: str | None = None) -> ConfigContainer:
    """The recipe's full ``ConfigContainer`` on the named layout (default: the recipe's first)."""
    from bridge_ext.compat import pretrain_template

    chosen = recipe.layout(layout)
    problems = chosen.problems(recipe.model.num_layers)
    if problems:
        raise UserError(f"layout {chosen.cluster} does not fit {recipe.model.display}: {'; '.join(problems)}")

    cfg = pretrain_template()
    cfg.model = model_provider(recipe)
    _apply_layout(cfg, chosen)
    _apply_preset(cfg, recipe)

    # Mock data by default: NullTokenizer over the model's vocabulary. Real data: set dataset.blend and
    # the tokenizer (see docs/recipes.md).
    cfg.tokenizer.tokenizer_type = "NullTokenizer"
    cfg.tokenizer.tokenizer_model = None
    cfg.tokenizer.vocab_size = cfg.model.vocab_size
    run_dir = f"{OUTPUT_ROOT}/{recipe.name}"
    cfg.checkpoint.save = cfg.checkpoint.load = f"{run_dir}/checkpoints"
    cfg.logger.tensorboard_dir = f"{run_dir}/tb_logs"
    from bridge_ext.overrides import set_dotted

    for dotted, value in recipe.overrides.items():
        set_dotted(cfg, dotted, value)
    resolve_for_run(cfg, recipe)
    return cfg


def validate_for_layout(cfg: ConfigContainer, *, gpus: int) -> ConfigContainer:
    """Run Megatron Bridge's ``ConfigContainer.validate()`` as if on ``gpus`` ranks; returns the copy.

    Validation mutates (finalizes) the config, so it runs on a deep copy. Checks that need the GPU or
    Transformer Engine on *this* machine are skipped when they are absent (``cpu_mode.validation_without_gpu``).
    """
    from bridge_ext.cpu_mode import validation_without_gpu

    checked = copy.deepcopy(cfg)
    tp_pp_cp = (
        checked.model.tensor_model_parallel_size
        * checked.model.pipeline_model_parallel_size
        * checked.model.context_parallel_size
    )
    if gpus % tp_pp_cp:
        raise UserError(f"{gpus} GPUs are not divisible by tp*pp*cp={tp_pp_cp}; fix the parallel sizes")
    checked.data_parallel_size = gpus // tp_pp_cp
    if checked.comm_overlap is not None:
        checked.comm_overlap.data_parallel_size = checked.data_parallel_size
    try:
        with validation_without_gpu(checked):
            checked.validate()
    except (AssertionError, ValueError, TypeError) as exc:
        message = " ".join(str(exc).split()) or type(exc).__name__
        raise UserError(f"the config does not validate: {message}") from None
    return checked
