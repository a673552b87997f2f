"""Recipes built into Megatron Bridge ConfigContainers: validation, YAML, overrides, twins."""

import dataclasses
import json

import pytest
import yaml

import bridge_ext  # noqa: F401  (before megatron.bridge: its import guard for machines without Transformer Engine)
import recipes
from megatron.bridge.training.mixed_precision import get_mixed_precision_config
from megatron.core.transformer.transformer_config import MLATransformerConfig

from bridge_ext.build import benchmark_only_fields, build_config, validate_for_layout
from bridge_ext.errors import UserError
from bridge_ext.overrides import apply_user_overrides, config_to_yaml
from bridge_ext.upstream_api import installed_optimizer_fields
from bridge_ext.shipped_files import RECIPE_CARDS, YAML_DIR, render_all, render_cards
from tests.stack_shapes import config_differences, stack_differences

pytestmark = [pytest.mark.slow, pytest.mark.stack]  # Megatron Bridge validates each recipe


@pytest.fixture(scope="module")
def rendered():
    return render_all()


@pytest.mark.parametrize("name", sorted(recipes.RECIPES))
def test_recipe_builds_offline_and_validates_on_every_layout(name):
    recipe = recipes.get_recipe(name)
    for layout_name, layout in recipe.layouts.items():
        cfg = build_config(recipe, layout=layout_name)
        checked = validate_for_layout(cfg, gpus=layout.gpus)
        model = checked.model
        assert checked.data_parallel_size == layout.dp
        assert (model.num_layers, model.hidden_size) == (recipe.model.num_layers, recipe.model.hf_config["hidden_size"])
        assert (model.tensor_model_parallel_size, model.pipeline_model_parallel_size) == (layout.tp, layout.pp)
        assert (model.expert_model_parallel_size, model.virtual_pipeline_model_parallel_size) == (layout.ep, layout.vp)
        assert (checked.train.global_batch_size, checked.train.micro_batch_size) == (
            layout.global_batch_size, layout.micro_batch_size)
        assert model.seq_length == checked.dataset.seq_length == layout.seq_length
        if layout.precision == "fp32":
            assert checked.mixed_precision is None and checked.optimizer.bf16 is False
        else:
            assert get_mixed_precision_config(checked.mixed_precision).bf16 is True  # a registered MB recipe
        for dotted, value in recipe.overrides.items():
            section, key = dotted.split(".")
            assert getattr(getattr(checked, section), key) == value
        preset = recipe.preset  # what `info` prints is what trains, under the installed release's names
        for key, value in installed_optimizer_fields(preset.name, preset.optimizer).items():
            expected = recipe.overrides.get(f"optimizer.{key}", value)
            assert getattr(checked.optimizer, key) == expected, key
        assert checked.ddp.use_distributed_optimizer is recipe.preset.ddp["use_distributed_optimizer"]
        if not layout_name.endswith("-bench"):  # training layouts: megatron-core's benchmark-only settings off
            defaults = {f.name: f.default for f in dataclasses.fields(type(model))}
            assert {k: getattr(model, k) for k in benchmark_only_fields()} == {
                k: defaults[k] for k in benchmark_only_fields()}, layout_name


def test_benchmark_only_settings_are_read_from_megatron_core_and_only_bench_layouts_set_them():
    fields = benchmark_only_fields()
    assert fields and all("benchmark" in doc.lower() for doc in fields.values())  # found in its docstrings
    bench = {(name, layout) for name, recipe in recipes.RECIPES.items() for layout in recipe.layouts
             if layout.endswith("-bench")}
    assert ("kimi_k2_muon", "gb300x256-bench") in bench
    for name, layout in bench:  # what makes them benchmark layouts, and their cards say so
        model = build_config(recipes.get_recipe(name), layout=layout).model
        assert any(getattr(model, k) for k in fields), (name, layout)
        assert "do not keep the weights" in recipes.get_recipe(name).layouts[layout].why


