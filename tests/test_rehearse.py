"""``nemo llm rehearse``: one rank of a recipe's real layout built by Megatron on fake tensors, against ``plan``.

The expected values are Megatron's own objects (the rank's model chunks, DDP buffers and optimizer, read by
``bridge_ext.rehearse.measure``) and hand counts; the code under test is ``nemo llm plan``'s (``bridge_ext.plan``):
parameters per rank exactly, weights, grad buffer, fp32 main params and optimizer state within 1 %, and the
Newton-Schulz FLOPs one ``optimizer.step()`` runs on the rank (torch's FlopCounterMode) equal to the manifest's.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from parallel_driver import launch_ranks

from bridge_ext.errors import UserError
from bridge_ext.rehearse import rehearse, select_ranks

MEMORY = ("weights", "grads", "main_params", "optimizer_state")
ROOT = Path(__file__).resolve().parents[1]


def _check(result: dict, *, step: bool) -> None:
    """``result``: one rank's ``Rehearsal.to_json()`` (the API's or ``--json``'s)."""
    measured, planned = result["measured"], result["planned"]
    assert measured["params"] == planned["params"]
    assert measured["expert_params"] == planned["expert_params"]
    for key in MEMORY:
        assert planned[key] == pytest.approx(measured[key], rel=0.01), key
    if "DistributedOptimizer(" not in result["optimizer"]:  # no buffer padding without the distributed optimizer
        assert measured["weights"] == 2 * measured["params"]  # bf16
        assert measured["grads"] == 4 * measured["params"]  # fp32 grad buffer (grad_reduce_in_fp32)
    if step:
        assert result["ns_flops"] == pytest.approx(result["planned_ns_flops"], rel=1e-9)
        assert (result["ns_flops"] > 0) == ("Muon" in result["optimizer"])


@pytest.mark.once
def test_rank_selection():
    assert select_ranks("first,last", world=256, pp=4) == (0, 255)
    assert select_ranks("all-pp,3", world=256, pp=4) == (0, 64, 128, 192, 3)
    for bad in ("256", "-1", "0,middle"):
        with pytest.raises(UserError):
            select_ranks(bad, world=256, pp=4)


@pytest.mark.slow
def test_bad_input_is_one_line_and_exit_2(nemo, cpu_mode):
    for argv, says in (
        (["--recipe", "kimi_k2_muon", "--rank", "256"], "outside layout gb300x256's world of 256 ranks"),
        (["--recipe", "kimi_k2_muon", "--ranks", "0,middle"], "got 'middle'"),
        (["--recipe", "qwen3_8b_muon", "model.tensor_parallel_size=2"], "did you mean"),
        # TP64 over Qwen3-8B's 32 attention heads: Megatron's TransformerConfig refuses it
        (["--recipe", "qwen3_8b_muon", "model.tensor_model_parallel_size=64", "gpus=64"], "does not validate"),
        (["--recipe", "qwen3_8b_muon", "--device", "cuda"], "needs a visible GPU"),
    ):
        result = nemo(["llm", "rehearse", *argv])
        assert result.code == 2, (argv, result)
        assert says in result.stderr and result.stderr.count("\n") == 1 and not result.stdout, (argv, result)


@pytest.mark.stack
@pytest.mark.slow
def test_qwen3_8b_tp4_rank0_distributed_adamw_equals_plan(cpu_mode):
    (rehearsed,) = rehearse("qwen3_8b_adamw", layout="h100x8", ranks=(0,), step=False, activations=False)
    result = rehearsed.to_json()
    assert result["micro_batch"] is None and result["micro_batch_skipped"] is None
    # by hand (Qwen3-8B config.json, TP4): per layer QKV (32 + 2 x 8) x 128 x 4096, proj 4096 x 4096, fc1
    # 2 x 12288 x 4096, fc2 4096 x 12288 (each / 4), two norms of 4096 and the q/k norms of 128; embedding and
    # output layer 151,936 x 4096 / 4 each; the final norm
    layer = ((32 + 16) * 128 * 4096 + 4096 * 4096 + 2 * 12288 * 4096 + 4096 * 12288) // 4 + 2 * 4096 + 2 * 128
    assert result["measured"]["params"] == 36 * layer + 2 * 151936 * 4096 // 4 + 4096 == 2_047_915_008
    assert result["optimizer"] == "ChainedOptimizer[DistributedOptimizer(AdamW)]"
    where = result["coordinates"]
    assert (where["tp"], where["dp"], where["dp_size"]) == (0, 0, 2)
    _check(result, step=False)


