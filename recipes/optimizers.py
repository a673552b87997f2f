"""Optimizer presets: every field that a recipe relies on, pinned.

megatron-core's Muon defaults differ between its ``OptimizerConfig`` (Nesterov off), its CLI and its
classes, and Megatron Bridge's helper differs again, so a preset never leaves a ``muon_*`` field to a
default. Values are plain data (no torch import): ``nemo llm info`` prints them, ``bridge_ext.build``
applies them to Megatron Bridge's ``OptimizerConfig`` / ``SchedulerConfig`` / DDP config.

Adding a preset: one ``OptimizerPreset`` (usually ``derive(...)`` of an existing one) in ``PRESETS``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from types import MappingProxyType
from typing import Any, Literal

__all__ = ["OptimizerPreset", "PRESETS", "derive"]


def _frozen(mapping: Mapping[str, Any]) -> Mapping[str, Any]:
    return MappingProxyType(dict(mapping))


@dataclass(frozen=True, kw_only=True)
class OptimizerPreset:
    name: str
    kind: Literal["muon", "adamw"]
    summary: str
    source: str
    optimizer: Mapping[str, Any]  # megatron.bridge.training.config.OptimizerConfig fields
    scheduler: Mapping[str, Any]  # megatron.bridge.training.config.SchedulerConfig fields
    ddp: Mapping[str, Any] = field(default_factory=dict)  # DDP settings the optimizer forces

    def __post_init__(self):
        for name in ("optimizer", "scheduler", "ddp"):
            object.__setattr__(self, name, _frozen(getattr(self, name)))

    @property
    def muon_fields(self) -> dict[str, Any]:
        return {k: v for k, v in self.optimizer.items() if k.startswith("muon_")}


def derive(
    base: OptimizerPreset,
    *,
    name: str,
    summary: str,
    source: str,
    optimizer: Mapping[str, Any] = {},
    scheduler: Mapping[str, Any] = {},
    ddp: Mapping[str, Any] = {},
    kind: Literal["muon", "adamw"] | None = None,
) -> OptimizerPreset:
    """A preset equal to ``base`` except for the given fields."""
    return replace(
        base,
        name=name,
        kind=kind or base.kind,
        summary=summary,
        source=source,
        optimizer={**base.optimizer, **optimizer},
        scheduler={**base.scheduler, **scheduler},
        ddp={**base.ddp, **ddp},
    )


# Shared by every preset so that a Muon run and its AdamW twin differ only in the optimizer.
_COMMON_OPTIMIZER = {
    "lr": 3e-4,
    "min_lr": 3e-5,
    "weight_decay": 0.1,
    "clip_grad": 1.0,
    # Adam settings; under Muon they drive the scalar parameters (norms, embeddings, output layer).
    "adam_beta1": 0.9,
    "adam_beta2": 0.95,
    "adam_eps": 1e-8,
    "decoupled_weight_decay": True,
}
_COMMON_SCHEDULER = {
    "lr_decay_style": "cosine",
    "lr_warmup_iters": 2000,
    "lr_warmup_init": 0.0,
    "lr_decay_iters": None,  # None: decay over train.train_iters
    "start_weight_decay": 0.033,
    "end_weight_decay": 0.033,
    "weight_decay_incr_style": "constant",
    "override_opt_param_scheduler": True,
}

NVIDIA_PERF = OptimizerPreset(
    name="nvidia_perf",
    kind="muon",
    summary="NVIDIA's benchmarked Muon: layer-wise distributed, Nesterov 0.95, spectral scale, 5 NS steps",
    source=(
        "Megatron Bridge 0.3 recipes/utils/optimizer_utils.py::distributed_muon_with_cosine_annealing "
        "and recipes/kimi/kimi_k2.py (NVIDIA blog 2026-04-22 benchmark)"
    ),
    optimizer={
        **_COMMON_OPTIMIZER,
        "optimizer": "dist_muon",  # layer-wise distributed Muon: whole matrices per DP rank
        "muon_momentum": 0.95,
        "muon_use_nesterov": True,  # megatron-core's OptimizerConfig default is False
        "muon_scale_mode": "spectral",
        "muon_extra_scale_factor": 1.0,
        "muon_num_ns_steps": 5,
        "muon_fp32_matmul_prec": "medium",
        "muon_tp_mode": "blockwise",
        "muon_split_qkv": True,
        "use_distributed_optimizer": False,  # layer-wise Muon cannot share params with the byte-sharded one
    },
    scheduler=_COMMON_SCHEDULER,
    ddp={"use_distributed_optimizer": False, "overlap_param_gather": False},
)

ADAMW = derive(
    NVIDIA_PERF,
    name="adamw",
    kind="adamw",
    summary="AdamW (betas 0.9/0.95, eps 1e-8) with the distributed optimizer: the A/B baseline",
    source="Megatron Bridge 0.3 recipes/utils/optimizer_utils.py::distributed_fused_adam_with_cosine_annealing",
    optimizer={"optimizer": "adam", "use_distributed_optimizer": True},
    ddp={"use_distributed_optimizer": True, "overlap_param_gather": True},
)

PRESETS: dict[str, OptimizerPreset] = {preset.name: preset for preset in (NVIDIA_PERF, ADAMW)}
