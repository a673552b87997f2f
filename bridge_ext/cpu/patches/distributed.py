"""CPU mode for several processes (torchrun, gloo): what DP, TP, PP and EP reach beyond one process's path.

The distributed optimizer's CUDA type check, ``dist_muon``'s (layer-wise optimizer) all-gather of unequal
sizes and its fp32 save, sequence parallelism with the local spec's torch norms, pipeline p2p buffers, and
conversion under TP > 1. Versions: megatron-core 0.16.0-0.19.0, megatron-bridge 0.3.0-0.6.0.
"""

from __future__ import annotations

import copy
import importlib
import inspect
from typing import Any

from bridge_ext.cpu.patches.redirect import TorchOnCPU, real_torch, torch_proxy
from bridge_ext.stack import module_source
from bridge_ext.upstream_patch import Patch, one_of, rewrite

__all__ = ["PATCHES", "TORCH_ON_CPU"]

# Upstream modules whose global ``torch`` becomes a ``TorchOnCPU`` (as in ``single_process.TORCH_ON_CPU``).
TORCH_ON_CPU: dict[str, tuple[str, ...]] = {
    # pipeline p2p: tensor-shape exchange buffers and receive buffers on the current CUDA device, synchronize
    "megatron.core.pipeline_parallel.p2p_communication": (
        '(3,), device=torch.cuda.current_device(), dtype=torch.int64',
        'tensor_send_prev.size(), device=torch.cuda.current_device(), dtype=torch.int64',
        'device=torch.cuda.current_device(),',
        'torch.cuda.synchronize()',
    ),
    # distributed optimizer: a resume allocates the fresh optimizer's state shards on the current CUDA device
    # (load_state_dict, reached through the state-dict patch below: distrib-optimizer-fresh-state-dict)
    "megatron.core.optimizer.distrib_optimizer": (
        '(numel,), dtype=dtype, device=torch.cuda.current_device()',
    ),
    # conversion under TP > 1 (nemo llm import --tp): replicated weights (norms, router) are moved to the CUDA
    # device before their broadcast to the TP ranks. Also gives scatter_to_tp_ranks' torch.distributed.scatter
    # of row-parallel shards (torch.chunk(dim=1) views) redirect's DistributedOnCPU.scatter, which sends copies.
    "megatron.bridge.models.conversion.param_mapping": (
        'if target_device.index != torch.cuda.current_device():',
        'hf_weights = hf_weights.to(torch.cuda.current_device())',
    ),
}


# distrib_optimizer.py's fp32/fp16/bf16 check asks for the legacy CUDA type names (megatron-core 0.16:
# `_build_model_and_main_param_groups`, lines 361, 420, 431); a CPU parameter is 'torch.FloatTensor'.
_DISTRIB_OPTIMIZER_TYPES = (
    ("if model_param.type() in ['torch.cuda.HalfTensor', 'torch.cuda.BFloat16Tensor']:",
     "if model_param.type() in ['torch.HalfTensor', 'torch.BFloat16Tensor']:"),
    ("elif model_param.type() == 'torch.cuda.FloatTensor':", "elif model_param.type() == 'torch.FloatTensor':"),
)

# layer_wise_optimizer.py (dist_muon): `allgather_params` all-gathers each rank's flattened parameters, whose
# sizes differ (an all_gather_v); gloo requires equal sizes. megatron-core 0.16 gathers into `output_list`, 0.19
# (`_allgather_helper`) into per-rank `gather_list` buffers of the actual sizes ("PyTorch's NCCL backend handles
# uneven sizes"). The module's `torch` becomes CPU mode's stand-in, whose `distributed.all_gather` pads uneven
# sizes to the largest and trims (redirect.DistributedOnCPU.all_gather). The same stand-in answers the module's
# other CUDA code: megatron-core 0.19's has_grad_norm_group agrees over ranks on a `device='cuda'` flag.
_LAYER_WISE = "megatron.core.optimizer.layer_wise_optimizer"
_LAYER_WISE_ALLGATHER = one_of("torch.distributed.all_gather(output_list, src, group=group)",
                               "torch.distributed.all_gather(gather_list, src, group=group)")

