"""The same run on every stack: each recipe resolves (as `nemo llm pretrain --to-yaml` resolves it) to the model,
optimizer, scheduler, batch and layout that tests/same_run_reference.yaml states, written by hand from the
papers and the recipe definitions; and the Newton-Schulz coefficients that really run for the paper presets are
Keller Jordan's. The same tests pass on each stack, so each stack runs the same thing.

Optimizer fields: the reference uses megatron-core 0.19's names. Older releases name one setting differently
(:data:`NAME_DIFFERENCES`) and lack a few fields, where they always run one fixed behaviour
(:data:`WHERE_ABSENT`): the reference must ask for exactly that behaviour there.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import yaml

import recipes

pytestmark = [pytest.mark.slow, pytest.mark.stack]

REFERENCE = yaml.safe_load((Path(__file__).parent / "same_run_reference.yaml").read_text())

# megatron-core 0.19 name -> the name megatron-core 0.16 / 0.17 give the same setting (0.18 renamed it, no alias)
NAME_DIFFERENCES = {"muon_nesterov": "muon_use_nesterov"}
# 0.19 fields an older release lacks -> what that release always runs (RUN_TIME: the preset's value is installed
# when the optimizer is built, bridge_ext.muon.presets.install_ns_coefficients, and test_ns_coefficients_that_run
# checks what runs)
RUN_TIME = object()
WHERE_ABSENT = {
    "muon_coefficient_type": RUN_TIME,  # 0.16: TensorParallelMuon built without one (added in 0.17)
    "muon_scalar_optimizer": "adam",  # 0.16: every non-Muon parameter on Adam (added in 0.17)
    "use_layer_wise_distributed_optimizer": False,  # 0.16/0.17: only the name dist_muon is layer-wise (0.18)
}
SERIALIZED_ALIASES = {"sequence_length": "seq_length"}  # GPTDatasetConfig: either may be the one written
LAYOUT_FIELDS = {"tp": "model.tensor_model_parallel_size", "pp": "model.pipeline_model_parallel_size",
                 "vp": "model.virtual_pipeline_model_parallel_size", "ep": "model.expert_model_parallel_size",
                 "etp": "model.expert_tensor_parallel_size", "cp": "model.context_parallel_size",
                 "global_batch_size": "train.global_batch_size", "micro_batch_size": "train.micro_batch_size",
                 "seq_length": "model.seq_length", "pipeline_layout": "model.pipeline_model_parallel_layout"}

KJ = (3.4445, -4.7750, 2.0315)  # Keller Jordan's Newton-Schulz coefficients (Moonlight, Algorithm 1)


def _family(model: str) -> str:
    return next(f for f, models in REFERENCE["models_by_family"].items() if model in models)


def expected_run(recipe_name: str, layout_name: str) -> dict[str, Any]:
    """The run as the reference states it: dotted key (optimizer names canonical) -> value."""
    model, optimizer = recipe_name.rsplit("_", 1)
    family = _family(model)
    preset = REFERENCE["presets"][REFERENCE["families"][family][optimizer]]
    layout = REFERENCE["layouts"][model][layout_name]
    proxy = model.endswith("_proxy")
    out: dict[str, Any] = {f"model.{k}": v for k, v in REFERENCE["models"][model].items()}
    if family.startswith("qwen3"):
        out.update({f"model.{k}": v for k, v in REFERENCE["qwen3_family"].items()
                    if not (proxy and k == "vocab_size")})
    out.update({f"model.{k}": v for k, v in preset["model"].items()})
    for section in ("optimizer", "scheduler", "ddp"):
        out.update({f"{section}.{k}": v for k, v in preset[section].items()})
    out.update({LAYOUT_FIELDS[k]: v for k, v in layout.items() if k in LAYOUT_FIELDS})
    out["dataset.sequence_length"] = layout["seq_length"]  # megatron-core's name (Megatron Bridge's alias: seq_length)
    out["model.sequence_parallel"] = layout["tp"] > 1
    out["mixed_precision"] = None if layout["precision"] == "fp32" else layout["precision"]
    lengths = REFERENCE["run_length"]
    length = lengths[model] if model in lengths else lengths["proxy" if proxy else "qwen3"]
    out["train.train_iters"] = length["train_iters"]
    if "lr_wsd_decay_iters" in length and preset["scheduler"]["lr_decay_style"] == "WSD":
        out["scheduler.lr_wsd_decay_iters"] = length["lr_wsd_decay_iters"]
    if proxy:
        out.update(REFERENCE["proxy_overrides"][optimizer])
        out.update(REFERENCE["proxy_overrides"].get(f"{model}_{optimizer}", {}))
    return out


def _flatten(tree: dict, prefix: str = "") -> dict[str, Any]:
    out = {}
    for key, value in tree.items():
        if isinstance(value, dict) and "_target_" in value and prefix:
            continue  # a nested object (e.g. a layer spec): not a field of the run
        if isinstance(value, dict) and key in ("model", "optimizer", "scheduler", "ddp", "train", "dataset"):
            out.update(_flatten(value, f"{key}."))
        elif not isinstance(value, dict):
            out[f"{prefix}{key}"] = value
    return out


@pytest.fixture(scope="module")
def resolve():
    """recipe, layout -> the resolved config as `--to-yaml` writes it, flattened (dotted keys)."""
    from bridge_ext.build import build_config, quiet_megatron, validate_for_layout
    from bridge_ext.overrides import config_to_yaml

    quiet_megatron()

    def run(recipe_name: str, layout_name: str) -> dict[str, Any]:
        recipe = recipes.get_recipe(recipe_name)
        cfg = build_config(recipe, layout=layout_name)
        validate_for_layout(cfg, gpus=recipe.layout(layout_name).gpus,
                            max_positions=recipe.model.hf_config.get("max_position_embeddings"))
        return _flatten(yaml.safe_load(config_to_yaml(cfg)))

    return run


def _installed_key(canonical: str, resolved: dict[str, Any]) -> str | None:
    section, _, name = canonical.rpartition(".")
    for candidate in (name, NAME_DIFFERENCES.get(name), SERIALIZED_ALIASES.get(name)):
        key = f"{section}.{candidate}" if section else candidate
        if candidate and key in resolved:
            return key
    return None


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, float) or isinstance(b, float):
        return a is not None and b is not None and math.isclose(a, b, rel_tol=1e-12)
    return a == b


def run_differences(recipe_name: str, expected: dict[str, Any], resolved: dict[str, Any]) -> list[str]:
    """Every field where the resolved run differs from the reference, under the installed names."""
    preset = recipes.get_recipe(recipe_name).preset
    problems, compared = [], set()
    for key, want in sorted(expected.items()):
        installed = _installed_key(key, resolved)
        if installed is not None:
            compared.add(installed)
            got = resolved[installed]
            if not _same(got, want):
                problems.append(f"{installed}: resolved {got!r}, reference {want!r}")
            continue
        name = key.rpartition(".")[2]
        if key.startswith("optimizer.") and name in WHERE_ABSENT:
            fixed = WHERE_ABSENT[name]
            if fixed is RUN_TIME:  # what bridge_ext.muon.presets installs when the optimizer is built
                fixed = preset.optimizer.get(name)
            if fixed != want:
                problems.append(f"{key}: absent on this stack, which runs {fixed!r}; reference {want!r}")
            continue
        problems.append(f"{key}: not in the resolved config")
    if preset.kind == "muon":  # every muon_* field the installed release has is pinned by the reference
        problems += [f"{k}: resolved {resolved[k]!r}, not in the reference (unpinned)" for k in resolved
                     if k.startswith("optimizer.muon_") and k not in compared]
    return problems


@pytest.mark.parametrize("recipe_name", sorted(recipes.RECIPES))
def test_recipe_resolves_to_the_reference_run(recipe_name, resolve):
    recipe = recipes.get_recipe(recipe_name)
    assert sorted(recipe.layouts) == sorted(REFERENCE["layouts"][recipe.model.name]), "layouts missing"
    problems = {}
    for layout_name in recipe.layouts:
        found = run_differences(recipe_name, expected_run(recipe_name, layout_name), resolve(recipe_name, layout_name))
        if found:
            problems[layout_name] = found
    assert problems == {}


def test_a_different_run_is_caught(resolve):
    """The comparison is not blind: a changed value, an unpinned Muon field and a missing field each show."""
    name, layout = "qwen3_proxy_muon", "cpu"
    expected, resolved = expected_run(name, layout), resolve(name, layout)
    assert run_differences(name, expected, resolved) == []
    nesterov = _installed_key("optimizer.muon_nesterov", resolved)
    assert run_differences(name, {**expected, "optimizer.muon_nesterov": False}, resolved) == [
        f"{nesterov}: resolved True, reference False"]
    unpinned = {k: v for k, v in expected.items() if k != "optimizer.muon_tp_mode"}
    assert run_differences(name, unpinned, resolved) == [
        "optimizer.muon_tp_mode: resolved 'duplicated', not in the reference (unpinned)"]
    assert run_differences(name, {**expected, "model.no_such_field": 1}, resolved) == [
        "model.no_such_field: not in the resolved config"]


def test_reference_presets_are_what_the_papers_state():
    """The reference's paper presets against shared/reference/models.md, number by number."""
    moonlight, kimi = REFERENCE["presets"]["moonlight"], REFERENCE["presets"]["kimi_k2"]
    for preset in (moonlight, kimi):
        o = preset["optimizer"]
        assert (o["muon_coefficient_type"], o["muon_num_ns_steps"], o["muon_fp32_matmul_prec"]) == ("simple", 5, "medium")
        assert (o["muon_momentum"], o["muon_nesterov"]) == (0.95, True)  # Nesterov momentum 0.95
        assert (o["muon_scale_mode"], o["muon_extra_scale_factor"]) == ("spectral", 0.2)  # 0.2 sqrt(max(A, B))
        assert o["weight_decay"] == preset["scheduler"]["start_weight_decay"] == preset["scheduler"]["end_weight_decay"] == 0.1
        assert (o["adam_beta1"], o["adam_beta2"], o["muon_scalar_optimizer"]) == (0.9, 0.95, "adam")
    assert (kimi["optimizer"]["lr"], kimi["optimizer"]["min_lr"]) == (2e-4, 2e-5)
    assert (kimi["scheduler"]["lr_warmup_iters"], kimi["scheduler"]["lr_decay_style"]) == (500, "WSD")
    assert kimi["model"]["qk_clip_threshold"] == 100.0
    kimi_len = REFERENCE["run_length"]["kimi_k2"]
    assert kimi_len["train_iters"] == math.ceil(15.5e12 / (4096 * 4096))
    assert kimi_len["lr_wsd_decay_iters"] == round(kimi_len["train_iters"] * 5.5 / 15.5)
    k2 = REFERENCE["models"]["kimi_k2"]
    assert (k2["num_layers"], k2["hidden_size"], k2["num_moe_experts"], k2["moe_router_topk"]) == (61, 7168, 384, 8)


