"""Optimizer patches: megatron-core's Muon (``megatron/core/optimizer/muon.py``) and emerging-optimizers.

Stack fixes (scope ``stack``, every run, GPUs too):

* ``muon-nesterov-kwarg``: megatron-core 0.16 ``TensorParallelMuon.__init__`` passes ``use_nesterov=`` to
  emerging-optimizers' ``OrthogonalizedOptimizer``; 0.3.0 renamed it ``nesterov``. Applies with
  emerging-optimizers 0.3.0; skipped with 0.1.0 (the NeMo 26.02 container's).
* ``muon-tp-mode-kwarg``: the same file (``TensorParallelMuon.orthogonalize``) calls
  ``newton_schulz_tp(..., mode=...)``; emerging-optimizers 0.3.0 renamed it ``tp_mode``. Same stacks.

A Muon preset's run-time parts (scope ``muon``, applied by ``bridge_ext.muon.presets.install_preset``): each
row points at the function in ``bridge_ext.muon`` that does the work; what they do is the preset's
``bridge_ext.muon.settings.MuonSettings``, installed whole with the preset and read at every call
(``muon_settings()``: megatron-core calls these functions and cannot hand them our settings):

* ``muon-ns-coefficients``: megatron-core 0.16's ``get_megatron_muon_optimizer`` builds ``TensorParallelMuon``
  without a ``coefficient_type`` (always the class default "quintic") and ``OptimizerConfig`` has no field for
  it: an unspecified ``coefficient_type`` becomes the preset's (``bridge_ext.muon.settings``). Where megatron-core
  passes it explicitly (0.17+: ``coefficient_type=config.muon_coefficient_type``) the default is never used.
* ``muon-gate-up-params`` / ``muon-gate-up-split``: orthogonalize a gated MLP's gate and up projections
  (``linear_fc1`` = ``[gate; up]``) apart, as Moonlight's reference Muon does on the HF weights
  (``bridge_ext.muon.split``).
* ``muon-clip-any-wrapper``: Megatron Bridge's training step calls megatron-core's ``qk_clip.clip_qk``, which
  reaches the decoder as ``model_chunk.module.module`` (a Float16Module): ``AttributeError`` for fp32 models
  (``bridge_ext.muon.clip``).

Muon over LoRA adapters (scope ``lora-muon``): ``muon-lora-no-empty-adam``.

And (scope ``stack``): ``muon-coefficient-types``: megatron-core 0.17 ``optimizer/muon.py``
``validate_coefficient_type`` accepts only "quintic" unless emerging-optimizers >= 0.2 is installed, although
emerging-optimizers 0.1.0's ``newton_schulz`` has the same sets ("simple" included): with 0.1.0 (the NeMo
26.04 containers') a preset's "simple" would stop the optimizer's construction. Accepts every set the installed
emerging-optimizers defines; skipped where megatron-core does not check (0.16, 0.18+) or already accepts them.
"""

from __future__ import annotations

import importlib
import importlib.util
from collections.abc import Callable
from typing import Any

from bridge_ext.muon.clip import bridge_clip_qk
from bridge_ext.muon.settings import GATE_UP_SPLIT, NS_COEFFICIENTS, ns_coefficients_default
from bridge_ext.muon.split import gate_up_apart, marking_gate_up
from bridge_ext.stack import UpstreamDrift, call_keywords, module_source, package_of, signature_params
from bridge_ext.upstream_patch import Patch

__all__ = ["PATCHES", "renamed_kwarg"]

_MUON = "megatron.core.optimizer.muon"


def renamed_kwarg(caller_passes: frozenset[str], callee: Callable, *, old: str, new: str, what: str) -> bool:
    """True when the caller passes ``old=`` but the callee now takes ``new=``; False when nothing to fix."""
    if old not in caller_passes:
        return False
    params = signature_params(callee)
    if old in params:
        return False
    if new in params:
        return True
    raise UpstreamDrift(f"{package_of(callee.__module__)}: {what} takes neither {old}= nor {new}=, which "
                        f"{package_of(_MUON)} passes; bridge_ext.patches.optimizer needs updating for this pair")


