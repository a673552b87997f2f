"""CPU mode on one process's path: the upstream code that model construction, forward/backward, the optimizer
step, Megatron Bridge's training loop and torch_dist checkpoints reach in every run (also the multi-process
ones), and what CPU mode does about each: a CUDA redirect (``TORCH_ON_CPU``), a targeted patch (``PATCHES``)
or the process-wide ``Tensor.cuda`` (``TENSOR_CUDA_CALLERS``); ``bridge_ext.cpu.patches`` turns the tables into
patches. Versions: megatron-core 0.16.0-0.19.0, megatron-bridge 0.3.0-0.6.0 (a snippet a release rewrote in
place is ``one_of`` its forms; code that moved to another module is in ``moved``).
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Callable
from typing import Any

from bridge_ext.cpu.patches.redirect import real_torch
from bridge_ext.upstream_patch import Patch, one_of

__all__ = ["CLAIMS_GPU", "PATCHES", "TENSOR_CUDA_CALLERS", "TORCH_ON_CPU"]

# Upstream modules whose global ``torch`` becomes a ``TorchOnCPU`` (``redirect``), and the CUDA code in each
# that needs it, matched by content: every snippet must still occur in the module (patches.drift()), and
# each mentions ``cuda`` or ``nccl``.
TORCH_ON_CPU: dict[str, tuple[str, ...]] = {
    # RoPE buffers moved to torch.cuda.current_device()
    "megatron.core.models.common.embeddings.rotary_pos_embedding": (
        'self.inv_freq = self.inv_freq.to(device=torch.cuda.current_device())',
        'torch.arange(0, dim, 2, dtype=torch.float32, device=torch.cuda.current_device())',
    ),
    "megatron.core.models.common.embeddings.yarn_rotary_pos_embedding": (
        'self.inv_freq_extra = self.inv_freq_extra.to(device=torch.cuda.current_device())',
        'self.inv_freq_inter = self.inv_freq_inter.to(device=torch.cuda.current_device())',
    ),
    # router weights, expert bias and aux-loss tensors on torch.cuda.current_device()
    "megatron.core.transformer.moe.router": (
        'self.weight.data = self.weight.data.to(device=torch.cuda.current_device())',
        'self.bias.data = self.bias.data.to(device=torch.cuda.current_device())',
        'device=torch.cuda.current_device(),',
        'torch.tensor(0, dtype=torch.float32, device=torch.cuda.current_device()),',
    ),
    # CUDA RNG tracker (fork/add/seed) -> the CPU generator
    "megatron.core.tensor_parallel.random": (
        'return torch.cuda.random.get_rng_state(device=device)',
        'orig_rng_state = torch.cuda.get_rng_state()',
        'torch.cuda.manual_seed(seed)',
        'self.states_[name] = torch.cuda.get_rng_state()',
        'torch.cuda.manual_seed(data_parallel_seed)',
    ),
    # initialize: asserts CUDA, sets the device and stream, seeds only if device_count() > 0
    "megatron.bridge.training.initialize": (
        'assert torch.cuda.is_available(), "Megatron requires CUDA."',
        'MoEAuxLossAutoScaler.set_loss_scale(torch.ones(1, device=torch.cuda.current_device()))',
        'device_count = torch.cuda.device_count()',
        'torch.cuda.set_device(0)',
        'torch.cuda.set_stream(torch.cuda.Stream())',
        'if torch.cuda.device_count() > 0:',
        'torch.cuda.empty_cache()',
        'torch.cuda.synchronize()',
    ),
    # default causal / sliding-window masks of the local DotProductAttention
    "megatron.core.transformer.utils": (
        'return torch.triu(torch.ones(sq, sq, device="cuda"), diagonal=1).bool()',
        'm = torch.ones(sq, skv, dtype=torch.bool, device="cuda")',
    ),
    # global memory buffer (local attention), local multi_tensor_l2norm result, nvtx ranges
    "megatron.core.utils": (
        'device=torch.cuda.current_device(),',
        'l2_cuda = torch.tensor([float(l2_reduced)], dtype=torch.float, device="cuda")',
        'torch.cuda.nvtx.range_push(msg)',
        'torch.cuda.nvtx.range_pop()',
    ),
    # parameters, all-gather buffers and mappings allocated on torch.cuda.current_device()
    "megatron.core.tensor_parallel.layers": (
        'device=torch.cuda.current_device(),',
        'dim_size, dtype=input.dtype, device=torch.cuda.current_device(), requires_grad=False',
    ),
    "megatron.core.tensor_parallel.mappings": (
        'output = torch.empty(dim_size, dtype=input_.dtype, device=torch.cuda.current_device())',
        'device=torch.cuda.current_device(),',
    ),
    # DDP grad buffers and their communication stream
    "megatron.core.distributed.param_and_grad_buffer": (
        'stream_context = torch.cuda.stream(self.communication_stream)',
        one_of('self.communication_stream.wait_stream(torch.cuda.default_stream())',
               'self.communication_stream.wait_stream(torch.cuda.current_stream())'),  # megatron-core 0.19
        one_of('torch.cuda.default_stream().wait_stream(self.communication_stream)',
               'torch.cuda.current_stream().wait_stream(self.communication_stream)'),
        'tmp_warmup_tensor = torch.zeros([1], device="cuda")',
        'device=torch.cuda.current_device(),',
    ),
    # optimizer: found_inf / scale / overflow buffers, grad-norm and zero-count buffers
    "megatron.core.optimizer.optimizer": (
        'torch.cuda.empty_cache()',
        "self.found_inf = torch.tensor([0.0], dtype=torch.float, device='cuda')",
        "self._dummy_overflow_buf = torch.tensor([0], dtype=torch.int, device='cuda')",
        "self._scale_one = torch.tensor([1.0], dtype=torch.float, device='cuda')",
        "self._scale = torch.tensor([1.0], dtype=torch.float, device='cuda')",
        'return torch.tensor([1.0], dtype=torch.float32, device=torch.cuda.current_device())',
    ),
    "megatron.core.optimizer.clip_grads": (
        "total_norm_cuda = torch.tensor([float(total_norm)], dtype=torch.float, device='cuda')",
        "dummy_overflow_buf = torch.zeros(1, dtype=torch.int, device='cuda')",
        one_of("grad_norm = torch.zeros(1, dtype=torch.float, device='cuda')",
               "total_norm = torch.zeros(1, dtype=torch.float, device='cuda')"),  # megatron-core 0.19
        one_of("total_num_zeros = torch.zeros(1, dtype=torch.float, device='cuda')",
               "total_num_zeros = torch.zeros(1, dtype=torch.int64, device='cuda')"),
    ),
    # schedules, timers, rerun state machine
    "megatron.core.pipeline_parallel.schedules": (
        'total_num_tokens = torch.zeros([], dtype=torch.int, device="cuda")',
    ),
    "megatron.core.timers": (
        'torch.cuda.synchronize()',
        '(world_size, len(names)), dtype=torch.float, device=torch.cuda.current_device()',
    ),
    "megatron.core.rerun_state_machine": (
        "val_tensor: torch.Tensor = torch.tensor(value, dtype=torch.int32, device='cuda')",
        "val_tensor: torch.Tensor = torch.tensor([value], dtype=torch.int32, device='cuda')",
        'device: int = torch.cuda.current_device()',
        '"cuda_rng_state": torch.cuda.get_rng_state(),',
        'torch.cuda.set_rng_state(rng_state["cuda_rng_state"])',
    ),
    # provide_distributed_model: `model_module.cuda(torch.cuda.current_device())` (a CPU run on megatron-bridge 0.6
    # reaches it, measured; on 0.3 it does not); its DDP stream: bridge_ext.cpu.patches.moved
    "megatron.bridge.models.model_provider": (
        'model_module.cuda(torch.cuda.current_device())',
    ),
    # Megatron Bridge's training loop, batches, logging, checkpoints
    "megatron.bridge.training.setup": (
        'start_time_tensor = torch.tensor([state.start_time], dtype=torch.double, device="cuda")',
    ),
    "megatron.bridge.data.loaders": (
        'flags = torch.tensor([int(do_train), int(do_valid), int(do_test)], dtype=torch.long, device="cuda")',
    ),
    "megatron.bridge.training.eval": (
        'torch.cuda.empty_cache()',
        '[train_time > state.cfg.train.exit_duration_in_mins], dtype=torch.int, device="cuda"',
    ),
    "megatron.bridge.training.train": (
        'torch.cuda.empty_cache()',
        'torch.cuda.synchronize()',
        'done_cuda = torch.tensor([train_time > state.cfg.train.exit_duration_in_mins], dtype=torch.int, device="cuda")',
    ),
    "megatron.bridge.training.checkpointing": (
        'iters_cuda = torch.tensor([iteration], dtype=torch.long, device="cuda")',
        '"cuda_rng_state": torch.cuda.get_rng_state(),',
        'torch.cuda.set_rng_state(rng_state["cuda_rng_state"])',
        'torch.cuda.set_rng_state(state_dict["cuda_rng_state"])',
        'torch.cuda.empty_cache()',
    ),
    "megatron.bridge.training.utils.train_utils": (
        'dummy_overflow_buf = torch.tensor([0], dtype=torch.int, device="cuda")',
        'norm_2 = torch.zeros((1,), dtype=torch.float32, device="cuda")',
        'total_norm_2 = torch.zeros((1,), dtype=torch.float32, device="cuda")',
        'stat = torch.tensor([stat], dtype=torch.float32, device=torch.cuda.current_device())',
        'input = torch.tensor([input], dtype=torch.int, device=torch.cuda.current_device())',
        'total_loss_dict.get(key, torch.tensor([0.0], dtype=torch.float, device="cuda")) + loss_dict[key]',
        'total_loss_dict[key] = torch.tensor([0.0], dtype=torch.float, device="cuda")',
        'memory_stats = torch.cuda.memory_stats()',
    ),
    # torch_dist checkpoint save: synchronize after staging, success/verification all-reduces
    "megatron.core.dist_checkpointing.strategies.filesystem_async": (
        'torch.cuda.synchronize()',
    ),
    "megatron.core.dist_checkpointing.strategies.state_dict_saver": (
        "all_results = torch.tensor([local_verify_reuse], dtype=torch.int, device='cuda')",
        '[int(len(node_failures) > 0)], dtype=torch.int, device=torch.cuda.current_device()',
    ),
}

# Modules whose ``torch.cuda.is_available()`` answers True: they assert a GPU, then do CPU-safe work.
CLAIMS_GPU = frozenset({"megatron.bridge.training.initialize"})

# Callers of ``Tensor.cuda()`` / ``Module.cuda()`` on the training path (``redirect.tensor_stays_on_cpu``).
TENSOR_CUDA_CALLERS: dict[str, tuple[str, ...]] = {
    "megatron.bridge.training.gpt_step": (
        '_batch_required_keys[key] = val.cuda(non_blocking=True) if val is not None else None',
    ),
    "megatron.bridge.models.model_provider": (
        'model_module.cuda(torch.cuda.current_device())',
    ),
}


# ---------------------------------------------------------------------------------------------------------
# Targeted attribute patches
# ---------------------------------------------------------------------------------------------------------


def _rng_state_set(new_state: Any, device: Any = -1, graph_safe: bool = False) -> None:
    real_torch().set_rng_state(new_state)


def _clip_grad_by_total_norm_fp32(clip_grads: Any) -> Callable:
    """``clip_grads.clip_grad_by_total_norm_fp32`` with its fp32 check on the dtype, not the CUDA type."""
    torch = real_torch()

    def clip_grad_by_total_norm_fp32(
        parameters: Any, max_norm: float, total_norm: float, use_decoupled_grad: bool = False
    ) -> None:
        if isinstance(parameters, torch.Tensor):
            parameters = [parameters]
        grads = []
        for param in parameters:
            grad = getattr(param, "decoupled_grad", None) if use_decoupled_grad else param.grad
            if grad is not None:
                assert grad.dtype == torch.float32 or (use_decoupled_grad and grad.dtype == torch.bfloat16)
                grads.append(clip_grads.to_local_if_dtensor(grad).detach())
        clip_coeff = max_norm / (total_norm + 1.0e-6)
        if clip_coeff < 1.0 and grads:
            overflow_buf = torch.zeros(1, dtype=torch.int)
            scale = clip_grads.multi_tensor_scale_impl
            clip_grads.multi_tensor_applier(scale, overflow_buf, [grads, grads], clip_coeff)

    return clip_grad_by_total_norm_fp32


def _jit_warmup(warmup: Callable) -> Callable:
    """``initialize._warmup_jit_function`` that skips warming fused kernels the CPU config turned off."""

    def warmup_jit_function(model_config: Any, micro_batch_size: int) -> None:
        if model_config.bias_activation_fusion or model_config.bias_dropout_fusion:
            warmup(model_config, micro_batch_size)

    return warmup_jit_function


def _clip_grads_fp32(old: Any) -> Callable:
    return _clip_grad_by_total_norm_fp32(importlib.import_module("megatron.core.optimizer.clip_grads"))


def _cpu(**fields: Any) -> Patch:
    return Patch(**{"area": "cpu", "scope": "cpu", "when": "CPU mode", **fields})




PATCHES: tuple[Patch, ...] = (
    _cpu(
        name="jit-warmup",
        upstream="megatron/bridge/training/initialize.py _warmup_jit_function",
        module="megatron.bridge.training.initialize",
        attr="_warmup_jit_function",
        snippets=('device="cuda"', one_of("_warmup_jit_function(model_config, micro_batch_size)",
                                          "_warmup_jit_function(\n        model_config.transformer if")),
        why="warms torch.compile'd bias_swiglu/bias_dropout_add on CUDA tensors; with those fusions off (CPU) "
        "the kernels never run, and compiling them with inductor costs ~3 s per run",
        make=_jit_warmup,
    ),
    _cpu(
        name="router-expert-bias-eager",
        upstream="megatron/core/transformer/moe/router.py TopKRouter._apply_expert_bias (@jit_fuser, which "
                 "megatron/core/jit.py makes torch.compile)",
        module="megatron.core.transformer.moe.router",
        attr="TopKRouter._apply_expert_bias",
        snippets=("@jit_fuser\n    def _apply_expert_bias",),
        why="inductor compiles it to C++ at the first routed step: ~10 s of every process that trains an "
            "expert-bias router (Kimi K2, Moonlight) for one small integer update; the eager function (what "
            "jit_fuser wraps) computes the same",
        accepts=callable,
        make=inspect.unwrap,
    ),
    _cpu(
        name="clip-grads-fp32-check",
        upstream="megatron/core/optimizer/clip_grads.py clip_grad_by_total_norm_fp32",
        module="megatron.core.optimizer.clip_grads",
        attr="clip_grad_by_total_norm_fp32",
        snippets=("assert param.grad.type() == 'torch.cuda.FloatTensor'",),
        why="asserts the legacy CUDA tensor type; a CPU fp32 grad is 'torch.FloatTensor'",
        make=_clip_grads_fp32,
    ),
    _cpu(
        name="clip-grads-fp32-check (imported name)",
        upstream="megatron/core/optimizer/optimizer.py: from .clip_grads import clip_grad_by_total_norm_fp32",
        module="megatron.core.optimizer.optimizer",
        attr="clip_grad_by_total_norm_fp32",
        snippets=("from .clip_grads import clip_grad_by_total_norm_fp32",),
        why="optimizer.py binds the function at import (used at optimizer.py:215 and :1324)",
        make=_clip_grads_fp32,
    ),
    _cpu(
        name="rng-set",
        upstream="megatron/core/tensor_parallel/random.py _set_cuda_rng_state",
        module="megatron.core.tensor_parallel.random",
        attr="_set_cuda_rng_state",
        snippets=("_lazy_call(cb)",),
        why="torch.cuda._lazy_call queues the callback forever when CUDA never initializes",
        make=lambda old: _rng_state_set,
    ),
)
