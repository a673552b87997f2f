"""Moonlight-16B-A3B, Muon's own model ("Muon is Scalable for LLM Training", arXiv 2502.16982): the shipped
config, the ``moonlight_16b`` preset, the layouts and the run length against numbers typed here from the paper
and the released ``config.json`` (never read from the package); the dry run and the plan of its 8-GPU layouts;
its SFT / LoRA twins; the CPU proxy (MLA without a query low-rank, MoE with a dense first layer) training with
Muon and AdamW and resuming bit for bit.
"""

from __future__ import annotations

import math

import pytest

import recipes
from recipes.finetune import FINETUNE_RECIPES
from recipes.models import MODELS
from recipes.optimizers import PRESETS

# ------------------------------------------------------------------------- typed from the sources
# Released config.json of moonshotai/Moonlight-16B-A3B (model_type deepseek_v3, auto_map into remote code).
RELEASED = {
    "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "hidden_size": 2048,
    "num_hidden_layers": 27, "num_attention_heads": 16, "num_key_value_heads": 16, "intermediate_size": 11264,
    "moe_intermediate_size": 1408, "n_routed_experts": 64, "n_shared_experts": 2, "num_experts_per_tok": 6,
    "first_k_dense_replace": 1, "moe_layer_freq": 1, "n_group": 1, "topk_group": 1, "topk_method": "noaux_tc",
    "scoring_func": "sigmoid", "norm_topk_prob": True, "routed_scaling_factor": 2.446, "q_lora_rank": None,
    "kv_lora_rank": 512, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128,
    "vocab_size": 163840, "max_position_embeddings": 8192, "rope_theta": 50000.0, "rms_norm_eps": 1e-5,
    "tie_word_embeddings": False, "num_nextn_predict_layers": 0, "aux_loss_alpha": 0.001,
    "bos_token_id": 163584, "eos_token_id": 163585,
}
# The paper, section by section.
PAPER = {
    # sec. 2.2, eq. 4: W <- W - lr (0.2 O sqrt(max(A, B)) + wd W); "Other Hyper-parameters": N = 5, momentum 0.95
    "update_rms_scale": 0.2, "ns_steps": 5, "momentum": 0.95,
    # sec. 3.3, "Pretraining": weight decay 0.1 in all stages; stage 1 (0 to 33 B tokens): lr rises linearly to
    # 4.2e-4 in 2k steps, batch 2048 examples; stage 2 (33 B to 5.2 T): cosine from 4.2e-4 to 4.2e-5, batch 2048
    # until 200 B tokens, then 4096; stage 3 (5.2 T to 5.7 T): up to 1e-4 in 100 steps, then linear to 0
    "weight_decay": 0.1, "peak_lr": 4.2e-4, "min_lr": 4.2e-5, "warmup_steps": 2000, "stage1_tokens": 33e9,
    "stage1_batch": 2048, "batch": 4096, "stage2_end_tokens": 5.2e12, "total_tokens": 5.7e12,
    # sec. 3.3: aux-free bias update rate 1e-3 in stages 1 and 2; "maximum context length ... is 8K"
    "bias_update_rate": 1e-3, "context": 8192,
    # sec. 3.3, "Model Architecture": 2.24 B activated, 15.29 B total without the embedding (3 B / 16 B with it)
    "active_b": 2.24, "total_b": 15.29,
    # appendix C: gate scaling factor 2.446, no multi-token prediction
    "gate_scaling": 2.446,
    # sec. 3.5.1: Moonlight's SFT, lr 5e-5 decaying linearly to 0
    "sft_lr": 5e-5,
}
FULL, PROXY = "moonlight_16b_a3b", "moonlight_proxy"


# ------------------------------------------------------------------------------------- config
def test_shipped_config_is_the_released_one():
    shipped = MODELS[FULL].hf_config
    assert {key: shipped.get(key, "<absent>") for key in RELEASED} == RELEASED
    assert shipped["auto_map"]["AutoModelForCausalLM"] == "modeling_deepseek.DeepseekV3ForCausalLM"
    assert shipped["routed_scaling_factor"] == PAPER["gate_scaling"] and shipped["num_nextn_predict_layers"] == 0


