"""The fake world one rehearsal runs in: rank R of a world of N in one process, tensors without memory.

- Process group: torch.distributed's ``fake`` backend (``FakeProcessGroup``: every collective returns at once,
  no data moves; torch 2.10 registers it when ``torch.testing._internal.distributed.fake_pg`` is imported,
  later releases have it built in) on an in-memory store, rank R of world N; Megatron's parallel state is
  initialized on it with the layout's real TP / PP / VP / CP / EP / ETP, as Megatron Bridge does
  (``training/initialize.py``), without Gloo groups (a fake world has no Gloo peers).
- Tensors: one ``FakeTensorMode`` for the whole rehearsal (shapes, dtypes and storages, no memory; a second mode
  would convert every tensor of the first again), under :class:`FakeWorldMode`, which answers what fake tensors
  cannot: c10d collectives on fake tensors (no fake kernel exists for them: the fake group runs on empty
  placeholders and the outputs are returned unchanged) and scalar reads (``.item()``).
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Iterator
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_map

__all__ = ["FakeWorldMode", "fake_process_group", "fake_tensors", "initialize_parallel_state", "register_fake_backend"]


def register_fake_backend() -> None:
    """torch.distributed's ``fake`` backend, registered where the installed torch does not have it built in."""
    import torch.distributed as dist

    if "fake" not in dist.Backend.backend_list:
        import torch.testing._internal.distributed.fake_pg  # noqa: F401  (registers "fake": torch 2.10)


class FakeWorldMode(TorchDispatchMode):
    """Collectives on fake tensors return at once, outputs unchanged; scalar reads answer 1 (see the module)."""

    _SCALAR_READS = (torch.ops.aten._local_scalar_dense.default, torch.ops.aten.item.default)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func.namespace == "c10d":
            with torch._C._DisableTorchDispatch():  # real empty placeholders: the fake group reads nothing
                placeholders = tree_map(
                    lambda a: torch.empty(0, dtype=a.dtype) if isinstance(a, torch.Tensor) else a, (args, kwargs))
                out = func(*placeholders[0], **placeholders[1])
            # in-place collectives return (their output argument, Work): the output, as it was
            return (args[0], out[1]) if isinstance(out, tuple) else out
        if func in self._SCALAR_READS:
            # No data: 1 keeps what callers compute from it finite (Adam's bias correction 1 - beta^step, a
            # gradient norm's clip coefficient); flags (found inf, NaN) read False.
            value = args[0]
            return False if value.dtype == torch.bool else 1.0 if value.is_floating_point() else 1
        return func(*args, **kwargs)


@contextlib.contextmanager
def fake_tensors(mode: Any) -> Iterator[None]:
    """``mode`` (the rehearsal's one ``FakeTensorMode``) with :class:`FakeWorldMode` on top."""
    with mode, FakeWorldMode():
        yield


@contextlib.contextmanager
def fake_process_group(*, rank: int, world_size: int) -> Iterator[None]:
    """The default process group: rank ``rank`` of ``world_size`` on the fake backend, destroyed on exit (with
    Megatron's parallel state and process globals)."""
    import torch.distributed as dist

    from bridge_ext.process_state import reset_megatron_globals
    from bridge_ext.errors import UserError

    if dist.is_initialized():
        raise UserError("a process group exists in this process; a rehearsal makes its own (run it alone, not "
                        "under torchrun)")
    register_fake_backend()
    dist.init_process_group("fake", store=dist.HashStore(), rank=rank, world_size=world_size)
    try:
        yield
    finally:
        from megatron.core import parallel_state

        if parallel_state.model_parallel_is_initialized():
            parallel_state.destroy_model_parallel()
        reset_megatron_globals()
        dist.destroy_process_group()


def initialize_parallel_state(model: Any, dist_config: Any, *, num_distributed_optimizer_instances: int) -> None:
    """megatron-core's parallel state from a provider's sizes, with the arguments Megatron Bridge passes
    (``training/initialize.py``), less the Gloo groups; only those the installed signature takes."""
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    wanted = {
        "tensor_model_parallel_size": model.tensor_model_parallel_size,
        "pipeline_model_parallel_size": model.pipeline_model_parallel_size,
        "virtual_pipeline_model_parallel_size": model.virtual_pipeline_model_parallel_size,
        "pipeline_model_parallel_comm_backend": getattr(model, "pipeline_model_parallel_comm_backend", None),
        "context_parallel_size": model.context_parallel_size,
        "hierarchical_context_parallel_sizes": getattr(model, "hierarchical_context_parallel_sizes", None),
        "expert_model_parallel_size": model.expert_model_parallel_size,
        "num_distributed_optimizer_instances": num_distributed_optimizer_instances,
        "expert_tensor_parallel_size": model.expert_tensor_parallel_size,
        "order": "tp-cp-ep-pp-dp" if getattr(dist_config, "use_tp_pp_dp_mapping", False) else "tp-cp-ep-dp-pp",
        "create_gloo_process_groups": False,
    }
    accepted = inspect.signature(parallel_state.initialize_model_parallel).parameters
    parallel_state.initialize_model_parallel(**{k: v for k, v in wanted.items() if k in accepted})
    model_parallel_cuda_manual_seed(1234)  # the RNG trackers a forward pass forks (CPU mode: on the CPU)