def _orthogonalized_optimizer() -> Any:
    from emerging_optimizers.orthogonalized_optimizers import OrthogonalizedOptimizer

    return OrthogonalizedOptimizer


def _newton_schulz_tp() -> Any:
    from emerging_optimizers.orthogonalized_optimizers.muon_utils import newton_schulz_tp

    return newton_schulz_tp


def _nesterov_needed() -> bool:
    return renamed_kwarg(call_keywords(_MUON, "__init__", inside="TensorParallelMuon"),
                         _orthogonalized_optimizer().__init__, old="use_nesterov", new="nesterov",
                         what="OrthogonalizedOptimizer.__init__")


def _tp_mode_needed() -> bool:
    return renamed_kwarg(call_keywords(_MUON, "newton_schulz_tp"), _newton_schulz_tp(), old="mode",
                         new="tp_mode", what="newton_schulz_tp")


def _nesterov_bases(bases: tuple[type, ...]) -> tuple[type, ...]:
    base = _orthogonalized_optimizer()

    class _OrthogonalizedOptimizerKwargs(base):
        """Accepts megatron-core 0.16's ``use_nesterov=`` for emerging-optimizers 0.3.0's ``nesterov=``."""

        def __init__(self, *args: Any, use_nesterov: bool, **kwargs: Any) -> None:
            super().__init__(*args, nesterov=use_nesterov, **kwargs)

    return (_OrthogonalizedOptimizerKwargs,)


def _tp_mode_shim(newton_schulz_tp: Callable) -> Callable:
    def newton_schulz_tp_mode(*args: Any, mode: str = "duplicated", **kwargs: Any) -> Any:
        return newton_schulz_tp(*args, tp_mode=mode, **kwargs)

    return newton_schulz_tp_mode


# --- a Muon preset's run-time parts (scope "muon") -----------------------------------------------------------


# Where megatron-core defines TensorParallelMuon: optimizer/muon.py (0.16-0.17), optimizer/emerging_optimizers.py
# (0.18+). One patch per home; each applies where the class is defined there.
_TPM_HOMES = (_MUON, "megatron.core.optimizer.emerging_optimizers")


def _defines_tensor_parallel_muon(module: str) -> Callable[[], bool]:
    def needed() -> bool:
        if importlib.util.find_spec(module) is None:
            return False
        cls = getattr(importlib.import_module(module), "TensorParallelMuon", None)
        return cls is not None and cls.__module__ == module

    return needed


# --- Muon over LoRA adapters (scope "lora-muon") ----------------------------------------------------------------


def _without_empty_parts(build: Callable) -> Callable:
    def get_megatron_muon_optimizer(*args: Any, **kwargs: Any) -> Any:
        optimizer = build(*args, **kwargs)
        parts = getattr(optimizer, "chained_optimizers", None)
        if parts and any(getattr(p, "optimizer", p) is None for p in parts):
            optimizer.chained_optimizers = [p for p in parts if getattr(p, "optimizer", p) is not None]
        return optimizer

    return get_megatron_muon_optimizer


_OPTIM = "megatron.bridge.training.optim"


# One patch per home of TensorParallelMuon, named as bridge_ext.muon.settings lists them.
assert len(NS_COEFFICIENTS) == len(GATE_UP_SPLIT[1:]) == len(_TPM_HOMES)


