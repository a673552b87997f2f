"""Rehearsal patches (scope ``rehearse``): one CPU process acts as rank R of a real layout on fake tensors.

``nemo llm rehearse`` (``bridge_ext.rehearse``) builds a rank's model, DDP buffers and optimizer through Megatron
Bridge with every tensor a ``FakeTensor`` (shapes and dtypes, no memory) and a fake process group of the
layout's world size (``torch.distributed``'s ``fake`` backend: collectives return at once). Five upstream spots
assume real tensors or a real world; each is changed only for the duration of a rehearsal
(``patches.temporarily("rehearse")``):

* ``fake-parameter-conversion``: torch ``Module._apply`` (``module.bfloat16()``, ``.cuda()``) swaps every
  ``FakeTensor`` parameter with its converted copy through ``torch.utils.swap_tensors``; the swap refuses a
  tensor that FakeTensorMode's converter memoized under a weak reference ("Couldn't swap"), and where it
  succeeds it moves the parameter's ``__dict__`` (Megatron's ``allreduce``, ``tensor_model_parallel``, ...)
  onto the discarded copy. Megatron's ``Float16Module`` calls ``module.bfloat16()`` on every model. Between two
  fake tensors the swap becomes ``param.data = converted``, what ``Module._apply`` does for plain tensors.
* ``fake-world-gather-object``: ``torch.distributed.all_gather_object`` unpickles what the other ranks sent;
  a fake group sends nothing. megatron-core's ``_get_param_groups`` gathers every rank's param-group keys:
  on a fake group every rank answers with this rank's object.
* ``float16-optimizer-cpu-types``: ``Float16OptimizerWithFloat16Params.__init__`` accepts only
  ``torch.cuda.*Tensor`` parameters; a rehearsal's bf16 parameters are CPU fake tensors (CPU mode runs fp32,
  where megatron-core uses ``FP32Optimizer`` instead). Recompiled to accept the CPU type names too (and an explicit
  ``super(...)``, which a recompiled method needs).
* ``local-l2-norm-fake``: without Transformer Engine or apex, ``clip_grads.py`` computes the gradient norm with
  ``utils.local_multi_tensor_l2_norm``, which builds ``torch.tensor(list of tensors)`` (reads their data) and
  ``float()`` of the result; replaced by the same norm with ``torch.stack``.
* ``fake-balanced-moe-dispatch``: the micro-batch forward + backward a rehearsal measures (activations, model
  FLOPs) routes tokens to experts; the ``allgather`` dispatcher's ``dispatch_postprocess`` sizes its output by
  the routing (``masked_select``, ``tokens_per_expert.tolist()``), which fake tensors have no data for. On fake
  tensors it takes megatron-core's own drop-and-pad path of ``permute`` with a perfectly balanced load: every
  expert receives ``ceil(tokens x top-k / experts)`` of the gathered tokens (what
  ``moe_router_force_load_balancing`` aims at), ``tokens_per_expert`` a real tensor of those counts. Real
  tensors take the upstream code. ``moe_utils.permute`` returns its permuted tokens, probabilities and sorted
  indices first on every release (megatron-core 0.17+ add the pad offsets and padded counts after them, which
  the unfused, unaligned path leaves None): the patch takes those three.
"""

from __future__ import annotations

import inspect
from typing import Any

from bridge_ext.upstream_patch import Patch, rewrite

__all__ = ["PATCHES", "balanced_capacity"]

_REHEARSE: dict[str, Any] = {"area": "rehearse", "scope": "rehearse"}


# --- torch Module._apply -> torch.utils.swap_tensors ------------------------------------------------------------
def _swap_refused_for_fake_parameters() -> bool:
    """Probe: ``bfloat16()`` of a bf16 module whose parameter is a FakeTensor (what Float16Module does)."""
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        layer = torch.nn.Linear(2, 2, dtype=torch.bfloat16)
        layer.weight.rehearse_probe = True
        try:
            layer.bfloat16()
        except RuntimeError:
            return True
        return not getattr(layer.weight, "rehearse_probe", False)  # swapped, and the attributes went with it


def _set_data_for_fake(swap_tensors: Any) -> Any:
    def swap_or_set_data(t1: Any, t2: Any) -> None:
        from torch._subclasses.fake_tensor import FakeTensor

        if isinstance(t1, FakeTensor) and isinstance(t2, FakeTensor):
            # what Module._apply does for plain tensors (param.data = converted): the parameter object, and the
            # attributes Megatron set on it, stay
            if t1 is not t2:
                t1.data = t2
            return None
        return swap_tensors(t1, t2)

    swap_or_set_data.__wrapped__ = swap_tensors
    return swap_or_set_data


