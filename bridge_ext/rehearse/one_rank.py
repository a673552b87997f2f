"""A recipe's config for a rehearsal, and one rank's model and optimizer built from it by Megatron Bridge.

The config is the recipe's own (``bridge_ext.build.build_config``: template, layout, preset) with what cannot
run on a CPU process changed, as CPU mode does (``bridge_ext.cpu.config``): megatron-core's local layer spec
(no Transformer Engine; MLA's down-projections are ``ColumnParallelLinear`` there, ``TELinear`` duplicated
with TE), fusions off, the ``allgather`` MoE dispatcher and sequential experts (TE's grouped GEMM holds the
same per-expert weights). Unlike CPU mode the precision stays: bf16 weights, fp32 gradients and main weights,
as on GPUs (MXFP8 recipes rehearse as ``bf16_mixed``: their fp8 copies need Transformer Engine). Weight
initialization is skipped (``perform_initialization=False``): values do not change what is allocated, and the
stack patches (applied first) give the weights their tensor-parallel attributes all the same.
"""

from __future__ import annotations

import copy
import inspect
from typing import Any

from bridge_ext.without_te import TE_KERNEL_SETTINGS, local_layer_spec

__all__ = ["REHEARSAL_MODEL_SETTINGS", "build_rank", "rehearsal_config"]

# Provider fields set for a rehearsal on CPU fake tensors (precision, parallelism and recompute stay).
REHEARSAL_MODEL_SETTINGS: dict[str, Any] = {
    **TE_KERNEL_SETTINGS,  # megatron-core's local modules (bridge_ext.without_te)
    "use_cpu_initialization": True,
    # values do not change what is allocated; the weights' tensor-parallel attributes (partition_dim, which
    # Muon's duplicated TP mode needs) are set without initialization too: upstream from megatron-core 0.18,
    # the stack row tp-weight-attributes-without-init's pre-wrap hook before (bridge_ext/patches/tensor_parallel.py)
    "perform_initialization": False,
    "init_model_with_meta_device": False,
    "cuda_graph_impl": "none",
    "bias_activation_fusion": False,
    "bias_dropout_fusion": False,
    "moe_shared_expert_overlap": False,
    "overlap_moe_expert_parallel_comm": False,
}
_MOE_SETTINGS: dict[str, Any] = {"moe_token_dispatcher_type": "allgather", "moe_grouped_gemm": False,
                                 "moe_enable_deepep": False}
_MXFP8 = "bf16_with_mxfp8_mixed"


def rehearsal_config(recipe: Any, *, layout: str | None, device: str = "cpu") -> tuple[Any, list[str]]:
    """The recipe's validated ``ConfigContainer`` for a rehearsal of ``layout`` (its real world size), and notes.

    ``device="cuda"``: the recipe's own settings (Transformer Engine spec, fusions), only the process group and
    the Gloo groups change."""
    from bridge_ext.build import build_config, validate_for_layout

    chosen = recipe.layout(layout)
    cfg = build_config(recipe, layout=chosen.cluster)
    notes = []
    if device == "cpu":
        model = cfg.model
        for name, value in REHEARSAL_MODEL_SETTINGS.items():
            if hasattr(model, name):
                setattr(model, name, value)
        if getattr(model, "num_moe_experts", None):
            for name, value in _MOE_SETTINGS.items():
                if hasattr(model, name):
                    setattr(model, name, value)
        model.transformer_layer_spec = local_layer_spec
        notes.append("layer spec: megatron-core's local spec on CPU fake tensors (no Transformer Engine): sequential "
                     "experts, MLA down-projections split over TP")
        if cfg.mixed_precision == _MXFP8:
            cfg.mixed_precision = "bf16_mixed"
            notes.append(f"precision {_MXFP8} rehearsed as bf16_mixed (MXFP8's fp8 weight copies need Transformer "
                         "Engine)")
    else:
        from bridge_ext.stack import have_transformer_engine

        if not have_transformer_engine():  # as a GPU training run without TE (bridge_ext.without_te)
            from bridge_ext import patches
            from bridge_ext.without_te import configure_without_te

            notes.append(configure_without_te(cfg))
            patches.apply("without-te")  # MLA and MoE modules built without TE
    cfg.comm_overlap = None
    cfg.dist.use_gloo_process_groups = False  # a fake world has no Gloo peers
    for name in ("overlap_grad_reduce", "overlap_param_gather"):
        setattr(cfg.ddp, name, False)
    cfg.optimizer.overlap_param_gather_with_optimizer_step = False
    cfg.rng.te_rng_tracker = device == "cuda" and cfg.rng.te_rng_tracker
    checked = validate_for_layout(cfg, gpus=chosen.gpus,
                                  max_positions=recipe.model.hf_config.get("max_position_embeddings"))
    return checked, notes


def build_rank(cfg: Any, *, use_cpu_initialization: bool) -> tuple[list[Any], Any]:
    """This rank's model chunks (Megatron Bridge's ``provide_distributed_model``: DDP-wrapped) and optimizer
    (``setup_optimizer``), as ``training/setup.py`` builds them. ``cfg`` is copied first: megatron-core's Muon
    builder rewrites the optimizer config it is given."""
    from megatron.bridge.training.optim import setup_optimizer

    from bridge_ext import patches

    cfg = copy.deepcopy(cfg)
    patches.register_hooks(cfg.model)  # the applied rows' pre-wrap hooks (tensor-parallel attributes without init)
    model = cfg.model.provide_distributed_model(
        ddp_config=cfg.ddp, use_megatron_fsdp=False, use_torch_fsdp2=False,
        overlap_param_gather_with_optimizer_step=False,
        data_parallel_random_init=cfg.rng.data_parallel_random_init,
        use_cpu_initialization=use_cpu_initialization)
    extra = {}
    if "optimizer_config_override_provider" in inspect.signature(setup_optimizer).parameters:
        extra["optimizer_config_override_provider"] = getattr(cfg, "optimizer_config_override_provider", None)
    optimizer, _scheduler = setup_optimizer(optimizer_config=cfg.optimizer, scheduler_config=cfg.scheduler,
                                            model=model, use_gloo_process_groups=False, **extra)
    return model, optimizer
