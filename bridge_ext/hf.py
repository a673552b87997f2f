"""Hugging Face configs without the hub and without remote code.

Kimi K2's ``config.json`` says ``model_type: kimi_k2`` with an ``auto_map`` into the repository's own
``configuration_deepseek.py``; transformers does not know that type. The architecture is DeepSeek-V3
(``architectures: ["DeepseekV3ForCausalLM"]``), so we build transformers' own ``DeepseekV3Config`` from it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

__all__ = ["MODEL_TYPE_ALIASES", "apply_config_stated_fields", "read_config_json", "load_hf_config"]

# model_type in a config.json -> the transformers model_type that implements it.
MODEL_TYPE_ALIASES: dict[str, str] = {"kimi_k2": "deepseek_v3"}

# Keys that point at remote code or describe how one checkpoint is stored, not the architecture.
_NON_ARCHITECTURE_KEYS = ("auto_map", "quantization_config")


def read_config_json(path: str | Path) -> dict[str, Any]:
    """The ``config.json`` of a directory (or the file itself) as a dict."""
    path = Path(path)
    file = path / "config.json" if path.is_dir() else path
    with open(file) as handle:
        return json.load(handle)


def load_hf_config(path: str | Path):
    """A transformers ``PretrainedConfig`` for ``path``, never executing remote code."""
    from transformers import AutoConfig

    raw = read_config_json(path)
    model_type = raw.get("model_type")
    target_type = MODEL_TYPE_ALIASES.get(model_type, model_type)
    fields = {k: v for k, v in raw.items() if k not in _NON_ARCHITECTURE_KEYS and k != "model_type"}
    return AutoConfig.for_model(target_type, **fields)


# YaRN keys of an HF ``rope_scaling`` -> Megatron's MLA provider fields.
_YARN_FIELDS = {"factor": "rotary_scaling_factor", "original_max_position_embeddings": "original_max_position_embeddings",
                "beta_fast": "beta_fast", "beta_slow": "beta_slow", "mscale": "mscale", "mscale_all_dim": "mscale_all_dim"}


def apply_config_stated_fields(provider: Any, hf_config: Any) -> None:
    """Set provider fields that the HF config states but some Megatron Bridge release drops or hard-codes.

    megatron-bridge 0.3.0's DeepSeek-V3 bridge leaves YaRN's ``beta_fast``/``beta_slow`` at its defaults
    (32/1; Kimi K2's config says 1/1), and its bridges lack 0.3.1's generic ``head_dim -> kv_channels`` and
    ``num_key_value_heads -> num_query_groups`` mappings (a Qwen3 config with head_dim 16 got 128);
    0.3.1's hard-codes ``moe_aux_loss_coeff`` 1e-4 (Kimi K2's config says ``aux_loss_alpha`` 0.001, as
    Megatron Bridge's own Kimi K2 provider does). The config wins, so the model is the same on every stack
    (recipes and conversion alike).
    """
    stated = {}
    for theirs, ours in (("head_dim", "kv_channels"), ("num_key_value_heads", "num_query_groups")):
        if getattr(hf_config, theirs, None) is not None:
            stated[ours] = getattr(hf_config, theirs)
    rope = getattr(hf_config, "rope_scaling", None) or {}
    if rope.get("type", rope.get("rope_type")) == "yarn":
        stated.update({ours: rope[theirs] for theirs, ours in _YARN_FIELDS.items() if theirs in rope})
    if getattr(hf_config, "aux_loss_alpha", None) is not None:
        stated["moe_aux_loss_coeff"] = hf_config.aux_loss_alpha
    for name, value in stated.items():
        if hasattr(provider, name):
            setattr(provider, name, value)
