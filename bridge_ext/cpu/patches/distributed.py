"""CPU mode for several processes (torchrun, gloo): what DP, TP, PP and EP reach beyond one process's path.

The distributed optimizer's CUDA type check, ``dist_muon``'s (layer-wise optimizer) all-gather of unequal
sizes and its fp32 save, sequence parallelism with the local spec's torch norms, pipeline p2p buffers, and
conversion under TP > 1. Versions: megatron-core 0.16.0-0.19.0, megatron-bridge 0.3.0-0.6.0.
"""

from __future__ import annotations

import inspect
from typing import Any

from bridge_ext.cpu.patches.redirect import real_torch
from bridge_ext.patching import Patch, rewrite
from bridge_ext.stack import UpstreamDrift, module_source, package_of

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
    # distributed optimizer: checkpoint shards and gathers allocated on the current CUDA device
    "megatron.core.optimizer.distrib_optimizer": (
        '(numel,), dtype=dtype, device=torch.cuda.current_device()',
        'device = "cpu" if use_gloo_comm else torch.cuda.current_device()',
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
# sizes differ (an all_gather_v); gloo requires equal sizes. Every rank pads to the largest and trims.
# megatron-core 0.16 pads nothing into `output_list`; 0.19 (`_allgather_helper`) into per-rank `gather_list`
# buffers of the actual sizes ("PyTorch's NCCL backend handles uneven sizes"): one rewrite per form.
_LAYER_WISE_ALLGATHER = (
    ("torch.distributed.all_gather(output_list, src, group=group)",
     "_bridge_ext_all_gather_v(output_list, src, group)"),
)
_LAYER_WISE_ALLGATHER_HELPER = (
    ("torch.distributed.all_gather(gather_list, src, group=group)",
     "_bridge_ext_all_gather_v(gather_list, src, group)"),
)
_LAYER_WISE = "megatron.core.optimizer.layer_wise_optimizer"


def _all_gather_form(replacements: tuple[tuple[str, str], ...]) -> bool:
    """Whether the installed ``allgather_params`` has this form's all-gather; drift when it has neither. Read
    from the module's file: once applied, the method is the recompiled one."""
    source = module_source(_LAYER_WISE)
    forms = (_LAYER_WISE_ALLGATHER, _LAYER_WISE_ALLGATHER_HELPER)
    if not any(form[0][0] in source for form in forms):
        raise UpstreamDrift(f"{package_of(_LAYER_WISE)}: LayerWiseDistributedOptimizer.allgather_params has none "
                            "of the all-gathers CPU mode pads (bridge_ext.cpu.patches.distributed)")
    return replacements[0][0] in source

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
# megatron-core 0.16 line 32). Their weights only need what TE's and Apex's norms do: the `sequence_parallel`
# flag, so that finalize_model_grads sums their gradients over the tensor-parallel ranks.
_TORCH_NORM_SEQUENCE_PARALLEL = (
    ('assert not config.sequence_parallel, f"sequence parallel not supported by torch LayerNorm"', ""),
    ("return norm_cls(normalized_shape=hidden_size, eps=eps)",
     "return _bridge_ext_sequence_parallel_norm(norm_cls(normalized_shape=hidden_size, eps=eps), config)"),
)


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


def _sequence_parallel_norm(norm: Any, config: Any) -> Any:
    """Flag a norm's parameters as TE's and Apex's norms do (``setattr(p, 'sequence_parallel', ...)``)."""
    for param in norm.parameters():
        param.sequence_parallel = bool(config.sequence_parallel)
    return norm


def _all_gather_v(output_list: list, src: Any, group: Any) -> None:
    """``all_gather`` of tensors of different sizes over gloo: pad to the largest, gather, copy back."""
    torch = real_torch()
    size = max(t.numel() for t in output_list)
    padded = [torch.empty(size, dtype=src.dtype, device=src.device) for _ in output_list]
    source = torch.zeros(size, dtype=src.dtype, device=src.device)
    source[: src.numel()] = src
    torch.distributed.all_gather(padded, source, group=group)
    for out, got in zip(output_list, padded):
        out.copy_(got[: out.numel()])


_CPU: dict[str, Any] = {"area": "cpu", "scope": "cpu", "when": "CPU mode"}

PATCHES: tuple[Patch, ...] = (
    *rewrite(
        "distrib-optimizer-cpu-types", "megatron.core.optimizer.distrib_optimizer",
        "DistributedOptimizer._build_model_and_main_param_groups", _DISTRIB_OPTIMIZER_TYPES,
        upstream="megatron/core/optimizer/distrib_optimizer.py DistributedOptimizer._build_model_and_main_param_groups",
        **_CPU, why="the distributed optimizer accepts only 'torch.cuda.*Tensor' parameters (TypeError for CPU fp32 "
        "ones); recompiled with the CPU type names",
    ),
    *rewrite(
        "layer-wise-all-gather-v", "megatron.core.optimizer.layer_wise_optimizer",
        "LayerWiseDistributedOptimizer.allgather_params", _LAYER_WISE_ALLGATHER,
        upstream="megatron/core/optimizer/layer_wise_optimizer.py LayerWiseDistributedOptimizer.allgather_params",
        **{**_CPU, "when": "CPU mode, where allgather_params all-gathers into output_list (megatron-core 0.16)"},
        why="dist_muon all-gathers parameter shards of different sizes per rank; gloo needs equal sizes "
        "(RuntimeError); padded to the largest",
        helpers={"_bridge_ext_all_gather_v": (
            _all_gather_v, "the padded all-gather the layer-wise optimizer's recompiled allgather_params calls")},
        needed=lambda: _all_gather_form(_LAYER_WISE_ALLGATHER),
    ),
    *rewrite(
        "layer-wise-all-gather-v (per-rank buffers)", "megatron.core.optimizer.layer_wise_optimizer",
        "LayerWiseDistributedOptimizer.allgather_params", _LAYER_WISE_ALLGATHER_HELPER,
        upstream="megatron/core/optimizer/layer_wise_optimizer.py LayerWiseDistributedOptimizer.allgather_params "
                 "(_allgather_helper)",
        **{**_CPU, "when": "CPU mode, where allgather_params all-gathers into per-rank buffers of their own sizes "
                           "(megatron-core 0.19)"},
        why="dist_muon all-gathers parameter shards of different sizes per rank (NCCL accepts them); gloo needs "
        "equal sizes (RuntimeError); padded to the largest",
        helpers={"_bridge_ext_all_gather_v": (
            _all_gather_v, "the padded all-gather the layer-wise optimizer's recompiled allgather_params calls")},
        needed=lambda: _all_gather_form(_LAYER_WISE_ALLGATHER_HELPER),
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
    *rewrite(
        "torch-norm-sequence-parallel", "megatron.core.transformer.torch_norm", "WrappedTorchNorm.__new__",
        _TORCH_NORM_SEQUENCE_PARALLEL,
        upstream="megatron/core/transformer/torch_norm.py WrappedTorchNorm.__new__",
        **_CPU, why="the local spec's torch norms assert no sequence parallelism (TP layouts turn it on); with their "
        "weights flagged `sequence_parallel`, finalize_model_grads sums their gradients over TP as for TE's",
        helpers={"_bridge_ext_sequence_parallel_norm": (
            _sequence_parallel_norm,
            "flags the norm's parameters for sequence parallelism; called by the recompiled WrappedTorchNorm")},
    ),
)