@pytest.mark.stack
@pytest.mark.slow
def test_kimi_k2_last_rank_layer_wise_muon_equals_plan(nemo, cpu_mode):
    """Rank 255 of 256 (last pipeline stage of PP4 x VP4, EP rank 63): one Muon step, gate and up apart; through
    the command, whose --json is the whole of stdout (without the micro-batch, which this test does not check:
    --no-activations)."""
    done = nemo(["llm", "rehearse", "--recipe", "kimi_k2_muon", "--ranks", "last", "--json", "--no-activations"])
    assert done.code == 0, done.stderr[-2000:]
    (result,) = json.loads(done.stdout)
    where = result["coordinates"]
    assert (where["rank"], where["pp"], where["ep"], where["dp"], where["dp_size"], where["expert_dp_size"]) == (
        255, 3, 63, 63, 64, 1)
    assert result["optimizer"].startswith("LayerWiseDistributedOptimizer[")
    assert (result["measured"]["params"], result["measured"]["expert_params"]) == HAND["kimi_k2", 255]
    _check(result, step=True)
    # every routed expert of the rank is Muon's and its own (expert DP 1): fp32 main + momentum for all of them
    assert result["measured"]["main_params"] >= 4 * result["measured"]["expert_params"]


# Parameters per rank by hand, from each model's config.json and its layout (TP, the pipeline layout's stages,
# EP), local layer spec; (all, routed experts). Independent of plan and of Megatron.
def _kimi_k2_counts() -> dict[int, tuple[int, int]]:
    """Kimi K2 gb300x256: TP1, PP4 x VP4 over "Etttt|(tttt|)*14,tL" (rank 0 holds virtual stages 0, 4, 8, 12:
    the embedding and 16 layers, the first dense; rank 255 stages 3, 7, 11, 15: 13 MoE layers, the final norm
    and the output layer), EP64: 384 / 64 = 6 routed experts per layer."""
    h, vocab, heads = 7168, 163840, 64
    # MLA: q down 7168->1536, q norm, q up 1536->64 x (128 + 64), kv down 7168->512 + 64, kv norm,
    # kv up 512->64 x (128 + 128), out 64 x 128->7168; input and pre-MLP norms
    attention = (h * 1536 + 1536 + 1536 * heads * 192 + h * 576 + 512 + 512 * heads * 256 + heads * 128 * h + 2 * h)
    experts = 6 * 3 * 2048 * h
    moe_layer = attention + 384 * h + 3 * 2048 * h + experts  # router, one shared expert, 6 routed experts
    dense_layer = attention + 3 * 18432 * h
    return {0: (vocab * h + dense_layer + 15 * moe_layer, 15 * experts),
            255: (13 * moe_layer + h + vocab * h, 13 * experts)}


def _qwen3_moe_counts(h: int, heads: int, kv: int, experts: int, ffn: int, layers: int, tp: int,
                      edges: int) -> tuple[int, int]:
    """A Qwen3-MoE rank: ``layers`` layers of QKV and out over TP, q/k norms, 2 norms, the router (replicated)
    and ``experts`` routed experts (ETP1); ``edges``: embedding / output / final norm on the rank."""
    expert_params = layers * experts * 3 * ffn * h
    layer = ((heads + 2 * kv) * 128 * h + heads * 128 * h) // tp + 2 * 128 + 2 * h + 128 * h
    return layers * layer + expert_params + edges, expert_params


