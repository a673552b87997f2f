"""Optimizer patches: megatron-core's Muon (``megatron/core/optimizer/muon.py``) and emerging-optimizers.

Stack fixes (scope ``stack``, every run, GPUs too):

* ``muon-nesterov-kwarg``: megatron-core 0.16 ``TensorParallelMuon.__init__`` passes ``use_nesterov=`` to
  emerging-optimizers' ``OrthogonalizedOptimizer``; 0.3.0 renamed it ``nesterov``. Applies with
  emerging-optimizers 0.3.0; skipped with 0.1.0 (the NeMo 26.02 container's).
* ``muon-tp-mode-kwarg``: the same file (``TensorParallelMuon.orthogonalize``) calls
  ``newton_schulz_tp(..., mode=...)``; emerging-optimizers 0.3.0 renamed it ``tp_mode``. Same stacks.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from bridge_ext.patches.core import Patch
from bridge_ext.stack import UpstreamDrift, call_keywords, package_of, signature_params

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
)
