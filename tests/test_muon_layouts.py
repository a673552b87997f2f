"""Muon's update does not depend on the layout: one step from the same weights on the same batch gives the same
weights at TP1 and TP2, PP1 and PP2, EP1 and EP2, with and without QK-clip (issue 29).

Two launches of ``tests/muon_layout_driver.py`` (one process, then two; CPU, gloo) build each case as a run does
(the recipe's preset, the stack patches, ``bridge_ext.muon``'s run-time parts) and take one step:

- the Qwen3 proxy (dense GQA, q/k norm; ``moonlight``: gate/up apart, Q/K/V apart): 1 process, TP2, PP2, and TP2
  in ``blockwise`` TP mode (the negative control: each shard orthogonalized alone);
- the Qwen3 proxy with QK-clip on (GQA; Megatron-LM issue 4646: a shape error at TP > 1 without our
  ``qk-clip-gqa-tp-shapes`` patch): 1 process and TP2;
- the Kimi K2 proxy (MLA, routed experts, ``kimi_k2``: QK-clip): 1 process, TP2 (experts ETP2), EP2;
- the Qwen3-MoE proxy (routed experts): 1 process, EP2, TP2 (experts ETP2).

The weights come from the 1-process case of each model (saved through ``megatron.core.dist_checkpointing`` and
resharded into every other layout by it); the stepped weights are read back as global tensors. A learning rate
of 0.02 for every group (the schedule's warm-up would start at 0), ``muon_fp32_matmul_prec=highest`` (the
presets' ``medium`` lets a CPU with bf16 units run Newton-Schulz in bf16: another rounding per layout), QK-clip
thresholds under the proxies' maxima so that heads are clipped and others not. Everything else is the preset's:
Muon's TP mode is the presets' own ``duplicated`` (recipes/optimizers.py).

Tolerances: Muon-stepped weights ``TOL`` = 5e-7 absolute (the step moves them by up to 1.4e-2; layouts sum the
same gradients in another order, fp32, and Newton-Schulz passes that on; measured <= 9e-8); Adam-stepped
tensors (embedding, output layer, norms) ``ADAM_TOL`` = 2e-4 (Adam's first step is lr * g / |g|: rows whose
gradient is float noise move by up to lr; tests/test_parallel_cpu.py). The hand computation of Muon (float64,
Keller Jordan's Newton-Schulz, 0.2 sqrt(max(A, B)), decoupled weight decay, from the 1-process gradient) has
``HAND_TOL`` = 2e-6 (fp32 Newton-Schulz against float64).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from ckpt_io import read_global_tensors
from hand_muon import newton_schulz
from parallel_driver import launch_ranks

ROOT = Path(__file__).resolve().parent.parent
DENSE, MOE, KIMI = "qwen3_proxy_muon", "qwen3_moe_proxy_muon", "kimi_k2_proxy_muon"
EXACT = ["optimizer.muon_fp32_matmul_prec=highest"]
# between the proxies' per-head maxima at this batch (GQA 2.70-3.22, MLA 0.054-0.084): some heads clipped, some not
GQA_TAU, MLA_TAU = 3.0, 0.06
# tau through build_config's values (the same as a model.qk_clip_threshold=3.0 override: tests/test_build.py)
GQA_CLIP = (["model.qk_clip=true"], {"model.qk_clip_threshold": GQA_TAU})
MLA_CLIP = ([], {"model.qk_clip_threshold": MLA_TAU})
TOL, ADAM_TOL, HAND_TOL = 5e-7, 2e-4, 2e-6

# (case, recipe, layout, overrides); the first case of each recipe in world 1 saves its initial weights
NONE = ([], {})
WORLD1 = [("dense-1", DENSE, "cpu", NONE), ("gqa-1", DENSE, "cpu", GQA_CLIP), ("kimi-1", KIMI, "cpu", MLA_CLIP),
          ("moe-1", MOE, "cpu", NONE)]
WORLD2 = [("dense-tp2", DENSE, "cpu-tp2", NONE), ("dense-pp2", DENSE, "cpu-pp2", NONE),
          ("dense-tp2-blockwise", DENSE, "cpu-tp2", (["optimizer.muon_tp_mode=blockwise"], {})),
          ("gqa-tp2", DENSE, "cpu-tp2", GQA_CLIP), ("kimi-tp2", KIMI, "cpu-tp2", MLA_CLIP),
          ("kimi-ep2", KIMI, "cpu-ep2", MLA_CLIP), ("moe-ep2", MOE, "cpu-ep2", NONE), ("moe-tp2", MOE, "cpu-tp2", NONE)]
# each multi-process case against the 1-process case it must equal
SAME = {"dense-tp2": "dense-1", "dense-pp2": "dense-1", "gqa-tp2": "gqa-1", "kimi-tp2": "kimi-1",
        "kimi-ep2": "kimi-1", "moe-ep2": "moe-1", "moe-tp2": "moe-1"}


def _launch(out: Path, cases: list[tuple], nproc: int) -> str:
    seen: set[str] = set()
    plan = []
    for name, recipe, layout, (overrides, values) in cases:
        plan.append({"name": name, "recipe": recipe, "layout": layout, "overrides": [*EXACT, *overrides],
                     "values": values, "init": nproc == 1 and recipe not in seen})
        seen.add(recipe)
    path = out / f"plan-{nproc}.json"
    path.write_text(json.dumps({"out": str(out), "cases": plan}))
    return launch_ranks(ROOT / "tests" / "muon_layout_driver.py", [path], out, nproc=nproc, timeout=900).stdout


def _adam_stepped(key: str) -> bool:
    return not key.endswith("weight") or any(part in key for part in ("embedding", "output_layer", "norm"))


def _record(out: Path, case: str) -> dict:
    return json.loads((out / f"{case}.json").read_text())


def _muon(w0: torch.Tensor, g: torch.Tensor, *, lr: float, wd: float, parts: list[torch.Tensor] | None = None):
    """One Muon step from zero momentum (the Nesterov vector is then a multiple of g, which Newton-Schulz
    normalizes away): W (1 - lr wd) - lr 0.2 sqrt(max(A, B)) NS(G), per part when ``parts`` index rows."""
    update = torch.empty_like(g, dtype=torch.float64)
    for rows in parts or [torch.arange(g.shape[0])]:
        part = g[rows]
        update[rows] = newton_schulz(part.double()) * 0.2 * math.sqrt(max(part.shape))
    return w0.double() * (1 - lr * wd) - lr * update


@pytest.fixture(scope="module")
def steps(tmp_path_factory, cpu_mode):
    out = tmp_path_factory.mktemp("muon-layouts")
    logs = _launch(out, WORLD1, 1) + _launch(out, WORLD2, 2)
    print(logs)
    tensors = {name: read_global_tensors(out / name) for name, *_ in WORLD1 + WORLD2}
    tensors.update({f"{recipe}-w0": read_global_tensors(out / f"{recipe}-w0") for recipe in (DENSE, MOE, KIMI)})
    return out, tensors


def _differences(a: dict, b: dict) -> tuple[float, float]:
    assert a.keys() == b.keys(), sorted(set(a) ^ set(b))
    muon = max((a[k] - b[k]).abs().max().item() for k in a if not _adam_stepped(k))
    adam = max((a[k] - b[k]).abs().max().item() for k in a if _adam_stepped(k))
    return muon, adam


@pytest.mark.slow
@pytest.mark.stack
def test_one_muon_step_is_the_same_in_every_layout(steps):
    out, tensors = steps
    worst = {}
    for case, reference in SAME.items():
        record = _record(out, case)
        assert record["muon_tp_mode"] == "duplicated" and record["optimizer"] == "dist_muon", record
        assert abs(record["loss"] - _record(out, reference)["loss"]) <= 2e-6, case
        worst[case] = _differences(tensors[case], tensors[reference])
    print("\nmax |W1(layout) - W1(1 process)| (Muon-stepped, Adam-stepped):",
          {k: f"{m:.1e}, {a:.1e}" for k, (m, a) in worst.items()})
    assert all(muon <= TOL and adam <= ADAM_TOL for muon, adam in worst.values()), worst
    # the layouts are what they say: TP2 (experts ETP2), PP2, EP2
    sizes = {case: tuple(_record(out, case)[k] for k in ("tp", "pp", "ep", "etp")) for case in SAME}
    assert sizes["dense-tp2"][:2] == (2, 1) and sizes["dense-pp2"][:2] == (1, 2) and sizes["gqa-tp2"][0] == 2
    assert sizes["kimi-tp2"] == sizes["moe-tp2"] == (2, 1, 1, 2)
    assert sizes["kimi-ep2"] == sizes["moe-ep2"] == (1, 1, 2, 1)


@pytest.mark.slow
@pytest.mark.stack
def test_blockwise_tp_mode_gives_another_update_at_tp2(steps):
    """The negative control: megatron-core's ``blockwise`` mode orthogonalizes each TP shard alone, so TP2
    moves every TP-sharded Muon matrix elsewhere than one process does; the presets pin ``duplicated``."""
    out, tensors = steps
    assert _record(out, "dense-tp2-blockwise")["muon_tp_mode"] == "blockwise"
    ref, blockwise = tensors["dense-1"], tensors["dense-tp2-blockwise"]
    sharded = ["linear_qkv.weight", "linear_proj.weight", "linear_fc1.weight", "linear_fc2.weight"]
    moved = {s: max((ref[k] - blockwise[k]).abs().max().item() for k in ref if k.endswith(s)) for s in sharded}
    print("\nblockwise TP2 vs 1 process:", {k: f"{v:.1e}" for k, v in moved.items()})
    assert all(v > 100 * TOL for v in moved.values()), moved


# (multi-process case, its 1-process case, parameter name there, torch_dist key, index into the global tensor)
HAND = [("dense-tp2", "dense-1", "decoder.layers.0.self_attention.linear_proj.weight",
         "decoder.layers.self_attention.linear_proj.weight", (0,)),
        ("dense-tp2", "dense-1", "decoder.layers.1.mlp.linear_fc1.weight", "decoder.layers.mlp.linear_fc1.weight", (1,)),
        ("dense-tp2", "dense-1", "decoder.layers.1.self_attention.linear_qkv.weight",
         "decoder.layers.self_attention.linear_qkv.weight", (1,)),
        ("moe-ep2", "moe-1", "decoder.layers.1.mlp.experts.local_experts.5.linear_fc2.weight",
         "decoder.layers.mlp.experts.experts.linear_fc2.weight", (1, 5)),
        ("moe-ep2", "moe-1", "decoder.layers.0.mlp.experts.local_experts.6.linear_fc1.weight",
         "decoder.layers.mlp.experts.experts.linear_fc1.weight", (0, 6)),
        ("kimi-tp2", "kimi-1", "decoder.layers.2.self_attention.linear_kv_down_proj.weight",
         "decoder.layers.2.self_attention.linear_kv_down_proj.weight", ()),
        ("kimi-ep2", "kimi-1", "decoder.layers.1.mlp.experts.local_experts.3.linear_fc2.weight",
         "decoder.layers.1.mlp.experts.experts.linear_fc2.weight", (3,))]


@pytest.mark.slow
@pytest.mark.stack
def test_the_step_is_muon_computed_by_hand(steps):
    """Independent of the code under test: from the 1-process gradient, one Muon step written out (float64)
    gives the multi-process run's weights: linear_proj whole, linear_fc1's gate and up halves apart (dense and a
    routed expert at EP2), linear_qkv's Q, K and V apart (rows of every query group), routed experts' linear_fc2
    at EP2, MLA's kv down-projection at TP2."""
    out, tensors = steps
    errors, grads = {}, {}
    for case, reference, name, key, index in HAND:
        record = _record(out, case)
        lr, wd = record["lr"], record["weight_decay"]
        assert wd == 0.1
        recipe = next(r for c, r, *_ in WORLD1 if c == reference)
        if reference not in grads:
            grads[reference] = torch.load(out / f"{reference}-grads.pt")
        g = grads[reference][name]
        w0, w1 = tensors[f"{recipe}-w0"][key][index], tensors[case][key][index]
        assert g.shape == w0.shape, (name, g.shape, w0.shape)
        rows = torch.arange(g.shape[0])
        parts = None
        if name.endswith("linear_fc1.weight"):
            parts = list(rows.chunk(2))  # [gate; up]
        elif name.endswith("linear_qkv.weight"):  # 2 groups of [q (2 heads x 16); k (16); v (16)]
            per = rows.view(2, 64)
            parts = [per[:, :32].reshape(-1), per[:, 32:48].reshape(-1), per[:, 48:].reshape(-1)]
        errors[f"{case} {name}"] = (w1.double() - _muon(w0, g, lr=lr, wd=wd, parts=parts)).abs().max().item()
        if parts:  # and the split matters: one matrix would be another update
            fused = (w1.double() - _muon(w0, g, lr=lr, wd=wd)).abs().max().item()
            assert fused > 100 * HAND_TOL, (name, fused)
    print("\n|W1 - hand Muon|:", {k: f"{v:.1e}" for k, v in errors.items()})
    assert all(v <= HAND_TOL for v in errors.values()), errors