HAND = {
    ("kimi_k2", 0): _kimi_k2_counts()[0],  # 7,854,489,600
    ("kimi_k2", 255): _kimi_k2_counts()[255],  # 6,532,652,032
    # Qwen3-30B-A3B gb300x8: TP1 PP1 EP8 (16 of 128 experts), 48 layers, embedding + output + final norm
    ("qwen3_30b_a3b", 0): _qwen3_moe_counts(2048, 32, 4, 16, 768, 48, 1, 2 * 151936 * 2048 + 2048),
    # Qwen3-235B-A22B h100x128: TP2 PP8 EP16 (8 of 128 experts) over "Et*11|(t*12|)*6,t*11L": rank 0 holds the
    # embedding (over TP) and 11 layers
    ("qwen3_235b_a22b", 0): _qwen3_moe_counts(4096, 64, 4, 8, 1536, 11, 2, 151936 * 4096 // 2),
    ("qwen3_8b", 0): (2_047_915_008, 0),  # test_qwen3_8b_tp4_rank0_distributed_adamw_equals_plan
    ("qwen3_8b", 4): (2_047_915_008, 0),  # DP rank 1 holds the same parameters
}


def _ns(rows: int, cols: int, steps: int = 5) -> int:
    """Newton-Schulz FLOPs of one m x n matrix (m <= n): X X^T, b A + c A A, B X (tests/test_muon_plan.py)."""
    m, n = sorted((rows, cols))
    return steps * (4 * m * m * n + 2 * m**3)


# Newton-Schulz FLOPs of one step by hand, the presets' muon_tp_mode=duplicated (emerging-optimizers'
# newton_schulz_tp: every TP rank all-gathers the shards and orthogonalizes the WHOLE matrix). Qwen3-8B h100x8
# (TP4, DP2): per layer Q 4096 x 4096, K and V 1024 x 4096 apart, proj 4096 x 4096, gate and up 12288 x 4096
# apart, fc2 4096 x 12288; the layer-wise optimizer deals the 36 layers' matrices over the 2 DP ranks in equal
# halves (ranks 0 and 4); embedding and output layer are Adam's.
_QWEN3_8B_LAYER_NS = (2 * _ns(4096, 4096) + 2 * _ns(1024, 4096) + 2 * _ns(12288, 4096) + _ns(4096, 12288))
HAND_NS = {
    ("qwen3_8b", 0): 36 * _QWEN3_8B_LAYER_NS // 2,  # 337,455,580,446,720
    ("qwen3_8b", 4): 36 * _QWEN3_8B_LAYER_NS // 2,
}


@pytest.mark.once
def test_hand_counts_written_out():
    """The hand counts above as numbers (the rehearsal tables in docs/launch.md); Qwen3-30B-A3B's rank with the
    other 7 ranks' experts is the whole model."""
    assert HAND["kimi_k2", 0] == (7_854_489_600, 3_963_617_280)
    assert HAND["kimi_k2", 255] == (6_532_652_032, 3_435_134_976)
    assert HAND["qwen3_30b_a3b", 0][0] == 5_164_972_032
    # x EP8 experts: Qwen3-30B-A3B's 30,532,122,624 parameters (config.json's sizes summed)
    assert HAND["qwen3_30b_a3b", 0][0] + 7 * HAND["qwen3_30b_a3b", 0][1] == 30_532_122_624
    assert HAND["qwen3_235b_a22b", 0][0] == 2_370_136_832
    assert HAND_NS["qwen3_8b", 0] == 337_455_580_446_720  # docs/launch.md: 3.375e14 (blockwise shards: 6.108e13)


# Minutes each on a loaded 2-core machine (Qwen3-30B-A3B's rank holds 1,536 expert matrices: ~40,000 fake-tensor
# dispatches to build; its AdamW twin took 16 min under load). Every model of the issue at rank 0 (Kimi K2 also
# rank 255) with Muon and with the AdamW twin; the lighter cases (Qwen3-8B AdamW rank 0, Kimi K2 Muon rank 255)
# are the tests above. Without the micro-batch (~40 s a rank here, and nothing below checks it; the micro-batch
# tests further down do).
@pytest.mark.heavy
@pytest.mark.slow
@pytest.mark.parametrize("recipe, layout, ranks, step", [
    ("qwen3_8b_muon", "h100x8", (0,), True),
    ("qwen3_8b_muon", "h100x8", (4,), True),  # the data-parallel rank the layer-wise optimizer gives the embedding
    ("kimi_k2_muon", "gb300x256", (0,), True),
    ("kimi_k2_adamw", "gb300x256", (0, 255), False),
    ("qwen3_30b_a3b_muon", "gb300x8", (0,), True),
    ("qwen3_30b_a3b_adamw", "gb300x8", (0,), False),
    ("qwen3_235b_a22b_muon", "h100x128", (0,), True),
    ("qwen3_235b_a22b_adamw", "h100x128", (0,), False),
], ids=lambda value: "rank" + "+".join(map(str, value)) if isinstance(value, tuple) else None)
def test_rehearsal_equals_plan(cpu_mode, recipe, layout, ranks, step):
    model = recipe.rsplit("_", 1)[0]
    for result in rehearse(recipe, layout=layout, ranks=ranks, step=step, activations=False):
        result = result.to_json()
        params, experts = HAND[model, result["coordinates"]["rank"]]
        assert (result["measured"]["params"], result["measured"]["expert_params"]) == (params, experts)
        _check(result, step=step)
        if step and (model, result["coordinates"]["rank"]) in HAND_NS:
            assert result["ns_flops"] == HAND_NS[model, result["coordinates"]["rank"]]


# The proxies at 2-process layouts: EP2 (dense DP2, expert DP1; the layer-wise Muon deals the dense matrices over
# 2 ranks, the distributed optimizer shards AdamW's), and PP2 with the Kimi K2 proxy's uneven stages.
GLOO_CASES = ["qwen3_moe_proxy_muon:cpu-ep2", "qwen3_moe_proxy_adamw:cpu-ep2", "kimi_k2_proxy_muon:cpu-pp2"]


@pytest.mark.stack
@pytest.mark.heavy
@pytest.mark.slow
def test_proxies_rehearsal_equals_a_real_two_process_gloo_run(tmp_path, cpu_mode):
    """One real iteration of ``nemo llm pretrain``'s path on 2 gloo processes (tests/rehearse_rank_driver.py,
    counting the live objects after the step) against the rehearsal of ranks 0 and 1 on fake tensors: every
    count equal, byte for byte (Adam's step counters included)."""
    launch_ranks(ROOT / "tests" / "rehearse_rank_driver.py", [tmp_path, *GLOO_CASES], ROOT, nproc=2, timeout=1800)
    real = {(r["recipe"], r["layout"], r["rank"]): r
            for rank in (0, 1) for r in json.loads((tmp_path / f"rank{rank}.json").read_text())}
    assert len(real) == 2 * len(GLOO_CASES)
    for case in GLOO_CASES:
        recipe, layout = case.split(":")
        for rehearsed in rehearse(recipe, layout=layout, ranks=(0, 1), step=True, activations=False):
            measured, rank = rehearsed.measured, rehearsed.coordinates.rank
            counted = real[recipe, layout, rank]
            for key in ("params", "expert_params", "grads", "main_params", "optimizer_state"):
                assert measured[key] == counted[key], (case, rank, key, measured[key], counted[key])
            assert measured["optimizer_state"] > 0, (case, rank)


# ------------------------------------------------------------------ one micro-batch: activations and model FLOPs
@pytest.mark.once
def test_live_bytes_counts_new_storages_until_they_die():
    """The tracker on plain tensors against a hand count: new storages count, views and in-place results do
    not, a freed storage stops counting, storages from before the window never count."""
    import torch

    from bridge_ext.rehearse.activations import LiveBytes

    before = torch.zeros(1000)  # 4,000 B, existing before: never counted
    with LiveBytes(square=8) as tracker:
        a = before * 2  # +4,000
        view = a[:10].view(2, 5)  # a view: +0
        a.add_(1)  # in place: +0
        b = torch.ones(8, 8, dtype=torch.float64)  # +512, an s x s tensor (s = 8)
        del a, view  # -4,000
        c = torch.empty(250, dtype=torch.int64)  # +2,000: current 2,512 < the peak 4,512
        del b
    assert (tracker.peak, tracker.square_at_peak, tracker.current) == (4_512, 512, 2_000)
    del c


def _proxy_hand_flops(recipe_name: str) -> tuple[int, int]:
    """(GEMMs, attention kernels) of one micro-batch forward + backward of a proxy at its 1-process layout, by hand
    from its config.json: 6 x (matmul parameters a token meets: attention, dense MLP, router, shared expert, top-k
    routed experts, output layer; no embedding, no norms) x tokens, and the core attention as the local path
    computes it: the whole s x s product, masked, 3 x 2 x tokens x seq x heads x (d_qk + d_v) per layer (the
    counter in docs/muon.md counts the causal half). The Kimi K2 proxy adds QK-clip's max-logit pass (forward only,
    without grad): 2 x tokens x seq x heads x d_qk per layer."""
    import json as _json

    config = _json.loads((ROOT / "recipes" / "hf_configs" / recipe_name.rsplit("_", 1)[0] / "config.json").read_text())
    h, heads, layers, vocab = (config[k] for k in ("hidden_size", "num_attention_heads", "num_hidden_layers",
                                                   "vocab_size"))
    tokens, seq = 4 * 128, 128  # layout cpu: MBS 4 x 128
    if "kv_lora_rank" in config:  # MLA (Kimi K2 proxy): q/kv down and up projections, output projection
        q, kv, nope, rope, v = (config[k] for k in ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim",
                                                    "qk_rope_head_dim", "v_head_dim"))
        attention = h * q + q * heads * (nope + rope) + h * (kv + rope) + kv * heads * (nope + v) + heads * v * h
        d_qk, d_v = nope + rope, v
        dense_layers = config["first_k_dense_replace"]
        experts, top_k, width = config["n_routed_experts"], config["num_experts_per_tok"], config["moe_intermediate_size"]
        shared = config["n_shared_experts"] * width
    else:  # GQA (Qwen3 proxies)
        d = config.get("head_dim") or h // heads
        attention = h * heads * d + 2 * h * config["num_key_value_heads"] * d + heads * d * h
        d_qk = d_v = d
        experts = config.get("num_experts")
        dense_layers = 0 if experts else layers
        top_k, width, shared = config.get("num_experts_per_tok"), config.get("moe_intermediate_size"), 0
    moe = h * experts + 3 * h * shared + top_k * 3 * h * width if experts else 0
    matmul = layers * attention + dense_layers * 3 * h * config["intermediate_size"] + (layers - dense_layers) * moe
    matmul += vocab * h  # output layer (untied)
    core = 6 * tokens * seq * heads * (d_qk + d_v) * layers
    if "kv_lora_rank" in config:
        core += 2 * tokens * seq * heads * d_qk * layers
    return 6 * matmul * tokens, core


