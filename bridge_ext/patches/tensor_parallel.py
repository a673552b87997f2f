"""megatron-core's tensor-parallel layers (``megatron/core/tensor_parallel/layers.py``). Area ``tensor_parallel``.

Hook (scope ``stack``, every run, GPUs too; tests/test_tp_weight_attributes.py):

* ``tp-weight-attributes-without-init``: megatron-core 0.16 and 0.17 give a layer's weight its tensor-parallel
  attributes (``tensor_model_parallel``, ``partition_dim``, ``partition_stride``:
  ``set_tensor_model_parallel_attributes``) only inside ``_initialize_affine_weight_cpu`` / ``_gpu``, which
  ``__init__`` calls under ``if config.perform_initialization:``. With ``perform_initialization=False`` (a run that
  loads its weights from a checkpoint; a rehearsal) every such weight keeps the defaults
  (``tensor_model_parallel=False``, ``partition_dim=-1``). At TP > 1 megatron-core's Muon
  (``TensorParallelMuon.orthogonalize``) then passes no partition dim: ``muon_tp_mode=duplicated`` silently
  orthogonalizes each TP shard alone (blockwise) and scales by the shard's shape; and the gradient norm
  (``param_is_not_tensor_parallel_duplicate``) counts the TP-sharded weights of TP rank 0 only. megatron-core 0.18
  added an ``else: set_tensor_model_parallel_attributes(...)`` to each of those ``if`` statements. Here a
  model-provider pre-wrap hook (Megatron Bridge's extension point; nothing upstream is changed) gives each such
  layer's weight that lacks them the attributes the init path gives: partition dim 0 (``VocabParallelEmbedding``,
  ``ColumnParallelLinear``) or 1 (``RowParallelLinear``), stride that of the layer's bias where it has one (set
  unconditionally with the weight's stride), else 2 for a gated MLP's ``linear_fc1`` (``transformer/mlp.py``'s
  ``fc1_stride``), else 1. Decided per class by reading its ``__init__`` (AST, read only): applies where a ``if
  config.perform_initialization:`` that initializes ``self.weight`` has no ``else`` setting the weight's
  attributes (megatron-core 0.16.0, 0.17.1 read: applies; 0.18.2, 0.19.0, 0.19.2: the ``else`` is upstream's).
  Until 2026-12-06 the row recompiled each ``__init__`` with that ``else`` (a syntax-tree edit).

  Not covered: megatron-core 0.16's legacy ``GroupedMLP`` (``transformer/moe/experts.py``, removed in 0.17) has the
  same guard around ``weight1`` / ``weight2``; Transformer Engine's layers set their own attributes.
"""

from __future__ import annotations

import ast
import importlib
import inspect
import textwrap
from collections.abc import Iterator
from typing import Any

from bridge_ext.stack import UpstreamDrift, package_of
from bridge_ext.upstream_patch import Area, Patch

__all__ = ["AREA", "PATCHES", "set_missing_tp_attributes", "weight_attributes_only_with_initialization"]

AREA: Area = "tensor_parallel"

_LAYERS = "megatron.core.tensor_parallel.layers"
# each layer's weight partition dim, as its __init__ passes it to _initialize_affine_weight_cpu/_gpu
_PARTITION_DIMS = {"VocabParallelEmbedding": 0, "ColumnParallelLinear": 0, "RowParallelLinear": 1}
_GUARD = "config.perform_initialization"
_INITS = ("_initialize_affine_weight_cpu", "_initialize_affine_weight_gpu")
_SET = "set_tensor_model_parallel_attributes"
_SET_SIGNATURE = "def set_tensor_model_parallel_attributes(tensor, is_parallel, dim, stride):"


def _function_tree(function: Any) -> ast.FunctionDef:
    tree = ast.parse(textwrap.dedent(inspect.getsource(function)))
    node = tree.body[0]
    if not isinstance(node, ast.FunctionDef):
        raise UpstreamDrift(f"{package_of(_LAYERS)}: {function.__qualname__} is not a plain function definition")
    return node


def _initializes_weight(statement: ast.If) -> bool:
    """Whether the body of an ``if`` calls ``_initialize_affine_weight_cpu/_gpu(self.weight, ...)``."""
    return any(isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in _INITS
               and node.args and ast.unparse(node.args[0]) == "self.weight"
               for stmt in statement.body for node in ast.walk(stmt))


def _guarded_weight_inits(function_node: ast.FunctionDef) -> Iterator[ast.If]:
    """Each ``if config.perform_initialization:`` of ``__init__`` that initializes ``self.weight``."""
    for node in ast.walk(function_node):
        if isinstance(node, ast.If) and ast.unparse(node.test) == _GUARD and _initializes_weight(node):
            yield node


