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

import re
from typing import Any

__all__ = ["GATE_UP_PATTERN", "gate_up_split_installed", "install_gate_up_split", "mark_gate_up_params"]

# linear_fc1 of dense MLPs and shared experts (``weight``), TE grouped-GEMM experts (``weight<i>``) and
# sequential experts (``local_experts.<i>.linear_fc1.weight``).
GATE_UP_PATTERN = re.compile(r"(^|\.)linear_fc1\.weight\d*$")

_split: bool = False  # read by every TensorParallelMuon step


def gate_up_split_installed() -> bool:
    return _split


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


def install_gate_up_split(enabled: bool) -> None:
    """Make every ``TensorParallelMuon`` built from now on orthogonalize gate and up apart (or not).

    Process-wide, idempotent; read at every step. Wraps Megatron Bridge's reference to
    ``get_megatron_muon_optimizer`` (to flag the gated ``linear_fc1`` weights by name, which only the model
    knows) and ``TensorParallelMuon.orthogonalize``.
    """
    global _split
    from megatron.bridge.training import optim
    from megatron.core.optimizer import muon

    _split = enabled
    if not getattr(optim.get_megatron_muon_optimizer, "_bridge_ext_gate_up", False):
        build = optim.get_megatron_muon_optimizer

        def get_megatron_muon_optimizer(config: Any, model_chunks: Any, *args: Any, **kwargs: Any) -> Any:
            mark_gate_up_params(model_chunks)
            return build(config, model_chunks, *args, **kwargs)

        get_megatron_muon_optimizer._bridge_ext_gate_up = True  # type: ignore[attr-defined]
        optim.get_megatron_muon_optimizer = get_megatron_muon_optimizer
    cls = muon.TensorParallelMuon
    if getattr(cls.orthogonalize, "_bridge_ext_gate_up", False):
        return
    orthogonalize = cls.orthogonalize

    def orthogonalize_parts(self: Any, p: Any, grad: Any, **kwargs: Any) -> Any:
        if not (_split and getattr(p, "is_gate_up", False)):
            return orthogonalize(self, p, grad, **kwargs)
        import torch

        gate, up = torch.chunk(grad, 2, dim=0)  # [gate; up]: each half orthogonalized and scaled alone
        return torch.cat([orthogonalize(self, p, gate.contiguous(), **kwargs),
                          orthogonalize(self, p, up.contiguous(), **kwargs)], dim=0)

    orthogonalize_parts._bridge_ext_gate_up = True  # type: ignore[attr-defined]
    cls.orthogonalize = orthogonalize_parts  # type: ignore[method-assign]
