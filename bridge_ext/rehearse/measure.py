"""What one rank holds, read from Megatron's own objects (model chunks, DDP buffers, the optimizer).

- parameters: every parameter of the rank's model chunks; of them the routed experts' (every ``MoELayer``'s
  ``experts``, the shared expert not included), whatever the expert parallelism (megatron-core marks them
  ``allreduce=False`` only where they use the expert groups, EP > 1 or ETP != TP: a 1-process layout's experts
  are in the dense buffer);
- weights: the bytes the parameters occupy (with the distributed optimizer, DDP's contiguous param buffer,
  padding included);
- grad buffer: DDP's ``grad_data`` of every dense and expert-parallel buffer (``param_and_grad_buffer.py``);
- fp32 main params: the tensors the torch optimizers inside the Megatron optimizer update that are not the
  model's own storage (``Float16OptimizerWithFloat16Params``' fp32 copies, the distributed optimizer's shards);
- optimizer state: every tensor in those torch optimizers' ``state`` (after a step: Muon's momentum, Adam's
  moments and step counts).

Bytes are counted once per storage: a view of a counted storage adds nothing.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import asdict, dataclass
from typing import Any

__all__ = ["Footprint", "describe_optimizer", "footprint", "initialize_state", "optimizer_members"]


@dataclass(frozen=True)
class Footprint:
    """One rank's model state; byte counts except ``params``, ``expert_params`` and ``updated_params``."""

    params: int
    expert_params: int
    updated_params: int  # parameters this rank's optimizer updates (its share under a sharded optimizer)
    weights: int
    grads: int
    main_params: int
    optimizer_state: int

    def as_dict(self) -> dict[str, int]:
        return asdict(self)


def optimizer_members(optimizer: Any) -> Iterator[Any]:
    """The Megatron optimizers inside ``optimizer`` (a chained or layer-wise one is flattened)."""
    chained = getattr(optimizer, "chained_optimizers", None)
    if chained is None:
        yield optimizer
        return
    for member in chained:
        yield from optimizer_members(member)


def describe_optimizer(optimizer: Any) -> str:
    """``Outer[Member(torch optimizer), ...]``: what the rank built."""
    inner = ", ".join(f"{type(m).__name__}({type(getattr(m, 'optimizer', None)).__name__})"
                      for m in optimizer_members(optimizer))
    return f"{type(optimizer).__name__}[{inner}]" if hasattr(optimizer, "chained_optimizers") else inner


def initialize_state(optimizer: Any) -> int:
    """Allocate the optimizer state without a step, as megatron-core does before a checkpoint load (each member's
    ``init_state_fn(optimizer, config)``: Muon's momentum, Adam's two moments; no step counters). Returns how
    many members allocated."""
    import inspect

    count = 0
    for member in optimizer_members(optimizer):
        init = getattr(member, "init_state_fn", None)
        inner = getattr(member, "optimizer", None)
        if init is None or inner is None or len(inspect.signature(init).parameters) < 2:
            continue  # the default (lambda x: None): nothing to allocate
        init(inner, member.config)
        count += 1
    return count


def _storage(tensor: Any) -> Any:
    from torch.multiprocessing.reductions import StorageWeakRef

    return StorageWeakRef(tensor.untyped_storage())


def _bytes(tensor: Any) -> int:
    return tensor.untyped_storage().nbytes()


def footprint(model: list[Any], optimizer: Any) -> Footprint:
    """The rank's :class:`Footprint` from its DDP-wrapped model chunks and its Megatron optimizer."""
    import torch

    from megatron.core.transformer.moe.moe_layer import MoELayer

    params = [p for chunk in model for p in chunk.parameters()]
    routed = {id(p) for chunk in model for module in chunk.modules() if isinstance(module, MoELayer)
              for p in module.experts.parameters()}
    buffers = [b for chunk in model for b in (*getattr(chunk, "buffers", ()), *getattr(chunk, "expert_parallel_buffers", ()))]
    model_storages: set[Any] = set()
    weights = 0
    for buffer in buffers:
        for data in (buffer.param_data, buffer.grad_data):
            if data is not None:
                model_storages.add(_storage(data))
        if buffer.param_data is not None:  # the distributed optimizer keeps the parameters in DDP's buffer
            weights += _bytes(buffer.param_data)
    for param in params:
        key = _storage(param)
        if key not in model_storages:
            model_storages.add(key)
            weights += _bytes(param)
    grads = sum(_bytes(b.grad_data) for b in buffers)
    counted: set[Any] = set()
    main = state = updated = 0
    for member in optimizer_members(optimizer):
        inner = getattr(member, "optimizer", None)
        if inner is None:
            continue
        for group in inner.param_groups:
            for param in group["params"]:
                updated += param.numel()
                key = _storage(param)
                if key not in model_storages and key not in counted:
                    counted.add(key)
                    main += _bytes(param)
        for values in inner.state.values():
            for value in values.values():
                if isinstance(value, torch.Tensor) and _storage(value) not in counted:
                    counted.add(_storage(value))
                    state += _bytes(value)
    return Footprint(params=sum(p.numel() for p in params),
                     expert_params=sum(p.numel() for p in params if id(p) in routed),
                     updated_params=updated, weights=weights, grads=grads, main_params=main, optimizer_state=state)
