"""Muon's run-time state: what a preset's run-time parts read at every call (process-wide), and the names of the
patches that wire them into megatron-core.

:data:`MUON` is the one place this state lives (tests/test_layering.py: no module outside ``bridge_ext/muon/``
holds Muon state). It is set by :func:`bridge_ext.muon.install_ns_coefficients`,
:func:`bridge_ext.muon.split.install_gate_up_split` and :func:`bridge_ext.muon.install_preset`, and read by the
functions the ``muon`` scope's patches (``bridge_ext.patches.optimizer``) put in place:

* :func:`ns_coefficients_default`: megatron-core 0.16's ``get_megatron_muon_optimizer`` builds
  ``TensorParallelMuon`` without a ``coefficient_type`` (always the class default "quintic") and
  ``OptimizerConfig`` has no field for it: an unspecified ``coefficient_type`` becomes the preset's. Where
  megatron-core passes it explicitly (0.17+: ``coefficient_type=config.muon_coefficient_type``) the default is
  never used.
* the gate/up split (:mod:`bridge_ext.muon.split`) and MuonClip (:mod:`bridge_ext.muon.clip`).

Imports neither torch nor Megatron.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

__all__ = ["GATE_UP_SPLIT", "MUON", "MUON_CLIP", "NS_COEFFICIENTS", "MuonRunTime", "ns_coefficients_default"]


@dataclass
class MuonRunTime:
    """What the ``muon`` patches read at every call (process-wide; set by ``bridge_ext.muon``)."""

    ns_coefficients: str = "quintic"  # what TensorParallelMuon gets when none is passed (0.16's default)
    split_gate_up: bool = False  # orthogonalize gate and up of a gated linear_fc1 apart


MUON = MuonRunTime()

# The muon-scope patches by job, for ``patches.apply("muon", only=...)``. TensorParallelMuon has two homes in
# megatron-core (optimizer/muon.py 0.16-0.17, optimizer/emerging_optimizers.py 0.18+): one patch per home,
# ``name`` and ``name (emerging_optimizers)`` (bridge_ext.patches.optimizer builds the rows in this order).
NS_COEFFICIENTS = ("muon-ns-coefficients", "muon-ns-coefficients (emerging_optimizers)")
GATE_UP_SPLIT = ("muon-gate-up-params", "muon-gate-up-split", "muon-gate-up-split (emerging_optimizers)")
MUON_CLIP = ("muon-clip-any-wrapper",)


def ns_coefficients_default(original: Callable) -> Callable:
    """``TensorParallelMuon.__init__`` whose unspecified ``coefficient_type`` is :data:`MUON`'s."""

    @functools.wraps(original)  # inspect.signature() sees upstream's parameters through __wrapped__
    def __init__(self, *args: Any, coefficient_type: str | None = None, **kwargs: Any) -> None:
        original(self, *args, coefficient_type=coefficient_type or MUON.ns_coefficients, **kwargs)
        self.coefficient_type = coefficient_type or MUON.ns_coefficients  # what it runs: for telemetry and tests

    return __init__
