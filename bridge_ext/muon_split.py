"""Muon on gated MLPs per part: orthogonalize the gate and up projections of ``linear_fc1`` separately.

Megatron stores a gated MLP's gate and up projections as one ``linear_fc1`` weight, ``[gate; up]`` row-wise
(Megatron Bridge's ``GatedMLPMapping``), and megatron-core 0.16's ``TensorParallelMuon`` orthogonalizes it as
one matrix. Moonlight's reference Muon runs on the Hugging Face weights, where ``gate_proj`` and ``up_proj``
are separate matrices, each orthogonalized and scaled by its own ``sqrt(max(rows, cols))``. With
:func:`install_gate_up_split` on, every ``TensorParallelMuon`` step does the same for dense,
shared-expert and routed-expert ``linear_fc1`` weights, as ``muon_split_qkv`` does for Q, K and V.

Tensor parallelism: each rank's shard is ``[gate_r; up_r]`` (``GatedMLPMapping`` shards gate and up apart),
so halving the local shard gives the gate and up shards; blockwise mode orthogonalizes each, the
distributed modes gather each along dim 0 as before. Imports neither torch nor Megatron at import time.
"""

from __future__ import annotations

from bridge_ext.patches.optimizer import GATE_UP_PATTERN, mark_gate_up_params

__all__ = ["GATE_UP_PATTERN", "gate_up_split_installed", "install_gate_up_split", "mark_gate_up_params"]


def gate_up_split_installed() -> bool:
    from bridge_ext.patches.optimizer import MUON

    return MUON.split_gate_up


def install_gate_up_split(enabled: bool) -> None:
    """Make every ``TensorParallelMuon`` built from now on orthogonalize gate and up apart (or not).

    Process-wide, idempotent; read at every step. The ``muon-gate-up-params`` and ``muon-gate-up-split``
    patches (``bridge_ext.patches.optimizer``) wrap Megatron Bridge's reference to ``get_megatron_muon_optimizer``
    (to flag the gated ``linear_fc1`` weights by name, which only the model knows) and
    ``TensorParallelMuon.orthogonalize``.
    """
    from bridge_ext import patches
    from bridge_ext.patches.optimizer import GATE_UP_SPLIT, MUON

    MUON.split_gate_up = enabled
    patches.apply("muon", only=GATE_UP_SPLIT)
