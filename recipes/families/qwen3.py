"""Qwen3, dense (``model_type`` ``qwen3``): everything specific to it, as data.

Qwen3 technical report (arXiv 2505.09388): dense decoders with grouped-query attention and QK-norm, 0.6 B to
32 B. Its MoE models are the ``qwen3_moe`` family (``recipes.families.qwen3_moe``), which builds its specs with
:func:`qwen3_spec` too. Shipped configs: ``recipes/hf_configs/<name>/config.json`` for each spec below.

Outside ``recipes/`` (named here, checked by tests/test_family_modules.py):

* :data:`HF_CONFIG_FIXES`, functions of ``bridge_ext.hf.config``: ``head_dim`` and ``num_key_value_heads`` come
  from its config (megatron-bridge 0.3.0's bridges lack the generic mappings: head_dim 16 got 128).
* :data:`PATCHES`, rows of ``bridge_ext.patches.REGISTRY`` (docs/patches.md) that concern it.
"""

from __future__ import annotations

from recipes.layout_spec import CPU_DENSE, H200_PROXY, SELECTIVE_RECOMPUTE, Layout
from recipes.model_spec import ModelFamily, ModelSpec, presets_of, proxy_spec, release_spec

FAMILY = ModelFamily(model_type="qwen3", display="Qwen3", hf_architecture="Qwen3ForCausalLM",
                     source="Qwen3 model cards (Qwen/Qwen3-8B config.json)")


def qwen3_spec(name: str, display: str, total: float, active: float | None = None) -> ModelSpec:
    """A Qwen3 model as its report and model card state it: dense, or MoE (``qwen3_moe``) with ``active``."""
    moe = active is not None
    return ModelSpec(
        name=name,
        display=display,
        family="qwen3_moe" if moe else "qwen3",
        hf_id=f"Qwen/{display}",
        published_params_b=(total, active if moe else total),
        source="Qwen3 technical report (arXiv 2505.09388) and model card",
    )


def releases_2507(base: ModelSpec) -> tuple[ModelSpec, ...]:
    """The 2507 Instruct and Thinking releases of ``base`` (262,144 tokens natively)."""
    return tuple(release_spec(f"{base.name}_{kind.lower()}_2507", f"{base.display}-{kind}-2507",
                              f"Qwen/{base.display}-{kind}-2507", of=base,
                              source=f"{base.display}-{kind}-2507 model card (262,144 tokens natively)")
                 for kind in ("Instruct", "Thinking"))


MODELS: tuple[ModelSpec, ...] = (
    qwen3_spec("qwen3_0p6b", "Qwen3-0.6B", 0.6),
    qwen3_spec("qwen3_1p7b", "Qwen3-1.7B", 1.7),
    qwen3_spec("qwen3_4b", "Qwen3-4B", 4.0),
    qwen3_spec("qwen3_8b", "Qwen3-8B", 8.2),
    qwen3_spec("qwen3_14b", "Qwen3-14B", 14.8),
    qwen3_spec("qwen3_32b", "Qwen3-32B", 32.8),
)
PROXIES: tuple[ModelSpec, ...] = (  # dense GQA with QK-norm
    proxy_spec("qwen3_proxy", of="qwen3", display="Qwen3 proxy", family="qwen3"),
)
RELEASES: tuple[ModelSpec, ...] = releases_2507(MODELS[2])  # Qwen3-4B-Instruct-2507, -Thinking-2507

# --- layouts ---------------------------------------------------------------------------------------------------

LAYOUTS: dict[str, dict[str, Layout]] = {
    "qwen3_0p6b": {
        "h100x8": Layout(cluster="h100x8", gpus=8, global_batch_size=256, micro_batch_size=4,
                         why="fits one GPU: pure data parallelism"),
        "h200x1": Layout(cluster="h200x1", gpus=1, global_batch_size=16, micro_batch_size=1,
                         why="one H200: the GPU tier's Muon vs AdamW step (bench/gpu_check.sh); micro-batch 1 "
                             "keeps the local spec's unfused 4K x 4K attention scores within memory"),
    },
    "qwen3_1p7b": {
        "h100x8": Layout(cluster="h100x8", gpus=8, global_batch_size=256, micro_batch_size=2,
                         why="fits one GPU: pure data parallelism"),
    },
    "qwen3_4b": {
        "h100x8": Layout(cluster="h100x8", gpus=8, tp=2, global_batch_size=256, micro_batch_size=2,
                         why="TP2 leaves room for fp32 main weights, grads and Muon momentum"),
    },
    "qwen3_8b": {
        "h100x8": Layout(cluster="h100x8", gpus=8, tp=4, global_batch_size=256, micro_batch_size=1,
                         why="Megatron Bridge's upstream Qwen3-8B parallelism (TP4) on one node"),
    },
    "qwen3_14b": {
        "h100x16": Layout(cluster="h100x16", gpus=16, tp=8, global_batch_size=256, micro_batch_size=1,
                          why="TP8 inside a node (upstream Qwen3-14B recipe), DP2 across two nodes"),
    },
    "qwen3_32b": {
        "h100x32": Layout(cluster="h100x32", gpus=32, tp=8, pp=2, global_batch_size=256, micro_batch_size=1,
                          model=SELECTIVE_RECOMPUTE,
                          why="upstream Qwen3-32B parallelism (TP8 PP2), DP2"),
    },
    "qwen3_proxy": {**CPU_DENSE, "h200x1": H200_PROXY},
}

# --- presets (recipes.optimizers; the `_muon` recipes use MUON_PRESET, the `_adamw` twins its AdamW twin) --------

MUON_PRESET = "moonlight"
MUON_PRESET_WHY = ("paper-faithful Muon whose update RMS matches AdamW's, so AdamW's learning rate and weight decay "
                   "transfer; Qwen3's QK-norm already bounds the logits (weight-level QK-clip is a no-op under it)")
# Every preset its recipes use: pre-training (`_muon`, `_adamw`), fine-tuning (recipes.finetune: `_sft_*`, `_lora_*`).
PRESETS = presets_of(MUON_PRESET)
# Its proxies' recipe overrides beyond every proxy's (recipes/__init__.py), by (model, optimizer): none.
PROXY_OVERRIDES: dict[tuple[str, str], dict[str, float]] = {}

# --- outside recipes/ (names only: recipes/ imports nothing of bridge_ext) -----------------------------------------

HF_CONFIG_FIXES: tuple[str, ...] = (
    "apply_config_stated_fields",  # head_dim -> kv_channels, num_key_value_heads -> num_query_groups
)
PATCHES: tuple[str, ...] = (
    # QK-clip on grouped-query attention (MuonClip, preset=kimi_k2, on a Qwen3 model)
    "qk-clip-nonpositive-logit-gqa", "qk-clip-gqa-tp-shapes",
)
