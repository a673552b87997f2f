"""Parameter counts of a model's :class:`~recipes.architecture.Architecture` (no torch, no weights).

Counts follow the HF module layout: every weight and norm, the MoE router (and its expert bias for
DeepSeek-V3-style routers), input embedding and output layer (once when tied). "Active" counts what one
token touches: attention, dense MLPs, ``top_k`` routed experts, shared experts, router, norms, embedding
and output layer.
"""

from __future__ import annotations

from dataclasses import dataclass

from recipes.architecture import Architecture

__all__ = ["ParamCount", "count_params"]


@dataclass(frozen=True)
class ParamCount:
    total: int
    active: int


def _attention(arch: Architecture) -> int:
    h, heads = arch.hidden_size, arch.num_attention_heads
    if arch.mla is not None:  # Multi-head Latent Attention (DeepSeek-V3 / Kimi K2)
        m = arch.mla
        nope, rope, v = m.qk_nope_head_dim, m.qk_rope_head_dim, m.v_head_dim
        q_rank, kv_rank = m.q_lora_rank, m.kv_lora_rank
        if q_rank:
            q = h * q_rank + q_rank + q_rank * heads * (nope + rope)
        else:
            q = h * heads * (nope + rope)
        kv = h * (kv_rank + rope) + kv_rank + kv_rank * heads * (nope + v)
        return q + kv + heads * v * h
    head_dim, kv_heads = arch.head_dim, arch.num_kv_heads
    q, kv = heads * head_dim, kv_heads * head_dim
    proj = h * (q + 2 * kv) + q * h + (q + 2 * kv + h if arch.attention_bias else 0)
    qk_norm = 2 * head_dim if arch.qk_norm else 0
    return proj + qk_norm


def count_params(arch: Architecture) -> ParamCount:
    """Total and active parameters of the model ``arch`` describes."""
    h, vocab = arch.hidden_size, arch.vocab_size
    mlp = lambda width: 3 * h * width  # gate, up, down (SwiGLU)
    attention = _attention(arch) + 2 * h  # plus the two layer norms
    moe = arch.moe

    total = active = 0
    for layer in range(arch.num_layers):
        total += attention
        active += attention
        if moe is not None and arch.is_moe(layer):
            router = moe.experts * h + (moe.experts if moe.expert_bias else 0)
            common = router + moe.shared_experts * mlp(moe.ffn_hidden_size)
            total += common + moe.experts * mlp(moe.ffn_hidden_size)
            active += common + moe.top_k * mlp(moe.ffn_hidden_size)
        else:
            total += mlp(arch.ffn_hidden_size)
            active += mlp(arch.ffn_hidden_size)
    edges = vocab * h * (1 if arch.tie_word_embeddings else 2) + h  # embedding, output, final norm
    return ParamCount(total=total + edges, active=active + edges)
