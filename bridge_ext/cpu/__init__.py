"""CPU mode: Megatron Bridge's real training loop on CPU processes, for development and tests on tiny models.

The CPU harness, apart from the GPU path's deviations (``bridge_ext.patches``), in one package:

* :mod:`bridge_ext.cpu.config`: official settings and process setup (:func:`configure_for_cpu`, the local layer
  spec, gloo process groups, resetting Megatron's globals between runs).

A GPU run imports nothing of this package (tests/test_layering.py): it is imported where CPU mode is switched on.
* :mod:`bridge_ext.cpu.sdpa_attention`: :class:`SDPACoreAttention`, MLA's core attention without Transformer
  Engine (also a GPU run's without TE: ``bridge_ext.without_te``).
* :mod:`bridge_ext.cpu.patches`: the patches CPU mode needs (scope ``cpu``, area ``cpu``; registered in
  ``bridge_ext.patches.REGISTRY`` like every other, each naming the upstream code it works around and matched
  against it by content).
* :mod:`bridge_ext.cpu.mode`: :func:`enable_cpu_mode` switches them on, once per process.

docs/cpu.md describes CPU mode; tests/test_cpu_mode.py and tests/test_cpu_training.py run it.
"""

from bridge_ext.cpu.config import (
    configure_for_cpu,
    init_cpu_distributed,
    init_single_process_distributed,
    reset_megatron_globals,
)
from bridge_ext.cpu.mode import cpu_mode_active, enable_cpu_mode
from bridge_ext.cpu.sdpa_attention import SDPACoreAttention

__all__ = [
    "SDPACoreAttention",
    "configure_for_cpu",
    "cpu_mode_active",
    "enable_cpu_mode",
    "init_cpu_distributed",
    "init_single_process_distributed",
    "reset_megatron_globals",
]
