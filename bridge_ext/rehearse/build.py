"""A recipe's config for a rehearsal, and one rank's model and optimizer built from it by Megatron Bridge.

The config is the recipe's own (``bridge_ext.build.build_config``: template, layout, preset) with what cannot
run on a CPU process changed, as CPU mode does (``bridge_ext.cpu.config``): megatron-core's local layer spec
(no Transformer Engine; MLA's down-projections are ``ColumnParallelLinear`` there, ``TELinear`` duplicated
with TE), fusions off, the ``allgather`` MoE dispatcher and sequential experts (TE's grouped GEMM holds the
same per-expert weights). Unlike CPU mode the precision stays: bf16 weights, fp32 gradients and main weights,
as on GPUs (MXFP8 recipes rehearse as ``bf16_mixed``: their fp8 copies need Transformer Engine). Weights are
initialized as in a training run (``perform_initialization=True``, on fake tensors: no values, no memory kept):
megatron-core's local layers set their tensor-parallel attributes only there (see ``REHEARSAL_MODEL_SETTINGS``).
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
    # Not False: megatron-core 0.16's local ColumnParallelLinear / RowParallelLinear / VocabParallelEmbedding
    # (tensor_parallel/layers.py) call set_tensor_model_parallel_attributes (tensor_model_parallel, partition_dim,
    # partition_stride) only inside _initialize_affine_weight_cpu/_gpu, i.e. under perform_initialization; skipped,
    # Megatron Bridge's provider gives every weight the defaults (not TP-parallel, partition_dim -1), the fp32
    # main weights copy those, and TensorParallelMuon.orthogonalize (megatron/core/optimizer/muon.py) passes
    # partition_dim None to emerging-optimizers' newton_schulz_tp: the presets' muon_tp_mode=duplicated then
    # orthogonalizes each TP shard alone (blockwise work) instead of all-gathering the whole matrix. (Megatron
    # Bridge's workaround for the same upstream gap also keeps initialization on: NVIDIA-NeMo/Megatron-Bridge PR
    # 992.) On fake tensors the initialization keeps nothing allocated and reads no data.
    "perform_initialization": True,
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
            from bridge_ext.without_te import TE_FREE_PATCHES, configure_without_te

            notes.append(configure_without_te(cfg))
            patches.apply("cpu", only=TE_FREE_PATCHES)  # MLA and MoE modules built without TE
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

    cfg = copy.deepcopy(cfg)
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
