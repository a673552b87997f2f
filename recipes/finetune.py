"""Fine-tuning recipes: ``<model>_sft_muon`` / ``_sft_adamw`` (full) and ``<model>_lora_muon`` / ``_lora_adamw``.

The same three parts as the pre-training recipes (model spec x optimizer preset x layout); what changes is
the preset (fine-tuning learning rate and schedule), the layout (Megatron Bridge's packed SFT batch) and,
for LoRA, the adapters. Pure data, no torch: ``bridge_ext.finetune`` turns a recipe into Megatron Bridge's
SFT/PEFT ``ConfigContainer`` and runs its ``finetune()``.

Settings and where they come from (the recipe cards in docs/finetune.md repeat them):

* Optimizer: Moonlight (arXiv 2502.16982, sec. 3.5) fine-tunes with the same Muon as pre-training (update
  RMS matched to AdamW's, weight decay 0.1) and reports that a Muon-pretrained model fine-tuned with Muon
  does best, and that on an AdamW-pretrained model Muon SFT is on par with AdamW. So the Muon presets are
  the pre-training ones (``moonlight`` for Qwen3, ``kimi_k2`` = MuonClip for Kimi K2) with a fine-tuning
  schedule; each has an AdamW twin with the same schedule. The paper states an SFT learning rate and decay for
  Moonlight itself (sec. 3.5.1: 5e-5, linear to 0; ``moonlight_16b_sft``) but no warm-up or batch, and nothing
  for LoRA or for other models' recipes; for those we use Megatron Bridge 0.3's own SFT/PEFT templates
  (``recipes/common.py`` ``_sft_common`` / ``_peft_common``): full SFT lr 5e-6 -> 0, LoRA lr 1e-4 -> 0, 50
  warm-up steps, cosine, Adam beta2 0.98, weight decay 0.1, 1000 iterations, seq 2048 packed, seed 5678.
  Because the Muon update's RMS matches AdamW's (0.2*sqrt(max(A, B))), the AdamW learning rate transfers.
* LoRA with Muon: Megatron Bridge's LoRA (dim 32, alpha 32, on linear_qkv, linear_proj, linear_fc1,
  linear_fc2; A xavier, B zero). The base weights are frozen (``requires_grad=False``) and megatron-core's
  Muon takes only trainable 2-D parameters, so only the adapters' A (dim x in) and B (out x dim) matrices
  are orthogonalized, each as one matrix: Q/K/V and gate/up splitting do not apply to a low-rank factor
  (``muon_split_qkv`` off, ``split_gate_up`` off).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from types import MappingProxyType
from typing import Any, Literal

from recipes import RECIPES, Recipe
from recipes.errors import UserError, closest
from recipes.layouts import LAYOUTS, Layout
from recipes.models import MODELS, RELEASES
from recipes.optimizers import KIMI_K2, MOONLIGHT, MOONLIGHT_16B, OptimizerPreset, adamw_twin, derive

__all__ = ["ALL_RECIPES", "FINETUNE_PRESETS", "FINETUNE_RECIPES", "FinetuneRecipe", "LORA_DEFAULTS", "Mode",
           "get_any_recipe", "get_finetune_recipe", "get_full_recipe"]

Mode = Literal["sft", "lora"]

# Megatron Bridge 0.3.1 recipes/common.py: _sft_common / _peft_common (and 0.3.0's per-model finetune configs).
_MB_SOURCE = "Megatron Bridge 0.3 recipes/common.py _sft_common / _peft_common"
FINETUNE_ITERS = 1000  # Megatron Bridge's SFT/PEFT template length
SFT_SEQ_LENGTH = 2048  # Megatron Bridge's SFT sequence (packed)
SFT_PACKS_PER_BATCH = 8  # Megatron Bridge's global batch for packed sequences

# LoRA as Megatron Bridge's _peft_common sets it.
LORA_DEFAULTS: Mapping[str, Any] = MappingProxyType({
    "target_modules": ["linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"],
    "dim": 32, "alpha": 32, "dropout": 0.0, "dropout_position": "pre",
    "lora_A_init_method": "xavier", "lora_B_init_method": "zero",
})

_SCHEDULE = {"lr_decay_style": "cosine", "lr_warmup_iters": 50, "lr_warmup_init": 0.0, "lr_decay_iters": None,
             "lr_wsd_decay_iters": None, "start_weight_decay": 0.1, "end_weight_decay": 0.1,
             "weight_decay_incr_style": "constant", "override_opt_param_scheduler": True}


# Where the paper states a model's own SFT run, its learning rate and decay replace Megatron Bridge's template:
# Moonlight's SFT (arXiv 2502.16982, sec. 3.5.1: tulu-3-sft-mixture, two epochs, lr 5e-5 decaying linearly to 0).
# Warm-up, batch and Adam's beta2 stay the template's (the paper states none of them).
_PAPER_SFT: dict[str, tuple[float, str, str]] = {
    MOONLIGHT_16B.name: (5e-5, "linear", "Moonlight's own SFT, arXiv 2502.16982 sec. 3.5.1 (lr 5e-5, linear to 0)"),
}


def _finetune_preset(base: OptimizerPreset, mode: Mode) -> OptimizerPreset:
    lr, decay, source = 5e-6 if mode == "sft" else 1e-4, "cosine", f"schedule and lr from {_MB_SOURCE}"
    if mode == "sft" and base.name in _PAPER_SFT:
        lr, decay, paper = _PAPER_SFT[base.name]
        source = f"{paper}; warm-up and Adam beta2 from {_MB_SOURCE}"
    what = "full SFT" if mode == "sft" else "LoRA"
    preset = derive(
        base, name=f"{base.name}_{mode}",
        summary=f"{base.name}'s Muon for {what}: lr {lr:g} -> 0, 50 warm-up steps, {decay}, Adam beta2 0.98",
        source=f"Moonlight, arXiv 2502.16982 sec. 3.5 (Muon for SFT); {source}",
        optimizer={"lr": lr, "min_lr": 0.0, "adam_beta2": 0.98, "weight_decay": 0.1,
                   **({"muon_split_qkv": False} if mode == "lora" else {})},
        scheduler={**_SCHEDULE, "lr_decay_style": decay},
    )
    # a short run: no WSD fractions; LoRA factors are orthogonalized whole
    return replace(preset, schedule_fractions={}, split_gate_up=base.split_gate_up and mode == "sft")


FINETUNE_PRESETS: dict[str, OptimizerPreset] = {}
for _base in (MOONLIGHT, KIMI_K2, MOONLIGHT_16B):
    for _mode in ("sft", "lora"):
        _muon = _finetune_preset(_base, _mode)
        _twin = adamw_twin(_muon)
        FINETUNE_PRESETS[_muon.name] = _muon
        FINETUNE_PRESETS[_twin.name] = replace(
            _twin, summary=f"AdamW (betas 0.9/0.98) with {_muon.name}'s learning rate, schedule and weight decay")


@dataclass(frozen=True, kw_only=True)
class FinetuneRecipe(Recipe):
    """A pre-training recipe's model and layouts, fine-tuned: full SFT or LoRA from a pretrained checkpoint."""

    mode: Mode
    base: str  # the pre-training recipe of the same model and optimizer (what a proxy's checkpoint comes from)
    lora: Mapping[str, Any] = field(default_factory=dict)  # megatron.bridge.peft.lora.LoRA fields (LoRA only)

    def train_iters(self, layout: Layout) -> int:
        return self.overrides.get("train.train_iters", FINETUNE_ITERS)

    def with_preset(self, name: str) -> FinetuneRecipe:
        if name not in FINETUNE_PRESETS:
            raise UserError(f"unknown fine-tuning preset '{name}'{closest(name, FINETUNE_PRESETS)}; "
                            f"choose one of: {', '.join(FINETUNE_PRESETS)}")
        return replace(self, preset=FINETUNE_PRESETS[name], preset_why=f"selected with preset={name}")