@pytest.mark.slow
@pytest.mark.stack
def test_qk_clip_at_tp2_scales_each_query_group_as_one_process_does(steps):
    """GQA QK-clip (Megatron-LM issue 4646 fixed by ``qk-clip-gqa-tp-shapes``): with tau under some heads'
    maxima, TP2 clips as one process does (test_one_muon_step_is_the_same_in_every_layout), and the clip is
    MuonClip's: each query group's q and k rows scaled by sqrt(min(1, tau / max over its heads)) (alpha 0.5),
    v untouched, against the same step without QK-clip (``dense-1``: same weights, batch and update)."""
    out, tensors = steps
    record = _record(out, "gqa-1")
    maxima = torch.tensor(record["head_max"])  # (layers, heads)
    assert (maxima > GQA_TAU).any() and (maxima <= GQA_TAU).any(), maxima  # some heads clipped, some not
    key = "decoder.layers.self_attention.linear_qkv.weight"
    clipped, unclipped = tensors["gqa-1"][key].double(), tensors["dense-1"][key].double()
    for layer, heads in enumerate(maxima):
        group_max = heads.view(2, 2).max(dim=1).values.double()  # 4 heads in 2 query groups
        scale = torch.clamp(GQA_TAU / group_max, max=1.0).sqrt()
        expected = unclipped[layer].view(2, 64, -1).clone()
        expected[:, :48] *= scale.view(2, 1, 1)  # q (32 rows) and k (16 rows) of each group; v as it was
        torch.testing.assert_close(clipped[layer], expected.view(128, -1), rtol=1e-6, atol=1e-7)
    kimi = torch.tensor(_record(out, "kimi-1")["head_max"])
    assert (kimi > MLA_TAU).any() and (kimi <= MLA_TAU).any(), kimi


