"""Moonlight (``model_type`` ``deepseek_v3``): everything specific to it, as data.

Moonlight-16B-A3B (Moonshot AI, "Muon is Scalable for LLM Training", arXiv 2502.16982) is the one shipped model
of the DeepSeek-V3 family: MLA without a query low-rank, 64 routed experts, sigmoid router with expert bias, two
shared experts, first layer dense. Shipped configs: ``recipes/hf_configs/<name>/config.json`` for each spec
below (``moonlight_16b_a3b``, ``moonlight_proxy``).

Outside ``recipes/`` (named here, checked by tests/test_family_modules.py):

* :data:`HF_CONFIG_FIXES`, functions of ``bridge_ext.hf.config``: ``aux_loss_alpha`` comes from its config, not
  a bridge's hard-coded value.
* :data:`PATCHES`, rows of ``bridge_ext.patches.REGISTRY`` (docs/patches.md) that concern it: MLA as
  DeepSeek-V3's code has it (its ``rms_norm_eps`` 1e-5 makes the latent norms' eps matter; its query without a
  low rank), the DeepSeek-V3 bridge's SequentialMLP experts.
"""

from __future__ import annotations

from dataclasses import replace

from recipes.layout_spec import CPU_MOE, CPU_PP2, H200_PROXY, SELECTIVE_RECOMPUTE, Layout
from recipes.model_spec import ModelFamily, ModelSpec, presets_of, proxy_spec

FAMILY = ModelFamily(
    model_type="deepseek_v3", display="DeepSeek-V3", hf_architecture="DeepseekV3ForCausalLM",
    source="deepseek-ai/DeepSeek-V3 config.json; transformers' DeepseekV3Config",
)

MOONLIGHT_16B_A3B = ModelSpec(
    name="moonlight_16b_a3b",
    display="Moonlight-16B-A3B",
    family="deepseek_v3",
    hf_id="moonshotai/Moonlight-16B-A3B",
    # sec. 3.3: 2.24 B active / 15.29 B total without the embedding and output layers, 3 B / 16 B with them
    published_params_b=(16.0, 3.0),
    source="Muon is Scalable for LLM Training (arXiv 2502.16982, sec. 3.3 and appendix C)",
    # Stages 1-2 of the paper's 5.7 T tokens (sec. 3.3): warm-up, then the cosine to 4.2e-5 ends at 5.2 T.
    # Stage 3 (5.2-5.7 T) re-warms to 1e-4 and decays linearly to 0: a second schedule that one
    # Megatron scheduler cannot follow after the cosine (docs/recipes.md, the Moonlight note).
    pretrain_tokens=5.2e12,
    provider={"moe_router_bias_update_rate": 1e-3},
    provider_source=("aux-free bias update rate 1e-3 in stages 1-2 (arXiv 2502.16982, sec. 3.3); the paper's "
                     "mean-centred sign update (appendix C) is not megatron-core's and is not reproduced"),
)
MODELS: tuple[ModelSpec, ...] = (MOONLIGHT_16B_A3B,)
# MLA without a query low-rank, sigmoid router + expert bias, 2 shared experts, first layer dense
PROXIES: tuple[ModelSpec, ...] = (
    proxy_spec("moonlight_proxy", of="moonlight_16b_a3b", display="Moonlight proxy", family="deepseek_v3"),
)
RELEASES: tuple[ModelSpec, ...] = ()

# --- layouts ---------------------------------------------------------------------------------------------------

# Moonlight-16B-A3B at its paper's batch and sequence (arXiv 2502.16982, sec. 3.3): 4,096 sequences of 8K tokens
# (33.6 M tokens per step: the paper's batch from 200 B tokens on; 2,048 before, which one fixed global batch
# cannot follow) on one node or two. EP8 puts 8 of the 64 experts on each GPU; the all-to-all dispatcher.
_MOONLIGHT = {"moe_token_dispatcher_type": "alltoall"}
_MOONLIGHT_BATCH = {"global_batch_size": 4096, "seq_length": 8192}