# layer_wise_optimizer.py `sharded_state_dict` (torch_dist save) reads sd['optimizer'] for every chained
# member, which only mixed-precision members have; an fp32 member (FP32Optimizer) is the torch optimizer's
# own state dict ({'state', 'param_groups'}): KeyError 'optimizer' (megatron-core 0.16, line 289). The loop
# sees an fp32 member through a {'optimizer': member} view, so its edits land in the member itself.
_LAYER_WISE_SAVE = (
    ("for sd in wrapped_sharded_state_dict.values():",
     "for sd in (s if 'optimizer' in s else {'optimizer': s} for s in wrapped_sharded_state_dict.values()):"),
    ("super().sharded_state_dict(", "super(LayerWiseDistributedOptimizer, self).sharded_state_dict("),
    # It also marks every optimizer-state shard as the main replica (replica_id 0, "for fixed DP usage
    # only"), which is right for the parameters it spread over the data-parallel ranks, but with one such
    # rank it spreads nothing (`shard_params` returns early) while expert parameters may still be replicated
    # over the expert-data-parallel ranks (TP2 with ETP1: both TP ranks hold every expert): two main
    # replicas, "Invalid access pattern" on save and load. Then upstream's replica ids stay.
    ("for sh_base in nested_values(sharded_state_dict):",
     "for sh_base in (nested_values(sharded_state_dict) if self.dp_cp_params_list is not None else ()):"),
)


# transformer/torch_norm.py: the local spec's norms (no Apex, no TE) refuse sequence parallelism (`WrappedTorchNorm`,
# megatron-core 0.16 line 32: an assert). Their weights only need what TE's and Apex's norms do: the
# `sequence_parallel` flag, so that finalize_model_grads sums their gradients over the tensor-parallel ranks. The
# norm is built by upstream's __new__ from a copy of the config without the flag, then its parameters are flagged.
_TORCH_NORM_SEQUENCE_PARALLEL = 'assert not config.sequence_parallel, f"sequence parallel not supported by torch LayerNorm"'


def _sequence_parallel_norms(old: Any) -> Any:
    new = getattr(old, "__func__", old)

    def __new__(cls: type, config: Any, *args: Any, **kwargs: Any) -> Any:
        if not getattr(config, "sequence_parallel", False):
            return new(cls, config, *args, **kwargs)
        plain = copy.copy(config)  # a shallow copy: no __post_init__ checks
        plain.sequence_parallel = False
        return _sequence_parallel_norm(new(cls, plain, *args, **kwargs), config)

    __new__._bridge_ext_original = new  # type: ignore[attr-defined]
    return staticmethod(__new__)


# layer_wise_optimizer.py `LayerWiseDistributedOptimizer.__init__` (megatron-core 0.19) wraps its base torch
# optimizers in Float16OptimizerWithFloat16Params for bf16 and in nothing otherwise ("Do not pre-wrap with Megatron
# optimizers"; get_megatron_optimizer passes them raw), so an fp32 run (CPU mode) chains raw torch optimizers:
# `ChainedOptimizer.get_loss_scale` -> AttributeError 'TensorParallelMuon' ... 'get_loss_scale' at the first
# forward. 0.16's get_megatron_muon_optimizer wrapped them in FP32Optimizer itself; the same is done here.
def _layer_wise_wraps_only_bf16() -> bool:
    source = module_source(_LAYER_WISE)  # upstream's file (once applied, __init__ is ours)
    return "Do not pre-wrap with Megatron optimizers" in source and "FP32Optimizer(" not in source


def _fp32_members(init: Any) -> Any:
    def __init__(self, optimizers: Any, config: Any, *args: Any, **kwargs: Any) -> None:
        if not config.bf16:  # what bf16 gets inside (Float16OptimizerWithFloat16Params), for fp32
            from megatron.core.optimizer.optimizer import FP32Optimizer, MegatronOptimizer

            bound = inspect.signature(init).bind(self, optimizers, config, *args, **kwargs)
            init_fns = bound.arguments.get("init_state_fn_list") or [None] * len(optimizers)
            optimizers = [opt if isinstance(opt, MegatronOptimizer) else FP32Optimizer(opt, config, fn)
                          for opt, fn in zip(optimizers, init_fns)]
        init(self, optimizers, config, *args, **kwargs)

    return __init__


# distrib_optimizer.py DistributedOptimizer.state_dict without Apex or TE (CPU mode: torch's Adam) reads the step
# from the inner optimizer's per-parameter state; a resume asks a fresh optimizer (no state yet) for it first
# (sharded_state_dict(is_loading=True): self.load_state_dict(self.state_dict())), and `assert len(steps) == 1`
# fails on no steps at all.
_STEP_FROM_STATE = ('steps = list(set([s["step"].item() for s in inner_state_dict["state"].values()]))',
                    "assert len(steps) == 1")