def test_kimi_k2_model_matches_its_hf_config():
    cfg = build_config(recipes.get_recipe("kimi_k2_muon"))
    model = cfg.model
    assert isinstance(model, MLATransformerConfig)  # MLAModelProvider (MB 0.3.1), DeepSeekV3ModelProvider (0.3.0)
    shipped = json.loads((recipes.get_recipe("kimi_k2_muon").model.config_dir / "config.json").read_text())
    rope = shipped["rope_scaling"]  # YaRN as the config states it, on every stack
    assert (model.beta_fast, model.beta_slow, model.mscale, model.mscale_all_dim) == (
        rope["beta_fast"], rope["beta_slow"], rope["mscale"], rope["mscale_all_dim"])
    assert (model.rotary_scaling_factor, model.original_max_position_embeddings) == (32.0, 4096)
    assert model.moe_aux_loss_coeff == shipped["aux_loss_alpha"] == 0.001
    assert (model.num_moe_experts, model.moe_router_topk, model.moe_ffn_hidden_size) == (384, 8, 2048)
    assert (model.q_lora_rank, model.kv_lora_rank, model.qk_head_dim, model.qk_pos_emb_head_dim) == (1536, 512, 128, 64)
    assert model.moe_router_score_function == "sigmoid" and model.moe_router_enable_expert_bias
    assert model.moe_router_topk_scaling_factor == pytest.approx(2.827)
    assert model.moe_layer_freq == [0] + [1] * 60  # one dense first layer
    assert model.vocab_size == 163840 and model.rotary_base == 50000
    assert model.transformer_layer_spec.keywords["use_transformer_engine"] is True  # GPU target, any builder


def test_shipped_yaml_matches_the_recipes(rendered):
    """On the stack that generated yaml/ the text is identical; on any other, every field is equal but
    the release shapes listed above (so a real difference, e.g. a bridge ignoring a config value, fails)."""
    assert sorted(p.stem for p in YAML_DIR.glob("*.yaml")) == sorted(rendered)
    problems = {name: config_differences((YAML_DIR / f"{name}.yaml").read_text(), text)
                for name, text in rendered.items()}
    assert {name: p for name, p in problems.items() if p} == {}, "run `make generate` (on the 26.02 stack)"
    assert RECIPE_CARDS.read_text() == render_cards(), "run `make generate`"


def test_stack_differences_catches_a_changed_value():
    shipped = {"model": {"_target_": "megatron.bridge.models.mla_provider.MLAModelProvider", "beta_fast": 1.0,
                         "mtp_loss_scaling_factor": 0.1, "rope_scaling": False}}
    built = {"model": {"_target_": "megatron.bridge.models.deepseek.deepseek_provider.DeepSeekV3ModelProvider",
                       "beta_fast": 32, "mtp_loss_scaling_factor": None, "max_position_embeddings": 4096}}
    assert stack_differences(shipped, built) == ["model.beta_fast: shipped 1.0, built 32"]


def test_stack_differences_allows_a_new_field_only_at_its_default():
    """A field the shipped YAML's release lacks is a release shape at the installed class's default (2 for
    TransformerConfig.moe_router_topk in megatron-core 0.16-0.19), a difference otherwise; a removed field only
    at the behaviour the newer release always runs."""
    target = "megatron.core.transformer.transformer_config.TransformerConfig"
    shipped = {"model": {"_target_": target, "num_layers": 2, "moe_use_legacy_grouped_gemm": False}}
    assert stack_differences(shipped, {"model": {"_target_": target, "num_layers": 2, "moe_router_topk": 2}}) == []
    assert stack_differences(shipped, {"model": {"_target_": target, "num_layers": 2, "moe_router_topk": 8}}) == [
        "model.moe_router_topk only in built"]
    legacy = {"model": {**shipped["model"], "moe_use_legacy_grouped_gemm": True}}
    assert stack_differences(legacy, {"model": {"_target_": target, "num_layers": 2}}) == [
        "model.moe_use_legacy_grouped_gemm only in shipped"]


