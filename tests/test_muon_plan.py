"""``nemo llm muon-plan``: the routing manifest, computed from the shipped HF config, against what Megatron
really builds and routes (proxy models on CPU), and its Newton-Schulz FLOP formula against a FLOP counter."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest

from bridge_ext.commands import main
from bridge_ext.muon import muon_plan, newton_schulz_flops
from recipes import get_recipe
from recipes.params import count_params

PROXIES = ("kimi_k2_proxy_muon", "qwen3_proxy_muon", "qwen3_moe_proxy_muon")


def test_cli_json_needs_no_torch():
    # instant because it reads the shipped configs only: checked by what was imported (timings live in bench/)
    code = ("import sys; from bridge_ext.muon import muon_plan; "
            "p = muon_plan('kimi_k2_muon'); print(len(p.rows) > 0, 'torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert out == ["True", "False"]


def test_cli_prints_table_and_json(capsys):
    assert main(["llm", "muon-plan", "--recipe", "qwen3_30b_a3b_muon", "--json"]) == 0  # in-process
    data = json.loads(capsys.readouterr().out)
    assert data["recipe"] == "qwen3_30b_a3b_muon" and data["tokens_per_step"] == 512 * 4096
    assert {r["route"] for r in data["rows"]} == {"muon", "adam"}
    assert main(["llm", "muon-plan", "--recipe", "kimi_k2_muon"]) == 0
    table = capsys.readouterr().out
    assert "mlp.experts.local_experts.[0-383].linear_fc1.weight" in table and "NS / model" in table


@pytest.mark.parametrize("name", ["kimi_k2_muon", "qwen3_30b_a3b_muon", "qwen3_8b_muon", "qwen3_0p6b_muon"])
def test_totals_match_the_parameter_count(name):
    recipe = get_recipe(name)
    plan = muon_plan(recipe)
    cfg = recipe.model.hf_config
    bias = 0
    if cfg.get("topk_method") == "noaux_tc":  # recipes.params counts the router's expert bias (a buffer)
        bias = cfg["n_routed_experts"] * (cfg["num_hidden_layers"] - cfg["first_k_dense_replace"])
    assert plan.params_total == count_params(recipe.model.architecture).total - bias
    assert plan.params_muon == sum(r.params for r in plan.rows if r.route == "muon")
    assert all(r.route == "adam" for r in plan.rows if len(r.shape) == 1 or "embedding" in r.pattern
               or r.pattern.startswith("output_layer"))


def _fused(name: str):
    """The recipe with megatron-core's fused gate/up (the split presets: tests/test_muon_split.py)."""
    recipe = get_recipe(name)
    return muon_plan(recipe.with_preset(f"{recipe.preset.name}_fused_mlp"))


def test_kimi_k2_and_qwen3_30b_figures():
    kimi, qwen = _fused("kimi_k2_muon"), _fused("qwen3_30b_a3b_muon")
    print(f"kimi_k2: Muon share {kimi.muon_share:.4f}, NS {kimi.ns_flops_per_step:.3e} FLOP/step, "
          f"model {kimi.model_flops_per_step:.3e}, NS/model {kimi.ns_over_model:.4f}")
    print(f"qwen3_30b_a3b: Muon share {qwen.muon_share:.4f}, NS {qwen.ns_flops_per_step:.3e} FLOP/step, "
          f"model {qwen.model_flops_per_step:.3e}, NS/model {qwen.ns_over_model:.4f}")
    assert kimi.tokens_per_step == 4096 * 4096 and qwen.tokens_per_step == 512 * 4096
    assert 0.997 < kimi.muon_share < 0.999 and 0.975 < qwen.muon_share < 0.985
    # the fused shares docs/muon.md quotes (2.56 %, 2.14 %); test_ns_and_model_flops_by_hand derives them
    assert round(kimi.ns_over_model, 4) == 0.0256 and round(qwen.ns_over_model, 4) == 0.0214
    experts = [r for r in kimi.rows if r.experts]
    assert {r.copies for r in experts} == {60 * 384}
    assert sum(r.ns_flops for r in experts) / kimi.ns_flops_per_step > 0.95  # experts dominate NS work


def _ns(rows: int, cols: int, steps: int = 5) -> int:
    """Newton-Schulz FLOPs on the wide orientation X (m x n, m <= n): X X^T, then b A + c A A, then B X."""
    m, n = sorted((rows, cols))
    return steps * (2 * m * m * n + 2 * m**3 + 2 * m * m * n)


