"""Initialization keyed by what a parameter is, not where it lives: the same weights at step 0 in every layout.

megatron-core draws a parameter on the rank that holds it: each pipeline stage from its own seed (``seed + 100 x
pipeline rank``, ``tensor_parallel/random.py``, ``model_parallel_cuda_manual_seed``), tensor- and expert-parallel
shards from per-rank streams (the model-parallel RNG tracker), so a run started at TP2, PP2 or EP2 starts from
other weights than the same run on one process (issue 38: the first loss already differs).

:func:`init_by_name` (a model provider pre-wrap hook, Megatron Bridge's extension point for "modify the model
before it is wrapped": ``ModelProviderMixin.register_pre_wrap_hook``) redraws every parameter from a generator
seeded by the run's seed and the parameter's *global* name -- global layer number (``TransformerLayer.layer_number``
counts the layers of earlier stages), global expert number (EP rank x local experts + local index) -- as the full
tensor of the one-process model, then keeps this rank's shard of it, the way megatron-core shards a full tensor
(``tensor_parallel/layers.py``, ``_initialize_affine_weight_cpu``: ``partition_dim``, ``partition_stride``; the
fused gate/up ``linear_fc1`` of a gated MLP has stride 2). The distribution is megatron-core's own: the same init
functions of the model config, chosen as megatron-core chooses them (``linear_proj`` and ``linear_fc2``:
``output_layer_init_method``; word embeddings: ``embedding_init_method``; every other matrix: ``init_method``).
Vectors (norm weights, biases) are constants in megatron-core's init, the same in every layout: kept.

Cost: each rank draws the full tensor of every parameter it holds a shard of (``tp`` x its own bytes for
tensor-parallel ones), on the parameter's device, once, before training; a checkpoint a run then loads replaces
it. Upstream's init: ``nemo llm pretrain --init upstream``.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Callable
from typing import Any, Literal

__all__ = ["Init", "global_name", "init_by_name", "name_seed", "shard_of"]

Init = Literal["by-name", "upstream"]
_LAYER = re.compile(r"(^|\.)(decoder\.layers\.)(\d+)(\.)")
_LOCAL_EXPERT = re.compile(r"(\.experts\.local_experts\.)(\d+)(\.)")
_GROUPED_EXPERT = re.compile(r"(\.experts\.linear_fc[12]\.weight)(\d+)$")
_OUTPUT_INIT = ("linear_proj.weight", "linear_fc2.weight")


def name_seed(seed: int, name: str) -> int:
    """A 63-bit seed from the run's seed and a parameter's global name (the same on every rank and stack)."""
    return int.from_bytes(hashlib.sha256(f"{seed}:{name}".encode()).digest()[:8], "little") >> 1


def global_name(name: str, *, layer_number: Callable[[int], int], first_expert: int) -> str:
    """``name`` (a model chunk's ``named_parameters`` name) with the local layer index replaced by the global one
    (``layer_number(local index)``, 0-based) and a local expert index by the global one (``first_expert``, this
    expert-parallel rank's first expert, plus the local index)."""
    name = _LAYER.sub(lambda m: f"{m.group(1)}{m.group(2)}{layer_number(int(m.group(3)))}{m.group(4)}", name, count=1)
    match = _LOCAL_EXPERT.search(name) or _GROUPED_EXPERT.search(name)
    if match is not None:
        name = f"{name[: match.start(2)]}{first_expert + int(match.group(2))}{name[match.end(2):]}"
    return name


def shard_of(full: Any, *, dim: int, stride: int, rank: int, size: int) -> Any:
    """This rank's shard of ``full`` as megatron-core shards it: ``full`` split along ``dim`` into ``size x stride``
    pieces, the rank keeping pieces ``rank, rank + size, ...`` (``_initialize_affine_weight_cpu``)."""
    import torch

    if size == 1:
        return full
    pieces = torch.split(full, full.shape[dim] // (size * stride), dim=dim)
    return torch.cat(pieces[rank::size], dim=dim)


def _init_function(name: str, param: Any, config: Any) -> Callable[[Any], Any]:
    if getattr(param, "shared_embedding", False) or name.endswith("word_embeddings.weight"):
        return getattr(config, "embedding_init_method", None) or config.init_method
    if name.endswith(_OUTPUT_INIT):
        return config.output_layer_init_method
    return config.init_method


def _parallel(param: Any, parallel_state: Any) -> tuple[int, int]:
    """(rank, size) of the tensor-parallel group that shards ``param``: the expert one for expert weights."""
    if not getattr(param, "tensor_model_parallel", False):
        return 0, 1
    if getattr(param, "allreduce", True) is False:  # megatron-core marks expert parameters allreduce=False
        return (parallel_state.get_expert_tensor_parallel_rank(),
                parallel_state.get_expert_tensor_parallel_world_size())
    return parallel_state.get_tensor_model_parallel_rank(), parallel_state.get_tensor_model_parallel_world_size()


def _layers_and_first_expert(chunk: Any, parallel_state: Any) -> tuple[dict[int, int], int]:
    """Local layer index -> global (0-based); this expert-parallel rank's first global expert (every MoE layer
    holds the same number of local experts)."""
    layers, first_expert = {}, 0
    for module_name, module in chunk.named_modules():
        match = re.search(r"(^|\.)decoder\.layers\.(\d+)$", module_name)
        if match and hasattr(module, "layer_number"):
            layers[int(match.group(2))] = int(module.layer_number) - 1
        if module_name.endswith(".experts") and hasattr(module, "num_local_experts"):
            first_expert = parallel_state.get_expert_model_parallel_rank() * int(module.num_local_experts)
    return layers, first_expert


def init_by_name(model: list[Any], *, seed: int) -> list[Any]:
    """Redraw every matrix of ``model`` (the model chunks of this rank) from ``seed`` and its global name; vectors
    are kept. Returns ``model`` (a pre-wrap hook's contract)."""
    import torch
    from megatron.core import parallel_state
    from megatron.core.utils import get_model_config

    config = get_model_config(model[0])
    for chunk in model:
        layers, first_expert = _layers_and_first_expert(chunk, parallel_state)
        for name, param in chunk.named_parameters():
            if param.dim() < 2:
                continue
            key = global_name(name, layer_number=layers.__getitem__, first_expert=first_expert)
            if getattr(param, "shared_embedding", False):
                key = "embedding.word_embeddings.weight"  # the tied output weight of the last stage
            rank, size = _parallel(param, parallel_state)
            dim = int(getattr(param, "partition_dim", 0)) if size > 1 else 0
            stride = int(getattr(param, "partition_stride", 1)) if size > 1 else 1
            shape = list(param.shape)
            shape[dim] *= size
            devices = [param.device] if param.device.type == "cuda" else []
            with torch.no_grad(), torch.random.fork_rng(devices=devices):
                torch.manual_seed(name_seed(seed, key))
                if size == 1:  # the whole tensor: drawn in place
                    _init_function(key, param, config)(param.data)
                    continue
                full = torch.empty(shape, dtype=param.dtype, device=param.device)
                _init_function(key, param, config)(full)
                param.data.copy_(shard_of(full, dim=dim, stride=stride, rank=rank, size=size))
    return model