def _sets_weight_attributes(statements: list[ast.stmt]) -> bool:
    for node in (n for stmt in statements for n in ast.walk(stmt)):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == _SET:
            tensor = node.args[0] if node.args else next(
                (k.value for k in node.keywords if k.arg == "tensor"), None)
            if tensor is not None and ast.unparse(tensor) == "self.weight":
                return True
    return False


def weight_attributes_only_with_initialization(cls_name: str) -> bool:
    """Whether the installed ``cls_name.__init__`` sets its weight's tensor-parallel attributes only by way of
    ``_initialize_affine_weight_cpu/_gpu`` under ``if config.perform_initialization:`` (no ``else`` that sets them).
    :class:`UpstreamDrift` when it initializes its weight in no such ``if`` or has an ``else`` of another kind."""
    function = inspect.unwrap(vars(getattr(importlib.import_module(_LAYERS), cls_name))["__init__"])
    guarded = list(_guarded_weight_inits(_function_tree(function)))
    if not guarded:
        raise UpstreamDrift(f"{package_of(_LAYERS)}: {cls_name}.__init__ no longer initializes self.weight under "
                            f"'if {_GUARD}:'; bridge_ext.patches.tensor_parallel needs updating")
    if any(node.orelse and not _sets_weight_attributes(node.orelse) for node in guarded):
        raise UpstreamDrift(f"{package_of(_LAYERS)}: {cls_name}.__init__ has an 'else' after 'if {_GUARD}:' that "
                            "does not set the weight's tensor-parallel attributes; bridge_ext.patches.tensor_parallel "
                            "needs updating")
    return any(not node.orelse for node in guarded)


def _any_layer_needs_it() -> bool:
    return any(weight_attributes_only_with_initialization(name) for name in _PARTITION_DIMS)


def _stride(module: Any, parent: Any) -> int:
    """The stride the layer's ``__init__`` was given: its bias's (set with it unconditionally), else a gated MLP's
    ``linear_fc1`` 2 (``transformer/mlp.py``: ``fc1_stride``, 1 with Kitchen), else 1."""
    bias = getattr(module, "bias", None)
    if bias is not None and hasattr(bias, "partition_stride"):
        return int(bias.partition_stride)
    config = getattr(parent, "config", None)
    if parent is not None and getattr(parent, "linear_fc1", None) is module and getattr(config, "gated_linear_unit",
                                                                                          False):
        return 1 if getattr(config, "use_kitchen", False) else 2
    return 1


def set_missing_tp_attributes(model: list[Any]) -> list[Any]:
    """Pre-wrap hook: each ``VocabParallelEmbedding`` / ``ColumnParallelLinear`` / ``RowParallelLinear`` weight
    without its tensor-parallel attributes gets those the init path would have set. Returns ``model``."""
    import torch
    from megatron.core.tensor_parallel import layers

    classes = tuple((getattr(layers, name), dim) for name, dim in _PARTITION_DIMS.items())
    for chunk in model:
        parents = {id(child): module for module in chunk.modules() for child in module.children()}
        for module in chunk.modules():
            dim = next((d for cls, d in classes if isinstance(module, cls)), None)
            weight = getattr(module, "weight", None)
            if dim is None or not isinstance(weight, torch.nn.Parameter) \
                    or getattr(weight, "tensor_model_parallel", False):
                continue
            # what set_tensor_model_parallel_attributes sets (it asserts none is set: some are defaults by now)
            weight.tensor_model_parallel, weight.partition_dim = True, dim
            weight.partition_stride = _stride(module, parents.get(id(module)))
    return model


PATCHES: tuple[Patch, ...] = (
    Patch(
        name="tp-weight-attributes-without-init", area=AREA, scope="stack",
        module="megatron.bridge.models.model_provider", attr="ModelProviderMixin.register_pre_wrap_hook",
        upstream="megatron/core/tensor_parallel/layers.py VocabParallelEmbedding, ColumnParallelLinear, "
                 "RowParallelLinear __init__ (set_tensor_model_parallel_attributes only inside "
                 "_initialize_affine_weight_cpu/_gpu; megatron-core 0.18 added the else branch)",
        why="with model.perform_initialization=false (weights loaded from a checkpoint) the weight keeps "
            "partition_dim=-1, tensor_model_parallel=False: at TP > 1 Muon's duplicated tp mode orthogonalizes each "
            "shard alone (no partition dim) and the grad norm counts TP rank 0's shards only; a pre-wrap hook sets "
            "them as the init path does",
        when=f"a layer's __init__ initializes self.weight under 'if {_GUARD}:' with no else setting its "
             "tensor-parallel attributes",
        needed=_any_layer_needs_it,
        elsewhere=((_LAYERS, (f"if {_GUARD}:", _SET_SIGNATURE)),),
        hook=set_missing_tp_attributes,
    ),
)
