"""Kimi K2 as its report publishes it: the learning-rate schedule stepped through Megatron's real scheduler,
the token budget, the initialization, and what `info` / the dry run say about them.

Expected values come from the Kimi K2 report (arXiv 2507.20534, sec. 3: 15.5 T tokens, 500 warm-up steps,
2e-4 constant for 10 T tokens, cosine to 2e-5 over the last 5.5 T) and the DeepSeek-V3 report (arXiv
2412.19437, sec. 4.2: initialization std 0.006), written out below as plain formulas, never read from the
recipes.
"""

from __future__ import annotations

import json
import math

import pytest

import recipes

# The papers' numbers.
PEAK_LR, FINAL_LR, WARMUP_STEPS = 2e-4, 2e-5, 500
TOTAL_TOKENS, DECAY_TOKENS = 15.5e12, 5.5e12
# NVIDIA's benchmark batch (README: GBS 4096 x seq 4096), the default layout's tokens per step.
BENCH_TOKENS_PER_STEP = 4096 * 4096


def paper_lr(iteration: int, tokens_per_step: int) -> float:
    """Kimi K2's learning rate after ``iteration`` steps: linear warm-up over 500 steps, constant until
    10 T tokens, then a cosine from 2e-4 to 2e-5 over the last 5.5 T tokens."""
    if iteration < WARMUP_STEPS:
        return PEAK_LR * iteration / WARMUP_STEPS
    tokens = iteration * tokens_per_step
    if tokens <= TOTAL_TOKENS - DECAY_TOKENS:
        return PEAK_LR
    progress = min(1.0, (tokens - (TOTAL_TOKENS - DECAY_TOKENS)) / DECAY_TOKENS)
    return FINAL_LR + (PEAK_LR - FINAL_LR) * 0.5 * (1 + math.cos(math.pi * progress))


def _megatron_lrs(cfg, gpus: int, iterations: list[int]) -> dict[int, float]:
    """lr of Megatron's OptimizerParamScheduler, built by Megatron Bridge from the validated config, after
    each of ``iterations`` (Bridge steps it by the global batch in samples)."""
    from megatron.bridge.training.optim import _get_scheduler

    from bridge_ext.build import validate_for_layout

    checked = validate_for_layout(cfg, gpus=gpus)  # ConfigContainer.validate() computes the scheduler steps
    optimizer = type("Optimizer", (), {"param_groups": [{}]})()
    scheduler = _get_scheduler(checked.optimizer, checked.scheduler, optimizer)
    lrs, done = {}, 0
    for iteration in sorted(iterations):
        scheduler.step((iteration - done) * checked.train.global_batch_size)
        done = iteration
        lrs[iteration] = optimizer.param_groups[0]["lr"]
    return lrs


pytestmark = pytest.mark.slow


@pytest.mark.parametrize("layout", ["gb300x256", "h100x512"])
def test_kimi_k2_lr_schedule_is_the_papers(layout):
    from bridge_ext.build import build_config

    recipe = recipes.get_recipe("kimi_k2_muon")
    cfg = build_config(recipe, layout=layout)
    tokens_per_step = cfg.train.global_batch_size * cfg.model.seq_length
    assert tokens_per_step == BENCH_TOKENS_PER_STEP
    end = cfg.train.train_iters
    # the run trains the paper's 15.5 T tokens, overshooting by less than one step
    assert TOTAL_TOKENS <= end * tokens_per_step < TOTAL_TOKENS + tokens_per_step
    decay_start = math.floor((TOTAL_TOKENS - DECAY_TOKENS) / tokens_per_step)  # last step at the peak: 10 T tokens
    mid = decay_start + round(DECAY_TOKENS / tokens_per_step / 2)
    iterations = [0, 250, 500, decay_start, decay_start + 1000, mid, end]
    lrs = _megatron_lrs(cfg, recipe.layout(layout).gpus, iterations)
    assert lrs[0] == 0.0
    assert lrs[250] == pytest.approx(1e-4, rel=1e-12)  # half-way through the 500-step warm-up
    assert lrs[500] == pytest.approx(PEAK_LR, rel=1e-12)
    assert lrs[decay_start] == pytest.approx(PEAK_LR, rel=1e-12)
    for iteration in (decay_start + 1000, mid):  # the decay's position in tokens, within a step's rounding
        assert lrs[iteration] == pytest.approx(paper_lr(iteration, tokens_per_step), rel=1e-5), iteration
    assert lrs[mid] == pytest.approx((PEAK_LR + FINAL_LR) / 2, rel=1e-5)  # cosine half-way: the mean
    assert lrs[end] == pytest.approx(FINAL_LR, rel=1e-9)


