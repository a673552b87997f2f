"""Model families: one module per family, each holding everything specific to it, as data.

A family is one HF ``config.json`` ``model_type``. Its numbers (layers, attention kind, experts, ...) are parsed
by :class:`recipes.architecture.Architecture`; its module (``recipes/families/<family>.py``) records the rest:

- ``FAMILY``: its :class:`ModelFamily`: the ``model_type``, the ``architectures`` entry its checkpoints carry
  (``hf_architecture``: Megatron Bridge's ``AutoBridge`` picks its bridge by this class name, so conversion
  accepts a directory only when its ``(architectures, model_type)`` pair is a family here,
  ``bridge_ext.hf.directory``) and ``transformers_model_type``, the transformers ``model_type`` that builds its
  config without remote code: a config that names its own code in ``auto_map`` with a ``model_type`` transformers
  does not know (Kimi K2's ``kimi_k2``, code in ``configuration_deepseek.py``) is built as that type's config
  (``bridge_ext.hf.load_hf_config``); conversion, training and plans then read transformers' own class;
- ``MODELS``, ``PROXIES``, ``RELEASES``: its :class:`~recipes.model_spec.ModelSpec` entries (each names a shipped
  ``recipes/hf_configs/<name>/config.json``): the full models, the tiny proxies of the same architecture for CPU
  runs and tests, the released post-trained checkpoints users fine-tune;
- ``LAYOUTS``: each of those models' layouts (model name -> cluster name -> :class:`~recipes.layout_spec.Layout`;
  the first is the default), the proxies' CPU layouts included;
- ``MUON_PRESET`` / ``MUON_PRESET_WHY``: the optimizer preset its ``_muon`` recipes use (``recipes.optimizers``,
  by name) and why; ``PRESETS``: every preset name its recipes use (the AdamW twin, fine-tuning's);
  ``PROXY_OVERRIDES``: its proxies' recipe overrides beyond every proxy's, by ``(model, optimizer)``;
- ``HF_CONFIG_FIXES`` (functions of ``bridge_ext.hf.config``) and ``PATCHES`` (rows of
  ``bridge_ext.patches.REGISTRY``) that concern it, by name: ``recipes/`` imports nothing of ``bridge_ext``;
  tests/test_family_modules.py checks that each exists.

The shared tables are assembled from :data:`MODULES`: :data:`FAMILIES` here, ``recipes.models.MODELS`` /
``RELEASES``, ``recipes.layouts.LAYOUTS``, ``recipes.RECIPES``. Adding a family: one module here and a line in
:data:`MODULES` (docs/architecture.md, "Where a change goes").
"""

from __future__ import annotations

from types import ModuleType

from recipes.families import kimi_k2, moonlight, qwen3, qwen3_moe
from recipes.model_spec import ModelFamily

__all__ = ["FAMILIES", "MODULES", "MUON_PRESET_BY_FAMILY", "PROXY_OVERRIDES_BY_MODEL", "ModelFamily",
           "families_of_architecture", "family", "module_of"]

# The family modules, in the order `nemo llm recipes` lists their models (each family's models, then each
# family's proxies: recipes.models.MODELS) and their released checkpoints (RELEASES).
MODULES: tuple[ModuleType, ...] = (kimi_k2, moonlight, qwen3, qwen3_moe)

# The order conversion lists the families in (`nemo llm import --help`, the supported HF classes); a family not
# named here follows these, in MODULES order.
_CONVERSION_ORDER = ("qwen3", "qwen3_moe", "deepseek_v3", "kimi_k2")

FAMILIES: dict[str, ModelFamily] = {
    f.model_type: f
    for f in sorted((m.FAMILY for m in MODULES),
                    key=lambda f: _CONVERSION_ORDER.index(f.model_type) if f.model_type in _CONVERSION_ORDER
                    else len(_CONVERSION_ORDER))
}

# The Muon preset each family's `_muon` recipes use, and why (shown on the recipe cards); the `_adamw` twin uses
# AdamW with the same learning rate, schedule and weight decay (recipes.optimizers.adamw_twin).
MUON_PRESET_BY_FAMILY: dict[str, tuple[str, str]] = {m.FAMILY.model_type: (m.MUON_PRESET, m.MUON_PRESET_WHY)
                                                     for m in MODULES}

# Proxy recipe overrides beyond every proxy's (recipes/__init__.py: run length, learning rates), by
# (model, optimizer suffix).
PROXY_OVERRIDES_BY_MODEL: dict[tuple[str, str], dict[str, float]] = {
    key: value for m in MODULES for key, value in m.PROXY_OVERRIDES.items()
}


def module_of(model_type: str) -> ModuleType:
    """The module of the family ``model_type`` (``recipes.families.kimi_k2`` for ``kimi_k2``); KeyError if none."""
    return {m.FAMILY.model_type: m for m in MODULES}[model_type]


def family(model_type: str | None) -> ModelFamily | None:
    """The family of a ``config.json``'s ``model_type``, or None when it is not one of ours."""
    return FAMILIES.get(model_type) if isinstance(model_type, str) else None


def families_of_architecture(hf_architecture: str) -> list[ModelFamily]:
    """The families whose checkpoints carry ``hf_architecture`` (DeepseekV3ForCausalLM: DeepSeek-V3, Kimi K2)."""
    return [f for f in FAMILIES.values() if f.hf_architecture == hf_architecture]
