"""Optimizer presets: every field that a recipe relies on, pinned.

megatron-core's Muon defaults differ between its ``OptimizerConfig`` (Nesterov off), its CLI and its
classes, and Megatron Bridge's helper differs again, so a preset never leaves a ``muon_*`` field to a
default. Field names are megatron-core 0.19's (one vocabulary for every stack);
``bridge_ext.upstream_api`` gives them the installed release's names. Values are plain data
(no torch import): ``nemo llm info`` prints them, ``bridge_ext.build`` applies them to Megatron Bridge's
``OptimizerConfig`` / ``SchedulerConfig`` / DDP config.

Adding a preset: one ``OptimizerPreset`` (usually ``derive(...)`` of an existing one) in ``PRESETS``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from types import MappingProxyType
from typing import Any, Literal

__all__ = ["MUON_OPTIMIZERS", "OptimizerPreset", "PRESETS", "derive", "is_muon"]

# Megatron's optimizer names (``optimizer.optimizer``) that run Muon: "muon", and "dist_muon" (layer-wise distributed;
# megatron-core 0.18+ maps it to "muon" plus the layer-wise field).
MUON_OPTIMIZERS = frozenset({"muon", "dist_muon"})


def is_muon(optimizer: str | None) -> bool:
    """Whether Megatron's optimizer name ``optimizer`` runs Muon (:data:`MUON_OPTIMIZERS`)."""
    return optimizer in MUON_OPTIMIZERS


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
    # TransformerConfig fields the optimizer relies on (QK-clip lives there, not in OptimizerConfig).
    model: Mapping[str, Any] = field(default_factory=dict)
    # Scheduler lengths as fractions of train.train_iters, resolved after overrides (recipes.budget.derived_schedule).
    schedule_fractions: Mapping[str, float] = field(default_factory=dict)
    # Orthogonalize a gated MLP's gate and up projections (linear_fc1 = [gate; up]) apart, as Moonlight's
    # reference does on the HF weights (bridge_ext.muon.split); megatron-core 0.16 has no field for it.
    split_gate_up: bool = False

    def __post_init__(self):
        for name in ("optimizer", "scheduler", "ddp", "model", "schedule_fractions"):
            object.__setattr__(self, name, _frozen(getattr(self, name)))

    @property
    def muon_fields(self) -> dict[str, Any]:
        return {k: v for k, v in self.optimizer.items() if k.startswith("muon_")}

    @property
    def ns_coefficients(self) -> Literal["simple", "quintic"] | None:
        """emerging-optimizers' Newton-Schulz coefficient set: the preset's ``muon_coefficient_type`` (one source;
        megatron-core 0.16 has no such OptimizerConfig field, so bridge_ext.muon installs it; 0.17+ pass it),
        megatron-core's "quintic" when unset; None for AdamW."""
        return self.optimizer.get("muon_coefficient_type", "quintic") if self.kind == "muon" else None


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
        "muon_nesterov": True,  # megatron-core's OptimizerConfig default is False
        "muon_scale_mode": "spectral",
        "muon_extra_scale_factor": 1.0,
        "muon_num_ns_steps": 5,
        "muon_fp32_matmul_prec": "medium",
        "muon_coefficient_type": "quintic",  # what megatron-core 0.16 (NVIDIA's benchmark) builds Muon with
        # Each TP-sharded matrix gathered and orthogonalized whole on its TP ranks: one process's update at every
        # TP size (tests/test_muon_layouts.py). megatron-core 0.16-0.19's default "blockwise" orthogonalizes each
        # rank's shard alone (another update per TP size); its main branch moves the default here (PR 6380).
        # Cost: each TP rank runs Newton-Schulz on the whole matrix (TP x blockwise's; nothing at TP1).
        "muon_tp_mode": "duplicated",
        "muon_split_qkv": True,
        "muon_scalar_optimizer": "adam",  # norms, embeddings, output layer
        "use_distributed_optimizer": False,  # layer-wise Muon cannot share params with the byte-sharded one
        # Layer-wise comes from the name "dist_muon" on every release (0.18+ maps it to "muon" + this field):
        # False keeps `optimizer.optimizer=muon` unsharded everywhere, as on releases without the field.
        "use_layer_wise_distributed_optimizer": False,
        # The helper leaves OptimizerConfig's Adam default for the parameters Muon does not take.
        "adam_beta2": 0.999,
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
    optimizer={"optimizer": "adam", "use_distributed_optimizer": True, "adam_beta2": 0.95},  # the Adam helper's
    ddp={"use_distributed_optimizer": True, "overlap_param_gather": True},
)

PRESETS: dict[str, OptimizerPreset] = {preset.name: preset for preset in (NVIDIA_PERF, ADAMW)}


