"""Module-scoped CUDA redirection: CPU mode's second way (after official settings, before targeted patches).

In each upstream module CPU mode lists (``single_process.TORCH_ON_CPU``, ``distributed.TORCH_ON_CPU``) the
global name ``torch`` is replaced by a :class:`TorchOnCPU`, whose ``torch.cuda`` answers for the CPU
(current device, streams, events, synchronize, RNG state), whose ``torch.distributed`` makes NCCL groups
gloo ones, and whose tensor factories turn ``device="cuda"`` into the CPU. The real ``torch`` module is
untouched, so code outside those modules sees the real CUDA state.

The only process-wide change is ``torch.Tensor.cuda`` (:func:`tensor_stays_on_cpu`): methods are looked up
on the class, so they cannot be scoped to one module.
"""

from __future__ import annotations

import contextlib
import types
from collections.abc import Callable
from typing import Any

__all__ = ["TorchOnCPU", "real_torch", "tensor_stays_on_cpu", "torch_proxy"]


def real_torch():
    import torch

    return torch


def _is_cuda_device(device: Any) -> bool:
    torch = real_torch()
    if isinstance(device, torch.device):
        return device.type == "cuda"
    if isinstance(device, str):
        return device.startswith("cuda")
    return isinstance(device, int) and not isinstance(device, bool)  # an int device means a CUDA ordinal


class NullStream:
    """A CUDA stream/event stand-in: work on the CPU is synchronous, so every wait is already done."""

    def __init__(self, *args: Any, **kwargs: Any):
        pass

    def __enter__(self) -> NullStream:
        return self

    def __exit__(self, *exc: Any) -> None:
        return None

    def synchronize(self) -> None:
        return None

    def wait_stream(self, *args: Any) -> None:
        return None

    def wait_event(self, *args: Any) -> None:
        return None

    def record_event(self, *args: Any) -> NullStream:
        return self

    def record(self, *args: Any) -> None:
        return None

    def wait(self, *args: Any) -> None:
        return None

    def query(self) -> bool:
        return True

    def elapsed_time(self, other: Any) -> float:
        return 0.0


class NvtxOnCPU:
    @staticmethod
    def range_push(*args: Any, **kwargs: Any) -> None:
        return None

    @staticmethod
    def range_pop(*args: Any, **kwargs: Any) -> None:
        return None

    @staticmethod
    def range(*args: Any, **kwargs: Any) -> contextlib.nullcontext:
        return contextlib.nullcontext()


class CudaOnCPU:
    """Stands in for ``torch.cuda`` inside the patched upstream modules.

    The "current CUDA device" is the CPU; streams and events are no-ops; the CUDA RNG state is the CPU
    default generator's state (dropout and init on the CPU draw from it, so forking it in Megatron's RNG
    tracker keeps the tracker's semantics). Anything not listed falls through to the real ``torch.cuda``.
    """

    Stream = NullStream
    Event = NullStream
    nvtx = NvtxOnCPU

    def __init__(self, claims_gpu: bool = False) -> None:
        self.random = self  # torch.cuda.random.get_rng_state(...)
        self._claims_gpu = claims_gpu

    def is_available(self) -> bool:
        """False (the truth), except in modules that assert a GPU before doing CPU-safe work."""
        return self._claims_gpu

    @staticmethod
    def current_device():
        return real_torch().device("cpu")

    @staticmethod
    def device_count() -> int:
        return 1

    @staticmethod
    def get_rng_state(device: Any = "cuda"):
        return real_torch().get_rng_state()

    @staticmethod
    def set_rng_state(new_state: Any, device: Any = "cuda") -> None:
        real_torch().set_rng_state(new_state)

    @staticmethod
    def manual_seed(seed: int) -> None:
        real_torch().default_generator.manual_seed(int(seed))

    manual_seed_all = manual_seed

    @staticmethod
    def current_stream(*args: Any) -> NullStream:
        return NullStream()

    default_stream = current_stream

    @staticmethod
    def stream(*args: Any) -> contextlib.nullcontext:
        return contextlib.nullcontext()

    @staticmethod
    def _noop(*args: Any, **kwargs: Any) -> None:
        return None

    set_device = set_stream = synchronize = empty_cache = reset_peak_memory_stats = _noop
    reset_max_memory_allocated = _noop

    @staticmethod
    def _zero(*args: Any, **kwargs: Any) -> int:
        return 0

    memory_allocated = max_memory_allocated = memory_reserved = max_memory_reserved = _zero

    @staticmethod
    def memory_stats(*args: Any, **kwargs: Any) -> dict:
        return {}

    @staticmethod
    def is_current_stream_capturing() -> bool:
        return False

    def __getattr__(self, name: str) -> Any:
        return getattr(real_torch().cuda, name)


