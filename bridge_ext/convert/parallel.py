"""Process group, ranks and Megatron parallel state for a conversion (one process, or torchrun)."""

from __future__ import annotations

import contextlib
import math
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

from bridge_ext.errors import UserError
from bridge_ext.runtime import is_rank_zero, launcher_local_rank, launcher_world_size

if TYPE_CHECKING:
    from recipes.architecture import Architecture

__all__ = ["barrier", "check_layout", "init_model_parallel", "is_rank0", "process_group", "shared_path",
           "union_over_ranks"]


def is_rank0() -> bool:
    """Rank 0 of the process group; before it exists (or after), torchrun's ``RANK`` (0 without torchrun)."""
    try:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            return dist.get_rank() == 0
    except ImportError:
        pass
    return is_rank_zero()


def _world_size() -> int:
    try:
        import torch.distributed as dist

        return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    except ImportError:
        return 1


def barrier() -> None:
    if _world_size() > 1:
        import torch.distributed as dist

        dist.barrier()


def shared_path(make: Callable[[], str]) -> Path:
    """``make()`` on rank 0, the same path on every rank (one staging directory for a torchrun job)."""
    if _world_size() == 1:
        return Path(make())
    import torch.distributed as dist

    box = [make() if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(box, src=0)
    return Path(box[0])


def union_over_ranks(items: set[str]) -> set[str]:
    """The union of every rank's ``items`` (the set itself in one process)."""
    if _world_size() == 1:
        return items
    import torch.distributed as dist

    gathered: list[set[str] | None] = [None] * _world_size()
    dist.all_gather_object(gathered, items)
    return set().union(*gathered)


@contextlib.contextmanager
def process_group(cpu: bool) -> Iterator[None]:
    """A process group and Megatron parallel state: world size 1 unless launched by torchrun."""
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state

    owned = not dist.is_initialized()
    saved_env = {k: os.environ.get(k) for k in ("MASTER_ADDR", "MASTER_PORT", "RANK", "LOCAL_RANK", "WORLD_SIZE")}
    if owned:
        if (launcher_world_size() or 1) > 1:
            if cpu:  # torchrun's rendezvous (MASTER_ADDR/PORT, RANK, WORLD_SIZE); gloo: collectives on CPU
                dist.init_process_group("gloo")
            else:
                torch.cuda.set_device(launcher_local_rank())
                dist.init_process_group("nccl")
        elif cpu:
            from bridge_ext.process_state import init_single_process_distributed

            init_single_process_distributed()
        else:
            os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
            os.environ.setdefault("MASTER_PORT", str(_free_port()))
            dist.init_process_group("nccl", rank=0, world_size=1)
    initialized_here = not parallel_state.model_parallel_is_initialized()
    try:
        yield
    finally:
        if initialized_here:  # Megatron's globals the conversion made (parallel state, the rerun state machine
            # a model's forward creates) end with it: a training run in this process initializes its own
            from bridge_ext.process_state import reset_megatron_globals

            reset_megatron_globals()
        if owned and dist.is_initialized():
            dist.destroy_process_group()
        if owned:  # a process group we made leaves no rendezvous variables behind (e.g. for subprocesses)
            for key, value in saved_env.items():
                if value is None:
                    os.environ.pop(key, None)
                else:
                    os.environ[key] = value


def _free_port() -> int:
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def check_layout(architecture: Architecture, *, tp: int, pp: int, ep: int) -> None:
    """Refuse a ``--tp/--pp/--ep`` layout the processes or the model (its ``architecture``, as the recipes parse
    it: layers and experts whatever the family calls them) cannot take, in one line.

    Before any work, from torchrun's ``WORLD_SIZE``. Megatron's own checks (``TransformerConfig``,
    ``initialize_model_parallel``) would stop later with an assertion: the experts must divide by EP, the
    layers by PP, and the world size must be a multiple of TP x PP and of TP x EP (expert tensor parallelism
    equals TP here).
    """
    world_size = launcher_world_size() or 1
    layers = architecture.num_layers
    experts = architecture.moe.experts if architecture.moe else 0
    if ep > 1 and not experts:
        raise UserError(f"--ep {ep} needs a mixture-of-experts model; this one has no experts, drop --ep")
    if experts and experts % ep:
        raise UserError(f"--ep {ep} does not divide the model's {experts} experts; choose a divisor of {experts}")
    if layers % pp:
        raise UserError(f"--pp {pp} does not divide the model's {layers} layers; choose a divisor of {layers}")
    need = math.lcm(tp * pp, tp * ep)
    if world_size % need:
        raise UserError(f"--tp {tp} --pp {pp} --ep {ep} needs a multiple of {need} processes (TP x PP = {tp * pp}, "
                        f"TP x EP = {tp * ep}), this run has {world_size}; launch it with "
                        f"`torchrun --nproc-per-node {need} $(which nemo) llm ...` or lower the sizes")


def init_model_parallel(*, tp: int, pp: int, ep: int, cpu: bool) -> None:
    import torch
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(
            tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, expert_model_parallel_size=ep,
            expert_tensor_parallel_size=tp,
        )  # fmt: skip
    if not cpu:
        model_parallel_cuda_manual_seed(0)
    else:
        with contextlib.suppress(Exception):  # CPU mode maps the CUDA RNG tracker to the CPU generator
            model_parallel_cuda_manual_seed(0)
    torch.manual_seed(0)
