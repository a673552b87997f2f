"""Everything that differs between the Megatron stacks we support, in one place.

A *stack* is a pinned set of megatron-bridge + megatron-core (+ emerging-optimizers). Product code asks
this module instead of testing versions itself.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache
from importlib import metadata

__all__ = ["Stack", "SUPPORTED_STACKS", "installed_stack", "version_tuple"]


def version_tuple(version: str) -> tuple[int, ...]:
    """``"0.16.1rc0"`` -> ``(0, 16, 1)``: numeric release parts only."""
    parts = []
    for piece in version.split(".")[:3]:
        digits = "".join(ch for ch in piece if ch.isdigit())
        if not digits:
            break
        parts.append(int(digits))
    return tuple(parts)


@dataclass(frozen=True, kw_only=True)
class Stack:
    name: str
    bridge: tuple[int, int]  # megatron-bridge major.minor
    core: tuple[int, int]  # megatron-core major.minor
    # megatron-core's OptimizerConfig Muon fields in this stack (used to validate presets).
    muon_fields: tuple[str, ...]
    # MB modules that import transformer_engine unguarded at module level (file, line).
    unguarded_te_imports: tuple[tuple[str, int], ...]


SUPPORTED_STACKS: tuple[Stack, ...] = (
    Stack(
        name="nemo-26.02",
        bridge=(0, 3),
        core=(0, 16),
        muon_fields=(
            "muon_momentum",
            "muon_split_qkv",
            "muon_use_nesterov",
            "muon_scale_mode",
            "muon_fp32_matmul_prec",
            "muon_num_ns_steps",
            "muon_tp_mode",
            "muon_extra_scale_factor",
        ),
        unguarded_te_imports=(
            ("megatron.bridge.peft.lora_layers", 20),
            ("megatron.bridge.peft.lora", 21),
        ),
    ),
)


class UnsupportedStackError(RuntimeError):
    pass


def pretrain_template():
    """Megatron Bridge's base pre-training ``ConfigContainer`` (every upstream recipe starts from it)."""
    from bridge_ext.cpu_mode import install_te_import_guard

    install_te_import_guard()
    from megatron.bridge.recipes.common import _pretrain_common  # 0.3.x location

    return _pretrain_common()


def check_optimizer_fields(preset: str, fields: dict) -> None:
    """Fail clearly when a preset sets a Muon field the installed megatron-core does not have."""
    from bridge_ext.errors import UserError

    unknown = sorted(k for k in fields if k.startswith("muon_") and k not in installed_stack().muon_fields)
    if unknown:
        raise UserError(
            f"optimizer preset '{preset}' sets {', '.join(unknown)}, which megatron-core "
            f"{'.'.join(map(str, installed_stack().core))} does not have; pick another preset"
        )


@cache
def installed_stack() -> Stack:
    """The supported stack matching the installed megatron-bridge / megatron-core versions."""
    try:
        bridge = version_tuple(metadata.version("megatron-bridge"))[:2]
        core = version_tuple(metadata.version("megatron-core"))[:2]
    except metadata.PackageNotFoundError as exc:
        raise UnsupportedStackError(f"{exc.name} is not installed; run `make install`") from None
    for stack in SUPPORTED_STACKS:
        if stack.bridge == bridge and stack.core == core:
            return stack
    known = ", ".join(f"{s.name} (bridge {s.bridge}, core {s.core})" for s in SUPPORTED_STACKS)
    raise UnsupportedStackError(
        f"megatron-bridge {bridge} + megatron-core {core} is not a supported stack; supported: {known}"
    )


# =========================================================================================================
# Stack fixes: version mismatches inside a pinned stack that break it on any device (GPU included).
# Not CPU-specific; applied by `apply_stack_fixes()` (bridge_ext.cpu_mode.enable_cpu_mode calls it; a GPU
# entry point should call it too). Each fix names the upstream line, applies only to the stacks listed,
# and raises StackFixError when its target no longer looks as expected.
# =========================================================================================================

import importlib  # noqa: E402
import inspect  # noqa: E402
from collections.abc import Callable  # noqa: E402
from typing import Any  # noqa: E402


class StackFixError(RuntimeError):
    """An upstream target of a stack fix changed; the fix needs updating."""


@dataclass(frozen=True)
class StackFix:
    name: str
    stacks: tuple[str, ...]
    check: Callable[[], None]  # raises StackFixError when the target drifted
    apply: Callable[[], None]
    why: str


def _source_line(module: Any, number: int) -> str:
    lines = inspect.getsourcelines(module)[0]
    return lines[number - 1] if 0 < number <= len(lines) else ""


def _expect_line(module_name: str, number: int, text: str) -> None:
    module = importlib.import_module(module_name)
    if text not in _source_line(module, number):
        raise StackFixError(f"{module.__file__}:{number} no longer contains {text!r}")


