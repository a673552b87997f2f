"""Official settings that run a Megatron Bridge config on CPU processes (one, or several under torchrun) and
process setup. No patches here: CPU mode's are in ``bridge_ext.cpu.patches``.
"""

from __future__ import annotations

from typing import Any

from bridge_ext import runtime
from bridge_ext.process_state import init_single_process_distributed
from bridge_ext.without_te.host_model import configure_host_model

__all__ = ["configure_for_cpu", "init_cpu_distributed"]


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
        return configure_host_model(cfg, world_size=world_size)
    note = configure_host_model(cfg.model, world_size=world_size)
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
