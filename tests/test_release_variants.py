"""The released checkpoints users fine-tune (Kimi-K2-Instruct-0905, Kimi-K2-Thinking, Qwen3-*-2507): their shipped
config.json, their fine-tuning recipes, and the commands that show them.

Expected values are typed from the sources named in each ``recipes/hf_configs/<name>/README.md`` (model cards,
copies of the released config.json), never read from the package; the base configs are the shipped ones.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bridge_ext import commands
from bridge_ext.errors import UserError
from recipes.models import HF_CONFIGS, MODELS, RELEASES

# release -> (base model, {key: value} that differs from the base release's config.json), from the READMEs' sources
KIMI_THINKING_QUANT = {
    "config_groups": {"group_0": {
        "input_activations": None, "output_activations": None, "targets": ["Linear"],
        "weights": {"actorder": None, "block_structure": None, "dynamic": False, "group_size": 32, "num_bits": 4,
                    "observer": "minmax", "observer_kwargs": {}, "strategy": "group", "symmetric": True,
                    "type": "int"}}},
    "format": "pack-quantized",
    "ignore": ["lm_head", "re:.*self_attn.*", "re:.*shared_experts.*", r"re:.*mlp\.(gate|up|gate_up|down)_proj.*"],
    "kv_cache_scheme": None, "quant_method": "compressed-tensors", "quantization_status": "compressed",
}
YARN_256K = {"beta_fast": 1.0, "beta_slow": 1.0, "factor": 64.0, "mscale": 1.0, "mscale_all_dim": 1.0,
             "original_max_position_embeddings": 4096, "type": "yarn"}
EXPECTED = {
    "kimi_k2_instruct_0905": ("kimi_k2", {"max_position_embeddings": 262144, "rope_scaling": YARN_256K}),
    "kimi_k2_thinking": ("kimi_k2", {"max_position_embeddings": 262144, "rope_scaling": YARN_256K,
                                     "quantization_config": KIMI_THINKING_QUANT}),
    **{f"qwen3_4b_{kind}_2507": ("qwen3_4b", {"max_position_embeddings": 262144, "rope_theta": 5000000})
       for kind in ("instruct", "thinking")},
    **{f"qwen3_30b_a3b_{kind}_2507": ("qwen3_30b_a3b", {"max_position_embeddings": 262144, "rope_theta": 10000000})
       for kind in ("instruct", "thinking")},
    **{f"qwen3_235b_a22b_{kind}_2507": ("qwen3_235b_a22b", {"max_position_embeddings": 262144,
                                                              "rope_theta": 5000000})
       for kind in ("instruct", "thinking")},
}


def nemo_llm(argv: list[str]) -> int:
    return commands.main(["llm", *argv])


@pytest.mark.once
def test_each_release_ships_its_config_differing_from_its_base_only_where_the_sources_say():
    assert set(RELEASES) == set(EXPECTED)
    for name, (base, differs) in EXPECTED.items():
        spec = RELEASES[name]
        raw = json.loads((HF_CONFIGS / name / "config.json").read_text())
        base_raw = json.loads((HF_CONFIGS / base / "config.json").read_text())
        assert spec.release_of == base and name not in MODELS
        assert sorted(k for k in raw.keys() | base_raw.keys() if raw.get(k) != base_raw.get(k)) == sorted(differs)
        for key, value in differs.items():
            assert raw[key] == value, (name, key)
        assert (HF_CONFIGS / name / "README.md").is_file()  # where each value comes from
        # the same architecture as the base: every size, the parameter count, the family
        from dataclasses import replace

        arch, base_arch = spec.architecture, MODELS[base].architecture
        assert arch.max_position_embeddings == 262144
        assert replace(arch, max_position_embeddings=0) == replace(base_arch, max_position_embeddings=0)
        assert spec.family == MODELS[base].family
        assert spec.params == MODELS[base].params


@pytest.mark.once
def test_each_release_has_sft_and_lora_recipes_with_its_base_models_layouts_and_presets():
    from recipes.finetune import ALL_RECIPES, FINETUNE_RECIPES

    for name, (base, _) in EXPECTED.items():
        for mode in ("sft", "lora"):
            for kind, twin in (("muon", "adamw"), ("adamw", "muon")):
                recipe, base_recipe = FINETUNE_RECIPES[f"{name}_{mode}_{kind}"], FINETUNE_RECIPES[f"{base}_{mode}_{kind}"]
                assert ALL_RECIPES[recipe.name] is recipe and recipe.model is RELEASES[name]
                assert recipe.twin == f"{name}_{mode}_{twin}" and recipe.base == f"{base}_{kind}"
                assert recipe.preset == base_recipe.preset and dict(recipe.layouts) == dict(base_recipe.layouts)
                assert recipe.lora == base_recipe.lora and recipe.mode == mode
    # a release is fine-tuned, not pre-trained
    from recipes import RECIPES

    assert not [r for r in RECIPES if any(r.startswith(f"{n}_") for n in EXPECTED)]


@pytest.mark.once
def test_recipes_info_plan_and_muon_plan_show_the_releases(capsys):
    assert nemo_llm(["recipes", "--json"]) == 0
    listed = {row["name"]: row for row in json.loads(capsys.readouterr().out)}
    for name in EXPECTED:
        for suffix in ("sft_muon", "sft_adamw", "lora_muon", "lora_adamw"):
            assert f"{name}_{suffix}" in listed
    row = listed["kimi_k2_thinking_lora_muon"]
    assert (row["model"], row["task"], row["base_recipe"], row["num_layers"]) == ("Kimi-K2-Thinking", "lora",
                                                                                    "kimi_k2_muon", 61)
    assert nemo_llm(["recipes"]) == 0
    lines = capsys.readouterr().out.splitlines()
    line = next(x for x in lines if x.startswith("qwen3_235b_a22b_thinking_2507_lora_adamw "))
    assert "Qwen3-235B-A22B-Thinking-2507" in line  # the name column is wide enough for the longest name
    assert nemo_llm(["info", "--recipe", "qwen3_30b_a3b_instruct_2507_sft_muon", "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert (info["model"], info["base_recipe"], info["params_total"]) == (
        "Qwen3-30B-A3B-Instruct-2507", "qwen3_30b_a3b_muon", MODELS["qwen3_30b_a3b"].params.total)
    # plan and muon-plan: full SFT (every parameter trained) is what they model
    assert nemo_llm(["plan", "--recipe", "kimi_k2_thinking_sft_muon", "--json"]) == 0
    planned = json.loads(capsys.readouterr().out)
    assert nemo_llm(["plan", "--recipe", "kimi_k2_sft_muon", "--json"]) == 0
    base = json.loads(capsys.readouterr().out)
    assert planned["recipe"] == "kimi_k2_thinking_sft_muon"
    for key in ("params_total", "memory_per_gpu", "fit", "layout", "tokens_per_step"):  # the release plans as its base model
        assert planned[key] == base[key], key
    assert nemo_llm(["muon-plan", "--recipe", "qwen3_4b_thinking_2507_sft_adamw"]) == 0
    assert "qwen3_4b_thinking_2507_sft_adamw" in capsys.readouterr().out


@pytest.mark.once
@pytest.mark.parametrize("argv, line", [
    (["info", "--recipe", "kimi_k2_thinkin_sft_muon"],
     "unknown recipe 'kimi_k2_thinkin_sft_muon' (did you mean 'kimi_k2_thinking_sft_muon'?)"),
    (["plan", "--recipe", "qwen3_4b_instruct_2507_lora_muon"],
     "qwen3_4b_instruct_2507_lora_muon trains LoRA adapters on a frozen model, which plan and muon-plan do not "
     "model; qwen3_4b_instruct_2507_sft_muon (full SFT, same model and layout) is its upper bound"),
    (["muon-plan", "--recipe", "qwen3_30b_a3b_thinking_2507_muon"],
     "unknown recipe 'qwen3_30b_a3b_thinking_2507_muon' (did you mean 'qwen3_30b_a3b_thinking_2507_sft_muon'?)"),
])
def test_unknown_names_and_lora_plans_are_one_line_errors(capsys, argv, line):
    assert nemo_llm(argv) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.strip().startswith(f"error: {line}") and "\n" not in err.strip()


def test_get_full_recipe_refuses_lora_with_the_sft_twin():
    from recipes.finetune import get_full_recipe

    assert get_full_recipe("kimi_k2_instruct_0905_sft_adamw").name == "kimi_k2_instruct_0905_sft_adamw"
    assert get_full_recipe("kimi_k2_muon").name == "kimi_k2_muon"
    with pytest.raises(UserError, match="kimi_k2_instruct_0905_sft_muon"):
        get_full_recipe("kimi_k2_instruct_0905_lora_muon")


@pytest.mark.once
def test_a_runs_checkpoint_is_told_from_its_release_by_rope_or_asks_for_the_config(tmp_path):
    """Export finds a training run's config by its sizes; a release has its base's sizes, so its RoPE (run config
    fields typed from the shipped yaml/*.yaml: rotary_base, rotary_scaling_factor) tells them apart, and where two
    releases are the same model (Instruct / Thinking 2507) the user is asked for --hf-config."""
    from bridge_ext.convert.megatron_ckpt import hf_source_for_checkpoint, provider_fields

    def run_with(model: str, **rope) -> Path:
        iter_dir = tmp_path / f"{model}-{len(list(tmp_path.iterdir()))}" / "iter_0000002"
        iter_dir.mkdir(parents=True)
        fields = {**provider_fields(MODELS[model].architecture), **rope}
        (iter_dir / "run_config.yaml").write_text(json.dumps({"model": fields}))  # JSON is YAML
        return iter_dir

    def found(iter_dir: Path):
        return hf_source_for_checkpoint(iter_dir.parent, iter_dir, None)

    assert found(run_with("qwen3_4b", rotary_base=1000000, rotary_scaling_factor=None)) == HF_CONFIGS / "qwen3_4b"
    assert found(run_with("kimi_k2", rotary_base=50000.0, rotary_scaling_factor=32.0)) == HF_CONFIGS / "kimi_k2"
    for model, rope in (("qwen3_4b", {"rotary_base": 5000000}), ("qwen3_30b_a3b", {"rotary_base": 10000000}),
                        ("kimi_k2", {"rotary_base": 50000.0, "rotary_scaling_factor": 64.0})):
        with pytest.raises(UserError, match="pass --hf-config DIR"):
            found(run_with(model, **rope))