# OptimizerConfig's Muon-related fields in each release, read from its optimizer/optimizer_config.py (0.16.0,
# 0.17.1, 0.18.2, 0.19.0, 0.19.2; 0.18.2 and 0.19.x alike), plus the fields every release has that presets set
RELEASE_0_16 = {"muon_momentum", "muon_split_qkv", "muon_use_nesterov", "muon_scale_mode", "muon_fp32_matmul_prec",
                "muon_num_ns_steps", "muon_tp_mode", "muon_extra_scale_factor"}
RELEASE_0_17 = RELEASE_0_16 | {"muon_coefficient_type", "muon_scalar_optimizer"}
RELEASE_0_19 = (RELEASE_0_17 - {"muon_use_nesterov"}) | {"muon_nesterov", "use_layer_wise_distributed_optimizer"}
EVERY_RELEASE = {"optimizer", "lr", "min_lr", "weight_decay", "clip_grad", "adam_beta1", "adam_beta2", "adam_eps",
                 "decoupled_weight_decay", "use_distributed_optimizer"}


@pytest.mark.parametrize("release", [RELEASE_0_16, RELEASE_0_17, RELEASE_0_19], ids=["0.16", "0.17", "0.19"])
@pytest.mark.parametrize("preset_name", ["nvidia_perf", "moonlight", "kimi_k2"])
def test_translation_to_each_release_pins_every_muon_field(preset_name, release):
    """Each release gets every Muon field it has, with the preset's value, and nothing it lacks."""
    from bridge_ext.upstream_api import installed_optimizer_fields
    from recipes.optimizers import PRESETS

    preset = PRESETS[preset_name]
    fields = installed_optimizer_fields(preset_name, preset.optimizer, available=frozenset(release | EVERY_RELEASE))
    assert {k for k in fields if k.startswith("muon_")} == {k for k in release if k.startswith("muon_")}
    nesterov = "muon_nesterov" if "muon_nesterov" in release else "muon_use_nesterov"
    assert fields[nesterov] is True and fields["optimizer"] == "dist_muon"
    if "muon_coefficient_type" in release:  # megatron-core passes it to TensorParallelMuon: the preset's set
        assert fields["muon_coefficient_type"] == preset.ns_coefficients


