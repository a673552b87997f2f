"""Hugging Face configs without the hub and without remote code.

Kimi K2's ``config.json`` says ``model_type: kimi_k2`` with an ``auto_map`` into the repository's own
``configuration_deepseek.py``; transformers does not know that type. The architecture is DeepSeek-V3
(``architectures: ["DeepseekV3ForCausalLM"]``), so we build transformers' own ``DeepseekV3Config`` from it.
Which ``model_type`` builds which is recipe data: :data:`recipes.families.FAMILIES`
(``transformers_model_type``), read when a config is loaded. Each family's module (``recipes.families.kimi_k2``,
...) names the functions here that concern it (``HF_CONFIG_FIXES``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from bridge_ext.hf.untrusted import read_json_capped
from recipes.families import family

__all__ = ["apply_config_stated_fields", "read_config_json", "load_hf_config", "transformers_model_type",
           "upstream_bridge_config", "upstream_bridge_for_model_type"]

# Keys that point at remote code or describe how one checkpoint is stored, not the architecture.
_NON_ARCHITECTURE_KEYS = ("auto_map", "quantization_config")


def read_config_json(path: str | Path) -> dict[str, Any]:
    """The ``config.json`` of a directory (or the file itself) as a dict; a regular file under a size cap
    (:func:`~bridge_ext.hf.untrusted.read_json_capped`), since it may come from someone else."""
    path = Path(path)
    file = path / "config.json" if path.is_dir() else path
    return read_json_capped(file, what="config.json")


def transformers_model_type(model_type: str | None) -> str | None:
    """The transformers ``model_type`` that builds a ``config.json`` of ``model_type``: its family's
    (:attr:`recipes.families.ModelFamily.config_model_type`), else ``model_type`` itself."""
    known = family(model_type)
    return known.config_model_type if known is not None else model_type


def load_hf_config(path: str | Path):
    """A transformers ``PretrainedConfig`` for ``path``, never executing remote code."""
    from transformers import AutoConfig

    raw = read_config_json(path)
    target_type = transformers_model_type(raw.get("model_type"))
    fields = {k: v for k, v in raw.items() if k not in _NON_ARCHITECTURE_KEYS and k != "model_type"}
    return AutoConfig.for_model(target_type, **fields)


def upstream_bridge_for_model_type(model_type: str | None) -> Any | None:
    """Megatron Bridge's own bridge class for a ``config.json`` model_type that transformers knows only under
    another (:func:`transformers_model_type`), where the installed Megatron Bridge registers one; else None.

    megatron-bridge 0.4 added ``KimiK2Bridge`` (``models/kimi/kimi_bridge.py``: ``register_bridge(source=
    "KimiK2ForCausalLM", model_type="kimi_k2")``, which stores ``SOURCE_NAME`` / ``MODEL_TYPE`` on the class);
    0.3 has no ``MODEL_TYPE`` and no Kimi K2 bridge.
    """
    if model_type is None or transformers_model_type(model_type) == model_type:
        return None
    import megatron.bridge.models  # noqa: F401  (registers every bridge)
    from megatron.bridge.models.conversion.model_bridge import MegatronModelBridge

    found, todo = [], list(MegatronModelBridge.__subclasses__())
    while todo:
        cls = todo.pop()
        todo += cls.__subclasses__()
        if cls.__dict__.get("MODEL_TYPE") == model_type and isinstance(cls.__dict__.get("SOURCE_NAME"), str):
            found.append(cls)
    return found[0] if len(set(found)) == 1 else None


def upstream_bridge_config(config: Any, *, model_type: str | None) -> Any:
    """The transformers config to hand Megatron Bridge's ``AutoBridge`` for a ``config.json`` of ``model_type``.

    ``AutoBridge`` picks its bridge from ``auto_map["AutoModelForCausalLM"]``'s class name when there is one,
    else from ``architectures`` (``auto_bridge.py`` ``_causal_lm_architecture``); Kimi K2 says
    ``DeepseekV3ForCausalLM``, so it would get the DeepSeek-V3 bridge. Where Megatron Bridge has its own bridge
    for the model_type (:func:`upstream_bridge_for_model_type`), a copy of ``config`` names that bridge's source
    in ``auto_map`` (as a remote-code config names its class), so ``AutoBridge`` dispatches to it. Otherwise
    ``config`` itself. Fields the config states still win afterwards (:func:`apply_config_stated_fields`).
    """
    bridge = upstream_bridge_for_model_type(model_type)
    if bridge is None:
        return config
    import copy

    config = copy.deepcopy(config)
    config.auto_map = {"AutoModelForCausalLM": bridge.SOURCE_NAME}
    return config


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
    # transformers 5 keeps a config.json's rope_scaling (and rope_theta) as rope_parameters
    for rope in (getattr(hf_config, "rope_scaling", None), getattr(hf_config, "rope_parameters", None)):
        if isinstance(rope, dict) and rope.get("type", rope.get("rope_type")) == "yarn":
            stated.update({ours: rope[theirs] for theirs, ours in _YARN_FIELDS.items() if theirs in rope})
            break
    if getattr(hf_config, "aux_loss_alpha", None) is not None:
        stated["moe_aux_loss_coeff"] = hf_config.aux_loss_alpha
    for name, value in stated.items():
        if hasattr(provider, name):
            setattr(provider, name, value)
