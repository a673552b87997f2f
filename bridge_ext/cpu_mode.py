"""Workarounds for running Megatron Bridge without a GPU or without Transformer Engine.

Every patch names the upstream file it works around and the code it expects there, matched by content (a
snippet that must still occur in the module, never a line number), so patch releases that move lines keep
working and a real change stops CPU mode with one line naming the package and version
(``tests/test_cpu_mode.py`` checks every target on every stack CI runs). CPU mode is only active once
:func:`enable_cpu_mode` ran (the CLI calls it for ``--device cpu`` or when no GPU is visible), never on a
normal GPU run. The Transformer Engine import guard lives in ``bridge_ext.te_guard``.

CPU mode (:func:`enable_cpu_mode`) is a development and testing mode: it runs Megatron Bridge's real
``pretrain()`` loop (data, forward, backward, optimizer step, clipping, LR schedule, logging, torch_dist
checkpoints) in one CPU process for tiny models. It works in three ways, in order of preference:

1. Official settings (:func:`configure_for_cpu`): local layer spec, fusions off, fp32, gloo, world size 1.
2. Module-scoped CUDA redirection: in the upstream modules listed in ``_TORCH_ON_CPU`` the global name
   ``torch`` is replaced by a proxy whose ``torch.cuda`` answers for the CPU (current device, streams,
   events, synchronize, RNG state) and whose tensor factories turn ``device="cuda"`` into the CPU.
   The real ``torch`` module is untouched, so code outside those modules sees the real CUDA state.
3. A few targeted attribute replacements (``_PATCHES``), each naming the upstream line it works around.

The only process-wide change is ``torch.Tensor.cuda`` (see :func:`_patch_tensor_cuda`): methods are
looked up on the class, so they cannot be scoped to one module.
"""

from __future__ import annotations

import contextlib
import importlib
import sys
import types
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from bridge_ext.compat import apply_stack_fixes
from bridge_ext.cpu_config import (  # re-exported: CPU mode's settings and process setup
    configure_for_cpu, cpu_layer_spec, init_cpu_distributed, init_single_process_distributed, launched_world_size,
    reset_megatron_globals, validation_without_gpu,
)
from bridge_ext.sdpa_attention import SDPACoreAttention
from bridge_ext.stack import (
    UpstreamDrift, missing_snippets, package_of,
)
from bridge_ext.te_guard import install_te_import_guard

__all__ = [
    "SDPACoreAttention",
    "check_patch_targets",
    "validation_without_gpu",
    "configure_for_cpu",
    "cpu_layer_spec",
    "cpu_mode_active",
    "enable_cpu_mode",
    "init_cpu_distributed",
    "init_single_process_distributed",
    "launched_world_size",
    "patch_table",
    "reset_megatron_globals",
]


# ---------------------------------------------------------------------------------------------------------
# CPU mode
# ---------------------------------------------------------------------------------------------------------

_active = False


def cpu_mode_active() -> bool:
    """True once :func:`enable_cpu_mode` has run in this process."""
    return _active


def _torch():
    import torch

    return torch


def _is_cuda_device(device: Any) -> bool:
    torch = _torch()
    if isinstance(device, torch.device):
        return device.type == "cuda"
    if isinstance(device, str):
        return device.startswith("cuda")
    return isinstance(device, int) and not isinstance(device, bool)  # an int device means a CUDA ordinal


class _NullStream:
    """A CUDA stream/event stand-in: work on the CPU is synchronous, so every wait is already done."""

    def __init__(self, *args: Any, **kwargs: Any):
        pass

    def __enter__(self) -> _NullStream:
        return self

    def __exit__(self, *exc: Any) -> None:
        return None

    def synchronize(self) -> None:
        return None

    def wait_stream(self, *args: Any) -> None:
        return None

    def wait_event(self, *args: Any) -> None:
        return None

    def record_event(self, *args: Any) -> _NullStream:
        return self

    def record(self, *args: Any) -> None:
        return None

    def wait(self, *args: Any) -> None:
        return None

    def query(self) -> bool:
        return True

    def elapsed_time(self, other: Any) -> float:
        return 0.0


class _NvtxOnCPU:
    @staticmethod
    def range_push(*args: Any, **kwargs: Any) -> None:
        return None

    @staticmethod
    def range_pop(*args: Any, **kwargs: Any) -> None:
        return None

    @staticmethod
    def range(*args: Any, **kwargs: Any) -> contextlib.nullcontext:
        return contextlib.nullcontext()