def test_budget_follows_the_batch_and_an_explicit_length_wins():
    from bridge_ext.build import build_config

    recipe = recipes.get_recipe("kimi_k2_muon")
    cfg = build_config(recipe, overrides=["train.global_batch_size=1024"])
    tokens_per_step = 1024 * 4096
    assert TOTAL_TOKENS <= cfg.train.train_iters * tokens_per_step < TOTAL_TOKENS + tokens_per_step
    assert cfg.scheduler.lr_warmup_iters == WARMUP_STEPS  # steps, not a fraction of the run
    lrs = _megatron_lrs(cfg, 256, [250, cfg.train.train_iters])
    assert lrs[250] == pytest.approx(1e-4) and lrs[cfg.train.train_iters] == pytest.approx(FINAL_LR)

    cfg = build_config(recipe, overrides=["train.train_iters=1000"])
    assert cfg.train.train_iters == 1000 and cfg.scheduler.lr_warmup_iters == WARMUP_STEPS
    assert cfg.scheduler.lr_wsd_decay_iters == round(1000 * 5.5 / 15.5)


def test_models_without_a_budget_keep_megatron_bridges_template_length():
    from bridge_ext.build import build_config
    from bridge_ext.upstream_api import pretrain_template

    cfg = build_config(recipes.get_recipe("qwen3_8b_muon"))
    assert cfg.train.train_iters == pretrain_template().train.train_iters == 300_000


@pytest.mark.parametrize("name", ["kimi_k2_muon", "kimi_k2_adamw"])
def test_kimi_k2_initialization_is_deepseek_v3s(name):
    from bridge_ext.build import build_config

    assert build_config(recipes.get_recipe(name)).model.init_method_std == 0.006
    # the proxy keeps its config's initializer_range: 0.006 is DeepSeek-V3's value for hidden size 7168
    assert build_config(recipes.get_recipe("kimi_k2_proxy_muon")).model.init_method_std == 0.02


def _cli(nemo, *args: str) -> str:
    result = nemo(["llm", *args])
    assert result.code == 0, result.stderr[-3000:]
    return result.stdout


@pytest.mark.once
def test_info_prints_warmup_tokens_per_step_and_total_tokens(nemo):
    run = json.loads(_cli(nemo, "info", "--recipe", "kimi_k2_muon", "--json"))["run"]
    steps = math.ceil(TOTAL_TOKENS / BENCH_TOKENS_PER_STEP)
    assert run == {"tokens_per_step": 16_777_216, "train_iters": steps, "warmup_iters": 500,
                   "decay_start": math.floor(10e12 / BENCH_TOKENS_PER_STEP), "total_tokens": steps * 16_777_216}
    text = _cli(nemo, "info", "--recipe", "kimi_k2_muon")
    assert (f"{steps:,} iterations x 16,777,216 tokens per step = 15.5 T tokens; warm-up 500 steps, "
            f"decay after iteration 596,046") in text


def test_dry_run_summary_prints_the_run_length(nemo):
    text = _cli(nemo, "pretrain", "--recipe", "kimi_k2_muon", "--dryrun")
    assert "923,872 iterations x 16,777,216 tokens per step = 15.5 T tokens; warm-up 500 steps" in text
    assert "WSD: warm-up 500 steps, final 327,826 iterations cosine" in text
    # 327,826 = round(5.5 / 15.5 x 923,872): the last 5.5 T tokens
    assert abs(327_826 * BENCH_TOKENS_PER_STEP - DECAY_TOKENS) < BENCH_TOKENS_PER_STEP