def _without_apex_or_te() -> bool:
    return not importlib.import_module("megatron.core.optimizer.distrib_optimizer").HAVE_APEX_OR_TE


def _state_dict_of_a_fresh_optimizer(state_dict: Any) -> Any:
    def fresh_state_dict(self) -> Any:
        inner = self.optimizer
        if inner.state:
            return state_dict(self)
        # step 0 for every parameter while upstream reads it; the resume's load replaces it with the saved step
        for group in inner.param_groups:
            for param in group["params"]:
                inner.state[param]["step"] = real_torch().tensor(0.0)
        try:
            return state_dict(self)
        finally:
            inner.state.clear()  # load_state_dict allocates the state of an empty optimizer

    return fresh_state_dict


def _the_saved_step_per_parameter(load_state_dict: Any) -> Any:
    def load_state_dict_with_the_saved_step(self, state_dict: Any) -> None:
        load_state_dict(self, state_dict)  # also copies the loaded parameter state in, "step" included
        (step,) = {group["step"] for group in state_dict["optimizer"]["param_groups"]}  # upstream asserted one
        for state in self.optimizer.state.values():
            if "step" in state:  # its own tensor: torch's Adam adds 1 to each parameter's step in place
                state["step"] = real_torch().tensor(float(step))

    return load_state_dict_with_the_saved_step


_COPIES_ALL_STATE = 'dst_tensors = {"param": main_param, **optim_state}'  # megatron-core 0.16


def _set_without_grad(set_states: Any) -> Any:
    def set_main_param_and_optimizer_states(self, model_param: Any, tensors: Any) -> None:
        with real_torch().no_grad():  # an fp32 main parameter is a view of the model's (a leaf that needs grad)
            set_states(self, model_param, tensors)

    return set_main_param_and_optimizer_states


def _sequence_parallel_norm(norm: Any, config: Any) -> Any:
    """Flag a norm's parameters as TE's and Apex's norms do (``setattr(p, 'sequence_parallel', ...)``)."""
    for param in norm.parameters():
        param.sequence_parallel = bool(config.sequence_parallel)
    return norm


_CPU: dict[str, Any] = {"area": "cpu", "scope": "cpu", "when": "CPU mode"}

