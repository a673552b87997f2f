"""``nemo llm plan``: parameters per rank against what Megatron builds, memory and FLOPs against hand
computations and Megatron Bridge's own counter."""

from __future__ import annotations

import collections
import json
import math
import subprocess
import sys
import time
from pathlib import Path

import pytest
from parallel_driver import launch_ranks

from bridge_ext.commands import main
from bridge_ext.muon import muon_plan, newton_schulz_flops
from bridge_ext.plan import plan
from bridge_ext.plan.memory import GB, activation_bytes, layer_wise_share, model_state
from bridge_ext.plan.ranks import Tensor, rank_params
from recipes import get_recipe
from recipes.params import count_params

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def kimi():
    return plan("kimi_k2_muon")


@pytest.fixture(scope="module")
def qwen8():
    return plan("qwen3_8b_muon")


# ------------------------------------------------------------------------------------------------ speed
def test_plan_is_fast_and_imports_neither_torch_nor_megatron():
    code = ("import sys, time; t = time.process_time(); from bridge_ext.commands import main; "
            "rc = main(['llm', 'plan', '--recipe', 'kimi_k2_muon', '--json']); "
            "print('CPU', time.process_time() - t, file=sys.stderr); "
            "assert rc == 0; assert not any(m == 'torch' or m.startswith('megatron.') for m in sys.modules), "
            "sorted(m for m in sys.modules if m.startswith(('torch', 'megatron.')))")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert run.returncode == 0, run.stderr
    cpu = float(run.stderr.split("CPU")[-1])
    data = json.loads(run.stdout)
    assert data["recipe"] == "kimi_k2_muon" and data["selected_optimizer"] == "dist_muon"
    assert cpu < 1.0, f"{cpu:.2f} s of CPU for the whole command"  # wall time depends on the machine's load
    start = time.process_time()
    plan("kimi_k2_muon", layout="h100x512")
    assert time.process_time() - start < 0.5


# ------------------------------------------------------------------------ totals against recipes/params.py
@pytest.mark.once
@pytest.mark.parametrize("layout", ["gb300x256", "h100x512"])
def test_kimi_k2_ranks_add_up_to_the_published_count(layout):
    """Over every pipeline rank, dense parameters once per TP group and experts once per EP group: the whole model.

    recipes/params.py counts the DeepSeek-V3 router's expert bias, which Megatron keeps as a buffer."""
    recipe = get_recipe("kimi_k2_muon")
    hf = recipe.model.hf_config
    p = plan(recipe, layout=layout)
    lay = recipe.layout(layout)
    moe_layers = hf["num_hidden_layers"] - hf["first_k_dense_replace"]
    expected = count_params(recipe.model.architecture).total - moe_layers * hf["n_routed_experts"]
    assert p.params_total == expected
    assert p.params_active == count_params(recipe.model.architecture).active
    assert sum(len(r.layers) for r in p.ranks) == 61
    if lay.tp == 1:
        assert sum(r.dense + r.expert * lay.ep for r in p.ranks) == expected
    else:  # TP2: replicated tensors (norms, router, MLA down projections with TE) appear on both TP ranks
        replicated = sum(t.numel for r in p.ranks for t in r.tensors if not t.expert and not any(
            t.name.endswith(s) for s in ("linear_q_up_proj.weight", "linear_kv_up_proj.weight", "linear_proj.weight",
                                         "linear_fc1.weight", "linear_fc2.weight", "word_embeddings.weight",
                                         "output_layer.weight")))
        sharded = sum(r.dense for r in p.ranks) - replicated
        assert sharded * lay.tp + replicated + sum(r.expert for r in p.ranks) * lay.ep == expected


# ----------------------------------------------------------------- against what Megatron builds per rank
DRIVER_CASES = ["kimi_k2_proxy_muon:cpu-tp2", "kimi_k2_proxy_muon:cpu-ep2", "kimi_k2_proxy_muon:cpu-pp2",
                "qwen3_proxy_muon:cpu-tp2", "qwen3_proxy_muon:cpu-pp2", "qwen3_moe_proxy_muon:cpu-ep2"]