# --- megatron-core 0.17 optimizer/muon.py validate_coefficient_type vs emerging-optimizers 0.1.0 -------------
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
        name="muon-nesterov-kwarg", area="optimizer", scope="stack",
        module=_MUON, attr="TensorParallelMuon.__bases__",
        upstream="megatron/core/optimizer/muon.py TensorParallelMuon.__init__ -> OrthogonalizedOptimizer",
        why="megatron-core passes use_nesterov=; emerging-optimizers 0.3.0 takes nesterov=",
        when="TensorParallelMuon passes use_nesterov= and OrthogonalizedOptimizer takes nesterov=",
        needed=_nesterov_needed,
        accepts=lambda bases: bases == (_orthogonalized_optimizer(),),
        make=_nesterov_bases,
    ),
    Patch(
        name="muon-tp-mode-kwarg", area="optimizer", scope="stack",
        module=_MUON, attr="newton_schulz_tp",
        upstream="megatron/core/optimizer/muon.py TensorParallelMuon.orthogonalize -> newton_schulz_tp",
        why="megatron-core passes mode=; emerging-optimizers 0.3.0 takes tp_mode=",
        when="megatron-core passes mode= and newton_schulz_tp takes tp_mode=",
        needed=_tp_mode_needed,
        accepts=lambda function: function is _newton_schulz_tp(),
        make=_tp_mode_shim,
    ),
    *(Patch(
        name=name,
        area="optimizer", scope="muon", module=home, attr="TensorParallelMuon.__init__",
        upstream=f"{home.replace('.', '/')}.py TensorParallelMuon, built by get_megatron_muon_optimizer without "
                 "coefficient_type",
        why="the preset's Newton-Schulz coefficients (e.g. Keller Jordan's 'simple') instead of the class default "
            "'quintic' where nothing passes one (an explicit coefficient_type= still wins)",
        when=f"a Muon preset is installed; TensorParallelMuon is defined in {home}",
        needed=_defines_tensor_parallel_muon(home),
        snippets=('coefficient_type: str = "quintic",',),
        make=ns_coefficients_default,
    ) for name, home in zip(NS_COEFFICIENTS, _TPM_HOMES)),
    Patch(
        name="muon-gate-up-params", area="optimizer", scope="muon",
        module=_OPTIM, attr="get_megatron_muon_optimizer",
        upstream="megatron/bridge/training/optim.py setup_optimizer -> get_megatron_muon_optimizer",
        why="flags the gated linear_fc1 weights (is_gate_up) by name, which only the model knows, for "
            "muon-gate-up-split, and the fp32 main copies a bf16 optimizer steps (megatron-core copies only its own "
            "attributes to them: without it bf16 runs orthogonalized gate and up together)",
        when="a Muon preset is installed",
        snippets=("get_megatron_muon_optimizer(",),
        make=marking_gate_up,
    ),
    *(Patch(
        name=name,
        area="optimizer", scope="muon", module=home, attr="TensorParallelMuon.orthogonalize",
        upstream=f"{home.replace('.', '/')}.py TensorParallelMuon.orthogonalize: linear_fc1 as one matrix",
        why="Moonlight's Muon orthogonalizes gate_proj and up_proj apart, each scaled by its own shape; "
            "megatron-core stores them as one [gate; up] matrix (off unless the preset splits them)",
        when=f"a Muon preset is installed; TensorParallelMuon is defined in {home}",
        needed=_defines_tensor_parallel_muon(home),
        make=gate_up_apart,
    ) for name, home in zip(GATE_UP_SPLIT[1:], _TPM_HOMES)),
    Patch(
        name="muon-clip-any-wrapper", area="optimizer", scope="muon",
        module="megatron.bridge.training.train", attr="clip_qk",
        upstream="megatron/core/optimizer/qk_clip.py clip_qk: model_chunk.module.module.decoder (called from "
                 "megatron/bridge/training/train.py after optimizer.step())",
        why="assumes a Float16Module: AttributeError for fp32 models; ours finds the decoder through any wrapper",
        when="a Muon preset is installed",
        snippets=("clip_qk(",),
        make=bridge_clip_qk,
    ),
    Patch(
        name="muon-lora-no-empty-adam", area="optimizer", scope="lora-muon",
        module=_OPTIM, attr="get_megatron_muon_optimizer",
        upstream="megatron/core/optimizer/muon.py get_megatron_muon_optimizer: always chains the Adam part",
        why="with only LoRA's A and B training (all matrices) the Adam part wraps None and the first checkpoint "
            "save fails in its state_dict; only parts that hold parameters are chained",
        when="LoRA fine-tuning with a Muon preset, where megatron-core's Muon builder chains an Adam part whatever it "
             "holds (0.16-0.17 muon.py; 0.18 builds through get_megatron_optimizer, measured without the row)",
        needed=lambda: "chained_adam = get_megatron_optimizer(" in module_source("megatron.core.optimizer.muon"),
        snippets=("get_megatron_muon_optimizer(",),
        make=_without_empty_parts,
    ),
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
