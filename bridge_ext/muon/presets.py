"""Muon presets at run time: what a ``recipes.optimizers.MuonPreset`` needs beyond what ``bridge_ext.build`` applies.

:func:`apply_preset` writes the preset's model fields; :func:`install_preset` installs its run-time parts in one
step: one :class:`~bridge_ext.muon.settings.MuonSettings` built from the preset and the run's config (Newton-Schulz
coefficients, the gate/up split), the ``muon`` patches that read it, and MuonClip. :func:`resolve_schedule` sets
its schedule fractions as iteration counts (``recipes.budget.derived_schedule``, their one home). References: Moonlight, arXiv
2502.16982; megatron-core 0.16.1 ``optimizer/muon.py``; emerging-optimizers ``orthogonalized_optimizers``.
Imports neither torch nor Megatron.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import replace
from typing import TYPE_CHECKING, Any, Literal

from bridge_ext import upstream_patch
from bridge_ext.errors import UserError
from bridge_ext.muon.clip import install_muon_clip
from bridge_ext.muon.settings import (GATE_UP_SPLIT, NS_COEFFICIENTS, MuonSettings, install, muon_settings,
                                      ns_coefficients_of)
from recipes.budget import derived_schedule

if TYPE_CHECKING:
    from recipes.optimizers import OptimizerPreset

__all__ = ["CoefficientType", "MuonSettings", "apply_preset", "install_ns_coefficients", "install_preset",
           "install_settings", "installed_ns_coefficients", "ns_coefficients_of", "resolve_schedule"]

CoefficientType = Literal["simple", "quintic", "polar_express", "cans", "aol"]


def _check_coefficients(coefficient_type: str) -> None:
    from emerging_optimizers.orthogonalized_optimizers.muon_utils import _COEFFICIENT_SETS

    if coefficient_type not in _COEFFICIENT_SETS:
        raise UserError(f"unknown Newton-Schulz coefficient set '{coefficient_type}'; "
                        f"emerging-optimizers has: {', '.join(_COEFFICIENT_SETS)}")


def _switch_on_ns_coefficients() -> None:
    if not upstream_patch.apply("muon", only=NS_COEFFICIENTS):
        from bridge_ext.stack import UpstreamDrift, package_of

        raise UpstreamDrift(f"{package_of('megatron.core')}: no TensorParallelMuon in megatron.core.optimizer's "
                            "muon or emerging_optimizers module; bridge_ext.patches.optimizer needs updating")


def install_settings(settings: MuonSettings) -> None:
    """Make ``settings`` Muon's current run-time settings (process-wide), whole, and switch on the ``muon`` patches
    that read them; what :func:`install_preset` does with ``MuonSettings.of(preset, cfg)``.

    Newton-Schulz coefficients: megatron-core 0.16's ``get_megatron_muon_optimizer`` (``optimizer/muon.py:236``)
    builds ``TensorParallelMuon`` without a ``coefficient_type``, so it is always the class default "quintic"
    (modded-nanogpt's 5 per-step sets), and ``OptimizerConfig`` has no field for it: the ``muon-ns-coefficients``
    patch (``bridge_ext.patches.optimizer``, making :func:`~bridge_ext.muon.settings.ns_coefficients_default`) makes
    an unspecified ``coefficient_type`` the settings' (an explicit ``coefficient_type=`` still wins). "simple" is
    Keller Jordan's (3.4445, -4.7750, 2.0315). megatron-core 0.17+ passes
    ``coefficient_type=config.muon_coefficient_type`` explicitly: there the preset's set reaches Muon through that
    field (``bridge_ext.upstream_api``), and this default is never used. The gate/up split
    (:mod:`bridge_ext.muon.split`) is read at every step. Idempotent.
    """
    _check_coefficients(settings.ns_coefficients)
    install(settings)
    _switch_on_ns_coefficients()
    upstream_patch.apply("muon", only=GATE_UP_SPLIT)


def install_preset(preset: OptimizerPreset, cfg: Any = None) -> None:
    """A preset's process-wide parts, at run time, in one step: ``MuonSettings.of(preset, cfg)`` installed whole
    (:func:`install_settings`; a second preset replaces the first's settings, nothing is merged) and the MuonClip
    fix (:func:`install_muon_clip`). A preset that is not Muon (``adamw``) installs the defaults (megatron-core's
    "quintic", no split) and switches no patch on."""
    settings = MuonSettings.of(preset, cfg)
    if preset.kind != "muon":
        install(settings)
        return
    install_settings(settings)
    install_muon_clip()


def install_ns_coefficients(coefficient_type: CoefficientType) -> None:
    """The current settings with ``coefficient_type`` as the Newton-Schulz set, installed whole (one replacement,
    no field set), and the ``muon-ns-coefficients`` patch on: for tests and benchmarks that pick a set by hand; a
    run installs its preset (:func:`install_preset`)."""
    _check_coefficients(coefficient_type)
    install(replace(muon_settings(), ns_coefficients=coefficient_type))
    _switch_on_ns_coefficients()


def installed_ns_coefficients() -> str:
    """The coefficient set ``TensorParallelMuon`` gets when none is passed."""
    return muon_settings().ns_coefficients


def apply_preset(cfg: Any, preset: OptimizerPreset, *, runtime: bool = True) -> None:
    """Apply a preset's non-``OptimizerConfig`` settings to ``cfg`` (a Bridge ``ConfigContainer``).

    Writes the preset's model fields (QK-clip: ``qk_clip``, ``qk_clip_threshold``, ``qk_clip_alpha``,
    ``log_max_attention_logit`` on the TransformerConfig / provider) and, when ``runtime``, installs its
    run-time parts (:func:`install_preset`). A model field the installed megatron-core does not have fails
    with a ``UserError``.
    """
    for key, value in getattr(preset, "model", {}).items():
        if not hasattr(cfg.model, key):
            raise UserError(f"optimizer preset '{preset.name}' sets model.{key}, which the installed "
                            "megatron-core's TransformerConfig does not have; pick another preset")
        setattr(cfg.model, key, value)
    if runtime:
        install_preset(preset, cfg)


def resolve_schedule(cfg: Any, preset: OptimizerPreset, *, explicit: Collection[str] = ()) -> dict[str, Any]:
    """Set the scheduler values ``preset``'s schedule fractions give for ``cfg.train.train_iters``
    (``recipes.budget.derived_schedule``) on ``cfg.scheduler``; returns them (field name -> value).
    ``bridge_ext.build`` derives them once, after every override."""
    changed = derived_schedule(cfg.scheduler, preset, train_iters=cfg.train.train_iters, explicit=explicit)
    for name, value in changed.items():
        setattr(cfg.scheduler, name, value)
    return changed