@pytest.mark.slow
@pytest.mark.heavy
def test_parameters_per_rank_equal_what_megatron_builds(tmp_path):
    """TP2, EP2 and PP2 (the Kimi K2 proxy's uneven `Ett|tL` included), 2 processes on gloo: every rank's
    parameter tensors (sizes, as a multiset) equal the plan's for that pipeline rank (local layer spec)."""
    launch_ranks(ROOT / "tests" / "plan_rank_driver.py", [tmp_path, *DRIVER_CASES], ROOT, nproc=2, timeout=900)
    records = [r for rank in (0, 1) for r in json.loads((tmp_path / f"rank{rank}.json").read_text())]
    assert len(records) == 2 * len(DRIVER_CASES)
    for record in records:
        recipe = get_recipe(record["recipe"])
        layout = recipe.layout(record["layout"])
        ranks = rank_params(recipe.model.architecture, muon_plan(recipe, layout=layout.cluster).rows, layout, spec="local")
        planned = sorted(t.numel for t in ranks[record["pp_rank"]].tensors)
        where = f"{record['recipe']} {record['layout']} pp{record['pp_rank']} tp{record['tp_rank']} ep{record['ep_rank']}"
        assert planned == record["numels"], (where, collections.Counter(planned) - collections.Counter(record["numels"]),
                                             collections.Counter(record["numels"]) - collections.Counter(planned))
        print(f"{where}: {sum(planned):,} parameters in {len(planned)} tensors")


# ------------------------------------------------------------------------------ arithmetic by hand: dense
@pytest.mark.once
def test_qwen3_8b_memory_by_hand(qwen8):
    """Qwen3-8B on h100x8 (TP4 DP2, bf16): parameters per GPU and bytes per component written out."""
    h, heads, kv, d, ffn, layers, vocab, tp, dp = 4096, 32, 8, 128, 12288, 36, 151936, 4, 2
    per_layer = ((heads + 2 * kv) * d * h + h * heads * d + 3 * h * ffn) // tp + 2 * h + 2 * d  # + norms, q/k norms
    edges = 2 * vocab * h // tp + h  # embedding, output layer (split over TP), final norm
    params = layers * per_layer + edges
    assert qwen8.ranks[0].total == params == 2_047_915_008  # = (8,190,735,360 - 308,224 replicated) / 4 + 308,224
    adam = 2 * vocab * h // tp + layers * (2 * h + 2 * d) + h  # what Muon leaves to Adam: embeddings and norms
    m = qwen8.memory
    assert m["adam_distributed"].weights == 2 * params  # bf16
    assert m["adam_distributed"].grads == 4 * params  # fp32 grad buffer, full size
    assert m["adam_distributed"].main_params == 4 * params / dp
    assert m["adam_distributed"].optimizer_state == 8 * params / dp
    assert m["adam"].main_params == 4 * params and m["adam"].optimizer_state == 8 * params
    assert m["muon"].main_params == 4 * params
    assert m["muon"].optimizer_state == 4 * (params - adam) + 8 * adam
    # layer-wise Muon over DP2: each rank updates about half (whole tensors), never less than half
    half = (4 * params + 4 * (params - adam) + 8 * adam) / 2
    shared = m["dist_muon"].main_params + m["dist_muon"].optimizer_state
    assert half <= shared <= half + 12 * vocab * h // tp
    # activations: TP4 + sequence parallel, MBS 1 x 4096 tokens, bf16, no recompute, one micro-batch in flight
    tokens = 4096 / tp
    attention = h + h + (heads + 2 * kv) * d + (heads + kv) * d + heads * d  # LN in, QKV in, q k v, q/k-norm in, out
    mlp = h + h + 2 * ffn + ffn  # LN in, fc1 in, SwiGLU in, fc2 in
    logits = h * 2 + vocab * 4  # output-layer input (bf16) and fp32 logits
    assert m["dist_muon"].activations == pytest.approx(tokens * (layers * (attention + mlp) * 2 + logits))
    assert all(m[k].activations == m["dist_muon"].activations for k in m)
    assert qwen8.verdicts() == {"GB300": "fits", "B200": "fits", "H200": "fits", "H100": "fits"}


def test_layer_wise_sharding_follows_megatron_core_docstring():
    """layer_wise_optimizer.py: "4 ranks and 10 parameters p0-p9 after sorting ... [[p0, p7, p8], [p1, p6, p9],
    [p2, p5], [p3, p4]]"."""
    tensors = [Tensor(f"p{i}", i + 1, "muon", False) for i in range(10)]
    shares = layer_wise_share(tensors, 4)
    assert [[t.name for t in share] for share in shares] == [["p0", "p7", "p8"], ["p1", "p6", "p9"], ["p2", "p5"],
                                                            ["p3", "p4"]]


