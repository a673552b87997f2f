"""MuonClip: Kimi K2's per-head QK-clip (arXiv 2507.20534, Algorithm 1) after every optimizer step.

Through megatron-core 0.16's ``MultiLatentAttention.clip_qk``, unwrapping fp32 models; the step's max logit
over every micro-batch comes from ``bridge_ext.attention_logits``. Imports neither torch nor Megatron.
"""

from __future__ import annotations

import math
from typing import Any

from bridge_ext.attention_logits import attentions

__all__ = ["clip_qk", "install_muon_clip"]



def clip_qk(model: Any, *, log_max_only: bool = False) -> float | None:
    """MuonClip's QK-clip after the optimizer step; returns the max attention logit (None if unmeasured).

    What ``megatron.core.optimizer.qk_clip.clip_qk`` does (all-reduce the per-head maxima over DP x CP,
    then ``self_attention.clip_qk()``), except that it finds the decoder through any wrapper: upstream
    reads ``model_chunk.module.module.decoder``, which assumes a Float16Module and fails for fp32 models.
    For MLA, megatron-core's ``clip_qk`` scales per head h with gamma_h = min(1, tau / S_max_h):
    q_nope by gamma^alpha, q_rope by gamma, k_nope by gamma^(1 - alpha) (rows of ``linear_kv_up_proj``), v
    and the shared k_rope (``linear_kv_down_proj``) untouched: Kimi K2's per-head QK-clip with alpha = 0.5.
    """
    import torch
    from megatron.core import parallel_state

    best = None
    with torch.no_grad():
        for attention in attentions(model):
            logits = getattr(attention.core_attention, "current_max_attn_logits", None)
            if logits is None or not hasattr(attention, "clip_qk"):
                continue
            if torch.distributed.is_initialized() and parallel_state.model_parallel_is_initialized():
                torch.distributed.all_reduce(logits, op=torch.distributed.ReduceOp.MAX,
                                             group=parallel_state.get_data_parallel_group(with_context_parallel=True))
            best = max(best or -math.inf, float(logits.max()))
            if log_max_only:
                attention.core_attention.current_max_attn_logits = None
            else:
                attention.clip_qk()
    return best


def install_muon_clip() -> None:
    """Make Megatron Bridge's training step use :func:`clip_qk` (idempotent).

    ``megatron/bridge/training/train.py:757`` calls ``megatron.core.optimizer.qk_clip.clip_qk(model)``
    after ``optimizer.step()`` when ``model.qk_clip`` is set; that one reaches the decoder as
    ``model_chunk.module.module`` and raises ``AttributeError`` for fp32 models (no Float16Module).
    """
    from megatron.bridge.training import train

    if getattr(train.clip_qk, "_bridge_ext", False):
        return

    def bridge_clip_qk(model: Any, log_max_only: bool = False) -> float | None:
        return clip_qk(model, log_max_only=log_max_only)

    bridge_clip_qk._bridge_ext = True  # type: ignore[attr-defined]
    train.clip_qk = bridge_clip_qk
