"""CPU mode's patches (scope ``cpu``, applied by ``bridge_ext.cpu.enable_cpu_mode``, never on a GPU run).

CPU mode runs Megatron Bridge's real ``pretrain()`` loop (data, forward, backward, optimizer step, clipping, LR
schedule, logging, torch_dist checkpoints) on CPU processes (one, or several under torchrun over gloo) for tiny
models. It works in three ways, in order of preference:

1. Official settings (``bridge_ext.cpu.config``, not patches): local layer spec, fusions off, fp32, gloo.
2. Module-scoped CUDA redirection (``redirect``): in the upstream modules the ``TORCH_ON_CPU`` tables list, the
   global name ``torch`` answers for the CPU (one patch per module, ``cuda-on-cpu <module>``); and
   ``Tensor.cuda()`` keeps tensors on the CPU (process-wide: a method cannot be scoped to a module).
3. A few targeted attribute replacements and recompiled functions (the ``PATCHES`` tables).

Parts: ``single_process`` (what every run reaches: model, forward/backward, optimizer, training loop,
checkpoints), ``distributed`` (what several processes add: distributed and layer-wise optimizers,
sequence-parallel norms, pipeline p2p, conversion under TP), ``moved`` (CUDA code that releases keep in
different modules: redirected where the installed one has it), ``redirect`` (the CUDA stand-ins).
"""

from __future__ import annotations

from typing import Any

from bridge_ext.cpu.patches import distributed, moved, single_process
from bridge_ext.cpu.patches.redirect import TorchOnCPU, real_torch, tensor_stays_on_cpu, torch_proxy
from bridge_ext.upstream_patch import Patch

__all__ = ["PATCHES", "TENSOR_CUDA_CALLERS", "TORCH_ON_CPU"]

TORCH_ON_CPU: dict[str, tuple[str, ...]] = {**single_process.TORCH_ON_CPU, **distributed.TORCH_ON_CPU}
TENSOR_CUDA_CALLERS: dict[str, tuple[str, ...]] = dict(single_process.TENSOR_CUDA_CALLERS)


def _is_torch(value: Any) -> bool:
    return value is real_torch() or isinstance(value, TorchOnCPU)


def _redirect(module: str, snippets: tuple[str, ...]) -> Patch:
    claims_gpu = module in single_process.CLAIMS_GPU
    return Patch(
        name=f"cuda-on-cpu {module}", area="cpu", scope="cpu", module=module, attr="torch",
        upstream=f"{module.replace('.', '/')}.py: torch.cuda.* calls and device='cuda' tensors",
        why="torch.cuda / device='cuda' -> CPU" + (" (is_available() answers True: the module asserts a GPU, "
                                                   "then does CPU-safe work)" if claims_gpu else ""),
        when="CPU mode", snippets=snippets, accepts=_is_torch, make=lambda old: torch_proxy(claims_gpu),
    )


PATCHES: tuple[Patch, ...] = (
    *(_redirect(module, snippets) for module, snippets in TORCH_ON_CPU.items()),
    *moved.PATCHES,
    *single_process.PATCHES,
    *distributed.PATCHES,
    Patch(
        name="tensor-cuda-stays-on-cpu", area="cpu", scope="cpu", module="torch", attr="Tensor.cuda",
        upstream="megatron/bridge/training/gpt_step.py, models/model_provider.py: .cuda()",
        why="`.cuda()` returns the tensor itself; methods cannot be scoped to a module",
        when="CPU mode", elsewhere=tuple(TENSOR_CUDA_CALLERS.items()), make=lambda old: tensor_stays_on_cpu,
    ),
)