# ---------------------------------------------------------------------------------------------------------
# Paper-faithful Muon presets. Settings megatron-core 0.16's OptimizerConfig/SchedulerConfig have no field
# for are applied by ``bridge_ext.muon`` (model: ``apply_preset``; ns_coefficients on megatron-core 0.16 and
# split_gate_up: ``install_preset``); schedule_fractions become iterations in ``recipes.budget.derived_schedule``.
# ---------------------------------------------------------------------------------------------------------

__all__ += ["MOONLIGHT", "KIMI_K2", "KIMI_K2_SCHEDULE", "adamw_twin"]


# Moonlight (arXiv 2502.16982, "Muon is Scalable for LLM Training"), Algorithm 1 and section 2.2:
# Keller Jordan's Newton-Schulz (a, b, c) = (3.4445, -4.7750, 2.0315) x 5, Nesterov momentum 0.95,
# update scaled by 0.2 * sqrt(max(A, B)) so its RMS matches AdamW's (0.2-0.4), weight decay 0.1 applied
# to the matrices too; AdamW (0.9, 0.95) for everything that is not a hidden matrix. lr transfers from AdamW.
MOONLIGHT = OptimizerPreset(
    name="moonlight",
    kind="muon",
    summary="Moonlight Muon: KJ Newton-Schulz x5, Nesterov 0.95, 0.2*sqrt(max(A,B)) scale, wd 0.1, gate/up apart",
    source="Moonlight, arXiv 2502.16982 (Algorithm 1, sec. 2.2); Keller Jordan's Muon (NS coefficients)",
    optimizer={
        **_COMMON_OPTIMIZER,  # lr 3e-4 / min_lr 3e-5 = the AdamW twin's: Moonlight's lr transfers unchanged
        "optimizer": "dist_muon",  # layer-wise distributed: the same update as "muon", whole matrices per rank
        "weight_decay": 0.1,
        "muon_momentum": 0.95,
        "muon_nesterov": True,
        "muon_scale_mode": "spectral",  # sqrt(max(rows, cols))
        "muon_extra_scale_factor": 0.2,  # x 0.2: update RMS ~ AdamW's
        "muon_num_ns_steps": 5,
        "muon_fp32_matmul_prec": "medium",  # NS in bf16, as Keller Jordan's reference
        "muon_coefficient_type": "simple",  # Keller Jordan's (3.4445, -4.7750, 2.0315)
        "muon_tp_mode": "duplicated",  # the whole matrix at every TP size, as nvidia_perf
        "muon_split_qkv": True,  # Q, K, V orthogonalized separately (per query group)
        "muon_scalar_optimizer": "adam",  # AdamW for everything that is not a hidden matrix
        "use_distributed_optimizer": False,
        "use_layer_wise_distributed_optimizer": False,  # layer-wise from the name, as nvidia_perf
    },
    scheduler={
        **_COMMON_SCHEDULER,
        # The scheduler sets every param group's weight decay each step: it must say 0.1 too, or it
        # silently replaces the optimizer's 0.1 (nvidia_perf's scheduler says 0.033).
        "start_weight_decay": 0.1,
        "end_weight_decay": 0.1,
        "weight_decay_incr_style": "constant",
    },
    ddp={"use_distributed_optimizer": False, "overlap_param_gather": False},
    # Gate and up projections apart, as Moonlight's reference on the HF weights (A/B: docs/muon.md)
    split_gate_up=True,
)

# Kimi K2 (arXiv 2507.20534: MuonClip and the pre-training recipe): 15.5 T tokens, 500 warm-up steps, 2e-4
# constant for 10 T tokens, cosine to 2e-5 over the last 5.5 T tokens; weight decay 0.1; MuonClip tau 100.
# Warm-up is stated in steps, the decay in tokens: the decay is a fraction of train.train_iters, which
# recipes.Recipe.train_iters sizes to 15.5 T tokens at the layout's tokens per step.
KIMI_K2_SCHEDULE = {
    "lr_warmup_iters": 500,
    "lr_wsd_decay_fraction": 5.5 / 15.5,  # cosine over the final ~35.5 % of train.train_iters (5.5 T of 15.5 T)
}

