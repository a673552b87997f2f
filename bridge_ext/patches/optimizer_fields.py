"""Optimizer presets in one vocabulary, megatron-core's ``OptimizerConfig`` in the installed one.

Presets (``recipes.optimizers``) name every setting as megatron-core 0.19's ``OptimizerConfig`` does: the
*canonical* vocabulary. :func:`installed_optimizer_fields` turns a preset into the fields the installed
``OptimizerConfig`` has, decided by its dataclass fields (never by a version number):

* a renamed field takes the installed name (:data:`RENAMED`: ``muon_nesterov`` is ``muon_use_nesterov`` in
  megatron-core 0.16/0.17; 0.18 renamed it, with no alias);
* a field the installed release lacks is dropped where the preset asks for what that release always does
  (:data:`WHERE_ABSENT` says what it does instead, and where), and is a one-line ``UserError`` naming the
  preset, the field and the package where the preset asks for anything else;
* ``muon_coefficient_type`` (megatron-core 0.17+): where it is absent (0.16), megatron-core builds
  ``TensorParallelMuon`` with no coefficient set and ``bridge_ext.muon.presets.install_ns_coefficients``
  supplies the preset's at run time; where it exists, megatron-core passes it explicitly
  (``coefficient_type=config.muon_coefficient_type``), which overrides any default installed there: the
  field is the only way the preset's set reaches the optimizer.

:func:`canonical_optimizer_fields` reads an installed config back in the canonical vocabulary (an absent
field as what its release runs instead), so that one reference describes the run on every stack
(tests/test_same_run_across_stacks.py).

Patch (scope ``stack``): ``muon-coefficient-types``: megatron-core 0.17 ``optimizer/muon.py``
``validate_coefficient_type`` accepts only "quintic" unless emerging-optimizers >= 0.2 is installed, although
emerging-optimizers 0.1.0's ``newton_schulz`` has the same sets ("simple" included): with 0.1.0 (the NeMo
26.04 containers') a preset's "simple" would stop the optimizer's construction. Accepts every set the installed
emerging-optimizers defines; skipped where megatron-core does not check (0.16, 0.18+) or already accepts them.
"""

from __future__ import annotations

import dataclasses
import importlib
from collections.abc import Mapping
from functools import cache
from typing import Any

from bridge_ext.errors import UserError
from bridge_ext.patching import Patch
from bridge_ext.stack import module_source, package_of

__all__ = [
    "PATCHES",
    "RENAMED",
    "RUN_TIME",
    "WHERE_ABSENT",
    "canonical_optimizer_fields",
    "config_has_coefficient_type",
    "installed_optimizer_fields",
    "optimizer_config_fields",
]

# canonical name -> the names older megatron-core releases give the same setting (newest first)
RENAMED: Mapping[str, tuple[str, ...]] = {
    "muon_nesterov": ("muon_use_nesterov",),  # megatron-core 0.16/0.17; renamed in 0.18 (no alias)
}

RUN_TIME = "run time"  # WHERE_ABSENT marker: bridge_ext.muon.presets supplies the value when the optimizer is built

# Canonical fields older releases lack: (what that release always runs instead, where upstream fixes it).
# A preset asking for that value loses nothing when the field is dropped; asking for another is refused.
WHERE_ABSENT: Mapping[str, tuple[Any, str]] = {
    # 0.16 optimizer/muon.py get_megatron_muon_optimizer: `config.optimizer = 'adam'` for every non-Muon param
    "muon_scalar_optimizer": ("adam", "megatron-core optimizer/muon.py routes every non-Muon parameter to Adam"),
    # 0.16/0.17: only the optimizer name makes Muon layer-wise (Megatron Bridge training/optim.py
    # `layer_wise_distributed_optimizer="dist" in optimizer_config.optimizer`); 0.18+ keeps that for "dist_muon"
    # (optimizer/__init__.py maps it to "muon" + layer-wise) and adds this field
    "use_layer_wise_distributed_optimizer": (False, "only the name dist_muon makes Muon layer-wise"),
    # 0.16 builds TensorParallelMuon without coefficient_type; bridge_ext.muon.presets.install_ns_coefficients
    # makes the preset's set the one it gets
    "muon_coefficient_type": (RUN_TIME, "bridge_ext.muon.presets.install_ns_coefficients sets it at run time"),
}


