"""Every change we make to upstream behaviour (Megatron Bridge, megatron-core, emerging-optimizers, torch), in one
package, with one mechanism (:class:`Patch`, in ``bridge_ext.upstream_patch``, below every package the rows wire in) and
one registry (:data:`REGISTRY`).

A patch names the upstream code it works around, the condition it applies under (decided from the installed
code by capability, never by version numbers), the code it relies on (matched by content: drift is one line
naming the package and version) and when it is applied (its scope). One module per upstream subsystem, every row
of a module in its area (tests/test_patches.py); the code a row puts in place lives with the feature it is
(``bridge_ext.muon``, ``bridge_ext.kill_safe``, ...), the module only declares the row:

* ``import_time``: Megatron Bridge without Transformer Engine (the import guard, PEFT's ``HAVE_TE``).
* ``optimizer``: megatron-core's Muon vs emerging-optimizers, Newton-Schulz coefficients, the gate/up split,
  MuonClip, Muon over LoRA adapters, the coefficient sets megatron-core 0.17 accepts (the preset field names the
  installed megatron-core knows are an adapter, not a patch: ``bridge_ext.upstream_api``).
* ``transformer``: megatron-core's attention: QK-clip's known bugs, MLA's latent norms and query as DeepSeek-V3's.
* ``tensor_parallel``: megatron-core's tensor-parallel layers: the weights' TP attributes without
  ``perform_initialization`` (megatron-core 0.16-0.17), set by a pre-wrap hook.
* ``training``: Megatron Bridge's start-up, scheduler and dry-run validation.
* ``checkpointing``: kill-safe saves, the checkpoint writer's helper processes, loads across layouts, the
  optimizer's param groups on resume.
* ``conversion``: SequentialMLP experts in Megatron Bridge's HF conversion.
* ``rehearse``: one rank of a real layout on fake tensors (``nemo llm rehearse``).
* CPU mode's patches (CUDA redirected per module, targeted patches, recompiled functions) are the CPU harness's,
  in ``bridge_ext.cpu.patches``, registered here like every other: this package is the GPU path's deviations.

Which upstream entry point to call, and with which names, changes nothing upstream and is not here:
``bridge_ext.upstream_api``.
Where upstream offers an extension point, a row uses it instead of changing upstream code: a pre-wrap hook
(``hook=``, registered on each provider by :func:`register_hooks`), a subclass (``transformer``'s resolver).
Adding a patch: one :class:`Patch` entry in its area module's ``PATCHES`` (and, for a new scope, a call of
:func:`apply` where it must take effect); tests/test_patches.py and docs/patches.md pick it up.
``python -m bridge_ext.patches`` prints the table (``--markdown``: docs/patches.md).
"""

from typing import Any

from bridge_ext.patches import registry
from bridge_ext.upstream_patch import Area, Patch, Scope, problems
from bridge_ext.patches.registry import (
    applied,
    applied_here,
    apply,
    drift,
    markdown,
    register_hooks,
    rows,
    table,
    temporarily,
)

__all__ = ["REGISTRY", "Area", "Patch", "Scope", "applied", "applied_here", "apply", "drift", "markdown", "problems",
           "register_hooks", "rows", "table", "temporarily"]


def __getattr__(name: str) -> Any:
    if name == "REGISTRY":  # every table: loaded on first use (registry.TABLES: a scope imports only its own)
        return registry.REGISTRY
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