def test_a_setting_a_release_cannot_run_is_refused_in_one_line():
    from bridge_ext.errors import UserError
    from bridge_ext.upstream_api import installed_optimizer_fields

    available = frozenset(RELEASE_0_16 | EVERY_RELEASE)
    with pytest.raises(UserError) as lion:
        installed_optimizer_fields("lion_muon", {"muon_scalar_optimizer": "lion"}, available=available)
    with pytest.raises(UserError) as layer_wise:
        installed_optimizer_fields("lw", {"use_layer_wise_distributed_optimizer": True}, available=available)
    for error, what in ((lion, "muon_scalar_optimizer='lion'"), (layer_wise, "use_layer_wise_distributed_optimizer")):
        text = str(error.value)
        assert "\n" not in text and what in text and "megatron-core" in text, text
    assert "optimizer preset 'lion_muon'" in str(lion.value) and "always runs 'adam'" in str(lion.value)
    with pytest.raises(UserError, match="muon_no_such_field"):
        installed_optimizer_fields("x", {"muon_no_such_field": 1}, available=available)


def test_shipped_yaml_comparison_knows_the_name_differences():
    """tests/stack_shapes (shipped YAML vs another stack's) reads a renamed or absent optimizer field as the same
    setting, and still reports a changed value."""
    from tests.stack_shapes import stack_differences

    old = {"optimizer": {"optimizer": "dist_muon", "muon_use_nesterov": True}}  # megatron-core 0.16's YAML
    new = {"optimizer": {"optimizer": "dist_muon", "muon_nesterov": True, "muon_coefficient_type": "simple",
                         "muon_scalar_optimizer": "adam", "use_layer_wise_distributed_optimizer": False}}
    assert stack_differences(old, new) == []
    assert stack_differences(old, {"optimizer": {**new["optimizer"], "muon_nesterov": False}}) == [
        "optimizer.muon_nesterov: shipped True, built False"]
    assert stack_differences(old, {"optimizer": {**new["optimizer"], "muon_scalar_optimizer": "lion"}}) == [
        "optimizer.muon_scalar_optimizer only in built"]
    assert stack_differences(old, new, release_shapes=False) != []  # the generating stack: strict