# ------------------------------------------------------------------------- arithmetic by hand: MoE + MLA
@pytest.mark.once
def test_kimi_k2_rank0_memory_by_hand(kimi):
    """Kimi K2 on gb300x256 (PP4 VP4 EP64 DP64, expert DP 1): pipeline rank 0 holds virtual stages 0, 4, 8,
    12 = the embedding + layers 0-3, 16-19, 32-35, 48-51 (layer 0 dense), 6 of the 384 experts each."""
    h, vocab, heads = 7168, 163840, 64
    q_rank, kv_rank, nope, rope, v = 1536, 512, 128, 64, 128
    attention = (h * q_rank + q_rank + q_rank * heads * (nope + rope) + h * (kv_rank + rope) + kv_rank
                 + kv_rank * heads * (nope + v) + heads * v * h + 2 * h)  # + input and pre-MLP norms
    dense_mlp = 3 * h * 18432
    expert = 3 * h * 2048
    moe_dense_part = 384 * h + expert  # router + one shared expert
    rank0 = next(r for r in kimi.ranks if r.pp_rank == 0)
    assert rank0.layers == (0, 1, 2, 3, 16, 17, 18, 19, 32, 33, 34, 35, 48, 49, 50, 51)
    dense = vocab * h + 16 * attention + dense_mlp + 15 * moe_dense_part
    experts = 15 * 6 * expert
    assert (rank0.dense, rank0.expert) == (dense, experts)
    layout = get_recipe("kimi_k2_muon").layout()
    m = model_state(rank0, layout, "adam_distributed", muon=False)
    assert m["weights"] == 2 * (dense + experts) and m["grads"] == 4 * (dense + experts)
    assert m["main_params"] == pytest.approx(4 * dense / 64 + 4 * experts)  # experts: expert DP = 256 / (64 x 4) = 1
    assert m["optimizer_state"] == pytest.approx(8 * dense / 64 + 8 * experts)
    # layer-wise Muon: every GPU owns its experts (expert DP 1: fp32 main + one momentum, not two Adam moments);
    # the embedding (Adam) is one tensor, so one DP rank holds all of it; the other dense tensors are dealt out
    muon = model_state(rank0, layout, "dist_muon", muon=True)
    owned = muon["main_params"] + muon["optimizer_state"]
    assert 8 * experts + 12 * vocab * h <= owned <= 8 * experts + 12 * vocab * h + 12 * dense / 64 + 12 * 2 * h * 18432
    assert kimi.muon_saving_gb == pytest.approx((kimi.memory["adam_distributed"].total - kimi.memory["dist_muon"].total) / GB)
    # Muon saves 4 B per expert parameter but pays the whole embedding's Adam state on one DP rank
    assert 0 < kimi.muon_saving_gb * GB < 4 * experts


@pytest.mark.once
def test_kimi_k2_activations_by_hand(kimi):
    """MXFP8: GEMM inputs kept in fp8 (1 B + 1/32 scale), the rest bf16; mla_up_proj recomputed; rank 0 of
    PP4 VP4 keeps (4 - 0 - 1) x 2 + (4 - 1) x 4 + 1 = 19 model chunks of 4 layers = 4.75 x its 16 layers."""
    h, heads, q_rank, kv_rank, rope, v, k, width, experts = 7168, 64, 1536, 512, 64, 128, 8, 2048, 384
    fp8, bf16, tokens = 1 + 1 / 32, 2, 2 * 4096
    attention = (h + q_rank + kv_rank + rope) * bf16 + (h + q_rank + kv_rank + heads * v) * fp8
    moe = (h + 2 * experts + k * 2 * width + 2 * width) * bf16 + (h + k * (h + width) + width) * fp8
    dense = (h + 2 * 18432) * bf16 + (h + 18432) * fp8
    per_microbatch = tokens * (16 * attention + moe * 15 + dense)
    recipe = get_recipe("kimi_k2_muon")
    rank0 = next(r for r in kimi.ranks if r.pp_rank == 0)
    assert activation_bytes(recipe.model.architecture, recipe.layout(), rank0, micro_batches=kimi.micro_batches,
                            recompute=dict(recipe.layout().model)) == pytest.approx(per_microbatch * 19 / 4)
    assert kimi.verdicts() == {"GB300": "fits", "B200": "does not fit", "H200": "does not fit", "H100": "does not fit"}


@pytest.mark.once
def test_recompute_full_keeps_layer_inputs():
    recipe = get_recipe("qwen3_8b_muon")
    arch, layout = recipe.model.architecture, recipe.layout()
    rank = plan(recipe).ranks[0]
    full = activation_bytes(arch, layout, rank, micro_batches=128,
                            recompute={"recompute_granularity": "full", "recompute_method": "uniform",
                                       "recompute_num_layers": 1})
    none = activation_bytes(arch, layout, rank, micro_batches=128, recompute={})
    tokens = 4096 / 4
    logits = tokens * (4096 * 2 + 151936 * 4)
    per_layer = (none - logits) / 36
    assert full == pytest.approx(tokens * 4096 * 2 * 36 + per_layer + logits)  # inputs + one layer live


