"""CPU mode: Megatron Bridge's real training loop on CPU processes, for development and tests on tiny models.

The CPU harness, apart from the GPU path's deviations (``bridge_ext.patches``), in one package:

* :mod:`bridge_ext.cpu.config`: official settings and process setup (:func:`configure_for_cpu`, the local layer
  spec, gloo process groups).
* :mod:`bridge_ext.cpu.patches`: the patches CPU mode needs (scope ``cpu``, area ``cpu``; registered in
  ``bridge_ext.patches.REGISTRY`` like every other, each naming the upstream code it works around and matched
  against it by content).
* :mod:`bridge_ext.cpu.mode`: :func:`enable_cpu_mode` switches them on, once per process.

A GPU run imports nothing of this package (tests/test_gpu_side.py): it is imported where CPU mode is switched on.
What a GPU run shares with it lives outside: ``bridge_ext.without_te`` (the local layer spec, MLA's SDPA core
attention, the ``without-te`` patches) and ``bridge_ext.process_state`` (the one-process group, clearing Megatron's globals).

docs/cpu.md describes CPU mode; tests/test_cpu_mode.py and tests/test_cpu_training.py run it.
"""

from bridge_ext.cpu.config import (
    configure_for_cpu,
    init_cpu_distributed,
)
from bridge_ext.cpu.mode import cpu_mode_active, enable_cpu_mode

__all__ = [
    "configure_for_cpu",
    "cpu_mode_active",
    "enable_cpu_mode",
    "init_cpu_distributed",
]
