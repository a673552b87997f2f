"""Process group, ranks and Megatron parallel state for a conversion (one process, or torchrun)."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator
from pathlib import Path

from bridge_ext.errors import UserError

__all__ = []


def _is_rank0() -> bool:
    try:
        import torch.distributed as dist

        return not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0
    except ImportError:
        return True


def _world_size() -> int:
    try:
        import torch.distributed as dist

        return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    except ImportError:
        return 1


def _barrier() -> None:
    if _world_size() > 1:
        import torch.distributed as dist

        dist.barrier()


def _shared_path(make: Callable[[], str]) -> Path:
    """``make()`` on rank 0, the same path on every rank (one staging directory for a torchrun job)."""
    if _world_size() == 1:
        return Path(make())
    import torch.distributed as dist

    box = [make() if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(box, src=0)
    return Path(box[0])


@contextlib.contextmanager
def _distributed(cpu: bool) -> Iterator[None]:
    """A process group and Megatron parallel state: world size 1 unless launched by torchrun."""
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state

    owned = not dist.is_initialized()
    saved_env = {k: os.environ.get(k) for k in ("MASTER_ADDR", "MASTER_PORT", "RANK", "LOCAL_RANK", "WORLD_SIZE")}
    if owned:
        if "WORLD_SIZE" in os.environ and int(os.environ["WORLD_SIZE"]) > 1:
            if cpu:
                raise UserError("distributed conversion (torchrun with WORLD_SIZE > 1) needs GPUs")
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
            dist.init_process_group("nccl")
        elif cpu:
            from bridge_ext.cpu_mode import init_single_process_distributed

            init_single_process_distributed()
        else:
            os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
            os.environ.setdefault("MASTER_PORT", str(_free_port()))
            dist.init_process_group("nccl", rank=0, world_size=1)
    initialized_here = not parallel_state.model_parallel_is_initialized()
    try:
        yield
    finally:
        if initialized_here and parallel_state.model_parallel_is_initialized():
            parallel_state.destroy_model_parallel()
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


def _init_parallel(*, tp: int, pp: int, ep: int, cpu: bool) -> None:
    import torch
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(
            tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, expert_model_parallel_size=ep
        )
    if not cpu:
        model_parallel_cuda_manual_seed(0)
    else:
        with contextlib.suppress(Exception):  # CPU mode maps the CUDA RNG tracker to the CPU generator
            model_parallel_cuda_manual_seed(0)
    torch.manual_seed(0)