def test_ns_and_model_flops_by_hand():
    """Both models written out matrix by matrix from their published architectures (not from the manifest)."""
    h = 7168  # Kimi K2: MLA (q rank 1536, kv rank 512, 64 heads of 128 + 64 rope, v 128), 384 experts of 2048
    attention = [(1536, h), (64 * 192, 1536), (512 + 64, h), (64 * (128 + 128), 512), (h, 64 * 128)]
    moe = [*attention, *[(2 * 2048, h), (h, 2048)] * (384 + 1), (384, h)]  # routed + shared experts, router
    dense = [*attention, (2 * 18432, h), (h, 18432)]  # layer 0
    ns = 60 * sum(_ns(*m) for m in moe) + sum(_ns(*m) for m in dense)
    norms = 61 * (2 * h + 1536 + 512) + h
    active = (61 * sum(a * b for a, b in attention) + 3 * h * 18432 + 60 * (9 * 3 * h * 2048 + 384 * h)
              + 163840 * h + norms)  # 8 routed + 1 shared expert per token; output layer (embedding: a lookup)
    model = (6 * active + 3 * 4096 * 64 * (192 + 128) * 61) * 4096 * 4096
    kimi = _fused("kimi_k2_muon")
    assert (kimi.ns_flops_per_step, kimi.model_flops_per_step) == (ns, model)
    assert ns / model == pytest.approx(0.025580, abs=1e-6)

    h = 2048  # Qwen3-30B-A3B: GQA 32 x 128 / 4 KV heads (Q, K, V orthogonalized apart), 128 experts of 768
    layer = [(32 * 128, h), (4 * 128, h), (4 * 128, h), (h, 32 * 128), *[(2 * 768, h), (h, 768)] * 128, (128, h)]
    ns = 48 * sum(_ns(*m) for m in layer)
    attention = 2 * 32 * 128 * h + 2 * 4 * 128 * h + 2 * 128  # q, o, k, v, q/k norms
    active = 48 * (attention + 2 * h + 8 * 3 * h * 768 + 128 * h) + 151936 * h + h
    model = (6 * active + 3 * 4096 * 32 * 256 * 48) * 512 * 4096
    qwen = _fused("qwen3_30b_a3b_muon")
    assert (qwen.ns_flops_per_step, qwen.model_flops_per_step) == (ns, model)
    assert ns / model == pytest.approx(0.021382, abs=1e-6)


