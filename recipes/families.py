"""Model families: what an HF ``config.json``'s ``model_type`` means beyond its numbers (pure data).

A family is one ``model_type``. Its numbers (layers, attention kind, experts, ...) are parsed by
:class:`recipes.architecture.Architecture`; what is recorded here is what code cannot read from the numbers:

- ``hf_architecture``: the ``architectures`` entry its checkpoints carry. Megatron Bridge's ``AutoBridge``
  picks its bridge by this class name (``auto_bridge.py``), so conversion accepts a directory only when its
  ``(architectures, model_type)`` pair is a family here (``bridge_ext.hf.directory``);
- ``transformers_model_type``: the transformers ``model_type`` that builds its config without remote code.
  A config that names its own code in ``auto_map`` with a ``model_type`` transformers does not know (Kimi K2's
  ``kimi_k2``, code in ``configuration_deepseek.py``) is built as that type's config
  (``bridge_ext.hf.load_hf_config``); conversion, training and plans then read transformers' own class.

Every :class:`recipes.models.ModelSpec`'s ``family`` is one of :data:`FAMILIES` (its ``config.json``'s
``model_type``; checked in tests/test_convert_families.py). Adding a family: docs/architecture.md,
"Where a change goes".
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["FAMILIES", "ModelFamily", "families_of_architecture", "family"]


@dataclass(frozen=True, kw_only=True)
class ModelFamily:
    model_type: str  # config.json's `model_type` (and ModelSpec.family)
    display: str  # in messages: "importing Qwen3-MoE from ..."
    hf_architecture: str  # config.json's `architectures` entry; Megatron Bridge has a bridge for it
    # The transformers `model_type` whose config class builds this family's config.json without remote code;
    # "" when transformers knows `model_type` itself.
    transformers_model_type: str = ""
    source: str = ""  # where the pairing above is stated

    @property
    def config_model_type(self) -> str:
        """The transformers ``model_type`` that builds its config (its own unless aliased)."""
        return self.transformers_model_type or self.model_type


FAMILIES: dict[str, ModelFamily] = {
    f.model_type: f
    for f in (
        ModelFamily(model_type="qwen3", display="Qwen3", hf_architecture="Qwen3ForCausalLM",
                    source="Qwen3 model cards (Qwen/Qwen3-8B config.json)"),
        ModelFamily(model_type="qwen3_moe", display="Qwen3-MoE", hf_architecture="Qwen3MoeForCausalLM",
                    source="Qwen3 model cards (Qwen/Qwen3-30B-A3B config.json)"),
        ModelFamily(model_type="deepseek_v3", display="DeepSeek-V3", hf_architecture="DeepseekV3ForCausalLM",
                    source="deepseek-ai/DeepSeek-V3 config.json; transformers' DeepseekV3Config"),
        ModelFamily(model_type="kimi_k2", display="Kimi K2", hf_architecture="DeepseekV3ForCausalLM",
                    transformers_model_type="deepseek_v3",
                    source="moonshotai/Kimi-K2-Instruct config.json: auto_map into its configuration_deepseek.py "
                           "(the DeepSeek-V3 architecture, Kimi K2 report arXiv 2507.20534)"),
    )
}


def family(model_type: str | None) -> ModelFamily | None:
    """The family of a ``config.json``'s ``model_type``, or None when it is not one of ours."""
    return FAMILIES.get(model_type) if isinstance(model_type, str) else None


def families_of_architecture(hf_architecture: str) -> list[ModelFamily]:
    """The families whose checkpoints carry ``hf_architecture`` (DeepseekV3ForCausalLM: DeepSeek-V3, Kimi K2)."""
    return [f for f in FAMILIES.values() if f.hf_architecture == hf_architecture]