def test_parameter_counts_are_the_papers():
    """Sec. 3.3 counts without the input embedding and the output layer (vocab x hidden each)."""
    spec = MODELS[FULL]
    edges = 2 * RELEASED["vocab_size"] * RELEASED["hidden_size"]
    assert round((spec.params.total - edges) / 1e9, 2) == PAPER["total_b"]
    assert round((spec.params.active - edges) / 1e9, 2) == PAPER["active_b"]
    arch = spec.architecture
    assert arch.dense_layers == (0,) and arch.moe_layers == tuple(range(1, 27))
    assert arch.mla.q_lora_rank is None and arch.moe.shared_experts == 2 and arch.moe.expert_bias


def test_proxy_has_the_same_keys_and_shape_family():
    full, proxy = MODELS[FULL].hf_config, MODELS[PROXY].hf_config
    assert set(full) == set(proxy)
    same = ("architectures", "model_type", "q_lora_rank", "first_k_dense_replace", "moe_layer_freq", "n_shared_experts",
            "scoring_func", "topk_method", "norm_topk_prob", "routed_scaling_factor", "tie_word_embeddings", "auto_map")
    assert {k: proxy[k] for k in same} == {k: full[k] for k in same}
    arch = MODELS[PROXY].architecture
    assert arch.dense_layers == (0,) and len(arch.moe_layers) == 2 and MODELS[PROXY].params.total < 1e6


# ------------------------------------------------------------------------------------- preset
def test_preset_is_the_papers_run():
    recipe = recipes.get_recipe(f"{FULL}_muon")
    preset = recipe.preset
    assert preset.name == "moonlight_16b" and preset.kind == "muon"
    o, s = preset.optimizer, preset.scheduler
    assert (o["lr"], o["min_lr"]) == (PAPER["peak_lr"], PAPER["min_lr"])
    assert (s["lr_warmup_iters"], s["lr_warmup_init"], s["lr_decay_style"]) == (PAPER["warmup_steps"], 0.0, "cosine")
    assert o["weight_decay"] == s["start_weight_decay"] == s["end_weight_decay"] == PAPER["weight_decay"]
    assert (o["muon_momentum"], o["muon_num_ns_steps"]) == (PAPER["momentum"], PAPER["ns_steps"])
    assert o["muon_extra_scale_factor"] == PAPER["update_rms_scale"] and o["muon_scale_mode"] == "spectral"
    # the AdamW twin is the paper's Moonlight-A: the same settings with AdamW
    twin = recipes.get_recipe(recipe.twin).preset
    assert twin.kind == "adamw" and dict(twin.scheduler) == dict(s)
    assert (twin.optimizer["lr"], twin.optimizer["min_lr"], twin.optimizer["weight_decay"]) == (
        PAPER["peak_lr"], PAPER["min_lr"], PAPER["weight_decay"])


@pytest.mark.parametrize(("rows", "cols"), [(1408, 2048), (2048, 1408), (16 * 192, 2048), (2048, 16 * 128),
                                            (64, 2048), (576, 2048)])
def test_update_scale_is_0p2_sqrt_max_dims_in_the_installed_muon(rows, cols):
    """Eq. 4's 0.2 sqrt(max(A, B)) from the preset's two fields, through emerging-optimizers' own scale function,
    on Moonlight's matrix shapes (expert up/down, q, o, router, kv down-projection)."""
    from emerging_optimizers.orthogonalized_optimizers.muon import get_muon_scale_factor

    o = PRESETS["moonlight_16b"].optimizer
    scale = get_muon_scale_factor(rows, cols, mode=o["muon_scale_mode"]) * o["muon_extra_scale_factor"]
    assert scale == pytest.approx(PAPER["update_rms_scale"] * math.sqrt(max(rows, cols)), rel=1e-12)


def test_run_length_batch_and_sequence():
    recipe = recipes.get_recipe(f"{FULL}_muon")
    for layout in recipe.layouts.values():
        assert (layout.global_batch_size, layout.seq_length) == (PAPER["batch"], PAPER["context"])
        run = recipe.run_length(layout.cluster)
        assert run.train_iters == math.ceil(PAPER["stage2_end_tokens"] / (PAPER["batch"] * PAPER["context"]))
        assert run.warmup_iters == PAPER["warmup_steps"]
    # the paper's 2k warm-up steps are its 33 B tokens at stage 1's 2048 x 8K batch
    assert abs(PAPER["warmup_steps"] * PAPER["stage1_batch"] * PAPER["context"] / PAPER["stage1_tokens"] - 1) < 0.02
    assert recipe.model.provider == {"moe_router_bias_update_rate": PAPER["bias_update_rate"]}


