"""Kimi K2 (``model_type`` ``kimi_k2``): everything specific to it, as data.

Moonshot AI's 1T-parameter MoE (Kimi K2 report, arXiv 2507.20534): DeepSeek-V3's architecture (MLA, 384 routed
experts, sigmoid router with expert bias, one shared expert, first layer dense) at 61 layers, trained with
MuonClip. Shipped configs: ``recipes/hf_configs/<name>/config.json`` for each spec below (``kimi_k2``,
``kimi_k2_proxy``, ``kimi_k2_instruct_0905``, ``kimi_k2_thinking``).

Outside ``recipes/`` (named here, checked by tests/test_family_modules.py):

* :data:`HF_CONFIG_FIXES`, functions of ``bridge_ext.hf.config``: its ``config.json`` names remote code
  (``auto_map`` into ``configuration_deepseek.py``) under a ``model_type`` transformers does not know, so it is
  built as transformers' ``DeepseekV3Config`` (:data:`FAMILY`'s ``transformers_model_type``); where Megatron
  Bridge has its own ``KimiK2Bridge`` (0.4+) conversion is dispatched to it; YaRN's ``beta_fast``/``beta_slow``
  and ``aux_loss_alpha`` come from the config, not a bridge's defaults.
* :data:`PATCHES`, rows of ``bridge_ext.patches.REGISTRY`` (docs/patches.md) that concern it.
"""

from __future__ import annotations

from dataclasses import replace

from recipes.layout_spec import CPU_MOE, CPU_PP2, H200_PROXY, SELECTIVE_RECOMPUTE, Layout
from recipes.model_spec import ModelFamily, ModelSpec, presets_of, proxy_spec, release_spec

FAMILY = ModelFamily(
    model_type="kimi_k2", display="Kimi K2", hf_architecture="DeepseekV3ForCausalLM",
    transformers_model_type="deepseek_v3",
    source="moonshotai/Kimi-K2-Instruct config.json: auto_map into its configuration_deepseek.py "
           "(the DeepSeek-V3 architecture, Kimi K2 report arXiv 2507.20534)",
)

KIMI_K2 = ModelSpec(
    name="kimi_k2",
    display="Kimi-K2",
    family="kimi_k2",
    hf_id="moonshotai/Kimi-K2-Instruct",
    published_params_b=(1040.0, 32.0),
    source="Kimi K2 technical report (arXiv 2507.20534)",
    pretrain_tokens=15.5e12,  # the report's pre-training corpus, one pass
    provider={"init_method_std": 0.006},
    provider_source=("init std 0.006: DeepSeek-V3 report (arXiv 2412.19437, sec. 4.2), the architecture Kimi "
                     "K2 scales; Megatron Bridge's KimiK2Provider sets it too"),
)
MODELS: tuple[ModelSpec, ...] = (KIMI_K2,)
# MLA, sigmoid router + expert bias, shared expert
PROXIES: tuple[ModelSpec, ...] = (proxy_spec("kimi_k2_proxy", of="kimi_k2", display="Kimi-K2 proxy", family="kimi_k2"),)
# Released checkpoints users fine-tune (recipes.models.RELEASES): their own config.json, Kimi K2's layouts.
RELEASES: tuple[ModelSpec, ...] = (
    release_spec("kimi_k2_instruct_0905", "Kimi-K2-Instruct-0905", "moonshotai/Kimi-K2-Instruct-0905", of=KIMI_K2,
                 source="Kimi K2 model card (256K context, YaRN factor 64); fp8 release"),
    release_spec("kimi_k2_thinking", "Kimi-K2-Thinking", "moonshotai/Kimi-K2-Thinking", of=KIMI_K2,
                 source="Kimi K2 Thinking model card (256K context); int4 routed experts (compressed-tensors)"),
)

# --- layouts ---------------------------------------------------------------------------------------------------

# Kimi K2's 61 layers over 16 pipeline stages: embedding + 4 layers first, 1 layer + loss last
# (Megatron Bridge 0.3 recipes/kimi/kimi_k2.py::_get_kimi_k2_pipeline_layout, PP4 VP4 and PP16).
_KIMI_K2_16_STAGES = "Etttt|(tttt|)*14,tL"

