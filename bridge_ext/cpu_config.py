"""Official settings that run a Megatron Bridge config on one CPU process, process setup, and validating a
GPU recipe on a machine without a GPU (``--dryrun``). No patches here: those are in ``bridge_ext.cpu_mode``.
"""

from __future__ import annotations

import contextlib
from typing import Any

from bridge_ext.stack import expect_snippets, have_transformer_engine

__all__ = ["configure_for_cpu", "cpu_layer_spec", "init_single_process_distributed", "reset_megatron_globals",
           "validation_without_gpu"]



def init_single_process_distributed() -> None:
    """A gloo process group of world size 1 on an in-memory store (no-op when a group exists).

    No TCP port and no environment variables: concurrent CPU runs on one machine (and their child
    processes) cannot collide. Call it before ``pretrain()`` on CPU, which then uses this group instead of
    a TCP rendezvous on MASTER_PORT (default 29500, ``megatron/bridge/utils/common_utils.py:149``), and
    leaves it to the caller to destroy (``torch.distributed.destroy_process_group()``). Also what
    ``provide_distributed_model`` needs outside ``pretrain()``, e.g. for conversion.
    """
    import torch.distributed as dist

    if not dist.is_initialized():
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)


def reset_megatron_globals() -> None:
    """Clear the Megatron process globals that outlive one ``pretrain()`` or model, for the next one.

    Several runs in one process (tests, in-process comparisons) otherwise collide on: the microbatch
    calculator, rerun state machine and parallel state when a run ended in ``sys.exit`` (``exit_interval``);
    ``MoEAuxLossAutoScaler.main_loss_backward_scale`` left 0-d by a backward outside ``pretrain()``
    (``initialize.py:209`` then fails to ``copy_`` a [1] tensor into it); and moe_utils'
    ``_MOE_LAYER_WISE_LOGGING_TRACKER``, sized for the first MoE model's layer count (IndexError at
    ``moe_utils.py:897`` for a deeper one). Leaves the process group alone. Not CPU-specific.
    """
    from megatron.bridge.training.initialize import destroy_global_state
    from megatron.core.transformer.moe import moe_utils

    destroy_global_state()
    moe_utils.MoEAuxLossAutoScaler.main_loss_backward_scale = None
    moe_utils._MOE_LAYER_WISE_LOGGING_TRACKER.clear()


# Model settings that cannot run on one CPU process, and the value that can. Everything else is kept.
_CPU_MODEL_SETTINGS: dict[str, Any] = {
    "transformer_impl": "local",  # TE kernels are CUDA-only
    "use_transformer_engine_full_layer_spec": False,
    "use_cpu_initialization": True,
    "init_model_with_meta_device": False,
    "cuda_graph_impl": "none",
    "fp8": None,
    "fp16": False,
    "bf16": False,  # fp32 params and compute: bf16 optimizers reject CPU tensors on megatron-core 0.16
    "fp16_lm_cross_entropy": False,
    # fused kernels (apex / TE / triton / CUDA JIT)
    "gradient_accumulation_fusion": False,
    "masked_softmax_fusion": False,
    "bias_activation_fusion": False,
    "bias_dropout_fusion": False,
    "persist_layer_norm": False,
    "apply_rope_fusion": False,
    "cross_entropy_loss_fusion": False,
    "moe_permute_fusion": False,
    "moe_router_fusion": False,
    # one process: no model parallelism and nothing to overlap with
    "tensor_model_parallel_size": 1,
    "pipeline_model_parallel_size": 1,
    "virtual_pipeline_model_parallel_size": None,
    "pipeline_model_parallel_layout": None,
    "context_parallel_size": 1,
    "expert_model_parallel_size": 1,
    "expert_tensor_parallel_size": 1,
    "sequence_parallel": False,
    "tp_comm_overlap": False,
    "moe_shared_expert_overlap": False,  # needs a CUDA side stream
    "overlap_moe_expert_parallel_comm": False,
}

# MoE-only settings (set only when the model has experts).
_CPU_MOE_SETTINGS: dict[str, Any] = {
    "moe_token_dispatcher_type": "allgather",  # alltoall/flex create CUDA streams or need DeepEP/HybridEP
    "moe_grouped_gemm": False,  # GroupedMLP needs the CUDA grouped_gemm package, TEGroupedMLP needs TE
    "moe_enable_deepep": False,
}