def test_finetune_twins():
    for mode in ("sft", "lora"):
        muon, adamw = FINETUNE_RECIPES[f"{FULL}_{mode}_muon"], FINETUNE_RECIPES[f"{FULL}_{mode}_adamw"]
        assert muon.twin == adamw.name and (muon.preset.kind, adamw.preset.kind) == ("muon", "adamw")
        assert muon.layouts.keys() == recipes.get_recipe(f"{FULL}_muon").layouts.keys()
        assert FINETUNE_RECIPES[f"{PROXY}_{mode}_muon"].base == f"{PROXY}_muon"
    sft = FINETUNE_RECIPES[f"{FULL}_sft_muon"].preset
    assert (sft.optimizer["lr"], sft.optimizer["min_lr"], sft.scheduler["lr_decay_style"]) == (PAPER["sft_lr"], 0.0,
                                                                                               "linear")
    assert FINETUNE_RECIPES[f"{FULL}_sft_adamw"].preset.optimizer["lr"] == PAPER["sft_lr"]
    assert FINETUNE_RECIPES[f"{FULL}_lora_muon"].lora["dim"] == 32


# ------------------------------------------------------------------------------------- plan
@pytest.mark.parametrize(("layout", "gpus"), [("h100x8", ("H100", "H200")), ("gb300x8", ("GB300",)),
                                              ("h100x16", ("H100", "H200"))])
def test_plan_fits_each_layout(layout, gpus):
    from bridge_ext.plan import plan

    for name in (f"{FULL}_muon", f"{FULL}_adamw"):
        p = plan(name, layout=layout)
        verdicts = p.verdicts()
        assert all(verdicts[gpu] == "fits" for gpu in gpus), (name, layout, verdicts)
        m = p.memory[p.selected]
        parts = (m.weights, m.grads, m.main_params, m.optimizer_state, m.activations)
        assert all(part > 0 for part in parts) and m.total == pytest.approx(sum(parts))
        assert p.tokens_per_step == PAPER["batch"] * PAPER["context"]
    assert plan(f"{FULL}_muon", layout=layout).selected == "dist_muon"


# ------------------------------------------------------------------------------------- dry run
@pytest.mark.slow
@pytest.mark.stack
def test_dry_run_validates(nemo):
    result = nemo(["llm", "pretrain", "--recipe", f"{FULL}_muon", "--dryrun"])
    assert result.code == 0, result.stderr[-2000:]
    summary = result.stdout.partition("---\n")[0]
    assert "TP2 PP1 VP1 EP8 ETP1 CP1 DP4 on 8 GPUs" in summary and "global 4096, micro 1, seq 8192" in summary
    assert "dist_muon lr=0.00042 min_lr=4.2e-05 wd=0.1" in summary and "extra_scale_factor=0.2" in summary


# ------------------------------------------------------------------------------------- the CPU proxy
def _losses(nemo, tmp_path, name: str, run: str, *, load: str | None = None, step: int | None = None
            ) -> dict[int, float]:
    """Train ``name`` to iteration 8 in ``tmp_path/run`` (saving at 4 and 8), from ``load`` at ``step`` if given."""
    from bridge_ext.training import read_losses

    out = tmp_path / run
    result = nemo(["llm", "pretrain", "--recipe", name, "--device", "cpu", "train.train_iters=8",
                   f"checkpoint.save={out}/ckpt", f"checkpoint.load={tmp_path / (load or run)}/ckpt",
                   "checkpoint.save_interval=4", f"logger.tensorboard_dir={out}/tb",
                   *([f"checkpoint.ckpt_step={step}"] if step else [])], cwd=tmp_path)
    assert result.code == 0, result.stderr[-3000:]
    return read_losses(out / "ckpt" / "losses.jsonl")


