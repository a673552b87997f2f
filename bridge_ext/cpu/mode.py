"""Switching CPU mode on: the ``import``, ``stack``, ``without-te`` and ``cpu`` patches, once per process.

CPU mode is only active once :func:`enable_cpu_mode` ran (the CLI calls it for ``--device cpu`` or when no GPU
is visible), never on a normal GPU run.
"""

from __future__ import annotations

from bridge_ext import upstream_patch

__all__ = ["cpu_mode_active", "enable_cpu_mode"]

_active = False


def cpu_mode_active() -> bool:
    """True once :func:`enable_cpu_mode` has run in this process."""
    return _active


def enable_cpu_mode() -> None:
    """Make Megatron Bridge's model construction, forward/backward, optimizers, training loop and torch_dist
    checkpoints run on CPU processes. Idempotent. Raises :class:`~bridge_ext.stack.UpstreamDrift` (one line,
    nothing patched) when installed code no longer looks as a patch expects.
    """
    global _active
    if _active:
        return
    upstream_patch.apply("import")
    upstream_patch.apply("stack")
    upstream_patch.apply("without-te")  # megatron-core's MLA and MoE built without TE (bridge_ext.without_te)
    upstream_patch.apply("cpu")
    _active = True
