"""An SDPA-based core attention for Multi-head Latent Attention without Transformer Engine.

megatron-core's MLA (``transformer/multi_latent_attention.py``) builds its core attention with ``k_channels``
and ``v_channels`` (key and value head sizes differ); Megatron's local ``DotProductAttention`` takes neither,
so without TE (CPU mode; a GPU without TE) MLA gets this one (the ``mla-core-attention`` patch,
``bridge_ext.without_te.patches``). Logits equal HF's within 4e-7.

It measures each head's maximum logit as TE's fused kernel returns it (QK-clip, telemetry) with :func:`max_logits`,
on query x key tiles of at most ``CHUNK`` x ``CHUNK``: its largest intermediate is ``b * h * CHUNK * CHUNK`` fp32
values, never the ``b * h * s * s`` logits (Qwen3-30B-A3B's layout, MBS 8, 32 heads, seq 4096: 268 MB per tile
instead of 17 GB); ``bridge_ext.muon.attention_logits``' hooks measure the local attention with it. Importing this
module imports neither torch nor Megatron.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

__all__ = ["CHUNK", "SDPACoreAttention", "max_logits"]

CHUNK = 512  # query and key positions per tile


def max_logits(query: torch.Tensor, key: torch.Tensor, scale: float, *, causal: bool = True,
               chunk: int = CHUNK) -> torch.Tensor:
    """Per-head max of ``q . k * scale`` (fp32) for [s, b, h, d] query and [s, b, g, d] key (g divides h).

    Causal masking is top-left (query i sees keys j <= i), as Megatron's causal mask and SDPA's
    ``is_causal``. Tiles above the diagonal are skipped. Heads of a query group share their key tile
    (grouped-query attention) without copying it per head.
    """
    import torch

    s_q, b, h, d = query.shape
    s_k, groups = key.shape[0], key.shape[2]
    per_group = h // groups
    best = torch.full((groups, per_group), -math.inf, dtype=torch.float32, device=query.device)
    with torch.no_grad():
        for q0 in range(0, s_q, chunk):
            q1 = min(q0 + chunk, s_q)
            # [c, b, h, d] -> [b, g, heads per group * c, d]: one matmul per (b, g) against that group's keys
            q = query[q0:q1].detach().float().permute(1, 2, 0, 3).reshape(b, groups, per_group * (q1 - q0), d)
            for k0 in range(0, min(q1, s_k) if causal else s_k, chunk):
                k1 = min(k0 + chunk, s_k, q1) if causal else min(k0 + chunk, s_k)
                k = key[k0:k1].detach().float().permute(1, 2, 3, 0)  # [b, g, d, c_k]
                logits = torch.matmul(q, k).view(b, groups, per_group, q1 - q0, k1 - k0)
                if causal and k1 - 1 > q0:  # the tile crosses the diagonal
                    rows = torch.arange(q0, q1, device=query.device)[:, None]
                    logits.masked_fill_(torch.arange(k0, k1, device=query.device) > rows, -math.inf)
                best = torch.maximum(best, logits.amax(dim=(0, 3, 4)))
    return best.flatten() * scale


def _sdpa_core_attention_class():
    import torch
    from megatron.core import tensor_parallel
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.module import MegatronModule

    class _SDPACoreAttention(MegatronModule):
        """Core attention over [s, b, h, d] query/key/value with ``scaled_dot_product_attention``.

        Stands in for TE's ``DotProductAttention`` in MLA, whose key (``k_channels``) and value
        (``v_channels``) head sizes differ, which Megatron's local ``DotProductAttention`` cannot do.
        """

        def __init__(
            self,
            config: Any,
            layer_number: int,
            attn_mask_type: AttnMaskType,
            attention_type: str,
            attention_dropout: float | None = None,
            softmax_scale: float | None = None,
            k_channels: int | None = None,
            v_channels: int | None = None,
            cp_comm_type: str | None = None,
            pg_collection: Any = None,
        ):
            super().__init__(config=config)
            if config.context_parallel_size != 1:
                raise ValueError("SDPACoreAttention supports no context parallelism")
            self.layer_number = layer_number
            self.attn_mask_type = attn_mask_type
            k_channels = k_channels or config.kv_channels
            self.softmax_scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(k_channels)
            self.dropout_p = config.attention_dropout if attention_dropout is None else attention_dropout
            self.current_max_attn_logits = None  # read by MLA's QK-Clip

        def forward(
            self,
            query: torch.Tensor,
            key: torch.Tensor,
            value: torch.Tensor,
            attention_mask: torch.Tensor | None,
            attn_mask_type: AttnMaskType | None = None,
            attention_bias: torch.Tensor | None = None,
            packed_seq_params: Any = None,
        ) -> torch.Tensor:
            if packed_seq_params is not None or attention_bias is not None:
                raise NotImplementedError("SDPACoreAttention: no packed sequences or attention bias")
            mask_type = attn_mask_type or self.attn_mask_type
            q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))  # [b, h, s, d]
            if k.shape[1] != q.shape[1]:  # grouped query attention
                k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
                v = v.repeat_interleave(q.shape[1] // v.shape[1], dim=1)
            causal = mask_type == AttnMaskType.causal
            mask = None
            if not causal and attention_mask is not None:
                mask = ~attention_mask  # Megatron masks are True where attention is forbidden
            if self.config.qk_clip or self.config.log_max_attention_logit:
                # as TE: a running max over the step's micro-batches, until clip_qk resets it; in tiles,
                # never the [b, h, s, s] logits
                measured = max_logits(query, key, self.softmax_scale, causal=causal)
                previous = self.current_max_attn_logits
                self.current_max_attn_logits = measured if previous is None else torch.maximum(previous, measured)
            dropout_p = self.dropout_p if self.training else 0.0
            with tensor_parallel.get_cuda_rng_tracker().fork() if dropout_p else contextlib.nullcontext():
                out = torch.nn.functional.scaled_dot_product_attention(
                    q, k, v, attn_mask=mask, dropout_p=dropout_p, is_causal=causal, scale=self.softmax_scale
                )
            out = out.permute(2, 0, 1, 3)  # [s, b, h, dv]
            return out.reshape(out.shape[0], out.shape[1], -1)

    return _SDPACoreAttention


class _LazyClass:
    """Builds the class on first use, so importing this module does not import torch or Megatron."""

    def __init__(self, build: Callable[[], type]):
        self._build = build

    @property
    def cls(self) -> type:
        if not hasattr(self, "_cls"):
            self._cls = self._build()
        return self._cls

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.cls(*args, **kwargs)

    def __instancecheck__(self, obj: Any) -> bool:
        return isinstance(obj, self.cls)


SDPACoreAttention = _LazyClass(_sdpa_core_attention_class)