# ----------------------------------------------------------------------------------- tokens and GPU-hours
@pytest.mark.once
def test_tokens_steps_and_gpu_hours_by_hand(kimi):
    steps = math.ceil(15.5e12 / (4096 * 4096))
    assert (kimi.tokens_per_step, kimi.train_iters) == (4096 * 4096, steps) == (16_777_216, 923_872)
    assert kimi.tflops_per_gpu == 1080.0 and "developer.nvidia.com/blog" in kimi.tflops_source
    assert kimi.gpu_hours == pytest.approx(steps * (kimi.model_flops_per_step + kimi.ns_flops_per_step) / 1080e12 / 3600)
    assert plan("qwen3_30b_a3b_muon").tflops_per_gpu == 721.0
    assert plan("qwen3_30b_a3b_adamw").tflops_per_gpu == 713.0
    assert plan("qwen3_8b_muon").gpu_hours is None
    assert plan("qwen3_8b_muon", tflops_per_gpu=400).gpu_hours == pytest.approx(
        300_000 * (plan("qwen3_8b_muon").model_flops_per_step + plan("qwen3_8b_muon").ns_flops_per_step) / 400e12 / 3600)


@pytest.mark.once
def test_ns_flops_come_from_the_manifest(kimi):
    assert kimi.ns_flops_per_step == muon_plan("kimi_k2_muon").ns_flops_per_step
    # one routed expert's gate (2048 x 7168), 5 steps, by the formula in docs/muon.md
    assert newton_schulz_flops(2048, 7168, 5) == 5 * (4 * 2048**2 * 7168 + 2 * 2048**3)
    assert plan("kimi_k2_adamw").ns_flops_per_step == 0


def test_model_flops_agree_with_6nd(kimi, qwen8):
    """Megatron Bridge's count against 6 x active matmul parameters x tokens + causal attention (muon-plan)."""
    for p, name in ((kimi, "kimi_k2_muon"), (qwen8, "qwen3_8b_muon")):
        assert p.model_flops_per_step == pytest.approx(muon_plan(name).model_flops_per_step, rel=0.02)


# --------------------------------------------------------------------------------------------- bad input
@pytest.mark.once
@pytest.mark.parametrize("argv, message", [
    (["layout=nope"], "layout 'nope' is not defined"),
    (["model.expert_model_parallel_size=5"], "384 experts do not split over ep=5"),
    (["train.global_batch_size=abc"], "must be a positive integer"),
    (["optimizer.lr=1"], "cannot take 'optimizer.lr'"),
    (["--tflops-per-gpu", "-3"], "must be positive"),
])
def test_bad_input_is_one_line(capsys, argv, message):
    assert main(["llm", "plan", "--recipe", "kimi_k2_muon", *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and message in err and err.count("\n") == 1


@pytest.mark.once
def test_cli_text_shows_muon_and_adamw(capsys):
    assert main(["llm", "plan", "--recipe", "kimi_k2_muon", "preset=kimi_k2_adamw"]) == 0
    out = capsys.readouterr().out
    assert "*AdamW, distributed optimizer" in out and "Muon, layer-wise sharded (dist_muon)" in out
    assert "layer-wise Muon saves" in out and "does not fit on H100 (80 GB)" in out and "fits on GB300 (288 GB)" in out
    assert "GPU-hours" in out and "1,051 TFLOP/s" in out


# ------------------------------------------------------------------------- FLOPs: Megatron Bridge's own
@pytest.mark.slow
def test_flops_equal_megatron_bridge_flop_utils_on_the_built_config():
    """The compiled counter on the mirrored provider fields = the imported module on the real ConfigContainer."""
    from bridge_ext.build import build_config, quiet_megatron
    from bridge_ext.plan.flops import SILU, import_cost_s, provider_fields

    quiet_megatron()
    cost = import_cost_s()
    import torch.nn.functional as F
    from megatron.bridge.training.utils.flop_utils import num_floating_point_operations

    print(f"importing flop_utils the ordinary way: {cost:.1f} s")
    for name in ("kimi_k2_muon", "qwen3_30b_a3b_muon", "qwen3_8b_muon"):
        recipe = get_recipe(name)
        cfg = build_config(recipe)
        layout = recipe.layout()
        mirrored = provider_fields(recipe.model.architecture, seq_length=layout.seq_length, tp=layout.tp)
        for key, value in mirrored.items():
            actual = getattr(cfg.model, key)
            assert (actual is F.silu) if value is SILU else actual == value, (name, key, actual, value)
        expected = num_floating_point_operations(cfg, layout.global_batch_size)
        assert plan(name).model_flops_per_step == expected, name