# ------------------------------------------------------------------------------- cheap checks, every stack
@pytest.mark.stack
def test_gqa_clip_on_a_tp2_shard_is_the_one_process_clip(cpu_mode):
    """Megatron-LM issue 4646: the ``_clip_linear_qkv`` that runs now (patched where needed) clips each TP2
    shard of a GQA probe as the one-process clip clips those rows; upstream's fails there where the patch
    applies, and the patch's replacement equals upstream's own one-process result bit for bit."""
    from megatron.core.transformer.attention import SelfAttention

    from bridge_ext import patches
    from bridge_ext.patches import transformer as muon_layout

    patches.apply("stack")
    upstream = getattr(SelfAttention._clip_linear_qkv, "_bridge_ext_original", SelfAttention._clip_linear_qkv)
    buggy = muon_layout.gqa_clip_fails_on_a_shard(upstream)
    assert ("qk-clip-gqa-tp-shapes" in patches.applied()) == buggy
    assert not muon_layout.gqa_clip_fails_on_a_shard(SelfAttention._clip_linear_qkv)
    stub, whole, _ = muon_layout._shard_probe(tp=1, rank=0)
    expected = upstream(stub, whole.clone())  # upstream's own result on one process
    shards = [SelfAttention._clip_linear_qkv(*muon_layout._shard_probe(tp=2, rank=r)[:2]) for r in (0, 1)]
    assert torch.equal(torch.cat(shards), expected)
    if buggy:
        with pytest.raises(RuntimeError, match="shape"):
            upstream(*muon_layout._shard_probe(tp=2, rank=0)[:2])