def test_yaml_round_trip_is_identical(tmp_path):
    from megatron.bridge.training.config import ConfigContainer

    cfg = build_config(recipes.get_recipe("kimi_k2_muon"))
    path = tmp_path / "kimi.yaml"
    cfg.to_yaml(str(path))
    reloaded = ConfigContainer.from_yaml(str(path))
    assert config_to_yaml(reloaded) == config_to_yaml(cfg)
    # and through our --yaml path: applying the full dump to the recipe changes nothing
    again = build_config(recipes.get_recipe("kimi_k2_muon"), yaml_path=path)
    assert config_to_yaml(again) == config_to_yaml(cfg)


def test_precedence_recipe_then_yaml_then_command_line(tmp_path):
    user = tmp_path / "my.yaml"
    user.write_text("optimizer:\n  lr: 1.0e-4\n  min_lr: 1.0e-6\ntrain:\n  train_iters: 1000\n")
    cfg = build_config(recipes.get_recipe("qwen3_30b_a3b_muon"))
    apply_user_overrides(cfg, yaml_path=user, overrides=["optimizer.lr=2e-4", "train.global_batch_size=256"])
    assert cfg.optimizer.lr == 2e-4  # command line beats YAML
    assert cfg.optimizer.min_lr == 1e-6  # YAML beats recipe
    assert cfg.train.train_iters == 1000
    assert cfg.train.global_batch_size == 256
    assert cfg.optimizer.muon_momentum == 0.95  # untouched recipe value
    assert isinstance(cfg.optimizer.lr, float)


def test_edited_full_dump_applies_its_edits(tmp_path):
    recipe = recipes.get_recipe("qwen3_8b_muon")
    data = yaml.safe_load(config_to_yaml(build_config(recipe)))
    data["optimizer"]["muon_num_ns_steps"] = 6
    data["model"]["params_dtype"] = {"_call_": False, "_target_": "torch.float32"}
    path = tmp_path / "edited.yaml"
    path.write_text(yaml.safe_dump(data))
    cfg = build_config(recipe, yaml_path=path)
    import torch

    assert cfg.optimizer.muon_num_ns_steps == 6 and cfg.model.params_dtype is torch.float32


def test_int_override_of_float_field_becomes_float():
    cfg = build_config(recipes.get_recipe("qwen3_0p6b_muon"), overrides=["optimizer.lr=1"])
    assert cfg.optimizer.lr == 1.0 and isinstance(cfg.optimizer.lr, float)


def test_float_override_of_float_field_with_an_int_default_is_taken():
    """megatron-core declares ``qk_clip_threshold: float = 100``: the Qwen3 recipes hold the int 100, and a user's
    2.5 is a float for that field (a float into an int-declared field stays refused, below)."""
    cfg = build_config(recipes.get_recipe("qwen3_8b_muon"),
                       overrides=["model.qk_clip=true", "model.qk_clip_threshold=2.5"])
    assert cfg.model.qk_clip_threshold == 2.5
    with pytest.raises(UserError, match="train.global_batch_size expects an integer"):
        build_config(recipes.get_recipe("qwen3_8b_muon"), overrides=["train.global_batch_size=2.5"])


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["optimizer.lrr=2e-4"], "unknown key 'optimizer.lrr' (did you mean 'lr'?)"),
        (["optimiser.lr=2e-4"], "unknown key 'optimiser.lr'"),
        (["train.global_batch_size=abc"], "train.global_batch_size expects an integer (recipe value 256), got 'abc'"),
        (["optimizer.muon_split_qkv=3"], "optimizer.muon_split_qkv expects a boolean"),  # a name on every release
        (["optimizer.lr"], "is not of the form key=value"),
    ],
)
def test_bad_overrides_are_refused(overrides, message):
    cfg = build_config(recipes.get_recipe("qwen3_8b_muon"))
    before = config_to_yaml(cfg)
    with pytest.raises(UserError) as info:
        apply_user_overrides(cfg, overrides=overrides)
    assert message in str(info.value) and "\n" not in str(info.value)
    assert config_to_yaml(cfg) == before


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("optimizer:\n  lrr: 1.0\n", "unknown key 'optimizer.lrr' (did you mean 'lr'?)"),
        ("optimizer: [1, 2\n", "is malformed at line"),
        ("- 1\n- 2\n", "must hold a mapping"),
        ("train:\n  micro_batch_size: many\n", "train.micro_batch_size expects an integer"),
    ],
)
def test_bad_yaml_is_refused(tmp_path, text, message):
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    with pytest.raises(UserError, match=None) as info:
        apply_user_overrides(build_config(recipes.get_recipe("qwen3_8b_muon")), yaml_path=path)
    assert message in str(info.value)