def _real_micro_batch(recipe_name: str) -> Any:
    """The same micro-batch on real CPU tensors: the rank's model built as the rehearsal builds it (Megatron
    Bridge's provider, DDP), weights drawn N(0, 0.02), real routing; measured by the same tracker."""
    import torch

    from bridge_ext import patches
    from bridge_ext.rehearse.activations import micro_batch
    from bridge_ext.rehearse.one_rank import build_rank, rehearsal_config
    from bridge_ext.rehearse.fake import fake_process_group, initialize_parallel_state
    from recipes import get_recipe

    recipe = get_recipe(recipe_name)
    layout = recipe.layout(None)
    cfg, _ = rehearsal_config(recipe, layout=layout.cluster)
    with patches.temporarily("rehearse"), fake_process_group(rank=0, world_size=1):
        initialize_parallel_state(cfg.model, cfg.dist, num_distributed_optimizer_instances=1)
        model, _optimizer = build_rank(cfg, use_cpu_initialization=True)
        torch.manual_seed(0)
        with torch.no_grad():
            for chunk in model:
                for param in chunk.parameters():
                    param.normal_(0, 0.02)
        return micro_batch(model, micro_batch_size=layout.micro_batch_size, seq_length=layout.seq_length,
                           hidden_size=cfg.model.hidden_size, tp=1, cp=1, sequence_parallel=False,
                           dtype=torch.float32)


