"""Workarounds for running Megatron Bridge without a GPU or without Transformer Engine.

Every patch names the upstream file it works around and the code it expects there, matched by content (a
snippet that must still occur in the module, never a line number), so patch releases that move lines keep
working and a real change stops CPU mode with one line naming the package and version
(``tests/test_cpu_mode.py`` checks every target on every stack CI runs). CPU mode is only active once
:func:`enable_cpu_mode` ran (the CLI calls it for ``--device cpu`` or when no GPU is visible), never on a
normal GPU run. The Transformer Engine import guard lives in ``bridge_ext.patches.import_time``.

CPU mode is a development and testing mode: it runs Megatron Bridge's real ``pretrain()`` loop (data,
forward, backward, optimizer step, clipping, LR schedule, logging, torch_dist checkpoints) on CPU processes
(one, or several under torchrun over gloo) for tiny models. It works in three ways, in order of preference:

1. Official settings (:func:`configure_for_cpu`, ``bridge_ext.cpu_config``): local layer spec, fusions off,
   fp32, gloo, the parallel sizes the launch holds.
2. Module-scoped CUDA redirection (``redirect``): in the upstream modules the ``TORCH_ON_CPU`` tables list,
   the global name ``torch`` answers for the CPU.
3. A few targeted attribute replacements (the ``PATCHES`` tables), each naming the upstream code it works
   around; the machinery (a patch, recompiling one function with exact text replacements, matching every
   target by content) is ``patching``.

The package's parts: ``redirect`` (the CUDA stand-ins), ``patching`` (the machinery), ``single_process``
(what every run reaches: model, forward/backward, optimizer, training loop, checkpoints), ``distributed``
(what several processes add: distributed and layer-wise optimizers, sequence-parallel norms, pipeline p2p,
conversion under TP). This module assembles their tables and switches CPU mode on.
"""

from __future__ import annotations

import importlib
from typing import Any

from bridge_ext import patches
from bridge_ext.cpu_config import (  # re-exported: CPU mode's settings and process setup
    configure_for_cpu, cpu_layer_spec, init_cpu_distributed, init_single_process_distributed, launched_world_size,
    reset_megatron_globals, validation_without_gpu,
)
from bridge_ext.cpu_mode import distributed, patching, redirect, single_process
from bridge_ext.sdpa_attention import SDPACoreAttention
from bridge_ext.stack import UpstreamDrift

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

# Every target, from the parts (tests/test_cpu_mode.py reads and monkeypatches these).
_TORCH_ON_CPU: dict[str, tuple[str, ...]] = {**single_process.TORCH_ON_CPU, **distributed.TORCH_ON_CPU}
_CLAIMS_GPU = single_process.CLAIMS_GPU
_PATCHES: tuple[patching.Patch, ...] = (*single_process.PATCHES, *distributed.PATCHES)
_TENSOR_CUDA_CALLERS: dict[str, tuple[str, ...]] = dict(single_process.TENSOR_CUDA_CALLERS)

_active = False


def cpu_mode_active() -> bool:
    """True once :func:`enable_cpu_mode` has run in this process."""
    return _active


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
    return patching.problems(_TORCH_ON_CPU, _PATCHES, _TENSOR_CUDA_CALLERS)


def _apply_patches() -> None:
    for module_name in _TORCH_ON_CPU:
        importlib.import_module(module_name).torch = redirect.torch_proxy(module_name in _CLAIMS_GPU)
    for patch in _PATCHES:
        patching.apply(patch)
    redirect.patch_tensor_cuda()


def enable_cpu_mode() -> None:
    """Make Megatron Bridge's model construction, forward/backward, optimizers, training loop and torch_dist
    checkpoints run on CPU processes. Idempotent. Raises :class:`~bridge_ext.stack.UpstreamDrift` (one line
    per drifted target, nothing patched) when installed code no longer looks as a patch expects.
    """
    global _active
    if _active:
        return
    patches.apply("import")
    patches.apply("stack")
    problems = check_patch_targets()
    if problems:
        more = f" (and {len(problems) - 1} more; tests/test_cpu_mode.py lists them)" if len(problems) > 1 else ""
        raise UpstreamDrift(f"CPU mode does not fit the installed code: {problems[0]}{more}")
    _apply_patches()
    _active = True
