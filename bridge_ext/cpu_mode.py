"""CPU mode: Megatron Bridge's real training loop on CPU processes, for development and tests on tiny models.

Two parts: official settings and process setup (``bridge_ext.cpu_config``, re-exported here) and the patches
CPU mode needs (``bridge_ext.patches.cpu``, scope ``cpu``, each naming the upstream code it works around and
matched against it by content). CPU mode is only active once :func:`enable_cpu_mode` ran (the CLI calls it for
``--device cpu`` or when no GPU is visible), never on a normal GPU run.
"""

from __future__ import annotations

from bridge_ext import patches
from bridge_ext.cpu_config import (  # re-exported: CPU mode's settings and process setup
    configure_for_cpu, cpu_layer_spec, init_cpu_distributed, init_single_process_distributed, launched_world_size,
    reset_megatron_globals, validation_without_gpu,
)
from bridge_ext.sdpa_attention import SDPACoreAttention

__all__ = [
    "SDPACoreAttention",
    "configure_for_cpu",
    "cpu_layer_spec",
    "cpu_mode_active",
    "enable_cpu_mode",
    "init_cpu_distributed",
    "init_single_process_distributed",
    "launched_world_size",
    "reset_megatron_globals",
    "validation_without_gpu",
]

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
    patches.apply("import")
    patches.apply("stack")
    patches.apply("cpu")
    _active = True