# --- torch.distributed.all_gather_object on the fake backend ----------------------------------------------------
def _gather_object_on_fake_groups(all_gather_object: Any) -> Any:
    def all_gather_object_faked(object_list: list[Any], obj: Any, group: Any = None) -> None:
        import torch.distributed as dist

        if dist.get_backend(group) != "fake":
            return all_gather_object(object_list, obj, group=group)
        for i in range(len(object_list)):  # nothing travels in a fake world: every rank says what this one says
            object_list[i] = obj
        return None

    all_gather_object_faked.__wrapped__ = all_gather_object
    return all_gather_object_faked


# --- megatron-core optimizer.py Float16OptimizerWithFloat16Params.__init__ --------------------------------------
_FLOAT16_OPTIMIZER = "megatron.core.optimizer.optimizer"
_FLOAT16_TYPES = (
    ("if param.type() in ['torch.cuda.HalfTensor', 'torch.cuda.BFloat16Tensor']:",
     "if param.type() in ['torch.cuda.HalfTensor', 'torch.cuda.BFloat16Tensor', 'torch.HalfTensor', "
     "'torch.BFloat16Tensor']:"),
    ("elif param.type() == 'torch.cuda.FloatTensor':", "elif param.type() in ('torch.cuda.FloatTensor', "
     "'torch.FloatTensor'):"),
    ("super().__init__(optimizer, config, grad_scaler, init_state_fn)",
     "super(Float16OptimizerWithFloat16Params, self).__init__(optimizer, config, grad_scaler, init_state_fn)"),
)


def _float16_accepts_only_cuda() -> bool:
    import importlib

    cls = importlib.import_module(_FLOAT16_OPTIMIZER).Float16OptimizerWithFloat16Params
    init = getattr(cls.__init__, "__wrapped__", cls.__init__)
    return _FLOAT16_TYPES[0][0] in inspect.getsource(init)


# --- megatron-core clip_grads.py l2_norm_impl (local fallback) --------------------------------------------------
_CLIP_GRADS = "megatron.core.optimizer.clip_grads"


def _local_l2_norm_in_use() -> bool:
    import importlib

    clip_grads = importlib.import_module(_CLIP_GRADS)
    utils = importlib.import_module("megatron.core.utils")
    return getattr(clip_grads, "l2_norm_impl", None) is getattr(utils, "local_multi_tensor_l2_norm", object())


def _l2_norm_without_data(chunk_size: int, noop_flag: Any, tensor_lists: Any, per_tensor: bool, *args: Any) -> Any:
    """``local_multi_tensor_l2_norm``'s result (a 1-element fp32 norm, None) without reading tensor data."""
    import torch

    norms = [torch.linalg.vector_norm(t.float()) for tensors in tensor_lists for t in tensors]
    total = torch.linalg.vector_norm(torch.stack(norms)) if norms else torch.zeros((), dtype=torch.float32)
    return total.reshape(1).float(), None


# --- megatron-core token_dispatcher.py MoEAllGatherTokenDispatcher.dispatch_postprocess ------------------------
_DISPATCHER = "megatron.core.transformer.moe.token_dispatcher"


