"""Hugging Face model directories, read and written without the hub and without remote code.

* :mod:`~bridge_ext.hf.config`: ``config.json`` -> transformers' config (Kimi K2's ``kimi_k2`` without its remote
  code), the values the shipped config states over an upstream bridge's defaults;
* :mod:`~bridge_ext.hf.directory`: reading and validating a directory (config, safetensors headers, shards,
  dtypes, the tensors an architecture needs), the ``hf_source/`` an import keeps;
* :mod:`~bridge_ext.hf.untrusted`: what a directory from someone else must pass before anything large is
  allocated (file kinds, JSON and header caps, config sizes against the weights, memory, NaN / Inf);
* :mod:`~bridge_ext.hf.read`: tensors as Megatron Bridge's state source reads them (per expert, dequantized);
* :mod:`~bridge_ext.hf.expert_layout` (routed experts per expert or fused), :mod:`~bridge_ext.hf.fp8`,
  :mod:`~bridge_ext.hf.int4` (quantized releases).

Conversion (``bridge_ext.convert``) maps these to and from Megatron checkpoints; building a recipe's config
(``bridge_ext.build``) reads the config part.
"""

from __future__ import annotations

from bridge_ext.hf.config import (
    apply_config_stated_fields,
    load_hf_config,
    read_config_json,
    transformers_model_type,
    upstream_bridge_config,
    upstream_bridge_for_model_type,
)

__all__ = ["apply_config_stated_fields", "load_hf_config", "read_config_json", "transformers_model_type",
           "upstream_bridge_config", "upstream_bridge_for_model_type"]
