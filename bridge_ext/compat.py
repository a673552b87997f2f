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