def test_blockwise_tensor_parallel_splits_the_matrices():
    import dataclasses

    from recipes.optimizers import derive

    recipe = get_recipe("qwen3_8b_muon")
    shipped = muon_plan(recipe, layout="h100x8")  # the presets' duplicated mode: whole matrices at TP4
    assert len(next(r for r in shipped.rows if r.pattern.endswith("linear_qkv.weight")).ns_matrices) == 3
    blockwise = derive(recipe.preset, name="blockwise", summary="", source="", optimizer={"muon_tp_mode": "blockwise"})
    plan = muon_plan(dataclasses.replace(recipe, preset=blockwise), layout="h100x8")  # TP4: each rank its own shard
    qkv = next(r for r in plan.rows if r.pattern.endswith("linear_qkv.weight"))
    assert len(qkv.ns_matrices) == 12 and "TP4 blockwise" in qkv.split  # Q|K|V x 4 TP shards
    assert qkv.ns_matrices[0] == (32 * 128 // 4, 4096) and qkv.ns_matrices[4] == (8 * 128 // 4, 4096)
    proj = next(r for r in plan.rows if r.pattern.endswith("linear_proj.weight"))
    assert proj.ns_matrices == ((4096, 4096 // 4),) * 4  # row-parallel: split along the input dim


def test_duplicated_tensor_parallel_runs_the_whole_matrix_on_every_tp_rank():
    """The presets' ``muon_tp_mode=duplicated`` at TP4 (Qwen3-8B on h100x8): emerging-optimizers'
    ``newton_schulz_tp`` all-gathers each shard and orthogonalizes the whole matrix on every TP rank, so the step's
    Newton-Schulz work is 4 x the whole matrices and each rank's is the whole matrices (blockwise: its shard)."""
    from bridge_ext.plan.ranks import rank_params

    recipe = get_recipe("qwen3_8b_muon")
    assert recipe.preset.optimizer["muon_tp_mode"] == "duplicated" and recipe.layout("h100x8").tp == 4
    plan = muon_plan(recipe, layout="h100x8")
    qkv = next(r for r in plan.rows if r.pattern.endswith("linear_qkv.weight"))
    proj = next(r for r in plan.rows if r.pattern.endswith("linear_proj.weight"))
    whole_qkv = _ns(32 * 128, 4096) + 2 * _ns(8 * 128, 4096)  # Q, K, V apart (32 heads, 8 KV groups of 128)
    assert "TP4 duplicated" in qkv.split and (qkv.ns_flops, proj.ns_flops) == (36 * 4 * whole_qkv, 36 * 4 * _ns(4096, 4096))
    layout = recipe.layout("h100x8")
    per_rank = {t.name: t.ns_flops for t in rank_params(recipe.model.architecture, plan.rows, layout)[0].tensors}
    assert per_rank["decoder.layers.0.self_attention.linear_qkv.weight"] == whole_qkv
    assert per_rank["decoder.layers.0.self_attention.linear_proj.weight"] == _ns(4096, 4096)
    # blockwise, the same rank: its shard of Q, K and V, and of the row-parallel projection
    import dataclasses

    from recipes.optimizers import derive

    blockwise = derive(recipe.preset, name="blockwise", summary="", source="", optimizer={"muon_tp_mode": "blockwise"})
    rows = muon_plan(dataclasses.replace(recipe, preset=blockwise), layout="h100x8").rows
    per_rank = {t.name: t.ns_flops for t in rank_params(recipe.model.architecture, rows, layout)[0].tensors}
    assert per_rank["decoder.layers.0.self_attention.linear_qkv.weight"] == _ns(8 * 128, 4096) + 2 * _ns(2 * 128, 4096)
    assert per_rank["decoder.layers.0.self_attention.linear_proj.weight"] == _ns(4096, 1024)


@pytest.mark.parametrize("shape", [(96, 48), (64, 64), (40, 160)])
def test_ns_flops_formula_matches_a_flop_counter(shape):
    import torch
    from emerging_optimizers.orthogonalized_optimizers.muon_utils import newton_schulz
    from torch.utils.flop_counter import FlopCounterMode

    x = torch.randn(*shape)
    with FlopCounterMode(display=False) as counter:
        newton_schulz(x, steps=5, coefficient_type="simple")
    assert counter.get_total_flops() == newton_schulz_flops(*shape, 5)


# ---------------------------------------------------------------------------- against a real proxy model
def _megatron_routes(recipe_name: str):
    """{name: (shape, route, is_qkv)} of the proxy model Megatron builds, routed by megatron-core's Muon."""
    from megatron.bridge.training.optim import setup_optimizer

    from bridge_ext.build import build_config
    from bridge_ext.cpu import configure_for_cpu
    from bridge_ext.process_state import init_single_process_distributed

    init_single_process_distributed()
    cfg = build_config(get_recipe(recipe_name))
    configure_for_cpu(cfg)
    cfg.validate()
    model = cfg.model.provide_distributed_model(ddp_config=cfg.ddp, use_cpu_initialization=True)
    optimizer, _ = setup_optimizer(cfg.optimizer, cfg.scheduler, model, use_gloo_process_groups=True)
    routes = {}
    for opt in optimizer.chained_optimizers:
        kind = "muon" if type(opt.optimizer).__name__ == "TensorParallelMuon" else "adam"
        for group in opt.optimizer.param_groups:
            for p in group["params"]:
                routes[id(p)] = kind
    return {
        name.removeprefix("module."): (tuple(p.shape), routes[id(p)], getattr(p, "is_qkv", False))
        for name, p in model[0].named_parameters()
    }


@pytest.fixture
def single_process(cpu_mode):
    import torch.distributed as dist
    from megatron.bridge.training.initialize import destroy_global_state

    yield
    destroy_global_state()
    if dist.is_initialized():
        dist.destroy_process_group()


@pytest.mark.slow
@pytest.mark.parametrize("recipe_name", PROXIES)
def test_manifest_matches_the_parameters_megatron_routes(single_process, recipe_name):
    actual = _megatron_routes(recipe_name)
    plan = muon_plan(recipe_name)
    planned = {}
    for row in plan.rows:
        for name in row.names():
            planned[name] = (row.shape, row.route, len(row.ns_matrices) == 3 and "Q | K | V" in row.split)
    assert planned.keys() == actual.keys(), planned.keys() ^ actual.keys()
    for name, value in actual.items():
        assert planned[name] == value, (name, planned[name], value)
    assert plan.params_total == sum(__import__("math").prod(s) for s, _, _ in actual.values())
    print(f"{recipe_name}: {len(actual)} parameters, {sum(r == 'muon' for _, r, _ in actual.values())} on Muon")
