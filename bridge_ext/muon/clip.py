"""MuonClip: Kimi K2's per-head QK-clip (arXiv 2507.20534, Algorithm 1) after every optimizer step.

Through megatron-core 0.16's ``MultiLatentAttention.clip_qk``, unwrapping fp32 models; the step's max logit
over every micro-batch comes from :mod:`bridge_ext.muon.attention_logits`. :func:`clip_qk` is megatron-core's
``qk_clip.clip_qk`` finding the decoder through any wrapper; Megatron Bridge's training step calls it through
the ``muon-clip-any-wrapper`` patch (``bridge_ext.patches.optimizer``). :func:`floored_clip_qk` is what the
``qk-clip-nonpositive-logit-*`` patches (``bridge_ext.patches.transformer``) make of upstream's per-layer
``clip_qk``. Imports neither torch nor Megatron.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Any

from bridge_ext.muon.attention_logits import attentions
from bridge_ext.muon.settings import MUON_CLIP
from bridge_ext import upstream_patch

__all__ = ["bridge_clip_qk", "clip_qk", "floored_clip_qk", "install_muon_clip"]


def install_muon_clip() -> None:
    """Make Megatron Bridge's training step use :func:`clip_qk` (idempotent).

    ``megatron/bridge/training/train.py:757`` calls ``megatron.core.optimizer.qk_clip.clip_qk(model)``
    after ``optimizer.step()`` when ``model.qk_clip`` is set; that one reaches the decoder as
    ``model_chunk.module.module`` and raises ``AttributeError`` for fp32 models (no Float16Module).
    """
    upstream_patch.apply("muon", only=MUON_CLIP)


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


def bridge_clip_qk(old: Callable) -> Callable:
    """What Megatron Bridge's training step calls instead of megatron-core's ``qk_clip.clip_qk``."""

    def bridge_clip_qk(model: Any, log_max_only: bool = False) -> float | None:
        return clip_qk(model, log_max_only=log_max_only)

    return bridge_clip_qk


def floored_clip_qk(clip_qk: Callable[[Any], Any]) -> Callable[[Any], Any]:
    """An attention's ``clip_qk`` whose per-head maxima are floored at tau first (Megatron-LM PR 7382).

    Upstream scales each head by ``eta = clamp(tau / S_max, max=1)``, q by ``eta ** alpha``: a head whose
    S_max is negative gets ``eta < 0`` and NaN weights. MuonClip's ``gamma = min(1, tau / S_max)`` scales only
    heads above tau: floored at tau, every head at or under tau gets ``eta = 1`` exactly (untouched)."""

    @functools.wraps(clip_qk)
    def clip_qk_floored(self: Any) -> Any:
        import torch

        core = self.core_attention
        if core.current_max_attn_logits is not None:
            # S_max <= tau leaves a head as it is (eta = 1); flooring at tau keeps S_max <= 0 from eta < 0
            core.current_max_attn_logits = torch.clamp(core.current_max_attn_logits,
                                                       min=float(self.config.qk_clip_threshold))
        return clip_qk(self)

    clip_qk_floored._bridge_ext_original = clip_qk  # type: ignore[attr-defined]
    return clip_qk_floored
