"""Parameter counts computed from an HF ``config.json`` dict (no torch, no weights).

Counts follow the HF module layout: every weight and norm, the MoE router (and its expert bias for
DeepSeek-V3-style routers), input embedding and output layer (once when tied). "Active" counts what one
token touches: attention, dense MLPs, ``num_experts_per_tok`` routed experts, shared experts, router,
norms, embedding and output layer.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

__all__ = ["ParamCount", "count_params"]


@dataclass(frozen=True)
class ParamCount:
    total: int
    active: int


def _attention(cfg: dict[str, Any]) -> int:
    h, heads = cfg["hidden_size"], cfg["num_attention_heads"]
    if "kv_lora_rank" in cfg:  # Multi-head Latent Attention (DeepSeek-V3 / Kimi K2)
        nope, rope, v = cfg["qk_nope_head_dim"], cfg["qk_rope_head_dim"], cfg["v_head_dim"]
        q_rank, kv_rank = cfg.get("q_lora_rank"), cfg["kv_lora_rank"]
        if q_rank:
            q = h * q_rank + q_rank + q_rank * heads * (nope + rope)
        else:
            q = h * heads * (nope + rope)
        kv = h * (kv_rank + rope) + kv_rank + kv_rank * heads * (nope + v)
        return q + kv + heads * v * h
    head_dim = cfg.get("head_dim") or h // heads
    kv_heads = cfg["num_key_value_heads"]
    bias = cfg.get("attention_bias", False)
    q, kv = heads * head_dim, kv_heads * head_dim
    proj = h * (q + 2 * kv) + q * h + (q + 2 * kv + h if bias else 0)
    qk_norm = 2 * head_dim if cfg["model_type"].startswith("qwen3") else 0
    return proj + qk_norm


def _is_moe_layer(cfg: dict[str, Any], layer: int) -> bool:
    if "n_routed_experts" in cfg:  # DeepSeek-V3 style
        freq = cfg.get("moe_layer_freq", 1)
        return layer >= cfg.get("first_k_dense_replace", 0) and layer % freq == 0
    if "num_experts" in cfg:  # Qwen3-MoE style
        step = cfg.get("decoder_sparse_step", 1)
        return layer not in cfg.get("mlp_only_layers", []) and (layer + 1) % step == 0
    return False


def count_params(cfg: dict[str, Any]) -> ParamCount:
    """Total and active parameters of the model an HF ``config.json`` describes."""
    h, vocab = cfg["hidden_size"], cfg["vocab_size"]
    mlp = lambda width: 3 * h * width  # gate, up, down (SwiGLU)
    attention = _attention(cfg) + 2 * h  # plus the two layer norms
    experts = cfg.get("n_routed_experts") or cfg.get("num_experts") or 0
    top_k = cfg.get("num_experts_per_tok", 0)
    shared = cfg.get("n_shared_experts") or 0
    moe_width = cfg.get("moe_intermediate_size", 0)
    router = experts * h + (experts if cfg.get("topk_method") == "noaux_tc" else 0)

    total = active = 0
    for layer in range(cfg["num_hidden_layers"]):
        total += attention
        active += attention
        if experts and _is_moe_layer(cfg, layer):
            common = router + shared * mlp(moe_width)
            total += common + experts * mlp(moe_width)
            active += common + top_k * mlp(moe_width)
        else:
            total += mlp(cfg["intermediate_size"])
            active += mlp(cfg["intermediate_size"])
    edges = vocab * h * (1 if cfg.get("tie_word_embeddings") else 2) + h  # embedding, output, final norm
    return ParamCount(total=total + edges, active=active + edges)