PROXIES = ["qwen3_proxy_muon", "qwen3_moe_proxy_muon", "kimi_k2_proxy_muon"]


@pytest.mark.stack  # the MoE proxies run the fake-balanced-moe-dispatch patch over megatron-core's permute
@pytest.mark.slow
@pytest.mark.parametrize("recipe", PROXIES)
def test_proxy_micro_batch_fake_equals_real_and_hand_flops(cpu_mode, recipe):
    """(a) The rehearsal's fake-tensor micro-batch (peak activation bytes, FLOPs) equals the same forward +
    backward on real tensors with real routing (the experts' load is balanced in the rehearsal, data-dependent in
    the real run: the proxies' 512 tokens x top-2 over 8 experts is 128 a piece when balanced, and the FLOPs and
    the bytes kept sum over experts); (b) the FLOPs equal the hand count exactly; (c) plan's numbers and ratios."""
    (rehearsed,) = rehearse(recipe, ranks=(0,), step=False)
    result = rehearsed.to_json()
    mb = result["micro_batch"]
    assert result["micro_batch_skipped"] is None and mb is not None
    assert (mb["micro_batch_size"], mb["seq_length"], mb["chunks"]) == (4, 128, 1)
    # the rank's routed experts at EP1 (megatron-core keeps them in the dense buffer, allreduce True), by hand from
    # config.json: 2 MoE layers x 8 experts x (gate, up, down) 48 x 64 on both MoE proxies
    experts = {"qwen3_proxy_muon": 0, "qwen3_moe_proxy_muon": 2 * 8 * 3 * 48 * 64,
               "kimi_k2_proxy_muon": (3 - 1) * 8 * 3 * 48 * 64}[recipe]
    assert result["measured"]["expert_params"] == result["planned"]["expert_params"] == experts
    assert result["measured"]["params"] == result["planned"]["params"]
    real = _real_micro_batch(recipe)
    assert mb["model_flops"] == real.flops
    # dense: equal to the byte; MoE: the two dispatch paths keep different routing bookkeeping (the real path's
    # masked_select keeps token-index and mask tensors the drop-and-pad path does not), measured 12,288 B per MoE
    # layer (three int64 vectors of the 512 tokens): that much at most, 0.12 % of the peak
    moe_layers = {"qwen3_proxy_muon": 0, "qwen3_moe_proxy_muon": 2, "kimi_k2_proxy_muon": 2}[recipe]
    assert 0 <= real.peak_bytes - mb["peak_activation_bytes"] <= moe_layers * 3 * 512 * 8
    assert mb["square_bytes"] == real.square_bytes > 0  # the local path's s x s scores and probabilities
    gemms, core = _proxy_hand_flops(recipe)
    assert mb["model_flops"] == gemms + core
    assert mb["flops_by_op"].get("aten.mm", 0) + mb["flops_by_op"].get("aten.addmm", 0) == gemms
    # (c) plan: Megatron Bridge's counter for one micro-batch (the whole model at the 1-process layout: plan's
    # per-step count x MBS / GBS) and plan's activation estimate for one micro-batch in flight (PP1: plan's own)
    from bridge_ext.plan import plan

    planned = plan(recipe)
    assert mb["planned_model_flops"] == pytest.approx(planned.model_flops_per_step * 4 / 8, rel=1e-12)
    assert mb["planned_activation_bytes"] == pytest.approx(planned.memory[planned.selected].activations, rel=1e-12)
    ratios = result["ratios"]
    assert ratios["model FLOPs, one micro-batch"] == pytest.approx(mb["model_flops"] / mb["planned_model_flops"])
    assert ratios["activations, one micro-batch"] == pytest.approx(
        mb["peak_activation_bytes"] / mb["planned_activation_bytes"])
    # the counter's causal attention is half the local path's s x s product; the router and QK-clip's pass are
    # not in it: within 6 % on the proxies (docs/launch.md has each)
    assert 0.95 < ratios["model FLOPs, one micro-batch"] < 1.06


