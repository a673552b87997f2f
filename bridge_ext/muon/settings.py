"""Muon's run-time settings: what a preset's run-time parts read at every call (process-wide), and the names of the
patches that wire them into megatron-core.

:class:`MuonSettings` is one immutable object, built once from a preset and the run's config
(:meth:`MuonSettings.of`); :func:`bridge_ext.muon.presets.install_preset` makes it the current one in one step
(:func:`install`, the one assignment: a second preset's settings replace the first's whole, nothing changes a
field), and the patched code reads it through :func:`muon_settings`. It is a module-level value, not an argument,
because the code that reads it is called by megatron-core, which passes no such argument:

* :func:`ns_coefficients_default`: megatron-core 0.16's ``get_megatron_muon_optimizer`` builds
  ``TensorParallelMuon`` without a ``coefficient_type`` (always the class default "quintic") and
  ``OptimizerConfig`` has no field for it: an unspecified ``coefficient_type`` becomes the preset's. Where
  megatron-core passes it explicitly (0.17+: ``coefficient_type=config.muon_coefficient_type``) the default is
  never used.
* the gate/up split (:func:`bridge_ext.muon.split.gate_up_apart`, inside ``TensorParallelMuon.orthogonalize``).

This module is the one place the settings live (tests/test_layering.py: no module outside ``bridge_ext/muon/``
holds Muon state). Imports neither torch nor Megatron.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from recipes.optimizers import OptimizerPreset

__all__ = ["GATE_UP_SPLIT", "MUON_CLIP", "NS_COEFFICIENTS", "MuonSettings", "install", "muon_settings",
           "ns_coefficients_default", "ns_coefficients_of"]


def ns_coefficients_of(preset: OptimizerPreset, cfg: Any = None) -> str | None:
    """The Newton-Schulz coefficient set a run of ``cfg`` uses: its ``optimizer.muon_coefficient_type`` where the
    installed OptimizerConfig has the field (an override counts), else the preset's (megatron-core 0.16)."""
    if preset.kind != "muon":
        return None
    configured = getattr(getattr(cfg, "optimizer", None), "muon_coefficient_type", None)
    return configured or preset.ns_coefficients


@dataclass(frozen=True, kw_only=True)
class MuonSettings:
    """What the ``muon`` patches read at every call. The defaults are megatron-core's own behaviour (what a
    process without a Muon preset, or with an AdamW one, runs)."""

    ns_coefficients: str = "quintic"  # what TensorParallelMuon gets when none is passed (0.16's default)
    split_gate_up: bool = False  # orthogonalize gate and up of a gated linear_fc1 apart

    @classmethod
    def of(cls, preset: OptimizerPreset, cfg: Any = None) -> MuonSettings:
        """The settings a run of ``cfg`` (a ``ConfigContainer``, or None: the preset alone) with ``preset`` needs:
        the coefficient set :func:`ns_coefficients_of` says, the preset's gate/up split; the defaults for a preset
        that is not Muon."""
        if preset.kind != "muon":
            return cls()
        return cls(ns_coefficients=ns_coefficients_of(preset, cfg), split_gate_up=preset.split_gate_up)


_current = MuonSettings()


def muon_settings() -> MuonSettings:
    """The current settings (the defaults until a preset is installed)."""
    return _current


def install(settings: MuonSettings) -> None:
    """Make ``settings`` the current ones, whole (the one assignment; callers: ``bridge_ext.muon.presets``)."""
    global _current
    if not isinstance(settings, MuonSettings):
        raise TypeError(f"expected MuonSettings, got {type(settings).__name__}")
    _current = settings


# The muon-scope patches by job, for ``patches.apply("muon", only=...)``. TensorParallelMuon has two homes in
# megatron-core (optimizer/muon.py 0.16-0.17, optimizer/emerging_optimizers.py 0.18+): one patch per home,
# ``name`` and ``name (emerging_optimizers)`` (bridge_ext.patches.optimizer builds the rows in this order).
NS_COEFFICIENTS = ("muon-ns-coefficients", "muon-ns-coefficients (emerging_optimizers)")
GATE_UP_SPLIT = ("muon-gate-up-params", "muon-gate-up-split", "muon-gate-up-split (emerging_optimizers)")
MUON_CLIP = ("muon-clip-any-wrapper",)


def ns_coefficients_default(original: Callable) -> Callable:
    """``TensorParallelMuon.__init__`` whose unspecified ``coefficient_type`` is the current settings'
    (:func:`muon_settings`, read when the optimizer is built: megatron-core calls this, not our code)."""

    @functools.wraps(original)  # inspect.signature() sees upstream's parameters through __wrapped__
    def __init__(self, *args: Any, coefficient_type: str | None = None, **kwargs: Any) -> None:
        chosen = coefficient_type or muon_settings().ns_coefficients
        original(self, *args, coefficient_type=chosen, **kwargs)
        self.coefficient_type = chosen  # what it runs: for telemetry and tests

    return __init__