def test_presets_pin_the_layout_free_tp_mode_and_launch_checks_name_the_field():
    """Every Muon preset pins ``muon_tp_mode=duplicated`` (the update of one process at every TP size; blockwise
    stays a user's explicit choice, test_blockwise_tp_mode_gives_another_update_at_tp2 shows what it does); the
    launch check refuses the legacy GroupedMLP under Muon in one line naming the field."""
    from bridge_ext.build import build_config
    from bridge_ext.muon.checks import launch_problems
    from recipes import get_recipe
    from recipes.optimizers import PRESETS

    assert {p.optimizer["muon_tp_mode"] for p in PRESETS.values() if p.kind == "muon"} == {"duplicated"}
    assert build_config(get_recipe(DENSE), layout="cpu-tp2").optimizer.muon_tp_mode == "duplicated"
    moe = build_config(get_recipe(MOE), layout="cpu-ep2")
    if hasattr(moe.model, "moe_use_legacy_grouped_gemm"):  # megatron-core 0.16-0.18; 0.19 has no legacy GroupedMLP
        assert launch_problems(moe) == []
        moe.model.moe_use_legacy_grouped_gemm = True
        (line,) = launch_problems(moe)
        assert line.startswith("model.moe_use_legacy_grouped_gemm=true with Muon")
        adamw = build_config(get_recipe("qwen3_moe_proxy_adamw"), layout="cpu-ep2")
        adamw.model.moe_use_legacy_grouped_gemm = True
        assert launch_problems(adamw) == []