PATCHES: tuple[Patch, ...] = (
    *rewrite(
        "distrib-optimizer-cpu-types", "megatron.core.optimizer.distrib_optimizer",
        "DistributedOptimizer._build_model_and_main_param_groups", _DISTRIB_OPTIMIZER_TYPES,
        upstream="megatron/core/optimizer/distrib_optimizer.py DistributedOptimizer._build_model_and_main_param_groups",
        **_CPU, why="the distributed optimizer accepts only 'torch.cuda.*Tensor' parameters (TypeError for CPU fp32 "
        "ones); recompiled with the CPU type names",
    ),
    Patch(
        name="distrib-optimizer-fresh-state-dict", module="megatron.core.optimizer.distrib_optimizer",
        attr="DistributedOptimizer.state_dict",
        upstream="megatron/core/optimizer/distrib_optimizer.py DistributedOptimizer.state_dict (without Apex or TE)",
        **{**_CPU, "when": "CPU mode, where megatron-core finds neither Apex nor TE (torch's Adam)"},
        why="a resume of the distributed optimizer (AdamW at DP > 1) asks the fresh optimizer for its step before "
            "it has state: `assert len(steps) == 1` fails on none; the fresh optimizer answers step 0 (the load "
            "replaces it)",
        needed=_without_apex_or_te,
        snippets=_STEP_FROM_STATE,
        make=_state_dict_of_a_fresh_optimizer,
    ),
    Patch(
        name="distrib-optimizer-resumed-step", module="megatron.core.optimizer.distrib_optimizer",
        attr="DistributedOptimizer.load_state_dict",
        upstream="megatron/core/optimizer/distrib_optimizer.py DistributedOptimizer.load_state_dict (without Apex "
                 "or TE)",
        **{**_CPU, "when": "CPU mode, where megatron-core finds neither Apex nor TE (torch's Adam)"},
        why="a resume gives every parameter's torch Adam state one shared step tensor (`s[\"step\"] = step`), "
            "then copies the loaded parameter state into it, a step of 0 with it (measured, dp_reshardable): the "
            "resumed run's bias correction starts over; each parameter gets its own tensor holding the saved step",
        needed=_without_apex_or_te,
        snippets=("step = torch.tensor(steps[0], dtype=torch.float)", 's["step"] = step'),
        make=_the_saved_step_per_parameter,
    ),
    Patch(
        name="distrib-optimizer-fp32-load", module="megatron.core.optimizer.distrib_optimizer",
        attr="DistributedOptimizer._set_main_param_and_optimizer_states",
        upstream="megatron/core/optimizer/distrib_optimizer.py DistributedOptimizer."
                 "_set_main_param_and_optimizer_states (fp32 parameters)",
        **{**_CPU, "when": "CPU mode, where the copy also takes the optimizer state's non-tensors (megatron-core "
                           "0.16; 0.17 copies tensors only and resumes without it, measured)"},
        why="a resume of the distributed optimizer in fp32 (CPU mode) copies the loaded shard into the main "
        "parameter, a view of the model's parameter outside no_grad (RuntimeError: a view of a leaf Variable that "
        "requires grad is being used in an in-place operation); the copy runs under no_grad",
        needed=lambda: _COPIES_ALL_STATE in module_source("megatron.core.optimizer.distrib_optimizer"),
        snippets=(one_of(_COPIES_ALL_STATE,
                         'dst_tensors = {"param": main_param}'),  # megatron-core 0.17+: tensors only
                  "dst_tensors[key].copy_(tensors[key])"),
        make=_set_without_grad,
    ),
    Patch(
        name="layer-wise-all-gather-v", module=_LAYER_WISE, attr="torch",
        upstream="megatron/core/optimizer/layer_wise_optimizer.py LayerWiseDistributedOptimizer.allgather_params "
                 "(0.16: into output_list; 0.19 _allgather_helper: into per-rank buffers of their own sizes)",
        **_CPU, why="dist_muon all-gathers parameter shards of different sizes per rank (NCCL accepts them); gloo "
        "needs equal sizes (RuntimeError); the module's torch is CPU mode's stand-in, whose all_gather pads "
        "uneven sizes to the largest",
        snippets=(_LAYER_WISE_ALLGATHER,),
        accepts=lambda value: value is real_torch() or isinstance(value, TorchOnCPU),
        make=lambda old: torch_proxy(False),
    ),
    Patch(
        name="layer-wise-fp32-members", module=_LAYER_WISE, attr="LayerWiseDistributedOptimizer.__init__",
        upstream="megatron/core/optimizer/layer_wise_optimizer.py LayerWiseDistributedOptimizer.__init__ "
                 "(base optimizers wrapped for bf16 only)",
        **{**_CPU, "when": "CPU mode, where LayerWiseDistributedOptimizer wraps its raw base optimizers for bf16 "
                           "only (megatron-core 0.19)"},
        why="an fp32 dist_muon run chains raw torch optimizers (AttributeError: no get_loss_scale at the first "
            "forward); they are wrapped in FP32Optimizer, as megatron-core 0.16's get_megatron_muon_optimizer does",
        needed=_layer_wise_wraps_only_bf16,
        snippets=("if config.bf16:", "super().__init__(optimizers)"),
        elsewhere=(("megatron.core.optimizer", ("layer_wise_base_results.append((optimizer, init_state_fn))",)),),
        make=_fp32_members,
    ),
    *rewrite(
        "layer-wise-fp32-save", "megatron.core.optimizer.layer_wise_optimizer",
        "LayerWiseDistributedOptimizer.sharded_state_dict", _LAYER_WISE_SAVE,
        upstream="megatron/core/optimizer/layer_wise_optimizer.py LayerWiseDistributedOptimizer.sharded_state_dict",
        **_CPU, why="dist_muon's torch_dist save reads sd['optimizer'], which an fp32 member lacks (KeyError "
        "'optimizer'; CPU mode is fp32); and marks replicated expert state as main replica on every rank when "
        "one data-parallel rank spreads nothing (TP2 ETP1: invalid access pattern)",
        also_expects=("if not sd['optimizer']['state']:",),
    ),
    Patch(
        name="torch-norm-sequence-parallel", module="megatron.core.transformer.torch_norm",
        attr="WrappedTorchNorm.__new__", upstream="megatron/core/transformer/torch_norm.py WrappedTorchNorm.__new__",
        **_CPU, why="the local spec's torch norms assert no sequence parallelism (TP layouts turn it on); built from "
        "a copy of the config without it, with their weights flagged `sequence_parallel`, finalize_model_grads "
        "sums their gradients over TP as for TE's",
        snippets=(_TORCH_NORM_SEQUENCE_PARALLEL,),
        accepts=lambda value: not hasattr(getattr(value, "__func__", value), "_bridge_ext_original"),
        make=_sequence_parallel_norms,
    ),
)
