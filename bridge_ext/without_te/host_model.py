"""A Megatron model built in host memory with megatron-core's local modules (no TE, no CUDA kernels), in fp32.

What CPU mode trains (``bridge_ext.cpu.config.configure_for_cpu`` adds the run's settings: gloo, no bf16 optimizer,
...) and what a streamed conversion builds on any machine, GPU machines included: its meta-device skeleton, whose
parameter names and shapes the checkpoint's tensors follow (``bridge_ext.convert.stream.skeleton``).
"""

from __future__ import annotations

import math
from typing import Any

from bridge_ext.errors import UserError
from bridge_ext.without_te import TE_KERNEL_SETTINGS, local_layer_spec

__all__ = ["configure_host_model", "processes_needed"]

# Model settings that cannot run on CPU processes, and the value that can. Everything else is kept.
_HOST_MODEL_SETTINGS: dict[str, Any] = {
    **TE_KERNEL_SETTINGS,  # TE and apex kernels are CUDA-only (bridge_ext.without_te)
    "use_cpu_initialization": True,
    "init_model_with_meta_device": False,
    "cuda_graph_impl": "none",
    "fp8": None,
    "fp16": False,
    "bf16": False,  # fp32 params and compute: bf16 optimizers reject CPU tensors on megatron-core 0.16
    "fp16_lm_cross_entropy": False,
    # torch.jit / triton fusions, compiled for CUDA tensors
    "bias_activation_fusion": False,
    "bias_dropout_fusion": False,
    # nothing to overlap with on a CPU
    "moe_shared_expert_overlap": False,  # needs a CUDA side stream
    "overlap_moe_expert_parallel_comm": False,
}

# Model parallelism a launch that cannot hold it falls back to (one process: every size 1).
_SINGLE_PROCESS_SIZES: dict[str, Any] = {
    "tensor_model_parallel_size": 1,
    "pipeline_model_parallel_size": 1,
    "virtual_pipeline_model_parallel_size": None,
    "pipeline_model_parallel_layout": None,
    "context_parallel_size": 1,
    "expert_model_parallel_size": 1,
    "expert_tensor_parallel_size": 1,
    "sequence_parallel": False,
}


def _parallel_shape(model: Any) -> str:
    sizes = {"TP": model.tensor_model_parallel_size, "PP": model.pipeline_model_parallel_size,
             "CP": model.context_parallel_size, "EP": model.expert_model_parallel_size}
    return " ".join(f"{k}{v or 1}" for k, v in sizes.items())


def processes_needed(model: Any) -> int:
    """The fewest processes that hold the model's parallel sizes (Megatron's decomposition:
    ``tp*pp*cp`` and ``etp*ep*pp`` both divide the world size)."""
    tp, pp, cp = (model.tensor_model_parallel_size or 1, model.pipeline_model_parallel_size or 1,
                  model.context_parallel_size or 1)
    ep, etp = model.expert_model_parallel_size or 1, model.expert_tensor_parallel_size or tp
    return math.lcm(tp * pp * cp, etp * ep * pp)


def _fit_parallelism(model: Any, world_size: int) -> str | None:
    """Keep the model's parallel sizes when ``world_size`` processes hold them; one process falls back to
    every size 1 (returns a note saying so); any other misfit is a ``UserError``."""
    needed = processes_needed(model)
    if world_size % needed == 0:
        if model.pipeline_model_parallel_size > 1:
            import torch

            model.pipeline_dtype = torch.float32  # what travels between stages: CPU mode is fp32
        return None
    shape = _parallel_shape(model)
    if world_size == 1:
        for name, value in _SINGLE_PROCESS_SIZES.items():
            if hasattr(model, name):
                setattr(model, name, value)
        return (f"CPU mode: {shape} needs {needed} processes and this is one: training with every parallel "
                f"size 1 (launch with `torchrun --nproc-per-node {needed}` to keep them)")
    raise UserError(f"{shape} needs a multiple of {needed} processes, launched with {world_size}; "
                    f"use `torchrun --nproc-per-node {needed}` or a layout for {world_size} processes")


# MoE-only settings (set only when the model has experts).
_HOST_MOE_SETTINGS: dict[str, Any] = {
    "moe_token_dispatcher_type": "allgather",  # alltoall/flex create CUDA streams or need DeepEP/HybridEP
    "moe_grouped_gemm": False,  # GroupedMLP needs the CUDA grouped_gemm package, TEGroupedMLP needs TE
    "moe_enable_deepep": False,
}


def configure_host_model(model: Any, *, world_size: int) -> str | None:
    """Set a model provider to build in host memory with megatron-core's local modules, in fp32, for
    ``world_size`` processes (:func:`_fit_parallelism`); a console note, or None."""
    import torch

    for name, value in _HOST_MODEL_SETTINGS.items():
        if hasattr(model, name):
            setattr(model, name, value)
    if getattr(model, "num_moe_experts", None):
        for name, value in _HOST_MOE_SETTINGS.items():
            if hasattr(model, name):
                setattr(model, name, value)
    model.params_dtype = torch.float32
    if hasattr(model, "pipeline_dtype"):
        model.pipeline_dtype = None
    if hasattr(model, "autocast_dtype"):
        model.autocast_dtype = torch.float32
    model.transformer_layer_spec = local_layer_spec
    return _fit_parallelism(model, world_size)