def _finetune_layout(layout: Layout) -> Layout:
    """Megatron Bridge's packed SFT batch (8 packs of 2048 tokens, micro-batch 1), at least one pack per DP rank."""
    dp = max(layout.dp, 1)
    gbs = -(-SFT_PACKS_PER_BATCH // dp) * dp
    return replace(layout, seq_length=SFT_SEQ_LENGTH, global_batch_size=gbs, micro_batch_size=1,
                   why=f"{layout.why}; fine-tuning: Megatron Bridge's packed SFT batch ({SFT_PACKS_PER_BATCH} packs "
                       f"of {SFT_SEQ_LENGTH} tokens, micro-batch 1 as packing requires, at least one pack per "
                       "data-parallel rank)")


# Proxies: 40 iterations on the shipped instruction set (docs/finetune.md), an eval every 10 on the held-out
# split. Learning rates set (not swept) from the pre-training proxies' tuned ones (Muon 1e-2, AdamW 3e-3),
# a notch lower for full SFT of a trained model; LoRA's adapters take 1e-2 with either optimizer.
_PROXY_COMMON = {"scheduler.lr_warmup_iters": 4, "train.train_iters": 40, "train.eval_interval": 10,
                 "train.eval_iters": 8, "logger.log_interval": 5, "checkpoint.save_interval": 20}
_PROXY_LR = {("sft", "muon"): 3e-3, ("sft", "adamw"): 1e-3, ("lora", "muon"): 1e-2, ("lora", "adamw"): 1e-2}
_PROXY_WHY = ("a tiny model of the same architecture fine-tuned from a proxy pre-training checkpoint on the shipped "
              "instruction set; only the run length and the learning rate (per optimizer) differ from the full recipe")

# Why each pre-training Muon preset carries over to fine-tuning (a model fine-tunes with its `_muon` recipe's preset).
_WHY = {
    KIMI_K2.name: "MuonClip as in pre-training: Kimi K2's MLA has no QK-norm, so QK-clip keeps bounding the logits",
    MOONLIGHT.name: "Moonlight's Muon as in pre-training (sec. 3.5: Muon-pretrained models fine-tune best with Muon)",
    MOONLIGHT_16B.name: ("Moonlight fine-tuned as its paper fine-tunes it: its pre-training Muon (sec. 3.5.1: "
                         "Moonlight with Muon SFT did best), the paper's SFT learning rate and linear decay"),
}


def _compose() -> dict[str, FinetuneRecipe]:
    out = {}
    # Released checkpoints (RELEASES) fine-tune exactly as their base model: its layouts, presets and base recipe.
    for model_name, model in {**MODELS, **RELEASES}.items():
        proxy = model.proxy_of is not None
        arch_name = model.release_of or model_name
        layouts = LAYOUTS[arch_name] if proxy else {k: _finetune_layout(v) for k, v in LAYOUTS[arch_name].items()}
        for mode in ("sft", "lora"):
            base = RECIPES[f"{arch_name}_muon"].preset  # the pre-training recipe's Muon preset
            muon = FINETUNE_PRESETS[f"{base.name}_{mode}"]
            for kind, preset, twin in (("muon", muon, "adamw"), ("adamw", FINETUNE_PRESETS[f"{muon.name}_adamw"],
                                                                  "muon")):
                name = f"{model_name}_{mode}_{kind}"
                overrides = ({**_PROXY_COMMON, "optimizer.lr": _PROXY_LR[mode, kind],
                              "optimizer.min_lr": _PROXY_LR[mode, kind] / 10} if proxy else {})
                out[name] = FinetuneRecipe(
                    name=name, model=model, preset=preset, layouts=layouts, twin=f"{model_name}_{mode}_{twin}",
                    overrides=overrides, why=_PROXY_WHY if proxy else "", mode=mode,
                    base=f"{arch_name}_{kind}", lora=LORA_DEFAULTS if mode == "lora" else {},
                    preset_why=_WHY[base.name] if kind == "muon" else f"the A/B twin of {model_name}_{mode}_muon",
                )
    return out


FINETUNE_RECIPES: dict[str, FinetuneRecipe] = _compose()


def get_finetune_recipe(name: str) -> FinetuneRecipe:
    """The fine-tuning recipe called ``name``; a ``UserError`` naming the closest one otherwise."""
    if name not in FINETUNE_RECIPES:
        hint = (f" ({name} pre-trains; its fine-tuning recipes are {name.rsplit('_', 1)[0]}_sft_* and _lora_*)"
                if name in RECIPES else closest(name, FINETUNE_RECIPES))
        raise UserError(f"unknown fine-tuning recipe '{name}'{hint}; `nemo llm finetune --list` lists them")
    return FINETUNE_RECIPES[name]


# Pre-training, then fine-tuning (`nemo llm recipes`, `info`, compare).
ALL_RECIPES: dict[str, Recipe] = {**RECIPES, **FINETUNE_RECIPES}


def get_any_recipe(name: str) -> Recipe:
    """A pre-training or fine-tuning recipe by name; a ``UserError`` naming the closest of either otherwise."""
    if name not in ALL_RECIPES:
        raise UserError(f"unknown recipe '{name}'{closest(name, ALL_RECIPES)}; `nemo llm recipes` lists them")
    return ALL_RECIPES[name]


def get_full_recipe(name: str) -> Recipe:
    """A recipe that trains every parameter (pre-training or full SFT), what ``plan`` and ``muon-plan`` model.

    A LoRA recipe trains only its adapters on a frozen model: a ``UserError`` naming its SFT twin (the upper bound)."""
    recipe = get_any_recipe(name)
    if getattr(recipe, "mode", None) == "lora":
        sft = name.replace("_lora_", "_sft_", 1)
        raise UserError(f"{name} trains LoRA adapters on a frozen model, which plan and muon-plan do not model; "
                        f"{sft} (full SFT, same model and layout) is its upper bound")
    return recipe
