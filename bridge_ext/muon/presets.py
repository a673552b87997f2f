"""Muon presets at run time: what a ``recipes.optimizers.MuonPreset`` needs beyond what ``bridge_ext.build`` applies.

:func:`apply_preset` writes the preset's model fields and installs its Newton-Schulz coefficients
(:func:`install_ns_coefficients`), the gate/up split and MuonClip; :func:`resolve_schedule` turns its schedule
fractions into iteration counts. References: Moonlight, arXiv 2502.16982; megatron-core 0.16.1
``optimizer/muon.py``; emerging-optimizers ``orthogonalized_optimizers``. Imports neither torch nor Megatron.
"""

from __future__ import annotations

from collections.abc import Collection
from typing import TYPE_CHECKING, Any, Literal

from bridge_ext import patching
from bridge_ext.errors import UserError
from bridge_ext.muon.clip import install_muon_clip
from bridge_ext.muon.runtime import MUON, NS_COEFFICIENTS
from bridge_ext.muon.split import install_gate_up_split
from recipes.budget import SCHEDULE_FIELDS, derived_schedule

if TYPE_CHECKING:
    from recipes.optimizers import OptimizerPreset

__all__ = ["CoefficientType", "apply_preset", "install_ns_coefficients", "install_preset",
           "installed_ns_coefficients", "ns_coefficients_of", "resolve_schedule", "schedule_values"]

CoefficientType = Literal["simple", "quintic", "polar_express", "cans", "aol"]


def install_ns_coefficients(coefficient_type: CoefficientType) -> None:
    """Make every ``TensorParallelMuon`` built from now on use ``coefficient_type`` (process-wide).

    megatron-core 0.16's ``get_megatron_muon_optimizer`` (``optimizer/muon.py:236``) builds
    ``TensorParallelMuon`` without a ``coefficient_type``, so it is always the class default "quintic"
    (modded-nanogpt's 5 per-step sets), and ``OptimizerConfig`` has no field for it: the
    ``muon-ns-coefficients`` patch (``bridge_ext.patches.optimizer``, making
    :func:`~bridge_ext.muon.runtime.ns_coefficients_default`) makes an unspecified ``coefficient_type`` this one.
    Idempotent; an explicit ``coefficient_type=`` argument still wins. "simple" is Keller Jordan's
    (3.4445, -4.7750, 2.0315). megatron-core 0.17+ passes ``coefficient_type=config.muon_coefficient_type``
    explicitly: there the preset's set reaches Muon through that field (``bridge_ext.patches.optimizer_fields``),
    and this default is never used.
    """
    from emerging_optimizers.orthogonalized_optimizers.muon_utils import _COEFFICIENT_SETS

    if coefficient_type not in _COEFFICIENT_SETS:
        raise UserError(f"unknown Newton-Schulz coefficient set '{coefficient_type}'; "
                        f"emerging-optimizers has: {', '.join(_COEFFICIENT_SETS)}")
    MUON.ns_coefficients = coefficient_type
    if not patching.apply("muon", only=NS_COEFFICIENTS):
        from bridge_ext.stack import UpstreamDrift, package_of

        raise UpstreamDrift(f"{package_of('megatron.core')}: no TensorParallelMuon in megatron.core.optimizer's "
                            "muon or emerging_optimizers module; bridge_ext.patches.optimizer needs updating")


def installed_ns_coefficients() -> str:
    """The coefficient set ``TensorParallelMuon`` gets when none is passed."""
    return MUON.ns_coefficients


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


def ns_coefficients_of(preset: OptimizerPreset, cfg: Any = None) -> str | None:
    """The Newton-Schulz coefficient set a run of ``cfg`` uses: its ``optimizer.muon_coefficient_type`` where the
    installed OptimizerConfig has the field (an override counts), else the preset's (megatron-core 0.16)."""
    if preset.kind != "muon":
        return None
    configured = getattr(getattr(cfg, "optimizer", None), "muon_coefficient_type", None)
    return configured or preset.ns_coefficients


def install_preset(preset: OptimizerPreset, cfg: Any = None) -> None:
    """A Muon preset's process-wide parts, at run time: the Newton-Schulz coefficients ``cfg`` runs with
    (:func:`ns_coefficients_of`), the gate/up split and the MuonClip fix (:func:`install_muon_clip`). Plain presets
    (``nvidia_perf``, ``adamw``) install nothing: megatron-core's "quintic" stays."""
    if preset.kind == "muon":
        install_ns_coefficients(ns_coefficients_of(preset, cfg))  # 0.16 has no field: how its set gets there
        install_gate_up_split(getattr(preset, "split_gate_up", False))
        install_muon_clip()


def schedule_values(scheduler: Any, preset: OptimizerPreset, *, train_iters: int | None,
                    explicit: Collection[str] = ()) -> dict[str, Any]:
    """The scheduler values the preset's schedule fractions give for ``train_iters`` (``scheduler.`` keys):
    ``recipes.budget.derived_schedule`` of ``scheduler`` (a Bridge ``SchedulerConfig``). ``explicit``: the dotted
    keys the user set (an explicit ``scheduler.lr_wsd_decay_iters`` is kept unless it is unset)."""
    values = {name: getattr(scheduler, name, None) for name in SCHEDULE_FIELDS}
    names = {key.removeprefix("scheduler.") for key in explicit if key.startswith("scheduler.")}
    derived = derived_schedule(values, train_iters=train_iters, fractions=getattr(preset, "schedule_fractions", {}),
                               explicit=names, preset=preset.name)
    return {f"scheduler.{name}": value for name, value in derived.items()}


def resolve_schedule(cfg: Any, preset: OptimizerPreset, *, explicit: Collection[str] = ()) -> dict[str, Any]:
    """Set :func:`schedule_values` for ``cfg.train.train_iters`` on ``cfg.scheduler``; returns what changed
    (field name -> value). ``bridge_ext.build`` derives them once, after every override."""
    sched, changed = cfg.scheduler, {}
    for dotted, value in schedule_values(sched, preset, train_iters=cfg.train.train_iters, explicit=explicit).items():
        name = dotted.removeprefix("scheduler.")
        setattr(sched, name, value)
        changed[name] = value
    return changed