@pytest.mark.stack
@pytest.mark.slow
def test_rehearse_command_reports_the_micro_batch_beside_plan(nemo, cpu_mode):
    """The text output has the micro-batch rows with plan's number and the ratio; --no-activations drops them."""
    done = nemo(["llm", "rehearse", "--recipe", "qwen3_proxy_muon", "--no-step"])
    assert done.code == 0, done.stderr[-2000:]
    rows = {line[:32].strip(): line[32:].split() for line in done.stdout.splitlines() if line.startswith("  ")}
    measured, unit, planned, unit2, ratio = rows["activations, one micro-batch"]
    assert unit == unit2 == "MiB" and float(ratio) == pytest.approx(float(measured) / float(planned), abs=2e-3)
    measured, planned, ratio = rows["model FLOPs, one micro-batch"]
    assert float(ratio) == pytest.approx(float(measured) / float(planned), abs=2e-4)
    assert "attention DotProductAttention" in done.stdout
    skipped = nemo(["llm", "rehearse", "--recipe", "qwen3_proxy_muon", "--no-step", "--no-activations", "--json"])
    assert skipped.code == 0, skipped.stderr[-2000:]
    (result,) = json.loads(skipped.stdout)
    assert result["micro_batch"] is None and "activations, one micro-batch" not in result["ratios"]