class _CudaOnCPU:
    """Stands in for ``torch.cuda`` inside the patched upstream modules.

    The "current CUDA device" is the CPU; streams and events are no-ops; the CUDA RNG state is the CPU
    default generator's state (dropout and init on the CPU draw from it, so forking it in Megatron's RNG
    tracker keeps the tracker's semantics). Anything not listed falls through to the real ``torch.cuda``.
    """

    Stream = _NullStream
    Event = _NullStream
    nvtx = _NvtxOnCPU

    def __init__(self, claims_gpu: bool = False) -> None:
        self.random = self  # torch.cuda.random.get_rng_state(...)
        self._claims_gpu = claims_gpu

    def is_available(self) -> bool:
        """False (the truth), except in modules that assert a GPU before doing CPU-safe work."""
        return self._claims_gpu

    @staticmethod
    def current_device():
        return _torch().device("cpu")

    @staticmethod
    def device_count() -> int:
        return 1

    @staticmethod
    def get_rng_state(device: Any = "cuda"):
        return _torch().get_rng_state()

    @staticmethod
    def set_rng_state(new_state: Any, device: Any = "cuda") -> None:
        _torch().set_rng_state(new_state)

    @staticmethod
    def manual_seed(seed: int) -> None:
        _torch().default_generator.manual_seed(int(seed))

    manual_seed_all = manual_seed

    @staticmethod
    def current_stream(*args: Any) -> _NullStream:
        return _NullStream()

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
        return getattr(_torch().cuda, name)


class _DistributedOnCPU:
    """Stands in for ``torch.distributed``: NCCL process groups become gloo ones."""

    def __getattr__(self, name: str) -> Any:
        return getattr(_torch().distributed, name)

    @staticmethod
    def init_process_group(backend: str | None = None, *args: Any, **kwargs: Any) -> None:
        if backend in (None, "nccl"):
            backend = "gloo"
        _torch().distributed.init_process_group(backend, *args, **kwargs)

    @staticmethod
    def new_group(*args: Any, backend: Any = None, **kwargs: Any) -> Any:
        if backend == "nccl":
            backend = "gloo"
        return _torch().distributed.new_group(*args, backend=backend, **kwargs)

    @staticmethod
    def scatter(tensor: Any, scatter_list: Any = None, *args: Any, **kwargs: Any) -> Any:
        """gloo's scatter reads each input as if it were contiguous: a strided view arrives scrambled (torch
        2.10 and 2.14.1, ``ProcessGroupGloo::scatter``; NCCL is not affected). Contiguous copies are sent."""
        if scatter_list is not None:
            scatter_list = [t.contiguous() for t in scatter_list]
        return _torch().distributed.scatter(tensor, scatter_list, *args, **kwargs)


_FACTORIES = frozenset(
    {
        "arange", "as_tensor", "empty", "empty_like", "empty_strided", "eye", "full", "full_like", "linspace",
        "ones", "ones_like", "rand", "randint", "randn", "randperm", "tensor", "zeros", "zeros_like",
    }
)


class _TorchOnCPU(types.ModuleType):
    """Stands in for the ``torch`` module inside one patched upstream module (see ``_TORCH_ON_CPU``)."""

    def __init__(self, claims_gpu: bool = False) -> None:
        super().__init__("torch")
        self.cuda = _CudaOnCPU(claims_gpu)
        self.distributed = _DistributedOnCPU()
        self._wrapped: dict[str, Callable] = {}

    def __getattr__(self, name: str) -> Any:
        value = getattr(_torch(), name)
        if name not in _FACTORIES:
            return value
        if name not in self._wrapped:

            def factory(*args: Any, _real=value, **kwargs: Any) -> Any:
                if _is_cuda_device(kwargs.get("device")):
                    kwargs["device"] = "cpu"
                return _real(*args, **kwargs)

            self._wrapped[name] = factory
        return self._wrapped[name]


_TORCH_PROXIES: dict[bool, _TorchOnCPU] = {}

