"""Muon per gated-MLP part (``split_gate_up``) against Moonlight's reference on the separate HF weights.

The Kimi K2 proxy (dense first layer, shared expert, routed experts) is built on CPU through
``bridge_ext.build``; Megatron Bridge's own ``setup_optimizer`` steps its ``linear_fc1`` weights. The
reference is ``tests/test_muon.py::moonlight_reference`` (Moonlight's Algorithm 1 in plain float64 torch)
applied to ``gate_proj`` and ``up_proj`` as Hugging Face stores them, each its own matrix; Megatron
Bridge's ``GatedMLPMapping`` maps them to Megatron's ``linear_fc1`` and back.
"""

from __future__ import annotations

import copy

import pytest

from recipes import get_recipe
from recipes.optimizers import PRESETS
from tests.test_muon import build_kimi_proxy, moonlight_reference, release_proxy

pytestmark = pytest.mark.stack  # Muon from emerging-optimizers: .ci/run runs these on every stack

FC1 = {  # which gated MLP -> its linear_fc1 weight in the proxy
    "dense": "module.decoder.layers.0.mlp.linear_fc1.weight",
    "shared expert": "module.decoder.layers.1.mlp.shared_experts.linear_fc1.weight",
    "routed expert": "module.decoder.layers.1.mlp.experts.local_experts.3.linear_fc1.weight",
}


@pytest.fixture(scope="module")
def kimi_proxy(cpu_mode):
    preset = PRESETS["moonlight"]
    assert preset.split_gate_up and not PRESETS["moonlight_fused_mlp"].split_gate_up  # the default splits
    yield build_kimi_proxy(preset)
    release_proxy()


def _step(cfg, model, name, grads, *, split: bool):
    """Megatron's Muon (fp32 Newton-Schulz, Keller Jordan's coefficients) on ``name`` with ``grads``;
    returns (W0, W after, lr, weight decay). The model is left as it was."""
    import torch
    from megatron.bridge.training.optim import setup_optimizer

    from bridge_ext.muon.presets import MuonSettings, install_settings

    install_settings(MuonSettings(ns_coefficients="simple", split_gate_up=split))
    opt_cfg = copy.deepcopy(cfg.optimizer)
    opt_cfg.muon_fp32_matmul_prec = "highest"
    params = dict(model[0].named_parameters())
    param = params[name]
    w0 = param.detach().clone()
    optimizer, scheduler = setup_optimizer(opt_cfg, cfg.scheduler, model, use_gloo_process_groups=True)
    scheduler.step(cfg.scheduler.lr_warmup_steps)  # the peak lr
    groups = [g for o in optimizer.chained_optimizers for g in o.optimizer.param_groups]
    group = next(g for g in groups if any(p is param for p in g["params"]))
    assert getattr(param, "is_gate_up", False)  # flagged by name when the optimizer was built
    for grad in grads:
        for p in params.values():
            p.main_grad.zero_()
        param.main_grad.copy_(grad)
        ok, grad_norm, _ = optimizer.step()
        assert ok and grad_norm < cfg.optimizer.clip_grad
    after = param.detach().clone()
    with torch.no_grad():
        param.copy_(w0)
    return w0, after, group["lr"], group["weight_decay"]


@pytest.mark.slow
@pytest.mark.parametrize("part", sorted(FC1))
def test_split_gate_up_matches_moonlight_on_the_hf_weights(kimi_proxy, part):
    import torch
    from megatron.bridge.models.conversion.param_mapping import GatedMLPMapping

    cfg, model = kimi_proxy
    name = FC1[part]
    mapping = GatedMLPMapping(name.removeprefix("module."), gate="gate_proj.weight", up="up_proj.weight")
    w0 = dict(model[0].named_parameters())[name].detach()
    gate0, up0 = torch.chunk(w0, 2, dim=0)  # Megatron's [gate; up] -> the HF weights
    assert torch.equal(mapping.hf_to_megatron({"gate": gate0, "up": up0}, model[0]), w0)  # MB agrees
    gen = torch.Generator().manual_seed(11)
    hf_grads = [{"gate": 0.003 * torch.randn(gate0.shape, generator=gen),  # norm < clip_grad: no clipping
                 "up": 0.003 * torch.randn(up0.shape, generator=gen)} for _ in range(2)]
    grads = [mapping.hf_to_megatron(g, model[0]) for g in hf_grads]

    _, split, lr, wd = _step(cfg, model, name, grads, split=True)
    _, fused, _, _ = _step(cfg, model, name, grads, split=False)
    assert wd == 0.1
    reference = mapping.hf_to_megatron(
        {part_name: moonlight_reference(w, [g[part_name] for g in hf_grads], lr=lr, weight_decay=wd)
         for part_name, w in (("gate", gate0), ("up", up0))}, model[0])
    update = reference - w0
    rel_split = float((split - reference).norm() / update.norm())
    rel_fused = float((fused - reference).norm() / update.norm())
    print(f"{part} {tuple(w0.shape)}: split vs reference {rel_split:.2e}, fused vs reference {rel_fused:.2%}")
    assert rel_split < 1e-3
    assert rel_fused > 0.1  # what splitting changes: one matrix's orthogonalization is not two