# NVIDIA's 2026-04 benchmark layout, with the real router. The benchmark itself forced the router to balance
# (`gb300x256-bench`): a setting megatron-core marks benchmark-only, never in a layout that trains weights.
_KIMI_K2_GB300 = Layout(
    cluster="gb300x256", gpus=256, tp=1, pp=4, vp=4, ep=64, global_batch_size=4096, micro_batch_size=2,
    precision="bf16_with_mxfp8_mixed", pipeline_layout=_KIMI_K2_16_STAGES,
    model={
        "recompute_granularity": "selective",
        "recompute_modules": ["mla_up_proj"],
        "moe_token_dispatcher_type": "flex",
        "moe_flex_dispatcher_backend": "hybridep",
        "moe_shared_expert_overlap": False,  # megatron-core allows it only with the alltoall dispatcher
    },
    why="NVIDIA's 2026-04 benchmark layout (1,080 TFLOP/s/GPU with Muon, MXFP8), training the real router; "
        "`gb300x256-bench` is the benchmark itself",
)

LAYOUTS: dict[str, dict[str, Layout]] = {
    "kimi_k2": {
        "gb300x256": _KIMI_K2_GB300,
        "gb300x256-bench": replace(
            _KIMI_K2_GB300, cluster="gb300x256-bench",
            model={**_KIMI_K2_GB300.model, "moe_router_force_load_balancing": True},
            why="reproduces the 1,080 TFLOP/s benchmark; the router is forced to balance, do not keep the weights "
                "(megatron-core: random router logits, for benchmarking only)",
        ),
        "h100x512": Layout(
            cluster="h100x512", gpus=512, tp=2, pp=16, ep=32, global_batch_size=4096, micro_batch_size=1,
            pipeline_layout=_KIMI_K2_16_STAGES,
            model={**SELECTIVE_RECOMPUTE, "moe_token_dispatcher_type": "alltoall"},
            why="Megatron Bridge's upstream Kimi K2 recipe layout (TP2 PP16 EP32)",
        ),
    },
    # Kimi K2 proxy: 3 layers over 2 stages, embedding + 2 layers first, 1 layer + loss last
    "kimi_k2_proxy": {**CPU_MOE, "cpu-pp2": replace(CPU_PP2, pipeline_layout="Ett|tL"), "h200x1": H200_PROXY},
}

# --- presets (recipes.optimizers; the `_muon` recipes use MUON_PRESET, the `_adamw` twins its AdamW twin) --------

MUON_PRESET = "kimi_k2"
MUON_PRESET_WHY = ("the paper's own recipe: MLA has no QK-norm, so MuonClip's QK-clip is what bounds the attention "
                   "logits (Kimi K2 trained 15.5 T tokens without a loss spike with it)")
# Every preset its recipes use: pre-training (`_muon`, `_adamw`), fine-tuning (recipes.finetune: `_sft_*`, `_lora_*`).
PRESETS = presets_of(MUON_PRESET)
# Its proxies' recipe overrides beyond every proxy's (recipes/__init__.py), by (model, optimizer): none.
PROXY_OVERRIDES: dict[tuple[str, str], dict[str, float]] = {}

# --- outside recipes/ (names only: recipes/ imports nothing of bridge_ext) -----------------------------------------

HF_CONFIG_FIXES: tuple[str, ...] = (
    "transformers_model_type",  # kimi_k2 -> transformers' deepseek_v3 (FAMILY.transformers_model_type)
    "upstream_bridge_for_model_type", "upstream_bridge_config",  # megatron-bridge >= 0.4's own KimiK2Bridge
    "apply_config_stated_fields",  # YaRN beta_fast/beta_slow 1/1, aux_loss_alpha 0.001 from its config.json
)
PATCHES: tuple[str, ...] = (
    # conversion: SequentialMLP experts (CPU, no TE) and the router's expert bias, for its bridges
    "deepseek-sequential-expert-mappings",  # the DeepSeek-V3 bridge Kimi K2 converts with on megatron-bridge 0.3
    "kimi-k2-bridge-mappings",  # megatron-bridge >= 0.4's KimiK2Bridge
    "sequential-expert-export", "sequential-expert-numbers",  # every MoE family's SequentialMLP experts
    # MLA as DeepSeek-V3's code has it (a no-op for Kimi K2's rms_norm_eps 1e-6), and under TP without TE
    "mla-latent-norm-eps", "mla-latent-norm-eps (conversion)", "mla-rope-key-grad-tp",
    # MuonClip (its preset's QK-clip on MLA)
    "qk-clip-nonpositive-logit-mla", "muon-clip-any-wrapper",
)
