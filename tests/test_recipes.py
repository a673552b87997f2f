"""Recipe registry, layouts and parameter counts: pure Python, no Megatron."""

import dataclasses
import math
import subprocess
import sys

import pytest

import recipes
from bridge_ext.errors import UserError
from recipes.architecture import Architecture
from recipes.layouts import LAYOUTS, Layout, pipeline_stages
from recipes.models import MODELS
from recipes.optimizers import PRESETS
from recipes.params import count_params

# Pure recipe data, no Megatron: the same on every stack, so CI runs it on the first stack only.
pytestmark = pytest.mark.once


def test_every_model_has_a_muon_recipe_and_an_adamw_twin():
    for model in MODELS:
        muon, adamw = recipes.get_recipe(f"{model}_muon"), recipes.get_recipe(f"{model}_adamw")
        assert muon.preset.kind == "muon" and adamw.preset.kind == "adamw"
        assert muon.twin == adamw.name and adamw.twin == muon.name
        assert muon.model is adamw.model and muon.layouts is adamw.layouts
    assert len(recipes.RECIPES) == 2 * len(MODELS) == 28


def test_unknown_recipe_names_the_closest():
    with pytest.raises(UserError, match="did you mean 'qwen3_8b_muon'"):
        recipes.get_recipe("qwen3_8b_moun")


def test_benchmark_layouts_are_the_defaults():
    kimi = recipes.get_recipe("kimi_k2_muon").layout()
    assert (kimi.cluster, kimi.gpus, kimi.tp, kimi.pp, kimi.vp, kimi.ep, kimi.dp) == ("gb300x256", 256, 1, 4, 4, 64, 64)
    assert (kimi.global_batch_size, kimi.micro_batch_size, kimi.seq_length) == (4096, 2, 4096)
    assert "moe_router_force_load_balancing" not in kimi.model  # the default trains the real router
    # the benchmark itself: the same layout with the router forced to balance
    bench = recipes.get_recipe("kimi_k2_muon").layout("gb300x256-bench")
    assert dataclasses.replace(bench, cluster=kimi.cluster, model=kimi.model, why=kimi.why) == kimi
    assert dict(bench.model) == {**kimi.model, "moe_router_force_load_balancing": True}
    upstream = recipes.get_recipe("kimi_k2_muon").layout("h100x512")
    assert (upstream.tp, upstream.pp, upstream.ep, upstream.gpus) == (2, 16, 32, 512)
    qwen = recipes.get_recipe("qwen3_30b_a3b_muon").layout()
    assert (qwen.cluster, qwen.gpus, qwen.tp, qwen.pp, qwen.ep, qwen.dp) == ("gb300x8", 8, 1, 1, 8, 8)
    assert (qwen.global_batch_size, qwen.micro_batch_size, qwen.seq_length) == (512, 8, 4096)


def test_unknown_layout_lists_the_choices():
    with pytest.raises(UserError, match="choose one of: gb300x256, gb300x256-bench, h100x512"):
        recipes.get_recipe("kimi_k2_muon").layout("h100x256")


@pytest.mark.parametrize("model", sorted(LAYOUTS))
def test_every_layout_fits_its_model(model):
    for layout in LAYOUTS[model].values():
        assert layout.problems(MODELS[model].num_layers) == [], layout.cluster


def test_layout_problems_catch_bad_splits():
    bad = Layout(cluster="x", gpus=20, tp=2, pp=4, ep=5, micro_batch_size=3, global_batch_size=16)
    problems = " | ".join(bad.problems(61))
    assert "20 GPUs are not divisible by tp*pp*cp=8" in problems
    assert "ep*etp=5 must divide tp*cp*dp=4" in problems
    assert "not a multiple of micro_batch_size*dp=6" in problems
    assert "61 layers do not split evenly over pp*vp=4" in problems
    wrong = Layout(cluster="y", gpus=16, pp=4, vp=4, micro_batch_size=1, global_batch_size=16,
                   pipeline_layout="Etttt|(tttt|)*14,ttL")
    assert wrong.problems(61) == ["pipeline_layout places 62 decoder layers, the model has 61"]


def test_pipeline_layout_grammar_matches_megatron_core():
    assert pipeline_stages("Et*3|(tt|)*2,tL") == ["Ettt", "tt", "tt", "tL"]
    kimi = pipeline_stages(LAYOUTS["kimi_k2"]["gb300x256"].pipeline_layout)
    assert len(kimi) == 16 and kimi[0] == "Etttt" and kimi[-1] == "tL"


# Published figures (models.md). Kimi K2's 1.04 T total is 1.3 % above what its released config
# describes (1.026 T; the same formula gives DeepSeek-V3's 671 B exactly): consistent with one
# multi-token-prediction layer (~17 B) that the released config (num_nextn_predict_layers 0) omits.
# Moonlight's "3B activated" rounds 2.91 B (with embedding and output layer); its exact figures without them
# (2.24 B / 15.29 B, sec. 3.3) are checked in tests/test_moonlight.py.
_TOLERANCE = {("kimi_k2", "total"): 0.015, ("moonlight_16b_a3b", "active"): 0.035}


def _agrees(ours: float, published: float, tolerance: float) -> bool:
    """Within ``tolerance``, or equal to the published figure at the precision it is printed with
    (``3.3`` B covers 3.30-3.39 B: model cards truncate)."""
    if abs(ours - published) <= tolerance * published:
        return True
    printed = repr(published).removesuffix(".0")
    decimals = len(printed.partition(".")[2])
    return math.floor(ours * 10**decimals) == round(published * 10**decimals)