def cpu_layer_spec(config: Any, vp_stage: int | None = None) -> Any:
    """Megatron's own decoder block spec without Transformer Engine (dense, GQA, QK-norm, MLA, MoE)."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

    return get_gpt_decoder_block_spec(config, use_transformer_engine=False, vp_stage=vp_stage)


def _configure_model(model: Any) -> None:
    import torch

    for name, value in _CPU_MODEL_SETTINGS.items():
        if hasattr(model, name):
            setattr(model, name, value)
    if getattr(model, "num_moe_experts", None):
        for name, value in _CPU_MOE_SETTINGS.items():
            if hasattr(model, name):
                setattr(model, name, value)
    model.params_dtype = torch.float32
    if hasattr(model, "pipeline_dtype"):
        model.pipeline_dtype = None
    if hasattr(model, "autocast_dtype"):
        model.autocast_dtype = torch.float32
    model.transformer_layer_spec = cpu_layer_spec


def configure_for_cpu(cfg: Any) -> None:
    """Rewrite a Megatron Bridge ``ConfigContainer`` to the official settings that run on one CPU process.

    Only what cannot run on one CPU process changes (layer spec, fusions, precision, parallelism,
    distributed optimizer, overlap, backend); data, tokenizer, optimizer hyper-parameters, schedule,
    recompute and checkpoint settings stay. A bare model provider (e.g. from
    ``AutoBridge.to_megatron_provider``) is accepted too; then only the model settings change.
    """
    import torch

    if not hasattr(cfg, "model"):  # a GPTModelProvider
        _configure_model(cfg)
        return
    _configure_model(cfg.model)
    cfg.mixed_precision = None  # fp32: the bf16 optimizer wrapper rejects CPU tensors on megatron-core 0.16
    cfg.comm_overlap = None
    cfg.dist.distributed_backend = "gloo"
    cfg.dist.use_gloo_process_groups = True
    cfg.dist.use_megatron_fsdp = False
    cfg.dist.use_torch_fsdp2 = False
    cfg.dist.external_gpu_device_mapping = False
    cfg.rng.te_rng_tracker = False
    for name in ("use_distributed_optimizer", "overlap_grad_reduce", "overlap_param_gather", "use_megatron_fsdp"):
        if hasattr(cfg.ddp, name):
            setattr(cfg.ddp, name, False)
    opt = cfg.optimizer
    if opt.optimizer == "dist_muon":
        # Layer-wise distributed Muon in fp32 trains but cannot save on megatron-core 0.16: torch_dist save
        # raises KeyError 'optimizer' at optimizer/layer_wise_optimizer.py:289 (its fp32 state dict has no
        # such key), and CPU must be fp32 (bf16 optimizers reject CPU tensors). With one data-parallel
        # rank every layer lives on that rank anyway, so plain Muon computes the same update.
        opt.optimizer = "muon"
    opt.use_distributed_optimizer = False
    opt.overlap_param_gather_with_optimizer_step = False
    opt.bf16 = False
    opt.fp16 = False
    opt.params_dtype = torch.float32
    opt.main_params_dtype = torch.float32
    opt.use_precision_aware_optimizer = False
    opt.optimizer_cpu_offload = False
    cfg.checkpoint.async_save = False  # the async writer process pins CUDA memory
    # GPU-only monitoring: nsys, CUDA memory history, GPU straggler/throughput detectors
    if cfg.profiling is not None:
        cfg.profiling.use_nsys_profiler = False
        cfg.profiling.record_memory_history = False
    cfg.straggler = None
    cfg.nvrx_straggler = None
    cfg.checkpoint.fully_parallel_load = False  # exchange_utils.py:98 allocates shards with init_data("cuda")


# ---------------------------------------------------------------------------------------------------------
# Validating a GPU recipe on a machine without a GPU or without Transformer Engine (``--dryrun``)
# ---------------------------------------------------------------------------------------------------------

# Provider flags whose validation only checks that Transformer Engine kernels import on *this* machine:
# megatron/core/transformer/transformer_config.py:1834 (megatron-core 0.16.1) for moe_permute_fusion.
_TE_KERNEL_FLAGS = ("moe_permute_fusion",)


@contextlib.contextmanager
def validation_without_gpu(cfg: Any):
    """Run ``ConfigContainer.validate()`` for a GPU target on a machine that lacks the GPU or TE.

    - ``megatron/bridge/training/config.py``: ``ConfigContainer.validate()`` ends with
      ``validate_flex_dispatcher_backend`` (``training/flex_dispatcher_backend.py``), which reads
      ``torch.cuda.get_device_properties(0)``: skipped when no GPU is visible.
    - TE-kernel flags (``_TE_KERNEL_FLAGS``) are turned off on ``cfg`` (a copy being validated) when TE is
      absent: their check says whether TE is installed here, nothing about the target.
    Everything else ``validate()`` checks still runs.
    """
    import torch
    from megatron.bridge.training import config as mb_config

    expect_snippets("megatron.bridge.training.config", ("validate_flex_dispatcher_backend(",),
                    fix="validation_without_gpu")
    if not have_transformer_engine():
        for flag in _TE_KERNEL_FLAGS:
            setattr(cfg.model, flag, False)
    if torch.cuda.is_available():
        yield
        return
    original = mb_config.validate_flex_dispatcher_backend
    mb_config.validate_flex_dispatcher_backend = lambda model_config: None
    try:
        yield
    finally:
        mb_config.validate_flex_dispatcher_backend = original
