"""Qwen3-MoE (``model_type`` ``qwen3_moe``): everything specific to it, as data.

Qwen3 technical report (arXiv 2505.09388): Qwen3's attention (grouped-query, QK-norm) with 128 routed experts,
top-8, no shared expert. Its specs are built like the dense ones (``recipes.families.qwen3.qwen3_spec``).
Shipped configs: ``recipes/hf_configs/<name>/config.json`` for each spec below.

Outside ``recipes/`` (named here, checked by tests/test_family_modules.py):

* :data:`HF_CONFIG_FIXES`, functions of ``bridge_ext.hf.config``: ``head_dim`` and ``num_key_value_heads`` come
  from its config.
* :data:`PATCHES`, rows of ``bridge_ext.patches.REGISTRY`` (docs/patches.md) that concern it. Its bridge already
  maps SequentialMLP expert names (``qwen/qwen3_moe_bridge.py``); the expert-number rows are every MoE family's.
"""

from __future__ import annotations

from recipes.families import qwen3
from recipes.families.qwen3 import qwen3_spec, releases_2507
from recipes.layout_spec import CPU_MOE, H200_PROXY, SELECTIVE_RECOMPUTE, Layout
from recipes.model_spec import ModelFamily, ModelSpec, proxy_spec

FAMILY = ModelFamily(model_type="qwen3_moe", display="Qwen3-MoE", hf_architecture="Qwen3MoeForCausalLM",
                     source="Qwen3 model cards (Qwen/Qwen3-30B-A3B config.json)")

MODELS: tuple[ModelSpec, ...] = (
    qwen3_spec("qwen3_30b_a3b", "Qwen3-30B-A3B", 30.5, 3.3),
    qwen3_spec("qwen3_235b_a22b", "Qwen3-235B-A22B", 235.0, 22.0),
)
PROXIES: tuple[ModelSpec, ...] = (proxy_spec("qwen3_moe_proxy", of="qwen3_moe", display="Qwen3-MoE proxy",
                                             family="qwen3_moe"),)
# Qwen3-30B-A3B- and Qwen3-235B-A22B-Instruct-2507, -Thinking-2507
RELEASES: tuple[ModelSpec, ...] = tuple(release for base in MODELS for release in releases_2507(base))

# --- layouts ---------------------------------------------------------------------------------------------------

LAYOUTS: dict[str, dict[str, Layout]] = {
    "qwen3_30b_a3b": {
        "gb300x8": Layout(
            cluster="gb300x8", gpus=8, ep=8, global_batch_size=512, micro_batch_size=8,
            precision="bf16_with_mxfp8_mixed", model={"moe_token_dispatcher_type": "alltoall"},
            why="NVIDIA's 2026-04 benchmark layout (721 TFLOP/s/GPU with Muon, MXFP8)",
        ),
        "h100x16": Layout(
            cluster="h100x16", gpus=16, tp=2, ep=8, global_batch_size=512, micro_batch_size=2,
            model={**SELECTIVE_RECOMPUTE, "moe_token_dispatcher_type": "alltoall"},
            why="80 GB GPUs: TP2 halves activation and dense-weight memory; EP8 over the 8 DP ranks",
        ),
    },
    "qwen3_235b_a22b": {
        "h100x128": Layout(
            cluster="h100x128", gpus=128, tp=2, pp=8, ep=16, global_batch_size=1024, micro_batch_size=1,
            pipeline_layout="Et*11|(t*12|)*6,t*11L",  # 94 layers; embedding and loss weigh one layer each
            model={**SELECTIVE_RECOMPUTE, "moe_token_dispatcher_type": "alltoall"},
            why="16 nodes of 8x80 GB: PP8 over nodes, EP16 across 2 nodes of DP, TP2 inside NVLink",
        ),
    },
    "qwen3_moe_proxy": {**CPU_MOE, "h200x1": H200_PROXY},
}

# --- presets (recipes.optimizers; the `_muon` recipes use MUON_PRESET, the `_adamw` twins its AdamW twin) --------

# Dense Qwen3's: the same attention, the same reasons
MUON_PRESET, MUON_PRESET_WHY, PRESETS = qwen3.MUON_PRESET, qwen3.MUON_PRESET_WHY, qwen3.PRESETS
# Its proxies' recipe overrides beyond every proxy's (recipes/__init__.py), by (model, optimizer): none.
PROXY_OVERRIDES: dict[tuple[str, str], dict[str, float]] = {}

# --- outside recipes/ (names only: recipes/ imports nothing of bridge_ext) -----------------------------------------

HF_CONFIG_FIXES: tuple[str, ...] = (
    "apply_config_stated_fields",  # head_dim -> kv_channels, num_key_value_heads -> num_query_groups
)
PATCHES: tuple[str, ...] = (
    "sequential-expert-export", "sequential-expert-numbers",  # every MoE family's SequentialMLP experts
    # QK-clip on grouped-query attention (MuonClip, preset=kimi_k2, on a Qwen3-MoE model)
    "qk-clip-nonpositive-logit-gqa", "qk-clip-gqa-tp-shapes",
)
