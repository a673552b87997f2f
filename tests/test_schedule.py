"""Schedule arithmetic has one source (``recipes.budget``, issue 39): what ``nemo llm info`` shows (recipe data,
``Recipe.run_length``) and what a built config trains with (``bridge_ext.build``) agree with the formulas written
out here by hand, for every shipped recipe at every layout it ships."""

from __future__ import annotations

import math

import pytest

from recipes.finetune import ALL_RECIPES

# Our arithmetic on Megatron Bridge's fields: the same on every stack, so CI runs it on the first stack only.
pytestmark = pytest.mark.once

TEMPLATE_ITERS = {"pretrain": 300_000, "sft": 1000, "lora": 1000}  # Megatron Bridge's templates' lengths
KIMI_K2_WSD = 5.5 / 15.5  # Kimi K2: cosine over the last 5.5 T of 15.5 T tokens


def by_hand(recipe, layout: str) -> dict:
    """The schedule of ``recipe`` on ``layout`` from the formulas, not from ``recipes.budget``."""
    chosen = recipe.layout(layout)
    sched = {**recipe.preset.scheduler,
             **{k.removeprefix("scheduler."): v for k, v in recipe.overrides.items() if k.startswith("scheduler.")}}
    tokens_per_step = chosen.global_batch_size * chosen.seq_length
    mode = getattr(recipe, "mode", "pretrain")
    if "train.train_iters" in recipe.overrides:
        iters = recipe.overrides["train.train_iters"]
    elif mode == "pretrain" and recipe.model.pretrain_tokens:
        iters = -(-int(recipe.model.pretrain_tokens) // tokens_per_step)  # ceil: at least the token budget
    else:
        iters = TEMPLATE_ITERS[mode]
    decay = sched.get("lr_decay_iters") or iters
    warmup = sched.get("lr_warmup_iters") or (sched.get("lr_warmup_fraction") or 0.0) * decay
    wsd = None
    if sched["lr_decay_style"] == "WSD":
        wsd = sched.get("lr_wsd_decay_iters") or max(1, round(recipe.preset.schedule_fractions[
            "lr_wsd_decay_fraction"] * decay))
    return {"tokens_per_step": tokens_per_step, "train_iters": iters, "warmup_iters": warmup,
            "decay_start": decay - wsd if wsd else None, "total_tokens": tokens_per_step * iters,
            "lr_wsd_decay_iters": wsd, "lr_decay_style": sched["lr_decay_style"]}


CASES = [(name, layout) for name, recipe in ALL_RECIPES.items() for layout in recipe.layouts]


def test_info_run_length_is_the_formula_for_every_recipe_and_layout():
    """``nemo llm info``'s run length (``Recipe.run_length``) of all shipped recipes at all their layouts."""
    assert len(CASES) > 100  # pre-training and fine-tuning recipes, each at each layout
    wrong = []
    for name, layout in CASES:
        recipe = ALL_RECIPES[name]
        expected = by_hand(recipe, layout)
        got = recipe.run_length(layout).as_dict()
        if got != {k: expected[k] for k in got}:
            wrong.append(f"{name}@{layout}: {got} != {expected}")
    assert not wrong, "\n".join(wrong)


def test_kimi_k2_and_qwen3_30b_a3b_in_numbers():
    """The two recipes the issue names, in numbers worked out by hand (not by the formula above)."""
    for layout in ("gb300x256", "gb300x256-bench", "h100x512"):  # 4096 x 4096 tokens per step
        run = ALL_RECIPES["kimi_k2_muon"].run_length(layout)
        assert (run.tokens_per_step, run.train_iters, run.warmup_iters) == (16_777_216, 923_872, 500)
        assert run.decay_start == 923_872 - 327_826  # round(923,872 x 5.5 / 15.5) = 327,826 WSD iterations
    for layout in ("gb300x8", "h100x16"):  # no published budget: the template's 300,000 at 512 x 4096
        run = ALL_RECIPES["qwen3_30b_a3b_muon"].run_length(layout)
        assert (run.tokens_per_step, run.train_iters, run.warmup_iters, run.decay_start) == (2_097_152, 300_000,
                                                                                            2000, None)


BUILT = [(name, layout) for name in ("kimi_k2_muon", "kimi_k2_adamw", "qwen3_30b_a3b_muon", "moonlight_16b_a3b_muon",
                                     "kimi_k2_proxy_muon", "kimi_k2_sft_muon")
         for layout in ALL_RECIPES[name].layouts]


@pytest.mark.parametrize(("name", "layout"), BUILT, ids=[f"{n}@{l}" for n, l in BUILT])
def test_built_config_schedule_is_the_formula(name, layout):
    """The config ``bridge_ext.build`` builds (what trains, and what the dry run prints) has the same schedule."""
    from bridge_ext.build import build_config

    recipe = ALL_RECIPES[name]
    expected = by_hand(recipe, layout)
    cfg = build_config(recipe, layout=layout)
    s, t = cfg.scheduler, cfg.train
    assert t.global_batch_size * cfg.model.seq_length == expected["tokens_per_step"]
    assert t.train_iters == expected["train_iters"]
    assert s.lr_decay_style == expected["lr_decay_style"]
    assert s.lr_warmup_iters == expected["warmup_iters"] and not s.lr_warmup_fraction
    assert s.lr_decay_iters is None  # decays over train.train_iters
    if expected["lr_wsd_decay_iters"] is not None:
        assert s.lr_wsd_decay_iters == expected["lr_wsd_decay_iters"]
    if name.startswith("kimi_k2_") and "proxy" not in name and "sft" not in name:
        assert s.lr_wsd_decay_iters == max(1, round(KIMI_K2_WSD * t.train_iters)) == 327_826
    run = recipe.run_length(layout)  # what `nemo llm info` says for it
    assert (run.train_iters, run.warmup_iters) == (t.train_iters, s.lr_warmup_iters)
    assert run.decay_start == (t.train_iters - s.lr_wsd_decay_iters if s.lr_decay_style == "WSD" else None)
    assert math.isclose(run.total_tokens, t.train_iters * t.global_batch_size * cfg.model.seq_length)