def test_the_name_list_is_the_adapters():
    """The explicit lists here and the adapter's translation say the same (the adapter is what builds)."""
    from bridge_ext.upstream_api import RENAMED, WHERE_ABSENT as ADAPTER_ABSENT

    assert {k: v[0] for k, v in RENAMED.items()} == NAME_DIFFERENCES
    assert set(ADAPTER_ABSENT) == set(WHERE_ABSENT)
    assert all(ADAPTER_ABSENT[k][0] == v for k, v in WHERE_ABSENT.items() if v is not RUN_TIME)


# ------------------------------------------------------------------ the Newton-Schulz coefficients that run
def hand_newton_schulz(g, coefficients, steps: int = 5):
    """Moonlight Algorithm 1's NS in float64: X = G / ||G||_F on the wide orientation, then
    ``steps`` x {A = X X^T; X = a X + (b A + c A^2) X}, cycling through ``coefficients``."""
    x = g.double()
    tall = x.shape[0] > x.shape[1]
    x = x.T if tall else x
    x = x / (x.norm() + 1e-7)
    for i in range(steps):
        a, b, c = coefficients[i % len(coefficients)]
        A = x @ x.T
        x = a * x + (b * A + c * A @ A) @ x
    return x.T if tall else x


QUINTIC = [(4.0848, -6.8946, 2.9270), (3.9505, -6.3029, 2.6377), (3.7418, -5.5913, 2.3037),
           (2.8769, -3.1427, 1.2046), (2.8366, -3.0525, 1.2012)]  # modded-nanogpt's (megatron-core's default)


def _muon_optimizers(optimizer) -> list:
    found, todo = [], [optimizer]
    while todo:
        opt = todo.pop()
        if type(opt).__name__ == "TensorParallelMuon":
            found.append(opt)
        todo += list(vars(opt).get("chained_optimizers", []))
        inner = vars(opt).get("optimizer")  # a wrapper's (ChainedOptimizer's property asserts a single one)
        if inner is not None:
            todo.append(inner)
    return found


