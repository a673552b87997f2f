"""Muon on gated MLPs per part: orthogonalize the gate and up projections of ``linear_fc1`` separately.

Megatron stores a gated MLP's gate and up projections as one ``linear_fc1`` weight, ``[gate; up]`` row-wise
(Megatron Bridge's ``GatedMLPMapping``), and megatron-core 0.16's ``TensorParallelMuon`` orthogonalizes it as
one matrix. Moonlight's reference Muon runs on the Hugging Face weights, where ``gate_proj`` and ``up_proj``
are separate matrices, each orthogonalized and scaled by its own ``sqrt(max(rows, cols))``. With
:func:`install_gate_up_split` on, every ``TensorParallelMuon`` step does the same for dense,
shared-expert and routed-expert ``linear_fc1`` weights, as ``muon_split_qkv`` does for Q, K and V.

Tensor parallelism: each rank's shard is ``[gate_r; up_r]`` (``GatedMLPMapping`` shards gate and up apart),
so halving the local shard gives the gate and up shards; blockwise mode orthogonalizes each, the
distributed modes gather each along dim 0 as before. The ``muon-gate-up-params`` and ``muon-gate-up-split``
patches (``bridge_ext.patches.optimizer``) put :func:`marking_gate_up` and :func:`gate_up_apart` in place; whether
the split is on is the current ``MuonSettings.split_gate_up`` (``bridge_ext.muon.settings``, installed with the
preset by ``bridge_ext.muon.presets.install_preset``). Imports neither torch nor Megatron at import time.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

from dataclasses import replace

from bridge_ext.muon.settings import GATE_UP_SPLIT, install, muon_settings
from bridge_ext import upstream_patch

__all__ = ["GATE_UP_PATTERN", "flag_main_params", "gate_up_apart", "gate_up_split_installed", "install_gate_up_split",
           "mark_gate_up_params", "marking_gate_up"]

# linear_fc1 of dense MLPs and shared experts (``weight``), TE grouped-GEMM experts (``weight<i>``) and
# sequential experts (``local_experts.<i>.linear_fc1.weight``).
GATE_UP_PATTERN = re.compile(r"(^|\.)linear_fc1\.weight\d*$")


def gate_up_split_installed() -> bool:
    return muon_settings().split_gate_up


def install_gate_up_split(enabled: bool) -> None:
    """The current settings with the split on (or off), installed whole (one replacement, no field set), and the
    patches that split on: for tests that pick it by hand; a run installs its preset's (``install_preset``).

    Process-wide, idempotent; read at every step. The ``muon-gate-up-params`` and ``muon-gate-up-split``
    patches (``bridge_ext.patches.optimizer``) wrap Megatron Bridge's reference to ``get_megatron_muon_optimizer``
    (to flag the gated ``linear_fc1`` weights by name, which only the model knows) and
    ``TensorParallelMuon.orthogonalize``.
    """
    install(replace(muon_settings(), split_gate_up=enabled))
    upstream_patch.apply("muon", only=GATE_UP_SPLIT)


def mark_gate_up_params(model_chunks: Any) -> int:
    """Flag ``is_gate_up`` on every 2-D ``linear_fc1`` weight of a gated MLP; returns how many."""
    count = 0
    for chunk in model_chunks:
        if not getattr(chunk.config, "gated_linear_unit", False):
            continue
        for name, param in chunk.named_parameters():
            if param.dim() == 2 and GATE_UP_PATTERN.search(name):
                param.is_gate_up = True
                count += 1
    return count


def flag_main_params(optimizer: Any) -> int:
    """Copy ``is_gate_up`` from model parameters to the fp32 main parameters Muon steps; returns how many.

    A mixed-precision optimizer (``Float16OptimizerWithFloat16Params``, also each member of the layer-wise
    ``dist_muon``) steps fp32 copies, which carry only megatron-core's own attributes
    (``tensor_parallel.copy_tensor_model_parallel_attributes``: ``is_qkv``, ``expert_tp``, the TP ones): without
    this, a bf16 run would orthogonalize gate and up together despite the preset (measured by ``nemo llm
    rehearse``: Newton-Schulz on the whole linear_fc1)."""
    count, pending = 0, [optimizer]
    while pending:
        member = pending.pop()
        pending.extend(getattr(member, "chained_optimizers", ()))
        for model_group, main_group in zip(getattr(member, "float16_groups", ()),
                                           getattr(member, "fp32_from_float16_groups", ())):
            for model_param, main_param in zip(model_group, main_group):
                if getattr(model_param, "is_gate_up", False) and main_param is not model_param:
                    main_param.is_gate_up = True
                    count += 1
    return count


def marking_gate_up(build: Callable) -> Callable:
    """``get_megatron_muon_optimizer`` that flags the gated weights (and their fp32 main copies) it is given."""

    def get_megatron_muon_optimizer(config: Any, model_chunks: Any, *args: Any, **kwargs: Any) -> Any:
        mark_gate_up_params(model_chunks)  # only the model knows which weights are gated: flagged by name
        optimizer = build(config, model_chunks, *args, **kwargs)
        flag_main_params(optimizer)  # bf16: Muon steps fp32 copies, which megatron-core does not flag
        return optimizer

    return get_megatron_muon_optimizer


def gate_up_apart(orthogonalize: Callable) -> Callable:
    """``TensorParallelMuon.orthogonalize`` that, while the split is on, orthogonalizes ``[gate; up]`` per half.

    The split is read from :func:`~bridge_ext.muon.settings.muon_settings` at every call: megatron-core calls this
    method, with no way to hand it our settings."""

    def orthogonalize_parts(self: Any, p: Any, grad: Any, **kwargs: Any) -> Any:
        if not (muon_settings().split_gate_up and getattr(p, "is_gate_up", False)):
            return orthogonalize(self, p, grad, **kwargs)
        import torch

        gate, up = torch.chunk(grad, 2, dim=0)  # [gate; up]: each half orthogonalized and scaled alone
        return torch.cat([orthogonalize(self, p, gate.contiguous(), **kwargs),
                          orthogonalize(self, p, up.contiguous(), **kwargs)], dim=0)

    return orthogonalize_parts
