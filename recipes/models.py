"""Model specs: a shipped Hugging Face ``config.json`` per model, never a hub id.

Adding a model: drop its ``config.json`` into ``recipes/hf_configs/<name>/`` and add one ``ModelSpec``.
A released post-trained checkpoint of a shipped model (instruct, reasoning, a later release of the same
architecture) is a ``RELEASES`` entry instead: its own config.json (context length, RoPE, quantization), its
base model's layouts, fine-tuning recipes only (``recipes.finetune``).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any, Literal

from recipes.architecture import Architecture
from recipes.params import ParamCount, count_params

__all__ = ["HF_CONFIGS", "MODELS", "RELEASES", "ModelSpec"]

HF_CONFIGS = Path(__file__).parent / "hf_configs"

Family = Literal["deepseek_v3", "kimi_k2", "qwen3", "qwen3_moe"]


@dataclass(frozen=True, kw_only=True)
class ModelSpec:
    name: str
    display: str  # the model's published name
    family: Family
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


def _qwen3(name: str, display: str, total: float, active: float | None = None) -> ModelSpec:
    moe = active is not None
    return ModelSpec(
        name=name,
        display=display,
        family="qwen3_moe" if moe else "qwen3",
        hf_id=f"Qwen/{display}",
        published_params_b=(total, active if moe else total),
        source="Qwen3 technical report (arXiv 2505.09388) and model card",
    )


MODELS: dict[str, ModelSpec] = {
    spec.name: spec
    for spec in (
        ModelSpec(
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
        ),
        ModelSpec(
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
        ),
        _qwen3("qwen3_0p6b", "Qwen3-0.6B", 0.6),
        _qwen3("qwen3_1p7b", "Qwen3-1.7B", 1.7),
        _qwen3("qwen3_4b", "Qwen3-4B", 4.0),
        _qwen3("qwen3_8b", "Qwen3-8B", 8.2),
        _qwen3("qwen3_14b", "Qwen3-14B", 14.8),
        _qwen3("qwen3_32b", "Qwen3-32B", 32.8),
        _qwen3("qwen3_30b_a3b", "Qwen3-30B-A3B", 30.5, 3.3),
        _qwen3("qwen3_235b_a22b", "Qwen3-235B-A22B", 235.0, 22.0),
        *(  # proxies keep their config's initializer_range and the template length (their recipes set 50 its)
            ModelSpec(name=name, display=display, family=family, hf_id="-", published_params_b=None,
                      source=f"tiny model with {full}'s config keys and architecture", proxy_of=full)
            for name, full, display, family in (
                # MLA, sigmoid router + expert bias, shared expert
                ("kimi_k2_proxy", "kimi_k2", "Kimi-K2 proxy", "kimi_k2"),
                # MLA without a query low-rank, sigmoid router + expert bias, 2 shared experts, first layer dense
                ("moonlight_proxy", "moonlight_16b_a3b", "Moonlight proxy", "deepseek_v3"),
                ("qwen3_proxy", "qwen3", "Qwen3 proxy", "qwen3"),  # dense GQA with QK-norm
                ("qwen3_moe_proxy", "qwen3_moe", "Qwen3-MoE proxy", "qwen3_moe"),
            )
        ),
    )
}


def _release(name: str, display: str, hf_id: str, of: str, source: str) -> ModelSpec:
    base = MODELS[of]
    return ModelSpec(name=name, display=display, family=base.family, hf_id=hf_id,
                     published_params_b=base.published_params_b, source=source, provider=base.provider,
                     provider_source=base.provider_source, release_of=of)


# The checkpoints users fine-tune: the same architectures as MODELS, their own config.json (the keys that differ
# and where each value comes from: recipes/hf_configs/<name>/README.md). Not in MODELS: a release is not
# pre-trained here, and a run of one is told from its base by its config, not by its sizes.
RELEASES: dict[str, ModelSpec] = {
    spec.name: spec
    for spec in (
        _release("kimi_k2_instruct_0905", "Kimi-K2-Instruct-0905", "moonshotai/Kimi-K2-Instruct-0905", "kimi_k2",
                 "Kimi K2 model card (256K context, YaRN factor 64); fp8 release"),
        _release("kimi_k2_thinking", "Kimi-K2-Thinking", "moonshotai/Kimi-K2-Thinking", "kimi_k2",
                 "Kimi K2 Thinking model card (256K context); int4 routed experts (compressed-tensors)"),
        *(_release(f"{base}_{kind.lower()}_2507", f"{display}-{kind}-2507", f"Qwen/{display}-{kind}-2507", base,
                   f"{display}-{kind}-2507 model card (262,144 tokens natively)")
          for base, display in (("qwen3_4b", "Qwen3-4B"), ("qwen3_30b_a3b", "Qwen3-30B-A3B"),
                                ("qwen3_235b_a22b", "Qwen3-235B-A22B"))
          for kind in ("Instruct", "Thinking")),
    )
}