@cache
def optimizer_config_fields() -> frozenset[str]:
    """The fields of Megatron Bridge's ``OptimizerConfig`` (megatron-core's, with deferred validation)."""
    from megatron.bridge.training.config import OptimizerConfig

    return frozenset(f.name for f in dataclasses.fields(OptimizerConfig))


def config_has_coefficient_type() -> bool:
    """Whether megatron-core takes the Newton-Schulz coefficient set from ``OptimizerConfig`` (0.17+)."""
    return "muon_coefficient_type" in optimizer_config_fields()


def _installed_name(canonical: str, available: frozenset[str]) -> str | None:
    for name in (canonical, *RENAMED.get(canonical, ())):
        if name in available:
            return name
    return None


def installed_optimizer_fields(preset: str, fields: Mapping[str, Any], *,
                               available: frozenset[str] | None = None) -> dict[str, Any]:
    """``fields`` (canonical names) as the installed ``OptimizerConfig`` takes them; ``preset`` names it in errors.

    ``available``: the installed field names (default: :func:`optimizer_config_fields`).
    """
    available = optimizer_config_fields() if available is None else available
    out: dict[str, Any] = {}
    for canonical, value in fields.items():
        name = _installed_name(canonical, available)
        if name is not None:
            out[name] = value
            continue
        fixed, where = WHERE_ABSENT.get(canonical, (None, ""))
        if fixed == RUN_TIME or (where and value == fixed):
            continue  # the release runs this value anyway (WHERE_ABSENT says how)
        always = f" (it always runs {fixed!r}: {where})" if where else ""
        raise UserError(f"optimizer preset '{preset}' sets {canonical}={value!r}, which {package_of('megatron.core')} "
                        f"does not have{always}; pick another preset or another stack")
    return out


def canonical_optimizer_fields(config: Any, names: Any, *, run_time: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The values of ``names`` (canonical) in an installed ``OptimizerConfig``; an absent field reads as what
    its release runs instead (:data:`WHERE_ABSENT`), a run-time one as ``run_time[name]``."""
    available = frozenset(f.name for f in dataclasses.fields(config))
    out: dict[str, Any] = {}
    for canonical in names:
        name = _installed_name(canonical, available)
        if name is not None:
            out[canonical] = getattr(config, name)
        elif canonical in WHERE_ABSENT:
            fixed = WHERE_ABSENT[canonical][0]
            out[canonical] = (run_time or {}).get(canonical) if fixed == RUN_TIME else fixed
        else:
            raise KeyError(f"{canonical}: not in {package_of(type(config).__module__)}'s OptimizerConfig")
    return out


# --- megatron-core 0.17 optimizer/muon.py validate_coefficient_type vs emerging-optimizers 0.1.0 -------------
_MUON = "megatron.core.optimizer.muon"


def _coefficient_sets() -> tuple[str, ...]:
    """The Newton-Schulz coefficient sets the installed emerging-optimizers' ``newton_schulz`` knows."""
    from emerging_optimizers.orthogonalized_optimizers import muon_utils

    return tuple(muon_utils._COEFFICIENT_SETS)


def _refuses(validate: Any, name: str) -> bool:
    try:
        validate(name)
    except ValueError:
        return True
    return False


def _coefficient_types_needed() -> bool:
    muon = importlib.import_module(_MUON)
    validate = getattr(muon, "validate_coefficient_type", None)
    if validate is None or "validate_coefficient_type(coefficient_type)" not in module_source(_MUON):
        return False  # megatron-core does not check the name here (0.16; 0.18+ checks against emerging-optimizers)
    return any(_refuses(validate, name) for name in _coefficient_sets())


def _accept_installed_sets(validate: Any) -> Any:
    def validate_coefficient_type(coefficient_type: str) -> None:
        if coefficient_type not in _coefficient_sets():
            validate(coefficient_type)

    return validate_coefficient_type


PATCHES: tuple[Patch, ...] = (
    Patch(
        name="muon-coefficient-types", area="optimizer", scope="stack",
        module=_MUON, attr="validate_coefficient_type",
        upstream="megatron/core/optimizer/muon.py validate_coefficient_type (TensorParallelMuon.__init__)",
        why="megatron-core accepts only 'quintic' without emerging-optimizers >= 0.2, whose 0.1.0 newton_schulz "
            "has 'simple' too (the moonlight and kimi_k2 presets' set)",
        when="megatron-core checks the coefficient set and refuses one the installed emerging-optimizers has",
        needed=_coefficient_types_needed,
        snippets=("validate_coefficient_type(coefficient_type)",),
        make=_accept_installed_sets,
    ),
)