def test_validation_errors_are_user_errors():
    cfg = build_config(recipes.get_recipe("qwen3_8b_muon"))
    # the dataset's sequence length under the installed release's name: megatron-bridge 0.6's own field seq_length
    # (megatron-core's sequence_length is a copy finalize() overwrites); 0.3's sequence_length (seq_length: alias)
    key = "seq_length" if "seq_length" in {f.name for f in dataclasses.fields(cfg.dataset)} else "sequence_length"
    apply_user_overrides(cfg, overrides=[f"dataset.{key}=2048"])
    with pytest.raises(UserError, match="Sequence length in model config: 4096"):
        validate_for_layout(cfg, gpus=8)


@pytest.mark.parametrize(("overrides", "refused"), [
    (["model.expert_tensor_parallel_size=1"], True),  # TP2 ETP1 EP1: experts' gradients reduced over DP only
    ([], False),  # the cpu-tp2 layout itself: ETP2
    (["model.expert_tensor_parallel_size=1", "model.expert_model_parallel_size=2"], False),  # EP2 reduces them
])
def test_moe_tp_without_etp_or_ep_is_refused_in_one_line(overrides, refused):
    """TP2 with the experts neither TP-split (ETP = TP) nor EP-split trains them wrong (1e-3 off a 1-process
    run after one step, on megatron-core 0.16, without an error): refused before Megatron starts."""
    cfg = build_config(recipes.get_recipe("qwen3_moe_proxy_muon"), layout="cpu-tp2")
    apply_user_overrides(cfg, overrides=overrides)
    if not refused:
        validate_for_layout(cfg, gpus=2)
        return
    with pytest.raises(UserError) as info:
        validate_for_layout(cfg, gpus=2)
    assert str(info.value) == (
        "model.expert_tensor_parallel_size 1 with tensor_model_parallel_size 2 and expert_model_parallel_size 1 "
        "trains the experts wrong (megatron-core reduces their gradients over data-parallel ranks only); set "
        "model.expert_tensor_parallel_size=2 or model.expert_model_parallel_size > 1")


def _leaves(tree, prefix=""):
    if isinstance(tree, dict):
        for key, value in tree.items():
            yield from _leaves(value, f"{prefix}.{key}" if prefix else key)
    else:
        yield prefix, tree


@pytest.mark.parametrize("model", ["kimi_k2", "qwen3_30b_a3b", "qwen3_8b", "kimi_k2_proxy"])
def test_adamw_twin_differs_only_in_the_optimizer(model):
    muon = dict(_leaves(yaml.safe_load(config_to_yaml(build_config(recipes.get_recipe(f"{model}_muon"))))))
    adamw = dict(_leaves(yaml.safe_load(config_to_yaml(build_config(recipes.get_recipe(f"{model}_adamw"))))))
    assert muon.keys() == adamw.keys()
    differing = {key for key in muon if muon[key] != adamw[key]}
    qk_clip = {"model.qk_clip", "model.qk_clip_threshold", "model.qk_clip_alpha", "model.log_max_attention_logit"}
    assert differing - qk_clip == {
        "optimizer.optimizer",
        "optimizer.use_distributed_optimizer",
        "ddp.use_distributed_optimizer",
        "ddp.overlap_param_gather",
        "checkpoint.save",  # run directories carry the recipe name
        "checkpoint.load",
        "logger.tensorboard_dir",
    } | ({"optimizer.lr", "optimizer.min_lr"} if model.endswith("_proxy") else set())  # tuned per optimizer
    assert ("model.qk_clip" in differing) == model.startswith("kimi_k2")  # MuonClip is Muon's