def balanced_capacity(tokens: int, top_k: int, experts: int) -> int:
    """Tokens each expert receives under a perfectly balanced router: ``ceil(tokens x top_k / experts)``."""
    return -(-tokens * top_k // experts)


def _balanced_dispatch_on_fake(dispatch_postprocess: Any) -> Any:
    def dispatch_postprocess_balanced(self: Any, hidden_states: Any, probs: Any) -> Any:
        import torch
        from megatron.core.transformer.moe.moe_utils import permute
        from torch._subclasses.fake_tensor import FakeTensor

        if not isinstance(hidden_states, FakeTensor):
            return dispatch_postprocess(self, hidden_states, probs)
        self.hidden_shape_before_permute = hidden_states.shape
        first, last = self.local_expert_indices[0], self.local_expert_indices[-1] + 1
        self.local_map = self.routing_map[:, first:last].contiguous()
        local_probs = probs[:, first:last].contiguous()
        capacity = balanced_capacity(hidden_states.shape[0], self.config.moe_router_topk,
                                     self.config.num_moe_experts)
        # megatron-core's own static-shape path (argsort, the first `capacity` tokens of each expert); permute
        # returns (tokens, probs, sorted indices) and, from megatron-core 0.17, (pad offsets, padded tokens per
        # expert) after them (None, None here: unfused, no alignment): the first three on every release
        permuted, self.local_probs, self.reversed_local_input_permutation_mapping = permute(
            hidden_states, self.local_map, probs=local_probs, num_out_tokens=capacity * (last - first),
            fused=False, drop_and_pad=True)[:3]
        with torch._C._DisableTorchDispatch():  # a real tensor: SequentialMLP reads it (tolist)
            tokens_per_expert = torch.full((last - first,), capacity, dtype=torch.long)
        self.routing_map = None
        return permuted, tokens_per_expert, self.local_probs

    dispatch_postprocess_balanced.__wrapped__ = dispatch_postprocess
    return dispatch_postprocess_balanced


PATCHES: tuple[Patch, ...] = (
    Patch(
        name="fake-parameter-conversion", module="torch.utils", attr="swap_tensors", **_REHEARSE,
        upstream="torch/nn/modules/module.py Module._apply: torch.utils.swap_tensors for every FakeTensor parameter",
        when="the installed Module._apply, on a bf16 FakeTensor parameter, refuses bfloat16() or drops its attributes",
        why="Float16Module's module.bfloat16() of fake parameters fails (\"Couldn't swap\": the fake converter's "
            "weak memo) or moves Megatron's parameter attributes onto a discarded copy; fake parameters take the "
            "converted data instead (param.data = ..., as Module._apply does for plain tensors)",
        needed=_swap_refused_for_fake_parameters,
        elsewhere=(("torch.nn.modules.module", ("torch.utils.swap_tensors(param, param_applied)",
                                                "isinstance(param, FakeTensor)")),),
        make=_set_data_for_fake,
    ),
    Patch(
        name="fake-world-gather-object", module="torch.distributed", attr="all_gather_object", **_REHEARSE,
        upstream="megatron/core/optimizer/__init__.py _get_param_groups: torch.distributed.all_gather_object",
        when="during a rehearsal, on groups of the fake backend only",
        why="a fake process group carries no data: unpickling the other ranks' objects fails; every rank answers "
            "with this rank's param-group keys",
        elsewhere=(("megatron.core.optimizer", ("torch.distributed.all_gather_object(gathered_params_key, "
                                                "params_key)",)),),
        make=_gather_object_on_fake_groups,
    ),
    *rewrite(
        "float16-optimizer-cpu-types", _FLOAT16_OPTIMIZER, "Float16OptimizerWithFloat16Params.__init__",
        _FLOAT16_TYPES, **_REHEARSE,
        upstream="megatron/core/optimizer/optimizer.py Float16OptimizerWithFloat16Params.__init__",
        when="the installed __init__ accepts only 'torch.cuda.*Tensor' parameters",
        why="a rehearsal's bf16 parameters are CPU fake tensors (TypeError 'Wrapped parameters must be one of "
            "torch.cuda...'); recompiled to accept the CPU type names too",
        needed=_float16_accepts_only_cuda,
    ),
    Patch(
        name="local-l2-norm-fake", module=_CLIP_GRADS, attr="l2_norm_impl", **_REHEARSE,
        upstream="megatron/core/optimizer/clip_grads.py l2_norm_impl = utils.local_multi_tensor_l2_norm "
                 "(no Transformer Engine, no apex)",
        when="clip_grads uses megatron-core's local l2 norm (no Transformer Engine, no apex)",
        why="local_multi_tensor_l2_norm reads tensor data (torch.tensor of a list of norms, float()); fake tensors "
            "have none: the same norm through torch.stack",
        needed=_local_l2_norm_in_use,
        snippets=("l2_norm_impl = local_multi_tensor_l2_norm",),
        make=lambda old: _l2_norm_without_data,
    ),
    Patch(
        name="fake-balanced-moe-dispatch", module=_DISPATCHER,
        attr="MoEAllGatherTokenDispatcher.dispatch_postprocess", **_REHEARSE,
        upstream="megatron/core/transformer/moe/token_dispatcher.py MoEAllGatherTokenDispatcher.dispatch_postprocess",
        when="during a rehearsal's micro-batch forward + backward, on fake tensors only",
        why="the dispatcher sizes its output by the routing (masked_select, tokens_per_expert.tolist()), which fake "
            "tensors have no data for; on fake tensors megatron-core's drop-and-pad permute with a balanced load "
            "(ceil(tokens x top-k / experts) per expert), taking permute's first three results (tokens, probs, "
            "sorted indices: every release returns them first; megatron-core 0.17+ return two more after them)",
        snippets=("tokens_per_expert = self.local_map.sum(dim=0).long().cpu()",
                  "self.local_probs = self.local_probs.T.contiguous().masked_select("),
        elsewhere=(("megatron.core.transformer.moe.moe_utils", ("if drop_and_pad and not (num_out_tokens is None):",
                                                                "capacity = num_out_tokens // num_experts",
                                                                # the three results it takes (0.17+ add two more)
                                                                "return permuted_input, permuted_probs, "
                                                                "sorted_indices")),),
        make=_balanced_dispatch_on_fake,
    ),
)