@pytest.mark.parametrize(("recipe_name", "preset_name", "coefficients"), [
    ("qwen3_proxy_muon", "moonlight", [KJ]),
    ("kimi_k2_proxy_muon", "kimi_k2", [KJ]),
    ("qwen3_proxy_muon", "nvidia_perf", QUINTIC),  # megatron-core's default set, where the preset asks for it
])
def test_ns_coefficients_that_run(recipe_name, preset_name, coefficients, cpu_mode):
    """Build the recipe's model and Megatron Bridge's optimizer on CPU; the Muon that was built orthogonalizes a
    matrix as Newton-Schulz with ``coefficients`` does (fp32 vs a float64 hand implementation)."""
    import torch
    from megatron.bridge.training.optim import setup_optimizer

    from bridge_ext.build import build_config
    from bridge_ext.cpu import configure_for_cpu
    from bridge_ext.process_state import init_single_process_distributed
    from bridge_ext.muon import apply_preset, install_ns_coefficients
    from bridge_ext.muon.split import install_gate_up_split

    recipe = recipes.get_recipe(recipe_name).with_preset(preset_name)
    init_single_process_distributed()
    try:
        cfg = build_config(recipe)
        apply_preset(cfg, recipe.preset)  # run-time parts, as bridge_ext.training does
        configure_for_cpu(cfg)
        cfg.validate()
        torch.manual_seed(0)
        model = cfg.model.provide_distributed_model(ddp_config=cfg.ddp, use_cpu_initialization=True)
        optimizer, _ = setup_optimizer(cfg.optimizer, cfg.scheduler, model, use_gloo_process_groups=True)
        muons = _muon_optimizers(optimizer)
        assert muons, "no TensorParallelMuon was built"
        g = torch.randn(96, 48, generator=torch.Generator().manual_seed(5))
        extra = cfg.optimizer.muon_extra_scale_factor
        want = hand_newton_schulz(g, coefficients) * math.sqrt(96) * extra  # spectral scale x extra
        other = hand_newton_schulz(g, QUINTIC if coefficients == [KJ] else [KJ]) * math.sqrt(96) * extra
        previous = torch.get_float32_matmul_precision()
        torch.set_float32_matmul_precision("highest")
        try:
            for muon in muons:
                got = muon.scaled_orthogonalize_fn(g.clone(), None, None).double()
                rel = float((got - want).norm() / want.norm())
                assert rel < 1e-5, f"{preset_name}: {rel:.2e} off the expected set"
                assert float((got - other).norm() / other.norm()) > 1e-2  # and not the other set
        finally:
            torch.set_float32_matmul_precision(previous)
    finally:
        install_ns_coefficients("quintic")  # process-wide: megatron-core 0.16's default for other tests
        install_gate_up_split(False)
        _end_process_state()


def _tensor_parallel_muon() -> type:
    import importlib
    import importlib.util

    for name in ("megatron.core.optimizer.emerging_optimizers", "megatron.core.optimizer.muon"):  # 0.18+, 0.16/0.17
        if importlib.util.find_spec(name) and hasattr(importlib.import_module(name), "TensorParallelMuon"):
            return importlib.import_module(name).TensorParallelMuon
    raise AssertionError("no TensorParallelMuon in megatron-core")


@pytest.mark.parametrize(("coefficient_type", "coefficients"), [("simple", [KJ]), ("quintic", QUINTIC)])
def test_tensor_parallel_muon_runs_the_set_it_is_given(coefficient_type, coefficients):
    """megatron-core's TensorParallelMuon given ``coefficient_type`` (as 0.17+ passes the config's) runs that set,
    with the stack fixes applied: megatron-core 0.17 refuses "simple" with emerging-optimizers 0.1.0 otherwise
    (patch muon-coefficient-types). No model or process group: Newton-Schulz on one matrix, no tensor parallelism."""
    import torch

    from bridge_ext import patches

    patches.apply("stack", only=["muon-coefficient-types"])
    weight = torch.nn.Parameter(torch.zeros(96, 48))
    muon = _tensor_parallel_muon()([weight], lr=0.1, coefficient_type=coefficient_type, num_ns_steps=5,
                                   scale_mode="spectral", extra_scale_factor=0.2)
    g = torch.randn(96, 48, generator=torch.Generator().manual_seed(5))
    previous = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("highest")
    try:
        got = muon.scaled_orthogonalize_fn(g.clone(), None, None).double()
    finally:
        torch.set_float32_matmul_precision(previous)
    want = hand_newton_schulz(g, coefficients) * math.sqrt(96) * 0.2
    assert float((got - want).norm() / want.norm()) < 1e-5


def _end_process_state() -> None:
    import torch.distributed as dist
    from megatron.bridge.training.initialize import destroy_global_state
    from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler

    destroy_global_state()
    if dist.is_initialized():
        dist.destroy_process_group()
    MoEAuxLossAutoScaler.main_loss_backward_scale = None  # as a fresh process has it (tests/test_muon.py)