@pytest.mark.slow
def test_proxy_trains_with_both_optimizers_and_resumes_bit_exact(nemo, tmp_path):
    straight = _losses(nemo, tmp_path, f"{PROXY}_muon", "straight")
    assert list(straight) == list(range(1, 9)) and straight[8] < straight[1] - 0.5  # ln(4096) = 8.3 at the start
    # the straight run's iteration-4 checkpoint, resumed in a new run: iterations 5-8 again, bit for bit (the
    # losses are the floats Megatron reported)
    resumed = _losses(nemo, tmp_path, f"{PROXY}_muon", "resumed", load="straight", step=4)
    assert resumed == {i: straight[i] for i in range(5, 9)}
    adamw = _losses(nemo, tmp_path, f"{PROXY}_adamw", "adamw")
    assert adamw[8] < adamw[1] - 0.3 and adamw != straight


# ------------------------------------------------------------------------------------- HF import / export
FP32_TOLERANCE = 1e-5  # Megatron vs transformers logits in fp32 (tests/test_convert.py's bar)


@pytest.mark.stack  # conversion is Megatron Bridge's DeepSeek-V3 bridge and transformers' classes: per release
@pytest.mark.slow
def test_hf_round_trip_and_recipe_cycle_without_remote_code(nemo, tmp_path):
    """A random model of the proxy's config (Moonlight's keys: model_type deepseek_v3, auto_map into remote code,
    no query low-rank, 2 shared experts, a dense first layer) HF -> import --verify -> export: every tensor bit for
    bit, the config's bytes, Megatron's logits = transformers'; transformers loads the export with its own
    DeepSeek-V3 class (no remote code). Then the imported checkpoint trains with the proxy recipe (lr 0) and the
    run exports, found by its sizes, to the same weights."""
    import json

    import torch
    from transformers import AutoModelForCausalLM

    from bridge_ext import convert
    from bridge_ext.convert import export_hf, find_iteration, import_hf
    from tests.hf_fixtures import write_hf_dir

    shipped = MODELS[PROXY].config_dir / "config.json"
    raw = json.loads(shipped.read_text())
    hf = write_hf_dir(tmp_path / "hf", raw, dtype=raw["torch_dtype"], config_json=raw, seed=3, shard_bytes=200_000)
    imported = import_hf(hf, tmp_path / "mg", verify=True, tolerance=FP32_TOLERANCE, progress=False, console=None)
    assert imported.max_logit_diff is not None and imported.max_logit_diff <= FP32_TOLERANCE
    export_hf(tmp_path / "mg", tmp_path / "out", progress=False, console=None)
    source, exported = _tensors(hf), _tensors(tmp_path / "out")
    assert sorted(source) == sorted(exported) and any(".mlp.shared_experts." in k for k in source)
    assert all(exported[k].view(torch.uint8).equal(v.view(torch.uint8)) for k, v in source.items())
    assert (tmp_path / "out" / "config.json").read_bytes() == shipped.read_bytes()  # auto_map kept, not run

    model, original = (AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32) for d in (tmp_path / "out", hf))
    assert type(model).__module__.startswith("transformers.models.deepseek_v3.")  # transformers' own class
    ids = torch.randint(0, raw["vocab_size"], (2, 12), generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        logits = model(ids).logits
        assert (logits - original(ids).logits).abs().max() <= 1e-6 and logits.abs().max() > 0.1

    result = nemo(["llm", "pretrain", "--recipe", f"{PROXY}_muon", "--device", "cpu", "train.train_iters=2",
                   "optimizer.lr=0", "optimizer.min_lr=0", "model.moe_router_bias_update_rate=0",
                   f"checkpoint.pretrained_checkpoint={tmp_path / 'mg'}", f"checkpoint.save={tmp_path / 'run'}",
                   "checkpoint.save_interval=2"], cwd=tmp_path)
    assert result.code == 0, result.stderr[-3000:]
    assert f"successfully loaded checkpoint from {tmp_path / 'mg'}" in result.stdout + result.stderr
    iter_dir, number = find_iteration(tmp_path / "run")
    assert number == 2
    export_hf(tmp_path / "run", tmp_path / "run_hf", progress=False, console=None)
    assert (tmp_path / "run_hf" / "config.json").read_bytes() == shipped.read_bytes()  # recognized by its sizes
    trained = _tensors(tmp_path / "run_hf")
    assert sorted(trained) == sorted(source) and all(trained[k].equal(v) for k, v in source.items())
    assert convert.verify_logits(tmp_path / "run_hf", iter_dir) <= FP32_TOLERANCE


def _tensors(directory) -> dict:
    from safetensors.torch import load_file

    out = {}
    for file in sorted(directory.glob("*.safetensors")):
        out.update(load_file(file))
    return out
