"""megatron-core's tensor-parallel layers (``megatron/core/tensor_parallel/layers.py``). Area ``tensor_parallel``.

Patch (scope ``stack``, every run, GPUs too; tests/test_tp_weight_attributes.py):

* ``tp-weight-attributes-without-init (VocabParallelEmbedding | ColumnParallelLinear | RowParallelLinear)``:
  megatron-core 0.16 and 0.17 give a layer's weight its tensor-parallel attributes (``tensor_model_parallel``,
  ``partition_dim``, ``partition_stride``: ``set_tensor_model_parallel_attributes``) only inside
  ``_initialize_affine_weight_cpu`` / ``_gpu``, which ``__init__`` calls under ``if
  config.perform_initialization:``. With ``perform_initialization=False`` (a run that loads its weights from a
  checkpoint; AutoBridge's ``to_megatron_provider(load_weights=True)``) every such weight keeps the defaults
  (``tensor_model_parallel=False``, ``partition_dim=-1``). At TP > 1 megatron-core's Muon
  (``TensorParallelMuon.orthogonalize``) then passes no partition dim: ``muon_tp_mode=duplicated`` silently
  orthogonalizes each TP shard alone (blockwise) and scales by the shard's shape; and the gradient norm
  (``param_is_not_tensor_parallel_duplicate``) counts the TP-sharded weights of TP rank 0 only. megatron-core 0.18
  added an ``else: set_tensor_model_parallel_attributes(tensor=self.weight, is_parallel=True, dim=..., stride=...)``
  to each of those ``if`` statements; the patch recompiles each ``__init__`` with that same ``else`` branch, its
  ``dim`` and ``stride`` the very expressions the guarded init call passes as ``partition_dim`` and ``stride``
  (every other line upstream's). The biases are not concerned (ColumnParallelLinear's gets its attributes
  unconditionally; RowParallelLinear's is not partitioned). Decided per class by reading its ``__init__`` (AST):
  applies where a ``if config.perform_initialization:`` that initializes ``self.weight`` has no ``else`` setting
  the weight's attributes (megatron-core 0.16.0, 0.17.1 read: applies; 0.18.2, 0.19.0, 0.19.2: the ``else`` is
  upstream's).

  Not patched: megatron-core 0.16's legacy ``GroupedMLP`` (``transformer/moe/experts.py``, removed in 0.17) has the
  same guard around ``weight1`` / ``weight2``; Transformer Engine's layers set their own attributes.
"""

from __future__ import annotations

import __future__
import ast
import copy
import importlib
import inspect
import sys
import textwrap
from collections.abc import Callable, Iterator
from typing import Any

from bridge_ext.patching import Area, Patch
from bridge_ext.stack import UpstreamDrift, package_of

__all__ = ["AREA", "PATCHES", "weight_attributes_only_with_initialization", "with_weight_attributes_always"]

AREA: Area = "tensor_parallel"

_LAYERS = "megatron.core.tensor_parallel.layers"
_CLASSES = ("VocabParallelEmbedding", "ColumnParallelLinear", "RowParallelLinear")
_GUARD = "config.perform_initialization"
_INITS = ("_initialize_affine_weight_cpu", "_initialize_affine_weight_gpu")
_SET = "set_tensor_model_parallel_attributes"
_SET_SIGNATURE = "def set_tensor_model_parallel_attributes(tensor, is_parallel, dim, stride):"
_MARK = "_bridge_ext_tp_weight_attributes"


def _upstream_init(cls_name: str) -> Any:
    """The class's own ``__init__`` as upstream wrote it (ours keeps upstream's as ``__wrapped__``)."""
    function = vars(getattr(importlib.import_module(_LAYERS), cls_name))["__init__"]
    return inspect.unwrap(function)


def _function_tree(function: Any) -> ast.FunctionDef:
    tree = ast.parse(textwrap.dedent(inspect.getsource(function)))
    node = tree.body[0]
    if not isinstance(node, ast.FunctionDef):
        raise UpstreamDrift(f"{package_of(_LAYERS)}: {function.__qualname__} is not a plain function definition")
    return node


def _weight_init_call(statement: ast.If) -> ast.Call | None:
    """The ``_initialize_affine_weight_cpu/_gpu(self.weight, ...)`` call in the body of an ``if``, if any."""
    for node in (n for stmt in statement.body for n in ast.walk(stmt)):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in _INITS \
                and node.args and ast.unparse(node.args[0]) == "self.weight":
            return node
    return None


def _guarded_weight_inits(function_node: ast.FunctionDef) -> Iterator[tuple[ast.If, ast.Call]]:
    """Each ``if config.perform_initialization:`` of ``__init__`` that initializes ``self.weight``, with its call."""
    for node in ast.walk(function_node):
        if isinstance(node, ast.If) and ast.unparse(node.test) == _GUARD:
            call = _weight_init_call(node)
            if call is not None:
                yield node, call


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
    function = _upstream_init(cls_name)
    guarded = list(_guarded_weight_inits(_function_tree(function)))
    if not guarded:
        raise UpstreamDrift(f"{package_of(_LAYERS)}: {cls_name}.__init__ no longer initializes self.weight under "
                            f"'if {_GUARD}:'; bridge_ext.patches.tensor_parallel needs updating")
    if any(node.orelse and not _sets_weight_attributes(node.orelse) for node, _ in guarded):
        raise UpstreamDrift(f"{package_of(_LAYERS)}: {cls_name}.__init__ has an 'else' after 'if {_GUARD}:' that "
                            "does not set the weight's tensor-parallel attributes; bridge_ext.patches.tensor_parallel "
                            "needs updating")
    return any(not node.orelse for node, _ in guarded)