@pytest.mark.parametrize("name", sorted(name for name, spec in MODELS.items() if spec.proxy_of is None))
def test_parameter_counts_match_published_figures(name):
    spec = MODELS[name]
    total, active = spec.published_params_b
    for kind, ours, published in (("total", spec.params.total, total), ("active", spec.params.active, active)):
        tolerance = _TOLERANCE.get((name, kind), 0.01)
        assert _agrees(ours / 1e9, published, tolerance), f"{name} {kind}: {ours / 1e9:.3f} B vs {published} B"


def test_parameter_count_formula_on_deepseek_v3():
    """The same counting gives DeepSeek-V3's published 671 B / 37 B (a model we do not ship)."""
    kimi = dict(MODELS["kimi_k2"].hf_config)
    dsv3 = {**kimi, "model_type": "deepseek_v3", "first_k_dense_replace": 3, "n_routed_experts": 256,
            "num_attention_heads": 128, "num_key_value_heads": 128, "vocab_size": 129280}
    counts = count_params(Architecture.from_hf_config(dsv3))
    assert abs(counts.total / 671e9 - 1) < 0.005
    assert abs(counts.active / 37e9 - 1) < 0.02


def test_proxies_share_family_and_preset_with_their_full_recipes():
    for name, recipe in recipes.RECIPES.items():
        if recipe.model.proxy_of is None:
            continue
        representative = {"kimi_k2": "kimi_k2", "qwen3": "qwen3_8b", "qwen3_moe": "qwen3_30b_a3b"}
        optimizer = name.rpartition("_")[2]
        full = recipes.get_recipe(f"{representative.get(recipe.model.proxy_of, recipe.model.proxy_of)}_{optimizer}")
        assert recipe.model.family == full.model.family and recipe.preset == full.preset
        cfg, full_cfg = recipe.model.hf_config, full.model.hf_config
        assert cfg["architectures"] == full_cfg["architectures"] and cfg["model_type"] == full_cfg["model_type"]
        assert set(cfg) - {"quantization_config"} == set(full_cfg) - {"quantization_config"}
        assert set(recipe.overrides) <= {"optimizer.lr", "optimizer.min_lr", "scheduler.lr_warmup_iters",
                                         "train.train_iters", "train.eval_interval", "train.eval_iters",
                                         "logger.log_interval", "checkpoint.save_interval"}
        assert recipe.model.params.total < 1e6


def test_muon_presets_keep_the_distributed_optimizer_off():
    # every muon_* field against the installed megatron-core: tests/test_muon.py (runs on every stack)
    for preset in PRESETS.values():
        if preset.kind == "muon":
            assert preset.ddp["use_distributed_optimizer"] is False


def test_default_presets():
    assert recipes.get_recipe("kimi_k2_muon").preset.name == "kimi_k2"
    assert recipes.get_recipe("kimi_k2_proxy_muon").preset.name == "kimi_k2"
    for name in ("qwen3_8b_muon", "qwen3_30b_a3b_muon", "qwen3_proxy_muon", "qwen3_moe_proxy_muon"):
        assert recipes.get_recipe(name).preset.name == "moonlight"
    assert recipes.get_recipe("qwen3_8b_adamw").preset.name == "moonlight_adamw"


def test_nvidia_perf_is_the_benchmarked_configuration():
    preset = PRESETS["nvidia_perf"]
    assert preset.optimizer["optimizer"] == "dist_muon"
    assert preset.muon_fields["muon_nesterov"] is True  # megatron-core's default is False
    assert preset.muon_fields["muon_coefficient_type"] == preset.ns_coefficients == "quintic"  # what it ran on 0.16
    assert (preset.muon_fields["muon_momentum"], preset.muon_fields["muon_num_ns_steps"]) == (0.95, 5)
    assert preset.muon_fields["muon_scale_mode"] == "spectral"
    assert preset.ddp["use_distributed_optimizer"] is False


@pytest.mark.parametrize("model", sorted(MODELS))
def test_adamw_twin_preset_differs_from_muon_only_in_the_optimizer(model):
    muon, adamw = recipes.get_recipe(f"{model}_muon").preset, recipes.get_recipe(f"{model}_adamw").preset
    changed = {k for k in muon.optimizer if muon.optimizer[k] != adamw.optimizer[k]}
    assert changed == {"optimizer", "use_distributed_optimizer"}
    assert dict(muon.scheduler) == dict(adamw.scheduler)
    assert dict(muon.schedule_fractions) == dict(adamw.schedule_fractions)
    assert set(muon.ddp) == set(adamw.ddp) == {"use_distributed_optimizer", "overlap_param_gather"}
    assert adamw.model == {}  # QK-clip belongs to MuonClip
    assert PRESETS[adamw.name] is adamw or adamw == PRESETS[adamw.name]


def test_recipes_and_info_answer_without_importing_torch_or_megatron():
    code = (
        "import sys\n"
        "from bridge_ext.commands import main\n"
        "assert main(['llm', 'recipes']) == 0\n"
        "assert main(['llm', 'info', '--recipe', 'kimi_k2_muon', '--json']) == 0\n"
        "assert main(['llm', 'info', '--recipe', 'kimi_k2_lora_muon', '--json']) == 0\n"
        "heavy = sorted({m.split('.')[0] for m in sys.modules} & {'torch', 'megatron', 'transformers'})\n"
        "assert not heavy, heavy\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, capture_output=True)
