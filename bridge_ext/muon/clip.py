"""MuonClip: Kimi K2's per-head QK-clip (arXiv 2507.20534, Algorithm 1) after every optimizer step.

Through megatron-core 0.16's ``MultiLatentAttention.clip_qk``, unwrapping fp32 models; the step's max logit
over every micro-batch comes from ``bridge_ext.attention_logits``. :func:`clip_qk` is megatron-core's
``qk_clip.clip_qk`` finding the decoder through any wrapper; Megatron Bridge's training step calls it through
the ``muon-clip-any-wrapper`` patch (``bridge_ext.patches.optimizer``, where it is defined). Imports neither
torch nor Megatron.
"""

from __future__ import annotations

from bridge_ext.patches.optimizer import clip_qk

__all__ = ["clip_qk", "install_muon_clip"]


def install_muon_clip() -> None:
    """Make Megatron Bridge's training step use :func:`clip_qk` (idempotent).

    ``megatron/bridge/training/train.py:757`` calls ``megatron.core.optimizer.qk_clip.clip_qk(model)``
    after ``optimizer.step()`` when ``model.qk_clip`` is set; that one reaches the decoder as
    ``model_chunk.module.module`` and raises ``AttributeError`` for fp32 models (no Float16Module).
    """
    from bridge_ext import patches
    from bridge_ext.patches.optimizer import MUON_CLIP

    patches.apply("muon", only=MUON_CLIP)