LAYOUTS: dict[str, dict[str, Layout]] = {
    "moonlight_16b_a3b": {
        "h100x8": Layout(
            cluster="h100x8", gpus=8, tp=2, ep=8, micro_batch_size=1, **_MOONLIGHT_BATCH,
            model={**SELECTIVE_RECOMPUTE, **_MOONLIGHT},
            why="one node of 80 GB (H100; H200 likewise): TP2 with sequence parallelism halves the dense weights and "
                "activations of the 8K sequences, EP8 over TP x DP, selective recompute; the tested 8-GPU layout",
        ),
        "gb300x8": Layout(
            cluster="gb300x8", gpus=8, ep=8, micro_batch_size=2, **_MOONLIGHT_BATCH,
            model={**SELECTIVE_RECOMPUTE, **_MOONLIGHT},
            why="one GB300 node (288 GB): no tensor parallelism, EP8 over the 8 data-parallel ranks, two sequences "
                "per micro-batch",
        ),
        "h100x16": Layout(
            cluster="h100x16", gpus=16, tp=2, ep=8, micro_batch_size=1, **_MOONLIGHT_BATCH,
            model={**SELECTIVE_RECOMPUTE, **_MOONLIGHT},
            why="two nodes of 80 GB: h100x8's TP2 EP8 inside a node, data parallelism 8 across both",
        ),
    },
    # as kimi_k2_proxy: 3 layers over 2 stages, embedding + 2 layers first, 1 layer + loss last
    "moonlight_proxy": {**CPU_MOE, "cpu-pp2": replace(CPU_PP2, pipeline_layout="Ett|tL"), "h200x1": H200_PROXY},
}

# --- presets (recipes.optimizers; the `_muon` recipes use MUON_PRESET, the `_adamw` twins its AdamW twin) --------

# DeepSeek-V3's architecture as Moonlight-16B-A3B has it (the one model of that family shipped): its own run
MUON_PRESET = "moonlight_16b"
MUON_PRESET_WHY = ("Moonlight's own pre-training run (arXiv 2502.16982, sec. 3.3), the run Muon's scaling claims "
                   "rest on; its AdamW twin is the paper's Moonlight-A (the same settings with AdamW)")
# Every preset its recipes use: pre-training (`_muon`, `_adamw`), fine-tuning (recipes.finetune: `_sft_*`, `_lora_*`).
PRESETS = presets_of(MUON_PRESET)
# Where the proxy's own sweep (docs/cpu.md, 200 iterations, seeds 1234 and 2) found another best rate: its AdamW at
# 1e-2 ends 0.06-0.10 below 3e-3 on both seeds (2e-2 diverges), so its A/B runs AdamW at its best.
PROXY_OVERRIDES: dict[tuple[str, str], dict[str, float]] = {
    ("moonlight_proxy", "adamw"): {"optimizer.lr": 1e-2, "optimizer.min_lr": 1e-3},
}

# --- outside recipes/ (names only: recipes/ imports nothing of bridge_ext) -----------------------------------------

HF_CONFIG_FIXES: tuple[str, ...] = (
    "apply_config_stated_fields",  # aux_loss_alpha 0.001 from its config.json, over a bridge's hard-coded value
)
PATCHES: tuple[str, ...] = (
    # conversion: the DeepSeek-V3 bridge's SequentialMLP experts (CPU, no TE)
    "deepseek-sequential-expert-mappings",
    "sequential-expert-export", "sequential-expert-numbers",  # every MoE family's SequentialMLP experts
    # MLA as DeepSeek-V3's code has it: latent norms' eps 1e-6 (its rms_norm_eps is 1e-5), the query without a
    # low rank straight from the block's normalized input; training and conversion build the same model
    "mla-latent-norm-eps", "mla-latent-norm-eps (conversion)",
    "mla-q-projection-without-norm", "mla-q-projection-without-norm (conversion)",
    "mla-rope-key-grad-tp",  # MLA under TP without TE
)