KIMI_K2 = replace(
    derive(
        MOONLIGHT,
        name="kimi_k2",
        summary="MuonClip as Kimi K2: moonlight + QK-clip (tau 100, alpha 0.5), 2e-4 WSD schedule to 2e-5",
        source="Kimi K2, arXiv 2507.20534 (MuonClip, Algorithm 1; training recipe, sec. 3)",
        optimizer={"lr": 2e-4, "min_lr": 2e-5},
        scheduler={
            "lr_decay_style": "WSD",  # warm-up, constant, then the WSD decay below
            "lr_wsd_decay_style": "cosine",
            "lr_warmup_iters": KIMI_K2_SCHEDULE["lr_warmup_iters"],  # steps, whatever train.train_iters is
            "lr_decay_iters": None,  # train.train_iters
            "lr_wsd_decay_iters": None,  # from lr_wsd_decay_fraction: recipes.budget.derived_schedule
        },
    ),
    model={"qk_clip": True, "qk_clip_threshold": 100.0, "qk_clip_alpha": 0.5, "log_max_attention_logit": True},
    schedule_fractions={"lr_wsd_decay_fraction": KIMI_K2_SCHEDULE["lr_wsd_decay_fraction"]},
)


# Moonlight-16B-A3B's own pre-training run (arXiv 2502.16982, sec. 3.3 "Pretraining"): the moonlight update
# above with the run's schedule. Stage 1 (0-33 B tokens): lr rises linearly to 4.2e-4 in 2k steps; stage 2 (to
# 5.2 T tokens): cosine from 4.2e-4 to 4.2e-5; weight decay 0.1 in every stage. Stage 3 (5.2-5.7 T, the
# cooldown) rises again to 1e-4 in 100 steps and decays linearly to 0 over 500 B tokens: a second schedule after
# the cosine, which one Megatron scheduler cannot follow, so a recipe with this preset runs stages 1-2
# (recipes.models: 5.2 T tokens). Not stated by the paper, kept from `moonlight`: Nesterov momentum (eq. 1 is
# plain momentum; Moonlight's released Muon, examples/toy_train.py, uses Nesterov), the Newton-Schulz
# coefficients (toy_train.py: Keller Jordan's), AdamW's betas and eps (toy_train.py: 0.9 / 0.95, 1e-8), gradient
# clipping (1.0, Megatron Bridge's) and the warm-up's start (0).
MOONLIGHT_16B = derive(
    MOONLIGHT,
    name="moonlight_16b",
    summary=("moonlight with Moonlight-16B-A3B's stages 1-2: 2k warm-up steps to 4.2e-4, cosine to 4.2e-5 at 5.2 T "
             "of its 5.7 T tokens, wd 0.1"),
    source=("Moonlight, arXiv 2502.16982 (update: sec. 2.2 eq. 4; schedule and weight decay: sec. 3.3 "
            "\"Pretraining\", stages 1-2); MoonshotAI/Moonlight examples/toy_train.py for what the paper leaves out"),
    optimizer={"lr": 4.2e-4, "min_lr": 4.2e-5},
    scheduler={"lr_decay_style": "cosine", "lr_warmup_iters": 2000, "lr_warmup_init": 0.0, "lr_decay_iters": None},
)
__all__ += ["MOONLIGHT_16B"]


def adamw_twin(muon: OptimizerPreset) -> OptimizerPreset:
    """AdamW with ``muon``'s learning rate, schedule and weight decay: the other half of an A/B pair.

    Only the optimizer and what it forces change (distributed optimizer on; no QK-clip, which is part of
    MuonClip). ``nvidia_perf``'s twin is ``adamw`` itself.
    """
    if muon.name == NVIDIA_PERF.name:
        return ADAMW
    return replace(
        derive(
            muon,
            name=f"{muon.name}_adamw",
            kind="adamw",
            summary=f"AdamW (betas 0.9/0.95) with {muon.name}'s learning rate, schedule and weight decay",
            source=f"the A/B twin of {muon.name}",
            optimizer={"optimizer": "adam", "use_distributed_optimizer": True},
            ddp=ADAMW.ddp,
        ),
        split_gate_up=False,
        model={},
    )


# megatron-core's way for gated MLPs: gate and up projections orthogonalized as one linear_fc1 matrix. The
# paper presets split them (split_gate_up); the A/B on the proxies that decided it is in docs/muon.md.
__all__ += ["fused_mlp"]


def fused_mlp(base: OptimizerPreset) -> OptimizerPreset:
    """``base`` with each gated MLP's gate and up projections orthogonalized together (megatron-core's way)."""
    return replace(base, name=f"{base.name}_fused_mlp", split_gate_up=False,
                   summary=f"{base.name} with gate and up projections orthogonalized as one matrix (megatron-core)",
                   source=f"{base.source}; megatron-core 0.16's fused linear_fc1")


PRESETS.update({preset.name: preset for preset in (MOONLIGHT, KIMI_K2, MOONLIGHT_16B)})
PRESETS.update({twin.name: twin for twin in map(adamw_twin, (MOONLIGHT, KIMI_K2, MOONLIGHT_16B))})
PRESETS.update({preset.name: preset for preset in map(fused_mlp, (MOONLIGHT, KIMI_K2))})
