"""A model's architecture, parsed once from its shipped Hugging Face ``config.json`` (pure data, no torch).

Every consumer (parameter counts in ``recipes.params``, the Muon routing manifest, ``nemo llm plan``'s
memory and FLOPs, fine-tuning) reads :class:`Architecture` instead of the raw dict, so the config keys of
each family are interpreted here only. Families: Qwen3 (dense GQA with QK-norm), Qwen3-MoE (the same
attention, every ``decoder_sparse_step``-th layer MoE unless in ``mlp_only_layers``) and DeepSeek-V3 /
Kimi K2 (Multi-head Latent Attention, dense layers below ``first_k_dense_replace``, then MoE every
``moe_layer_freq``-th layer; sigmoid router with an aux-loss-free expert bias for ``topk_method: noaux_tc``).
Adding a family: teach :meth:`Architecture.from_hf_config` its keys.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

__all__ = ["Architecture", "AttentionKind", "LatentAttention", "MixtureOfExperts", "RouterKind"]

AttentionKind = Literal["mla", "gqa"]
RouterKind = Literal["softmax", "sigmoid"]  # HF `scoring_func` (Qwen3-MoE has none: softmax)


@dataclass(frozen=True, kw_only=True)
class LatentAttention:
    """Multi-head Latent Attention's ranks and per-head dims (DeepSeek-V3 / Kimi K2)."""

    q_lora_rank: int | None  # None: queries projected straight from the hidden state (no low-rank q)
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim


@dataclass(frozen=True, kw_only=True)
class MixtureOfExperts:
    """Routed experts: how many, how wide, which layers have them."""

    experts: int
    top_k: int
    ffn_hidden_size: int  # one routed expert's intermediate size (`moe_intermediate_size`)
    shared_experts: int  # each as wide as a routed one (DeepSeek-V3 `n_shared_experts`); 0 for Qwen3-MoE
    router: RouterKind
    expert_bias: bool  # `topk_method: noaux_tc`: a per-expert routing bias updated without a loss
    layers: tuple[int, ...]  # decoder layer indices (0-based) whose MLP is a MoE

    @property
    def shared_ffn_hidden_size(self) -> int:
        return self.shared_experts * self.ffn_hidden_size


@dataclass(frozen=True, kw_only=True)
class Architecture:
    """What the HF ``config.json`` of a model says about its shape (read by :meth:`from_hf_config`)."""

    family: str  # HF `model_type`: kimi_k2, qwen3, qwen3_moe
    hf_architecture: str  # `architectures[0]`, e.g. DeepseekV3ForCausalLM
    num_layers: int
    hidden_size: int
    num_attention_heads: int
    num_kv_heads: int  # GQA query groups (MLA configs state as many as attention heads)
    # GQA: `head_dim` or hidden / heads. MLA: transformers' DeepseekV3Config sets head_dim = qk_rope_head_dim.
    head_dim: int
    attention: AttentionKind
    mla: LatentAttention | None
    attention_bias: bool
    qk_norm: bool  # RMSNorm on each head's q and k (Qwen3; no config key states it)
    vocab_size: int
    tie_word_embeddings: bool
    ffn_hidden_size: int  # the dense MLP's intermediate size (`intermediate_size`)
    moe: MixtureOfExperts | None
    mtp_layers: int  # `num_nextn_predict_layers` (multi-token prediction), 0 when absent
    max_position_embeddings: int | None

    @property
    def moe_layers(self) -> tuple[int, ...]:
        return self.moe.layers if self.moe else ()

    @property
    def dense_layers(self) -> tuple[int, ...]:
        moe = set(self.moe_layers)
        return tuple(i for i in range(self.num_layers) if i not in moe)

    def is_moe(self, layer: int) -> bool:
        return layer in self.moe_layers

    @classmethod
    def from_hf_config(cls, cfg: Mapping[str, Any]) -> Architecture:
        """Parse an HF ``config.json`` dict (Qwen3, Qwen3-MoE, DeepSeek-V3 / Kimi K2)."""
        h, heads, layers = cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_hidden_layers"]
        mla = None
        if "kv_lora_rank" in cfg:
            mla = LatentAttention(q_lora_rank=cfg.get("q_lora_rank") or None, kv_lora_rank=cfg["kv_lora_rank"],
                                  qk_nope_head_dim=cfg["qk_nope_head_dim"], qk_rope_head_dim=cfg["qk_rope_head_dim"],
                                  v_head_dim=cfg["v_head_dim"])
        experts = cfg.get("n_routed_experts") or cfg.get("num_experts") or 0
        moe = None
        if experts:
            moe = MixtureOfExperts(
                experts=experts, top_k=cfg["num_experts_per_tok"], ffn_hidden_size=cfg["moe_intermediate_size"],
                shared_experts=cfg.get("n_shared_experts") or 0, router=cfg.get("scoring_func", "softmax"),
                expert_bias=cfg.get("topk_method") == "noaux_tc",
                layers=tuple(i for i in range(layers) if _moe_layer(cfg, i)))
        return cls(
            family=cfg["model_type"], hf_architecture=(cfg.get("architectures") or [""])[0], num_layers=layers,
            hidden_size=h, num_attention_heads=heads, num_kv_heads=cfg.get("num_key_value_heads", heads),
            head_dim=cfg.get("head_dim") or (mla.qk_rope_head_dim if mla else h // heads),
            attention="mla" if mla else "gqa", mla=mla, attention_bias=bool(cfg.get("attention_bias", False)),
            qk_norm=cfg["model_type"].startswith("qwen3"), vocab_size=cfg["vocab_size"],
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)), ffn_hidden_size=cfg["intermediate_size"],
            moe=moe, mtp_layers=cfg.get("num_nextn_predict_layers") or 0,
            max_position_embeddings=cfg.get("max_position_embeddings"))


def _moe_layer(cfg: Mapping[str, Any], layer: int) -> bool:
    if "n_routed_experts" in cfg:  # DeepSeek-V3 style
        freq = cfg.get("moe_layer_freq", 1)
        return layer >= cfg.get("first_k_dense_replace", 0) and layer % freq == 0
    step = cfg.get("decoder_sparse_step", 1)  # Qwen3-MoE style
    return layer not in cfg.get("mlp_only_layers", []) and (layer + 1) % step == 0