# --- megatron-core 0.16 optimizer/muon.py vs emerging-optimizers 0.3.0 ------------------------------------
# muon.py:103 calls OrthogonalizedOptimizer.__init__(..., use_nesterov=...) but 0.3.0 names it `nesterov`
# (keyword-only, required) -> TypeError; muon.py:87 calls newton_schulz_tp(..., mode=...) but 0.3.0 names
# it `tp_mode` -> TypeError on the first step.


def _check_muon_kwargs() -> None:
    _expect_line("megatron.core.optimizer.muon", 103, "use_nesterov=use_nesterov")
    _expect_line("megatron.core.optimizer.muon", 87, 'mode="duplicated" if mode == "blockwise" else mode')
    from emerging_optimizers.orthogonalized_optimizers import OrthogonalizedOptimizer
    from emerging_optimizers.orthogonalized_optimizers.muon_utils import newton_schulz_tp

    init = inspect.signature(OrthogonalizedOptimizer.__init__).parameters
    ns = inspect.signature(newton_schulz_tp).parameters
    if "nesterov" not in init or "use_nesterov" in init or "tp_mode" not in ns or "mode" in ns:
        raise StackFixError("emerging_optimizers Muon signatures changed; update the Muon stack fix")


def _apply_muon_kwargs() -> None:
    from emerging_optimizers.orthogonalized_optimizers import OrthogonalizedOptimizer
    from emerging_optimizers.orthogonalized_optimizers.muon_utils import newton_schulz_tp

    muon = importlib.import_module("megatron.core.optimizer.muon")
    tp_muon = muon.TensorParallelMuon
    if tp_muon.__bases__ != (OrthogonalizedOptimizer,):
        if getattr(tp_muon.__bases__[0], "_bridge_ext_fix", False):
            return  # already applied
        raise StackFixError(f"TensorParallelMuon bases are {tp_muon.__bases__}")

    class _OrthogonalizedOptimizerKwargs(OrthogonalizedOptimizer):
        """Accepts megatron-core 0.16's ``use_nesterov=`` for emerging-optimizers 0.3.0's ``nesterov=``."""

        _bridge_ext_fix = True

        def __init__(self, *args: Any, use_nesterov: bool, **kwargs: Any) -> None:
            super().__init__(*args, nesterov=use_nesterov, **kwargs)

    def newton_schulz_tp_mode(*args: Any, mode: str = "duplicated", **kwargs: Any) -> Any:
        return newton_schulz_tp(*args, tp_mode=mode, **kwargs)

    tp_muon.__bases__ = (_OrthogonalizedOptimizerKwargs,)
    muon.newton_schulz_tp = newton_schulz_tp_mode


# --- megatron-bridge 0.3 training/initialize.py:139 compile_helpers() ------------------------------------
# runs `make` in megatron/core/datasets, but the PyPI wheel ships the prebuilt helpers_cpp extension and no
# Makefile -> "Failed to compile" and sys.exit(1). Use the prebuilt extension (fail if it is missing).


def _check_compile_helpers() -> None:
    _expect_line("megatron.bridge.training.initialize", 139, "compile_helpers()")
    _expect_line("megatron.core.datasets.utils", 25, '["make", "-C"')


def _apply_compile_helpers() -> None:
    initialize = importlib.import_module("megatron.bridge.training.initialize")

    def use_prebuilt_helpers() -> None:
        importlib.import_module("megatron.core.datasets.helpers_cpp")  # ImportError if not prebuilt

    initialize.compile_helpers = use_prebuilt_helpers


STACK_FIXES: tuple[StackFix, ...] = (
    StackFix(
        name="muon-kwargs",
        stacks=("nemo-26.02",),
        check=_check_muon_kwargs,
        apply=_apply_muon_kwargs,
        why="megatron-core 0.16 Muon passes use_nesterov=/mode=; emerging-optimizers 0.3.0 wants nesterov=/tp_mode=",
    ),
    StackFix(
        name="prebuilt-dataset-helpers",
        stacks=("nemo-26.02",),
        check=_check_compile_helpers,
        apply=_apply_compile_helpers,
        why="the wheel has no Makefile for compile_helpers(); its prebuilt helpers_cpp works",
    ),
)

_stack_fixes_applied = False


def apply_stack_fixes() -> None:
    """Apply every stack fix for the installed stack (idempotent). Raises StackFixError on upstream drift."""
    global _stack_fixes_applied
    if _stack_fixes_applied:
        return
    stack = installed_stack()
    for fix in STACK_FIXES:
        if stack.name in fix.stacks:
            fix.check()
            fix.apply()
    _stack_fixes_applied = True


__all__ += ["STACK_FIXES", "StackFix", "StackFixError", "apply_stack_fixes"]