def _argument(call: ast.Call, init: Callable, name: str) -> ast.expr:
    """The expression ``call`` passes for ``init``'s parameter ``name`` (its default when it passes none)."""
    parameter = inspect.signature(init).parameters[name]
    for keyword in call.keywords:
        if keyword.arg == name:
            return copy.deepcopy(keyword.value)
    index = list(inspect.signature(init).parameters).index(name)
    if parameter.kind is parameter.POSITIONAL_OR_KEYWORD and index < len(call.args):
        return copy.deepcopy(call.args[index])
    if parameter.default is parameter.empty:
        raise UpstreamDrift(f"{package_of(_LAYERS)}: a call of {init.__name__} passes no {name}; "
                            "bridge_ext.patches.tensor_parallel needs updating")
    return ast.Constant(parameter.default)


def _else_branch(call: ast.Call, module: Any) -> ast.stmt:
    """``set_tensor_model_parallel_attributes(tensor=self.weight, is_parallel=True, dim=D, stride=S)``: D and S
    what ``call`` passes as ``partition_dim`` and ``stride`` (megatron-core 0.18's ``else`` branch)."""
    init = getattr(module, call.func.id)
    if any(k.arg == "skip_set_tensor_parallel_attributes" for k in call.keywords):
        raise UpstreamDrift(f"{package_of(_LAYERS)}: {call.func.id}(self.weight, ...) skips the attributes; "
                            "bridge_ext.patches.tensor_parallel needs updating")
    statement = ast.parse(f"{_SET}(tensor=self.weight, is_parallel=True, dim=_D, stride=_S)").body[0]
    keywords = statement.value.keywords
    keywords[2].value = _argument(call, init, "partition_dim")
    keywords[3].value = _argument(call, init, "stride")
    return statement


def with_weight_attributes_always(old: Any) -> Any:
    """``make``: ``old`` (a layer's ``__init__``) recompiled with an ``else`` after each ``if
    config.perform_initialization:`` that initializes ``self.weight``, setting its tensor-parallel attributes as
    the init call would (megatron-core 0.18's code); every other line upstream's, in upstream's module globals."""
    function = inspect.unwrap(getattr(old, "__func__", old))
    module = sys.modules[function.__module__]
    node = _function_tree(function)
    for statement, call in _guarded_weight_inits(node):
        if not statement.orelse:
            statement.orelse = [ast.copy_location(_else_branch(call, module), statement)]
    tree = ast.fix_missing_locations(ast.Module(body=[node], type_ignores=[]))
    flags = __future__.annotations.compiler_flag if getattr(module, "annotations", None) is __future__.annotations \
        else 0  # annotations evaluated as upstream's module evaluates them
    code = compile(tree, f"<bridge_ext.patches: {function.__module__}.{function.__qualname__}>", "exec",
                   flags=flags, dont_inherit=True)
    namespace: dict[str, Any] = {}
    exec(code, module.__dict__, namespace)
    new = namespace[function.__name__]
    new.__qualname__ = function.__qualname__
    new.__wrapped__ = function  # inspect.getsource() of it reads upstream's: needed() decides the same later
    setattr(new, _MARK, True)
    return new


def _patch(cls_name: str) -> Patch:
    return Patch(
        name=f"tp-weight-attributes-without-init ({cls_name})", area=AREA, scope="stack", module=_LAYERS,
        attr=f"{cls_name}.__init__",
        upstream=f"megatron/core/tensor_parallel/layers.py {cls_name}.__init__ (set_tensor_model_parallel_attributes "
                 "only inside _initialize_affine_weight_cpu/_gpu; megatron-core 0.18 added the else branch)",
        why="with model.perform_initialization=false (weights loaded from a checkpoint) the weight keeps "
            "partition_dim=-1, tensor_model_parallel=False: at TP > 1 Muon's duplicated tp mode orthogonalizes each "
            "shard alone (no partition dim) and the grad norm counts TP rank 0's shards only; set as the init path "
            "sets them",
        when=f"{cls_name}.__init__ initializes self.weight under 'if {_GUARD}:' with no else setting its "
             "tensor-parallel attributes",
        needed=lambda: weight_attributes_only_with_initialization(cls_name),
        snippets=(f"if {_GUARD}:", _SET_SIGNATURE),
        accepts=lambda function: callable(function) and not getattr(function, _MARK, False),
        make=with_weight_attributes_always,
    )


PATCHES: tuple[Patch, ...] = tuple(_patch(cls_name) for cls_name in _CLASSES)
