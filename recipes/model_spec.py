"""The model part of a recipe, as types: :class:`ModelSpec` (one shipped Hugging Face ``config.json``, never a
hub id) and :class:`ModelFamily` (what a ``config.json``'s ``model_type`` means beyond its numbers).

The specs themselves live with their family (``recipes/families/<family>.py``); ``recipes.models`` and
``recipes.families`` assemble the tables (``MODELS``, ``RELEASES``, ``FAMILIES``).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any

from recipes.architecture import Architecture
from recipes.params import ParamCount, count_params

__all__ = ["HF_CONFIGS", "ModelFamily", "ModelSpec", "presets_of", "proxy_spec", "release_spec"]

HF_CONFIGS = Path(__file__).parent / "hf_configs"


@dataclass(frozen=True, kw_only=True)
class ModelFamily:
    """One ``model_type`` (see ``recipes.families``)."""

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


@dataclass(frozen=True, kw_only=True)
class ModelSpec:
    name: str
    display: str  # the model's published name
    family: str  # its config.json's `model_type`: one of recipes.families.FAMILIES (tests/test_convert_families.py)
    hf_id: str  # where the shipped config.json comes from (documentation only; never downloaded)
    # Published (total, active) parameter counts in billions, as the source states them.
    published_params_b: tuple[float, float] | None
    source: str
    proxy_of: str | None = None  # a tiny model of the same architecture family, for CPU runs and tests
    # Tokens of the published pre-training run: train.train_iters is sized to it at each layout's tokens per
    # step (recipes.Recipe.train_iters). None: Megatron Bridge's template length (recipes.budget).
    pretrain_tokens: float | None = None
    # Provider fields the model's authors set that its config.json does not state (HF configs carry the
    # library's initializer_range 0.02), and where they come from.
    provider: Mapping[str, Any] = field(default_factory=dict)
    provider_source: str = ""
    # A RELEASES entry: the MODELS spec of the same architecture (layouts, pre-training recipes, run recognition).
    release_of: str | None = None

    @property
    def config_dir(self) -> Path:
        return HF_CONFIGS / self.name

    @cached_property
    def hf_config(self) -> dict[str, Any]:
        with open(self.config_dir / "config.json") as handle:
            return json.load(handle)

    @cached_property
    def architecture(self) -> Architecture:
        """The shape its ``config.json`` states, parsed once."""
        return Architecture.from_hf_config(self.hf_config)

    @cached_property
    def params(self) -> ParamCount:
        return count_params(self.architecture)

    @property
    def num_layers(self) -> int:
        return self.architecture.num_layers

    @property
    def is_moe(self) -> bool:
        return self.params.total != self.params.active


def proxy_spec(name: str, *, of: str, display: str, family: str) -> ModelSpec:
    """A tiny model with ``of``'s config keys and architecture, for CPU runs and tests. Proxies keep their config's
    initializer_range and the template length (their recipes set 50 iterations)."""
    return ModelSpec(name=name, display=display, family=family, hf_id="-", published_params_b=None,
                     source=f"tiny model with {of}'s config keys and architecture", proxy_of=of)


def release_spec(name: str, display: str, hf_id: str, *, of: ModelSpec, source: str) -> ModelSpec:
    """A released post-trained checkpoint of ``of`` (instruct, reasoning, a later release of the same
    architecture): its own config.json, ``of``'s family, published sizes, provider fields and layouts."""
    return ModelSpec(name=name, display=display, family=of.family, hf_id=hf_id,
                     published_params_b=of.published_params_b, source=source, provider=of.provider,
                     provider_source=of.provider_source, release_of=of.name)


def presets_of(muon: str) -> tuple[str, ...]:
    """Every preset a family's recipes use, from its Muon preset's name: pre-training (``_muon``, ``_adamw``) and
    fine-tuning (recipes.finetune: ``_sft``, ``_lora``, each with its AdamW twin)."""
    return tuple(f"{muon}{part}{twin}" for part in ("", "_sft", "_lora") for twin in ("", "_adamw"))