@pytest.mark.slow
def test_qwen3_8b_rank0_micro_batch_by_hand(cpu_mode):
    """Qwen3-8B h100x8 rank 0 (TP4 with sequence parallelism, MBS 1 x 4096, bf16): the micro-batch's FLOPs and its
    s x s bytes by hand (config.json: 36 layers, 32 heads of 128, 8 KV groups, FFN 12,288, vocabulary 151,936), and
    plan's rows. 16 s for the micro-batch on the loaded 2-core machine (the build and step as before)."""
    (rehearsed,) = rehearse("qwen3_8b_muon", layout="h100x8", ranks=(0,), step=False)
    mb = rehearsed.micro_batch
    assert rehearsed.micro_batch_skipped is None and mb is not None
    tokens, seq, layers, tp, h = 4096, 4096, 36, 4, 4096
    # GEMM parameters of the TP rank: QKV, out, fc1 (gate + up) and fc2 over TP4, the output layer's vocab shard
    matmul = layers * ((32 + 2 * 8) * 128 * h + 32 * 128 * h + 3 * 12288 * h) // tp + 151936 * h // tp
    core = 6 * tokens * seq * (32 // tp) * (128 + 128) * layers  # the local path's whole s x s, fwd + 2 bwd
    assert mb["flops_by_op"]["aten.mm"] == 6 * matmul * tokens
    assert mb["model_flops"] == 6 * matmul * tokens + core
    # Megatron Bridge's counter for the rank counts the causal half of the s x s products: the rest is equal
    assert mb["planned_model_flops"] == pytest.approx(6 * matmul * tokens + core / 2, rel=1e-3)
    # DotProductAttention keeps, per layer, the bf16 softmax probabilities [1, 8, s, s] and a bool causal mask
    # [s, s] (the 268 MB scores buffer is one, shared, and flat)
    assert mb["square_bytes"] == layers * (1 * (32 // tp) * seq * seq * 2 + seq * seq) == 10_267_656_192
    # the tensors plan counts are there at plan's sizes (by hand, per rank: 4,096 tokens at TP4 widths; plan's
    # per-token terms over the 1,024 sequence-parallel tokens): fc1's output (2 x FFN / TP), the SwiGLU output
    # (fc2's input, FFN / TP), the norms' bf16 outputs (hidden, over SP), the fp32 logits (vocab / TP)
    by_op = mb["peak_by_op"]
    assert by_op["decoder.layers.*.mlp.linear_fc1: aten.mm bfloat16"] == layers * tokens * 2 * 12288 // tp * 2
    assert by_op["decoder.layers.*.mlp: aten.mul bfloat16"] == layers * tokens * 12288 // tp * 2
    for norm in ("input_layernorm", "pre_mlp_layernorm"):
        assert by_op[f"decoder.layers.*.{norm}: aten._to_copy bfloat16"] == layers * tokens // tp * h * 2
    assert by_op["module: aten._to_copy float32"] == tokens * 151936 // tp * 4
    # plan (flash attention: no s x s tensors; fused norms and SwiGLU): 5.30 GiB; without the s x s tensors the
    # local path keeps 2.05 x that (docs/launch.md itemizes it: fp32 norm copies, unfused SwiGLU, q/k/v copies)
    assert mb["planned_activation_bytes"] == pytest.approx(5_689_049_088, rel=1e-6)
    ratios = rehearsed.to_json()["ratios"]
    assert ratios["  activations less s x s"] == pytest.approx(2.053, rel=0.01)
    assert ratios["activations, one micro-batch"] == pytest.approx(3.858, rel=0.01)


@pytest.mark.slow
def test_a_micro_batch_that_cannot_run_is_reported_not_failed(cpu_mode, monkeypatch):
    """A forward that fails on fake tensors leaves the rank's other rows and says why, in the text and --json."""
    from bridge_ext.rehearse import activations, format_rehearsal

    def refuses(*args, **kwargs):
        raise RuntimeError("aten.nonzero: data-dependent output shape\nsecond line")

    monkeypatch.setattr(activations, "micro_batch", refuses)
    (rehearsed,) = rehearse("qwen3_proxy_muon", ranks=(0,), step=False)
    result = rehearsed.to_json()
    assert result["micro_batch"] is None
    assert result["micro_batch_skipped"] == "RuntimeError: aten.nonzero: data-dependent output shape"
    assert "not measured: RuntimeError: aten.nonzero" in format_rehearsal(rehearsed)
    assert result["measured"]["params"] == result["planned"]["params"] == 622_976


@pytest.mark.slow
def test_qwen3_235b_rank0_micro_batch_flops_by_hand(cpu_mode):
    """Qwen3-235B-A22B h100x128 rank 0 (TP2 with sequence parallelism, EP16, ETP1; 11 layers, MBS 1 x 4096;
    selective recompute of core_attn): the routed experts' FLOPs are 1/TP of the micro-batch's (the rank enters the
    MoE layer with its 2,048 sequence-parallel tokens, the allgather dispatcher gathers the ETP x EP group's, 16 x
    2,048, and its 8 of 128 experts get 8 x 2,048 x 16 / 128 = 2,048 each); the recomputed core attention runs its
    forward twice. By hand from config.json (64 heads of 128, 4 KV groups, hidden 4,096, 128 experts of 1,536,
    top-8)."""
    (rehearsed,) = rehearse("qwen3_235b_a22b_muon", layout="h100x128", ranks=(0,), step=False)
    mb = rehearsed.micro_batch
    assert rehearsed.micro_batch_skipped is None and mb is not None
    tokens, seq, layers, tp, h, heads = 4096, 4096, 11, 2, 4096, 64
    attention = ((heads + 2 * 4) * 128 * h + heads * 128 * h) // tp  # QKV and out, TP rank's shard
    router = h * 128  # replicated, on the rank's 2,048 sequence-parallel tokens
    experts = 3 * h * 1536  # per routed token, ETP1
    gemms = 6 * layers * (attention * tokens + router * tokens // tp + experts * tokens * 8 // tp)
    assert mb["flops_by_op"]["aten.mm"] == gemms
    core_forward = 2 * 2 * tokens * seq * (heads // tp) * 128  # QK^T and PV over the whole s x s
    assert mb["model_flops"] == gemms + layers * (3 * core_forward + core_forward)  # + the recomputed forward
    # Megatron Bridge's counter for the rank (1/TP of the 11 layers' terms): no router, the causal half of the
    # attention once, no recomputation
    assert mb["planned_model_flops"] == pytest.approx(
        gemms - 6 * layers * router * tokens // tp + layers * 3 * core_forward / 2, rel=2e-3)


@pytest.mark.once
@pytest.mark.parametrize("recipe, layout", [("kimi_k2_muon", "gb300x256"), ("qwen3_235b_a22b_muon", "h100x128"),
                                            ("kimi_k2_proxy_muon", "cpu-pp2"), ("qwen3_8b_muon", "h100x8")])
def test_plan_rank_flops_add_up_to_the_counter(recipe, layout):
    """plan's micro-batch FLOPs per rank (what the rehearsal compares with), summed over the pipeline stages and
    the TP x CP ranks of a stage, are Megatron Bridge's count for one micro-batch of the whole model."""
    from bridge_ext.plan import pipeline_ranks
    from bridge_ext.plan.flops import model_flops_on_rank, model_flops_per_step
    from bridge_ext.plan.memory import holds_logits
    from recipes import get_recipe

    chosen = get_recipe(recipe)
    arch, lay = chosen.model.architecture, chosen.layout(layout)
    stages = pipeline_ranks(chosen, lay, spec="te")
    assert sum(holds_logits(arch, lay, stage) for stage in stages) == 1
    per_rank = [model_flops_on_rank(arch, layers=stage.layers, logits=holds_logits(arch, lay, stage),
                                    seq_length=lay.seq_length, tp=lay.tp, cp=lay.cp,
                                    micro_batch_size=lay.micro_batch_size) for stage in stages]
    whole = model_flops_per_step(arch, seq_length=lay.seq_length, tp=lay.tp, global_batch_size=lay.micro_batch_size)
    assert sum(per_rank) * lay.tp * lay.cp == pytest.approx(whole, rel=1e-9)
