"""Official settings that run a Megatron Bridge config on CPU processes (one, or several under torchrun) and
process setup. No patches here: CPU mode's are in ``bridge_ext.cpu.patches``.
"""

from __future__ import annotations

import math
from typing import Any

from bridge_ext import runtime
from bridge_ext.errors import UserError
from bridge_ext.without_te import TE_KERNEL_SETTINGS, local_layer_spec

__all__ = ["configure_for_cpu", "init_cpu_distributed", "init_single_process_distributed",
           "processes_needed", "reset_megatron_globals"]



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


def init_cpu_distributed() -> None:
    """The CPU run's process group: one process on an in-memory store, several (torchrun) over gloo.

    Under torchrun (``WORLD_SIZE`` > 1) the group uses the launcher's rendezvous (``MASTER_ADDR``,
    ``MASTER_PORT``, ``RANK``); no-op when a group exists.
    """
    import torch.distributed as dist

    if dist.is_initialized():
        return
    if runtime.world_size() == 1:
        init_single_process_distributed()
    else:
        dist.init_process_group("gloo")


def reset_megatron_globals() -> None:
    """Clear the Megatron process globals that outlive one ``pretrain()`` or model, for the next one.

    Several runs in one process (tests, in-process comparisons) otherwise collide on: the microbatch
    calculator, rerun state machine and parallel state when a run ended in ``sys.exit`` (``exit_interval``);
    ``MoEAuxLossAutoScaler.main_loss_backward_scale`` left 0-d by a backward outside ``pretrain()``
    (``initialize.py:209`` then fails to ``copy_`` a [1] tensor into it); and moe_utils'
    ``_MOE_LAYER_WISE_LOGGING_TRACKER``, sized for the first MoE model's layer count (IndexError at
    ``moe_utils.py:897`` for a deeper one); and ``checkpoint_utils.read_train_state``'s cache, whose
    ``TrainState`` the last run advanced (a second load of that checkpoint would start at the wrong
    iteration). The process groups megatron-core made for the run are destroyed (its ``destroy_model_parallel``
    only forgets them: each gloo group keeps its sockets and threads, ~75 descriptors and ~50 threads per TP2
    run, and runs in one process slowed down run by run); the default process group is left alone. Not
    CPU-specific.
    """
    from megatron.bridge.training.initialize import destroy_global_state
    from megatron.bridge.training.utils import checkpoint_utils
    from megatron.core.transformer.moe import moe_utils

    _destroy_megatron_process_groups()
    destroy_global_state()
    for cached in ("read_train_state", "read_run_config"):  # lru_cache'd; the TrainState is mutated by training
        getattr(getattr(checkpoint_utils, cached, None), "cache_clear", lambda: None)()
    moe_utils.MoEAuxLossAutoScaler.main_loss_backward_scale = None
    tracker = getattr(moe_utils, "_MOE_LAYER_WISE_LOGGING_TRACKER", None)  # megatron-core 0.16-0.17
    if tracker is not None:
        tracker.clear()
    else:  # 0.19: moe_logging's MoEMetricsTracker (get_moe_metrics_tracker), created again on first use
        from megatron.core.transformer.moe import moe_logging

        moe_logging.destroy_moe_metrics_tracker()


def _destroy_megatron_process_groups() -> None:
    """Every process group but the default one. Megatron Bridge's ``pretrain()`` ends in megatron-core's
    ``destroy_model_parallel``, which drops its globals but not the groups, so they are found in torch's table
    of groups (``distributed_c10d._world.pg_map``), not in ``parallel_state``."""
    import torch.distributed as dist
    from torch.distributed import distributed_c10d

    if not dist.is_initialized():
        return
    for group in [g for g in distributed_c10d._world.pg_map if g is not dist.group.WORLD]:
        dist.destroy_process_group(group)


# Model settings that cannot run on CPU processes, and the value that can. Everything else is kept.
_CPU_MODEL_SETTINGS: dict[str, Any] = {
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
_CPU_MOE_SETTINGS: dict[str, Any] = {
    "moe_token_dispatcher_type": "allgather",  # alltoall/flex create CUDA streams or need DeepEP/HybridEP
    "moe_grouped_gemm": False,  # GroupedMLP needs the CUDA grouped_gemm package, TEGroupedMLP needs TE
    "moe_enable_deepep": False,
}


def _configure_model(model: Any, world_size: int) -> str | None:
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
    model.transformer_layer_spec = local_layer_spec
    return _fit_parallelism(model, world_size)


def configure_for_cpu(cfg: Any, *, world_size: int | None = None) -> str | None:
    """Rewrite a Megatron Bridge ``ConfigContainer`` to the official settings that run on CPU processes.

    Only what cannot run on a CPU changes (layer spec, fusions, precision, overlap, backend); data,
    tokenizer, optimizer (``dist_muon`` included), schedule, recompute and checkpoint settings stay. The
    parallel sizes (TP, PP, VP, CP, EP) stay when ``world_size`` processes (default: this launch's) hold
    them; one process that cannot falls back to every size 1 and the returned note says so; any other
    misfit is a ``UserError``. The distributed optimizer stays as configured with several processes (one
    has nothing to distribute: off). A bare model provider (e.g. from ``AutoBridge.to_megatron_provider``) is
    accepted too; then only the model settings change. Returns a note for the console, or None.
    """
    import torch

    world_size = world_size or runtime.world_size()
    if not hasattr(cfg, "model"):  # a GPTModelProvider
        return _configure_model(cfg, world_size)
    note = _configure_model(cfg.model, world_size)
    cfg.mixed_precision = None  # fp32: the bf16 optimizer wrapper rejects CPU tensors on megatron-core 0.16
    cfg.comm_overlap = None
    cfg.dist.distributed_backend = "gloo"
    cfg.dist.use_gloo_process_groups = True
    cfg.dist.use_megatron_fsdp = False
    cfg.dist.use_torch_fsdp2 = False
    cfg.dist.external_gpu_device_mapping = False
    cfg.rng.te_rng_tracker = False
    for name in ("overlap_grad_reduce", "overlap_param_gather", "use_megatron_fsdp"):
        if hasattr(cfg.ddp, name):
            setattr(cfg.ddp, name, False)
    opt = cfg.optimizer
    if world_size == 1:
        cfg.ddp.use_distributed_optimizer = opt.use_distributed_optimizer = False
    # dist_muon (layer-wise Muon) stays: its fp32 checkpoint save is fixed in CPU mode
    # (cpu.patches: layer-wise-fp32-save), and over one data-parallel rank it computes plain Muon's update.
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
    return note