@pytest.mark.slow
def test_only_gated_fc1_weights_are_flagged(kimi_proxy):
    from bridge_ext.muon.split import GATE_UP_PATTERN, mark_gate_up_params

    _, model = kimi_proxy
    names = [n for n, p in model[0].named_parameters() if getattr(p, "is_gate_up", False) or
             (p.dim() == 2 and GATE_UP_PATTERN.search(n))]
    mark_gate_up_params(model)
    flagged = {n for n, p in model[0].named_parameters() if getattr(p, "is_gate_up", False)}
    assert flagged == set(names) and set(FC1.values()) <= flagged
    assert not any("linear_fc2" in n or "linear_q" in n or "router" in n for n in flagged)
    # 1 dense layer + (shared + every routed expert) in each MoE layer
    cfg = get_recipe("kimi_k2_proxy_muon").model.hf_config
    moe_layers = cfg["num_hidden_layers"] - cfg["first_k_dense_replace"]
    assert len(flagged) == cfg["first_k_dense_replace"] + moe_layers * (cfg["n_routed_experts"] + 1)


@pytest.mark.once
def test_manifest_counts_gate_and_up_as_two_matrices():
    """``nemo llm muon-plan`` with a split preset: each linear_fc1 is two (rows / 2) x hidden matrices; Kimi K2's
    Newton-Schulz FLOPs written out by hand (steps * (4 m^2 n + 2 m^3) per matrix, m <= n)."""
    from bridge_ext.muon import muon_plan

    def ns(rows: int, cols: int) -> int:
        m, n = sorted((rows, cols))
        return 5 * (4 * m * m * n + 2 * m**3)

    h = 7168
    attention = [(1536, h), (64 * 192, 1536), (576, h), (64 * 256, 512), (h, 64 * 128)]
    moe = [*attention, *[(2048, h), (2048, h), (h, 2048)] * (384 + 1), (384, h)]
    dense = [*attention, (18432, h), (18432, h), (h, 18432)]
    recipe = get_recipe("kimi_k2_muon")  # kimi_k2 splits; kimi_k2_fused_mlp is megatron-core's one matrix
    split, fused = muon_plan(recipe), muon_plan(recipe.with_preset("kimi_k2_fused_mlp"))
    assert split.ns_flops_per_step == 60 * sum(ns(*m) for m in moe) + sum(ns(*m) for m in dense)
    rows = {r.pattern.rsplit("mlp.", 1)[-1]: r for r in split.rows if r.pattern.endswith("linear_fc1.weight")}
    assert rows["linear_fc1.weight"].ns_matrices == ((18432, h),) * 2
    assert rows["experts.local_experts.{expert}.linear_fc1.weight"].ns_matrices == ((2048, h),) * 2
    assert rows["shared_experts.linear_fc1.weight"].ns_matrices == ((2048, h),) * 2
    print(f"Kimi K2 NS/model: fused {fused.ns_over_model:.4f}, split {split.ns_over_model:.4f}")
    assert split.model_flops_per_step == fused.model_flops_per_step  # the model is the same
    assert round(split.ns_over_model, 4) == 0.0141 and round(fused.ns_over_model, 4) == 0.0256  # docs/muon.md

    h = 2048  # Qwen3-30B-A3B: Q, K, V apart; 128 experts of 768, gate and up apart
    layer = [(32 * 128, h), (4 * 128, h), (4 * 128, h), (h, 32 * 128), *[(768, h), (768, h), (h, 768)] * 128, (128, h)]
    qwen = muon_plan("qwen3_30b_a3b_muon")
    assert qwen.ns_flops_per_step == 48 * sum(ns(*m) for m in layer)
    assert round(qwen.ns_over_model, 4) == 0.0118  # docs/muon.md (fused: 0.0214)
