"""The Megatron model of a conversion on the ``meta`` device: every name, shape, dtype, module type and
checkpoint key of the real model, no storage.

Megatron Bridge's mappings (``MegatronMappingRegistry`` of the model's bridge: QKV, gated MLP, MLA, experts, ...)
are keyed by Megatron parameter names and consult the module they convert for (``AutoMapping`` detects column /
row / replicated from its class, ``QKVMapping`` reads its ``config``); megatron-core's ``sharded_state_dict``
decides the torch_dist keys, global shapes and chunks (layers stacked on a leading axis where the layers are
alike, experts on an expert axis, gated ``linear_fc1`` stored as its two halves). Both come from the layer
structure the provider builds from the HF config, so the skeleton is that model, built exactly as the
model-building path builds it (:func:`bridge_ext.convert.model.build_model`, Megatron's local layer spec: the
checkpoint a CPU conversion writes) but under ``torch.device("meta")``: building it costs no memory, whatever
the model's size, and nothing is hand-written here. Tensors megatron-core creates with an explicit device
(the MoE router's ``expert_bias``, E floats per layer) are real and small.

What needs more than the skeleton raises :class:`NeedsModel` (naming the parameter and why) before anything is
written; the caller then converts through the built model.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

__all__ = ["NeedsModel", "Skeleton", "build_skeleton", "cpu_twin"]


class NeedsModel(Exception):
    """A parameter this path cannot convert without the real model (the message says which and why)."""


@dataclass
class Skeleton:
    """A meta-device Megatron model with its conversion tasks (Megatron Bridge's ``build_conversion_tasks``)."""

    bridge: Any  # AutoBridge
    model: list[Any]  # the meta model chunks (one without virtual pipelining)
    tasks: dict[tuple[int, str], Any]  # (vp stage, parameter name) -> WeightConversionTask
    params: dict[tuple[int, str], Any]  # (vp stage, parameter name) -> the meta (or small real) tensor
    owners: dict[int, tuple[int, str]] = field(default_factory=dict)  # storage id -> (vp stage, name)

    @property
    def model_bridge(self) -> Any:
        return self.bridge._model_bridge

    def owner_of(self, tensor: Any) -> tuple[int, str]:
        """The parameter (or persistent buffer) whose storage ``tensor`` views."""
        owner = self.owners.get(tensor.untyped_storage()._cdata)
        if owner is None:
            raise NeedsModel(f"a checkpoint tensor of shape {list(tensor.shape)} is not a view of a model parameter")
        return owner


def _unwrapped(name: str) -> str:
    while name.startswith("module."):  # Float16Module / DDP wrappers, as model_bridge._unwrap_name
        name = name[len("module.") :]
    return name


def build_skeleton(config: Any, *, model_type: str | None, dtype: Any, hf: Any, pretrained: Any = None) -> Skeleton:
    """The meta model for the HF ``config`` with parameters in ``dtype`` and its conversion tasks.

    ``hf``: what Megatron Bridge's ``build_conversion_tasks`` reads (``config`` and ``state.source.get_all_keys()``,
    the HF names the mappings may use): a :class:`bridge_ext.convert.model.ConfigSource` over the checkpoint's
    tensors (import) or the architecture's (export). ``pretrained``: the import source's ``PreTrainedCausalLM``
    (its generation config goes into the provider, hence ``run_config.yaml``), as the model-building import
    passes it. Needs Megatron's parallel state for one process (``bridge_ext.convert.parallel.process_group``).
    Raises :class:`NeedsModel` when a parameter has no mapping.
    """
    import torch
    from megatron.bridge.models.conversion.model_bridge import persistent_buffers

    from bridge_ext.convert.model import bridge_for, build_model

    bridge = bridge_for(config, pretrained, model_type=model_type)
    with torch.device("meta"):  # explicit-device tensors (router expert_bias) stay real; they are small
        model = build_model(bridge, cpu=True, dtype=dtype)
    params: dict[tuple[int, str], Any] = {}
    owners: dict[int, tuple[int, str]] = {}
    for vp, chunk in enumerate(model):
        for name, tensor in list(chunk.named_parameters()) + list(persistent_buffers(chunk)):
            name = _unwrapped(name)
            if "_extra_state" in name:
                continue
            params[(vp, name)] = tensor
            owners[tensor.untyped_storage()._cdata] = (vp, name)
    tasks = {}
    for task in bridge._model_bridge.build_conversion_tasks(hf, model):
        if task is not None and task.megatron_module is not None:
            tasks[(task.vp_stage or 0, task.param_name)] = task
    missing = [key for key in params if key not in tasks]
    if missing:
        raise NeedsModel(f"Megatron Bridge has no mapping for {missing[0][1]} ({len(missing)} parameters)")
    return Skeleton(bridge=bridge, model=model, tasks=tasks, params=params, owners=owners)


def cpu_twin(module: Any) -> Any:
    """A stand-in for a meta ``module`` that a mapping may read: the same class, config and submodules, its own
    parameters as zero-stride CPU tensors of the right shape and dtype (one element of storage each).

    Mappings look at the module they convert for: its class (``AutoMapping``), ``config`` (QKV, MLA), and
    ``ReplicatedMapping.hf_to_megatron`` moves the HF tensor to ``module.weight.device`` -- on the meta device
    that would drop the values. Nothing of the twin is written anywhere.
    """
    import torch

    twin = object.__new__(type(module))
    twin.__dict__.update(module.__dict__)
    twin.__dict__["_parameters"] = {
        name: None if p is None else torch.nn.Parameter(
            torch.empty((), dtype=p.dtype).expand(p.shape), requires_grad=False)
        for name, p in module._parameters.items()
    }  # fmt: skip
    return twin