# Upstream modules whose global ``torch`` becomes a ``_TorchOnCPU``, and the CUDA code in each that needs it
# (megatron-core 0.16.0-0.16.1, megatron-bridge 0.3.0-0.3.1), matched by content: every snippet must still
# occur in the module (check_patch_targets), and each mentions ``cuda`` or ``nccl``.
_TORCH_ON_CPU: dict[str, tuple[str, ...]] = {
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
    "megatron.core.transformer.moe.moe_utils": (
        'tracker[key]["values"] = torch.zeros(num_layers, device="cuda")',
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
    "megatron.core.models.gpt.gpt_model": (
        'device=torch.cuda.current_device(),',
    ),
    "megatron.core.transformer.transformer_layer": (
        '.to(torch.cuda.current_device())',
        'device=torch.cuda.current_device(),',
    ),
    "megatron.core.transformer.attention": (
        'device=torch.cuda.current_device(),',
    ),
    "megatron.core.transformer.moe.experts": (
        'device=torch.cuda.current_device(),',
    ),
    # DDP grad buffers and their communication stream
    "megatron.core.distributed.param_and_grad_buffer": (
        'stream_context = torch.cuda.stream(self.communication_stream)',
        'self.communication_stream.wait_stream(torch.cuda.default_stream())',
        'torch.cuda.default_stream().wait_stream(self.communication_stream)',
        'tmp_warmup_tensor = torch.zeros([1], device="cuda")',
        'device=torch.cuda.current_device(),',
    ),
    "megatron.core.distributed.distributed_data_parallel": (
        'communication_stream = torch.cuda.Stream(device=torch.cuda.current_device())',
        'torch.cuda.synchronize()',
        'torch.cuda.empty_cache()',
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
        "grad_norm = torch.zeros(1, dtype=torch.float, device='cuda')",
        "total_num_zeros = torch.zeros(1, dtype=torch.float, device='cuda')",
    ),
    # schedules, timers, rerun state machine
    "megatron.core.pipeline_parallel.schedules": (
        'total_num_tokens = torch.zeros([], dtype=torch.int, device="cuda")',
    ),
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
    # provide_distributed_model: NCCL init, set_device, `model.cuda(torch.cuda.current_device())`, DDP stream
    "megatron.bridge.models.model_provider": (
        'torch.cuda.set_device(get_local_rank_preinit())',
        'torch.distributed.init_process_group("nccl")',
        'model_module.cuda(torch.cuda.current_device())',
        'ddp_stream = torch.cuda.Stream()',
        'ddp_stream.wait_stream(torch.cuda.current_stream())',
        'with torch.cuda.stream(ddp_stream):',
        'torch.cuda.current_stream().wait_stream(ddp_stream)',
    ),
    # conversion under TP > 1 (nemo llm import --tp): replicated weights (norms, router) are moved to the CUDA
    # device before their broadcast to the TP ranks. Also gives scatter_to_tp_ranks' torch.distributed.scatter
    # of row-parallel shards (torch.chunk(dim=1) views) _DistributedOnCPU.scatter, which sends copies.
    "megatron.bridge.models.conversion.param_mapping": (
        'if target_device.index != torch.cuda.current_device():',
        'hf_weights = hf_weights.to(torch.cuda.current_device())',
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
    "megatron.bridge.training.utils.batch_utils": (
        'device=torch.cuda.current_device(),',
    ),
    # torch_dist checkpoint save: synchronize after staging, success/verification all-reduces
    "megatron.core.dist_checkpointing.strategies.filesystem_async": (
        'torch.cuda.synchronize()',
    ),
    "megatron.core.dist_checkpointing.strategies.state_dict_saver": (
        "all_results = torch.tensor([local_verify_reuse], dtype=torch.int, device='cuda')",
        '[int(len(node_failures) > 0)], dtype=torch.int, device=torch.cuda.current_device()',
    ),
    "megatron.core.dist_checkpointing.strategies.fully_parallel": (
        'torch.cuda.synchronize()',
    ),
    "megatron.core.dist_checkpointing.strategies.async_utils": (
        'ten = torch.tensor([is_alive], dtype=torch.int, device=torch.cuda.current_device())',
        'torch.cuda.synchronize()',
        'ten = torch.tensor([call_idx], dtype=torch.int, device=torch.cuda.current_device())',
    ),
}

# Modules whose ``torch.cuda.is_available()`` answers True: they assert a GPU, then do CPU-safe work.
_CLAIMS_GPU = frozenset({"megatron.bridge.training.initialize"})


# ---------------------------------------------------------------------------------------------------------
# Targeted attribute patches
# ---------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Patch:
    """Replace ``module.attr`` (or set it, when ``must_exist`` is False) to work around upstream code.

    ``snippets``: code that must still occur in the module's source for the patch to be right.
    """

    name: str
    module: str
    attr: str
    snippets: tuple[str, ...]
    why: str
    make: Callable[[Any], Any]  # old value (or None) -> new value
    must_exist: bool = True


def _rng_state_get(device: Any = "cuda", clone: bool = False, graph_safe: bool = False):
    return _torch().get_rng_state()


def _rng_state_set(new_state: Any, device: Any = -1, graph_safe: bool = False) -> None:
    _torch().set_rng_state(new_state)


def _mla_build_module(build_module: Callable) -> Callable:
    """``build_module`` for multi_latent_attention.py: its local core attention becomes SDPA-based."""
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    def build(spec: Any, *args: Any, **kwargs: Any) -> Any:
        if spec is DotProductAttention or getattr(spec, "module", None) is DotProductAttention:
            return SDPACoreAttention(*args, **kwargs)
        return build_module(spec, *args, **kwargs)

    return build


def _clip_grad_by_total_norm_fp32(clip_grads: Any) -> Callable:
    """``clip_grads.clip_grad_by_total_norm_fp32`` with its fp32 check on the dtype, not the CUDA type."""
    torch = _torch()

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


def _rewritten(qualname: str, replacements: tuple[tuple[str, str], ...]) -> Callable[[Any], Any]:
    """``make`` for a patch that recompiles one upstream function with a few exact text replacements.

    The function's own source is read, each ``old`` must occur in it (the patch's snippets are the
    ``old`` strings, so ``check_patch_targets`` reports drift first), and the result is compiled in the
    upstream module's globals under the same name: every other line is upstream's, unchanged.
    """

    def make(old_function: Any) -> Any:
        import inspect
        import textwrap

        function = getattr(old_function, "__func__", old_function)
        source = textwrap.dedent(inspect.getsource(function))
        for old, new in replacements:
            if old not in source:
                raise UpstreamDrift(f"{package_of(function.__module__)}: {qualname} no longer contains {old!r}")
            source = source.replace(old, new)
        namespace: dict[str, Any] = {}
        module = sys.modules[function.__module__]
        exec(compile(source, f"<bridge_ext.cpu_mode: {function.__module__}.{qualname}>", "exec"),
             module.__dict__, namespace)
        return namespace[function.__name__]

    return make


# distrib_optimizer.py's fp32/fp16/bf16 check asks for the legacy CUDA type names (megatron-core 0.16:
# `_build_model_and_main_param_groups`, lines 361, 420, 431); a CPU parameter is 'torch.FloatTensor'.
_DISTRIB_OPTIMIZER_TYPES = (
    ("if model_param.type() in ['torch.cuda.HalfTensor', 'torch.cuda.BFloat16Tensor']:",
     "if model_param.type() in ['torch.HalfTensor', 'torch.BFloat16Tensor']:"),
    ("elif model_param.type() == 'torch.cuda.FloatTensor':", "elif model_param.type() == 'torch.FloatTensor':"),
)

# layer_wise_optimizer.py (dist_muon): `allgather_params` all-gathers each rank's flattened parameters, whose
# sizes differ (an all_gather_v); gloo requires equal sizes. Every rank pads to the largest and trims.
_LAYER_WISE_ALLGATHER = (
    ("torch.distributed.all_gather(output_list, src, group=group)",
     "_bridge_ext_all_gather_v(output_list, src, group)"),
)

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


def _sequence_parallel_norm(norm: Any, config: Any) -> Any:
    """Flag a norm's parameters as TE's and Apex's norms do (``setattr(p, 'sequence_parallel', ...)``)."""
    for param in norm.parameters():
        param.sequence_parallel = bool(config.sequence_parallel)
    return norm


def _all_gather_v(output_list: list, src: Any, group: Any) -> None:
    """``all_gather`` of tensors of different sizes over gloo: pad to the largest, gather, copy back."""
    torch = _torch()
    size = max(t.numel() for t in output_list)
    padded = [torch.empty(size, dtype=src.dtype, device=src.device) for _ in output_list]
    source = torch.zeros(size, dtype=src.dtype, device=src.device)
    source[: src.numel()] = src
    torch.distributed.all_gather(padded, source, group=group)
    for out, got in zip(output_list, padded):
        out.copy_(got[: out.numel()])


_PATCHES: tuple[_Patch, ...] = (
    _Patch(
        name="jit-warmup",
        module="megatron.bridge.training.initialize",
        attr="_warmup_jit_function",
        snippets=("_warmup_jit_function(model_config, micro_batch_size)", 'device="cuda"'),
        why="warms torch.compile'd bias_swiglu/bias_dropout_add on CUDA tensors; with those fusions off (CPU) "
        "the kernels never run, and compiling them with inductor costs ~3 s per run",
        make=_jit_warmup,
    ),
    _Patch(
        name="clip-grads-fp32-check",
        module="megatron.core.optimizer.clip_grads",
        attr="clip_grad_by_total_norm_fp32",
        snippets=("assert param.grad.type() == 'torch.cuda.FloatTensor'",),
        why="asserts the legacy CUDA tensor type; a CPU fp32 grad is 'torch.FloatTensor'",
        make=lambda old: _clip_grad_by_total_norm_fp32(importlib.import_module("megatron.core.optimizer.clip_grads")),
    ),
    _Patch(
        name="clip-grads-fp32-check (imported name)",
        module="megatron.core.optimizer.optimizer",
        attr="clip_grad_by_total_norm_fp32",
        snippets=("from .clip_grads import clip_grad_by_total_norm_fp32",),
        why="optimizer.py binds the function at import (used at optimizer.py:215 and :1324)",
        make=lambda old: _clip_grad_by_total_norm_fp32(importlib.import_module("megatron.core.optimizer.clip_grads")),
    ),
    _Patch(
        name="mla-have-te",
        module="megatron.core.transformer.multi_latent_attention",
        attr="HAVE_TE",
        snippets=("HAVE_TE", "isinstance(self.linear_proj, TELinear)"),
        why="without TE, extensions/transformer_engine.py:76 makes `te` a MagicMock, so the import succeeds, "
        "HAVE_TE is True and TELinear is a MagicMock instance: isinstance() raises TypeError",
        make=lambda old: False,
    ),
    _Patch(
        name="rng-get",
        module="megatron.core.tensor_parallel.random",
        attr="_get_cuda_rng_state",
        snippets=("torch.cuda.random.get_rng_state", "torch.cuda.default_generators"),
        why="the CUDA RNG state is the CPU generator's state",
        make=lambda old: _rng_state_get,
    ),
    _Patch(
        name="rng-set",
        module="megatron.core.tensor_parallel.random",
        attr="_set_cuda_rng_state",
        snippets=("_lazy_call(cb)",),
        why="torch.cuda._lazy_call queues the callback forever when CUDA never initializes",
        make=lambda old: _rng_state_set,
    ),
    _Patch(
        name="moe-te-general-gemm",
        module="megatron.core.transformer.moe.moe_utils",
        attr="te_general_gemm",
        snippets=("te_general_gemm is not None",),
        why="without TE the name is never bound (only imported in a try block): NameError in every router",
        make=lambda old: None,
        must_exist=False,
    ),
    _Patch(
        name="distrib-optimizer-cpu-types",
        module="megatron.core.optimizer.distrib_optimizer",
        attr="DistributedOptimizer._build_model_and_main_param_groups",
        snippets=tuple(old for old, _ in _DISTRIB_OPTIMIZER_TYPES),
        why="the distributed optimizer accepts only 'torch.cuda.*Tensor' parameters (TypeError for CPU fp32 ones); "
        "recompiled with the CPU type names",
        make=_rewritten("DistributedOptimizer._build_model_and_main_param_groups", _DISTRIB_OPTIMIZER_TYPES),
    ),
    _Patch(
        name="layer-wise-all-gather-v (helper)",
        module="megatron.core.optimizer.layer_wise_optimizer",
        attr="_bridge_ext_all_gather_v",
        snippets=("torch.distributed.all_gather(output_list, src, group=group)",),
        why="the padded all-gather the layer-wise optimizer's recompiled allgather_params calls",
        make=lambda old: _all_gather_v,
        must_exist=False,
    ),
    _Patch(
        name="layer-wise-all-gather-v",
        module="megatron.core.optimizer.layer_wise_optimizer",
        attr="LayerWiseDistributedOptimizer.allgather_params",
        snippets=tuple(old for old, _ in _LAYER_WISE_ALLGATHER),
        why="dist_muon all-gathers parameter shards of different sizes per rank; gloo needs equal sizes "
        "(RuntimeError); padded to the largest",
        make=_rewritten("LayerWiseDistributedOptimizer.allgather_params", _LAYER_WISE_ALLGATHER),
    ),
    _Patch(
        name="layer-wise-fp32-save",
        module="megatron.core.optimizer.layer_wise_optimizer",
        attr="LayerWiseDistributedOptimizer.sharded_state_dict",
        snippets=(*(old for old, _ in _LAYER_WISE_SAVE), "if not sd['optimizer']['state']:"),
        why="dist_muon's torch_dist save reads sd['optimizer'], which an fp32 member lacks (KeyError 'optimizer'; "
        "CPU mode is fp32); and marks replicated expert state as main replica on every rank when one "
        "data-parallel rank spreads nothing (TP2 ETP1: invalid access pattern)",
        make=_rewritten("LayerWiseDistributedOptimizer.sharded_state_dict", _LAYER_WISE_SAVE),
    ),
    _Patch(
        name="torch-norm-sequence-parallel (helper)",
        module="megatron.core.transformer.torch_norm",
        attr="_bridge_ext_sequence_parallel_norm",
        snippets=("return norm_cls(normalized_shape=hidden_size, eps=eps)",),
        why="flags the norm's parameters for sequence parallelism; called by the recompiled WrappedTorchNorm",
        make=lambda old: _sequence_parallel_norm,
        must_exist=False,
    ),
    _Patch(
        name="torch-norm-sequence-parallel",
        module="megatron.core.transformer.torch_norm",
        attr="WrappedTorchNorm.__new__",
        snippets=tuple(old for old, _ in _TORCH_NORM_SEQUENCE_PARALLEL),
        why="the local spec's torch norms assert no sequence parallelism (TP layouts turn it on); with their "
        "weights flagged `sequence_parallel`, finalize_model_grads sums their gradients over TP as for TE's",
        make=_rewritten("WrappedTorchNorm.__new__", _TORCH_NORM_SEQUENCE_PARALLEL),
    ),
    _Patch(
        name="mla-core-attention",
        module="megatron.core.transformer.multi_latent_attention",
        attr="build_module",
        snippets=("self.core_attention = build_module(", "k_channels=self.q_head_dim"),
        why="local DotProductAttention takes no k_channels/v_channels; MLA gets an SDPA core attention",
        make=_mla_build_module,
    ),
)


# Callers of ``Tensor.cuda()`` / ``Module.cuda()`` on the training path (see :func:`_patch_tensor_cuda`).
_TENSOR_CUDA_CALLERS: dict[str, tuple[str, ...]] = {
    "megatron.bridge.training.gpt_step": (
        '_batch_required_keys[key] = val.cuda(non_blocking=True) if val is not None else None',
    ),
    "megatron.bridge.training.utils.batch_utils": (
        '"tokens": data["tokens"].cuda(non_blocking=True),',
        '"labels": data["labels"].cuda(non_blocking=True),',
        '"loss_mask": data["loss_mask"].cuda(non_blocking=True),',
        '"attention_mask": None if "attention_mask" not in data else data["attention_mask"].cuda(non_blocking=True),',
        '"position_ids": data["position_ids"].cuda(non_blocking=True),',
    ),
    "megatron.bridge.models.model_provider": (
        'model_module.cuda(torch.cuda.current_device())',
    ),
}


def patch_table() -> list[dict[str, Any]]:
    """Every CPU-mode patch as ``{"target", "code", "why"}`` (for docs and ``--device cpu`` logs)."""
    rows = [
        {"target": f"{module}.torch", "code": list(snippets), "why": "torch.cuda / device='cuda' -> CPU"}
        for module, snippets in _TORCH_ON_CPU.items()
    ]
    rows += [{"target": f"{p.module}.{p.attr}", "code": list(p.snippets), "why": p.why} for p in _PATCHES]
    rows += [
        {"target": "torch.Tensor.cuda (process-wide)",
         "code": [f"{m}: {c}" for m, snippets in _TENSOR_CUDA_CALLERS.items() for c in snippets],
         "why": "`.cuda()` returns the tensor itself; methods cannot be scoped to a module"}
    ]
    return rows


def check_patch_targets() -> list[str]:
    """What no longer matches upstream: one line per drifted target; empty when all patches fit."""
    targets = [(module, snippets, "CUDA redirect") for module, snippets in _TORCH_ON_CPU.items()]
    targets += [(patch.module, patch.snippets, patch.name) for patch in _PATCHES]
    targets += [(module, snippets, "Tensor.cuda caller") for module, snippets in _TENSOR_CUDA_CALLERS.items()]
    problems: list[str] = []
    for module_name, snippets, what in targets:
        try:
            module = importlib.import_module(module_name)
        except ImportError as exc:
            problems.append(f"{package_of(module_name)}: cannot import {module_name} ({exc})")
            continue
        problems += [f"{package_of(module_name)}: {module_name} no longer contains {code!r} ({what})"
                     for code in missing_snippets(module_name, snippets)]
        if what == "CUDA redirect":
            current = module.__dict__.get("torch")
            if current is not _torch() and not isinstance(current, _TorchOnCPU):
                problems.append(f"{package_of(module_name)}: {module_name}'s global `torch` is {current!r}")
    for patch in _PATCHES:
        module = sys.modules.get(patch.module)
        if module is not None and patch.must_exist and _owner(module, patch.attr) is None:
            problems.append(f"{package_of(patch.module)}: {patch.module}.{patch.attr} is gone ({patch.name})")
    return problems


def _owner(module: Any, attr: str) -> Any:
    """The object that holds ``attr`` (``"Class.method"`` -> the class), or None when it is gone."""
    owner = module
    *path, name = attr.split(".")
    for part in path:
        owner = getattr(owner, part, None)
    return owner if owner is not None and hasattr(owner, name) else None


def _apply_patches() -> None:
    for module_name in _TORCH_ON_CPU:
        claims_gpu = module_name in _CLAIMS_GPU
        proxy = _TORCH_PROXIES.setdefault(claims_gpu, _TorchOnCPU(claims_gpu))
        importlib.import_module(module_name).torch = proxy
    for patch in _PATCHES:
        module = importlib.import_module(patch.module)
        owner = _owner(module, patch.attr) or module
        name = patch.attr.rsplit(".", 1)[-1]
        setattr(owner, name, patch.make(owner.__dict__.get(name, getattr(owner, name, None))))
    _patch_tensor_cuda()


def _patch_tensor_cuda() -> None:
    """``Tensor.cuda()`` returns the tensor itself (process-wide; ``Module.cuda()`` goes through it).

    Works around the callers in ``_TENSOR_CUDA_CALLERS``: ``gpt_step.py:131`` and ``batch_utils.py:53-57``
    (``batch[k].cuda(non_blocking=True)``), ``model_provider.py:583`` (``model_module.cuda(...)``, which
    ``pretrain()`` always reaches). A method is looked up on the class, so this cannot be scoped to those
    modules. Only installed in CPU mode, where no tensor may go to a GPU anyway.
    """
    torch = _torch()
    if getattr(torch.Tensor.cuda, "_bridge_ext_cpu", False):
        return

    def cuda(self, device: Any = None, non_blocking: bool = False, memory_format: Any = None):
        return self

    cuda._bridge_ext_cpu = True  # type: ignore[attr-defined]
    torch.Tensor.cuda = cuda  # type: ignore[method-assign]


def enable_cpu_mode() -> None:
    """Make Megatron Bridge's model construction, forward/backward, optimizers, training loop and torch_dist
    checkpoints run on the CPU in one process. Idempotent. Raises :class:`~bridge_ext.stack.UpstreamDrift`
    (one line per drifted target, nothing patched) when installed code no longer looks as a patch expects.
    """
    global _active
    if _active:
        return
    install_te_import_guard()
    apply_stack_fixes()
    problems = check_patch_targets()
    if problems:
        more = f" (and {len(problems) - 1} more; tests/test_cpu_mode.py lists them)" if len(problems) > 1 else ""
        raise UpstreamDrift(f"CPU mode does not fit the installed code: {problems[0]}{more}")
    _apply_patches()
    _active = True
