"""A process's distributed and Megatron state on any device: the one-process gloo group (a conversion that builds its
Megatron side on the CPU runs in it, on a GPU machine too; CPU mode starts from it), and Megatron's globals
cleared between two runs or conversions in one process.
"""

from __future__ import annotations

__all__ = ["init_single_process_distributed", "reset_megatron_globals"]


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
    ``moe_utils.py:897`` for a deeper one); and ``checkpoint_utils.read_train_state``'s cache, whose
    ``TrainState`` the last run advanced (a second load of that checkpoint would start at the wrong
    iteration). The process groups megatron-core made for the run are destroyed (its ``destroy_model_parallel``
    only forgets them: each gloo group keeps its sockets and threads, ~75 descriptors and ~50 threads per TP2
    run, and runs in one process slowed down run by run); the default process group is left alone.
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
