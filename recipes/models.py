"""Model specs: a shipped Hugging Face ``config.json`` per model, never a hub id.

Each spec lives with its family (``recipes/families/<family>.py``: ``MODELS``, ``PROXIES``, ``RELEASES``); the
tables here are assembled from them. Adding a model: drop its ``config.json`` into
``recipes/hf_configs/<name>/`` and add one ``ModelSpec`` to its family's module. A released post-trained
checkpoint of a shipped model (instruct, reasoning, a later release of the same architecture) is a ``RELEASES``
entry instead: its own config.json (context length, RoPE, quantization), its base model's layouts, fine-tuning
recipes only (``recipes.finetune``).
"""

from __future__ import annotations

from recipes.families import MODULES
from recipes.model_spec import HF_CONFIGS, ModelSpec

__all__ = ["HF_CONFIGS", "MODELS", "RELEASES", "ModelSpec"]

# Every family's models, then every family's proxies (the order `nemo llm recipes` lists them in).
MODELS: dict[str, ModelSpec] = {
    spec.name: spec
    for spec in (*(spec for m in MODULES for spec in m.MODELS), *(spec for m in MODULES for spec in m.PROXIES))
}

# The checkpoints users fine-tune: the same architectures as MODELS, their own config.json (the keys that differ
# and where each value comes from: recipes/hf_configs/<name>/README.md). Not in MODELS: a release is not
# pre-trained here, and a run of one is told from its base by its config, not by its sizes.
RELEASES: dict[str, ModelSpec] = {spec.name: spec for m in MODULES for spec in m.RELEASES}