class DistributedOnCPU:
    """Stands in for ``torch.distributed``: NCCL process groups become gloo ones."""

    def __getattr__(self, name: str) -> Any:
        return getattr(real_torch().distributed, name)

    @staticmethod
    def init_process_group(backend: str | None = None, *args: Any, **kwargs: Any) -> None:
        if backend in (None, "nccl"):
            backend = "gloo"
        real_torch().distributed.init_process_group(backend, *args, **kwargs)

    @staticmethod
    def new_group(*args: Any, backend: Any = None, **kwargs: Any) -> Any:
        if backend == "nccl":
            backend = "gloo"
        return real_torch().distributed.new_group(*args, backend=backend, **kwargs)

    @staticmethod
    def scatter(tensor: Any, scatter_list: Any = None, *args: Any, **kwargs: Any) -> Any:
        """gloo's scatter reads each input as if it were contiguous: a strided view arrives scrambled (torch
        2.10 and 2.14.1, ``ProcessGroupGloo::scatter``; NCCL is not affected). Contiguous copies are sent."""
        if scatter_list is not None:
            scatter_list = [t.contiguous() for t in scatter_list]
        return real_torch().distributed.scatter(tensor, scatter_list, *args, **kwargs)

    @staticmethod
    def all_gather(tensor_list: list, tensor: Any, group: Any = None, async_op: bool = False) -> Any:
        """gloo's all_gather needs one size on every rank (RuntimeError); NCCL takes uneven ones, which
        megatron-core's layer-wise optimizer (``dist_muon``) relies on. Uneven ones are padded to the largest and
        trimmed; even ones go to torch as they are."""
        torch = real_torch()
        sizes = {t.numel() for t in tensor_list}
        if len(sizes) <= 1:
            return torch.distributed.all_gather(tensor_list, tensor, group=group, async_op=async_op)
        if async_op:
            raise NotImplementedError("CPU mode: an asynchronous all_gather of uneven sizes")
        size = max(sizes)
        padded = [torch.empty(size, dtype=tensor.dtype, device=tensor.device) for _ in tensor_list]
        source = torch.zeros(size, dtype=tensor.dtype, device=tensor.device)
        source[: tensor.numel()] = tensor.reshape(-1)
        torch.distributed.all_gather(padded, source, group=group)
        for out, got in zip(tensor_list, padded):
            out.copy_(got[: out.numel()].view_as(out))
        return None


_FACTORIES = frozenset(
    {
        "arange", "as_tensor", "empty", "empty_like", "empty_strided", "eye", "full", "full_like", "linspace",
        "ones", "ones_like", "rand", "randint", "randn", "randperm", "tensor", "zeros", "zeros_like",
    }
)


class TorchOnCPU(types.ModuleType):
    """Stands in for the ``torch`` module inside one patched upstream module (the ``TORCH_ON_CPU`` tables)."""

    def __init__(self, claims_gpu: bool = False) -> None:
        super().__init__("torch")
        self.cuda = CudaOnCPU(claims_gpu)
        self.distributed = DistributedOnCPU()
        self._wrapped: dict[str, Callable] = {}

    def __getattr__(self, name: str) -> Any:
        value = getattr(real_torch(), name)
        if name not in _FACTORIES:
            return value
        if name not in self._wrapped:

            def factory(*args: Any, _real=value, **kwargs: Any) -> Any:
                if _is_cuda_device(kwargs.get("device")):
                    kwargs["device"] = "cpu"
                return _real(*args, **kwargs)

            self._wrapped[name] = factory
        return self._wrapped[name]


_PROXIES: dict[bool, TorchOnCPU] = {}


def torch_proxy(claims_gpu: bool) -> TorchOnCPU:
    """The shared stand-in for ``torch`` (one per answer of ``torch.cuda.is_available()``)."""
    return _PROXIES.setdefault(claims_gpu, TorchOnCPU(claims_gpu))


def tensor_stays_on_cpu(self, device: Any = None, non_blocking: bool = False, memory_format: Any = None):
    """``Tensor.cuda()`` in CPU mode: the tensor itself (process-wide; ``Module.cuda()`` goes through it).

    Works around the callers in ``single_process.TENSOR_CUDA_CALLERS``: ``gpt_step.py:131``
    (``batch[k].cuda(non_blocking=True)``, every step) and ``model_provider.py:583`` (``model_module.cuda(...)``,
    for a model built without ``use_cpu_initialization``). A method is looked up on the class,
    so this cannot be scoped to those modules. Only installed in CPU mode, where no tensor may go to a GPU.
    """
    return self
