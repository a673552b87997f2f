"""Megatron Bridge's real ``pretrain()`` on CPU: tiny Qwen3, Qwen3-MoE and DeepSeek-V3/Kimi-K2-style models.

Everything runs in this process through ``megatron.bridge.training.pretrain.pretrain`` with
``gpt_step.forward_step``, mock data and the NullTokenizer; CPU mode supplies only the patches.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch

from bridge_ext.cpu import configure_for_cpu
from bridge_ext.process_state import init_single_process_distributed, reset_megatron_globals

pytestmark = pytest.mark.stack  # training, checkpoint save and resume: .ci/run runs these on every stack

VOCAB = 256
SEQ = 64


def tiny_hf_config(family: str):
    """A tiny transformers config of one model family (random weights are built from it)."""
    from transformers import DeepseekV3Config, Qwen3Config, Qwen3MoeConfig

    common = dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                  max_position_embeddings=4 * SEQ, rms_norm_eps=1e-6)
    if family == "qwen3":  # dense, GQA, QK-norm
        return Qwen3Config(**common, intermediate_size=128, num_key_value_heads=2, head_dim=16,
                           tie_word_embeddings=True, architectures=["Qwen3ForCausalLM"])
    if family == "qwen3_moe":
        return Qwen3MoeConfig(**common, intermediate_size=128, moe_intermediate_size=32, num_experts=4,
                              num_experts_per_tok=2, num_key_value_heads=2, head_dim=16,
                              architectures=["Qwen3MoeForCausalLM"])
    if family == "deepseek_v3":  # Kimi-K2 style: MLA, sigmoid router + expert bias, shared expert, dense first layer
        return DeepseekV3Config(**common, intermediate_size=128, moe_intermediate_size=32, n_routed_experts=4,
                                num_experts_per_tok=2, n_shared_experts=1, first_k_dense_replace=1,
                                num_key_value_heads=4, q_lora_rank=32, kv_lora_rank=16, qk_nope_head_dim=16,
                                qk_rope_head_dim=8, v_head_dim=16, n_group=1, topk_group=1,
                                scoring_func="sigmoid", topk_method="noaux_tc", rope_scaling=None,
                                architectures=["DeepseekV3ForCausalLM"])
    raise ValueError(family)


def tiny_config(family: str, optimizer: str, iters: int, *, save: Path | None = None, load: Path | None = None,
                save_interval: int | None = None, exit_interval: int | None = None, lr: float = 3e-3):
    """A full ConfigContainer for ``family`` with Muon or AdamW, configured for CPU."""
    from megatron.bridge import AutoBridge
    from megatron.bridge.training.config import (
        CheckpointConfig, ConfigContainer, LoggerConfig, MockGPTDatasetConfig, OptimizerConfig, RNGConfig,
        SchedulerConfig, TokenizerConfig, TrainingConfig,
    )

    model = AutoBridge.from_hf_config(tiny_hf_config(family)).to_megatron_provider(load_weights=False)
    model.seq_length = SEQ
    common = dict(lr=lr, min_lr=lr / 10, weight_decay=0.1, clip_grad=1.0, bf16=False)
    if optimizer == "muon":
        from bridge_ext.upstream_api import installed_optimizer_fields

        muon = installed_optimizer_fields("tiny", dict(  # megatron-core 0.19's names -> the installed release's
            muon_momentum=0.95, muon_nesterov=True, muon_scale_mode="spectral", muon_fp32_matmul_prec="medium",
            muon_num_ns_steps=5, muon_tp_mode="blockwise", muon_extra_scale_factor=0.2, muon_split_qkv=True))
        opt = OptimizerConfig(optimizer="dist_muon", **common, **muon)
    else:
        opt = OptimizerConfig(optimizer="adam", **common, adam_beta1=0.9, adam_beta2=0.95, adam_eps=1e-8)
    cfg = ConfigContainer(
        model=model,
        train=TrainingConfig(train_iters=iters, global_batch_size=4, micro_batch_size=4, eval_interval=10_000,
                             eval_iters=0, exit_interval=exit_interval),
        optimizer=opt,
        scheduler=SchedulerConfig(lr_decay_style="cosine", lr_warmup_iters=2, lr_decay_iters=40,
                                  start_weight_decay=0.1, end_weight_decay=0.1, weight_decay_incr_style="constant"),
        dataset=MockGPTDatasetConfig(seq_length=SEQ, random_seed=1234, reset_attention_mask=False,
                                     reset_position_ids=False, eod_mask_loss=False, num_dataset_builder_threads=1,
                                     split="1,0,0", dataloader_type="single", num_workers=0),
        logger=LoggerConfig(log_interval=10_000),
        tokenizer=TokenizerConfig(tokenizer_type="NullTokenizer", vocab_size=VOCAB),
        checkpoint=CheckpointConfig(save=str(save) if save else None, load=str(load) if load else None,
                                    save_interval=save_interval, ckpt_format="torch_dist"),
        rng=RNGConfig(seed=1234),
    )
    configure_for_cpu(cfg)
    return cfg


@dataclass
class Run:
    losses: list[float] = field(default_factory=list)
    params: dict[str, torch.Tensor] = field(default_factory=dict)
    buffers: dict[str, torch.Tensor] = field(default_factory=dict)  # e.g. the routers' expert_bias
    optimizer_state: dict[str, dict[str, torch.Tensor]] = field(default_factory=dict)  # param name -> state


def train(cfg: Any, into: Run | None = None) -> Run:
    """Run ``pretrain()`` and return per-iteration losses and the final parameters and optimizer state."""
    from megatron.bridge.training.callbacks import Callback
    from megatron.bridge.training.gpt_step import forward_step
    from megatron.bridge.training.pretrain import pretrain

    run = into if into is not None else Run()

    class Record(Callback):
        def on_train_step_end(self, context):
            run.losses.append(float(context.loss_dict["lm loss"]))

        def on_train_end(self, context):
            names = {id(p): n for n, p in context.model[0].named_parameters()}
            run.params = {n: p.detach().clone() for n, p in context.model[0].named_parameters()}
            run.buffers = {n: b.detach().clone() for n, b in context.model[0].named_buffers()}
            for opt in context.optimizer.chained_optimizers:
                for param, state in opt.optimizer.state.items():
                    # FP32Optimizer steps the model params themselves (no main-param copies on CPU/fp32)
                    run.optimizer_state[names[id(param)]] = {k: v.clone() for k, v in state.items()
                                                            if torch.is_tensor(v)}

    reset_megatron_globals()  # whatever earlier tests in this process left behind
    # an in-memory gloo group instead of pretrain()'s TCP rendezvous: concurrent runs cannot collide
    init_single_process_distributed()
    try:
        pretrain(cfg, forward_step, callbacks=[Record()])
    finally:  # also after sys.exit (exit_interval), which skips train._finish_train
        reset_megatron_globals()
        torch.distributed.destroy_process_group()
    return run


def _check_trains(run: Run, iters: int) -> None:
    assert len(run.losses) == iters
    assert all(math.isfinite(x) for x in run.losses)
    assert run.losses[0] > math.log(VOCAB) - 0.3  # random init starts near uniform
    assert run.losses[-1] < run.losses[0] - 0.5, run.losses


@pytest.mark.slow
@pytest.mark.parametrize("family", ["qwen3", "qwen3_moe", "deepseek_v3"])
def test_pretrain_muon_decreases_loss(cpu_mode, family):
    run = train(tiny_config(family, "muon", 12))
    _check_trains(run, 12)
    momentum = [s["momentum_buffer"] for s in run.optimizer_state.values() if "momentum_buffer" in s]
    assert momentum and all(m.abs().sum() > 0 for m in momentum)  # Muon really stepped the matrices
    if family == "deepseek_v3":  # the sigmoid router's expert bias is updated from the expert load
        biases = [b for n, b in run.buffers.items() if n.endswith("expert_bias")]
        assert biases and all(b.abs().sum() > 0 for b in biases)


@pytest.mark.slow
def test_pretrain_adamw_decreases_loss(cpu_mode):
    run = train(tiny_config("deepseek_v3", "adam", 12))
    _check_trains(run, 12)
    assert not any("momentum_buffer" in s for s in run.optimizer_state.values())
    assert all("exp_avg_sq" in s for s in run.optimizer_state.values())


@pytest.mark.slow
@pytest.mark.parametrize("family", ["qwen3", "deepseek_v3"])
def test_resume_is_bit_exact(cpu_mode, tmp_path, family):
    n = 4
    straight = train(tiny_config(family, "muon", 2 * n))
    # the same 2N-iteration run (same LR schedule) stopped after N by Megatron's exit_interval (sys.exit(0))
    first_cfg = tiny_config(family, "muon", 2 * n, save=tmp_path / "ckpt", save_interval=n, exit_interval=n)
    first = Run()
    with pytest.raises(SystemExit) as exit_info:
        train(first_cfg, into=first)
    assert exit_info.value.code == 0
    assert (tmp_path / "ckpt" / "latest_checkpointed_iteration.txt").read_text().strip() == str(n)
    resumed = train(tiny_config(family, "muon", 2 * n, save=tmp_path / "ckpt", load=tmp_path / "ckpt",
                                save_interval=n))

    assert first.losses + resumed.losses == straight.losses  # bit-exact, not approximately
    assert straight.params.keys() == resumed.params.keys()
    for name, value in straight.params.items():
        assert torch.equal(value, resumed.params[name]), name
    for name, value in straight.buffers.items():
        assert torch.equal(value, resumed.buffers[name]), name
    muon_states = [k for k, s in straight.optimizer_state.items() if "momentum_buffer" in s]
    assert muon_states
    assert straight.optimizer_state.keys() == resumed.optimizer_state.keys()
    for name, state in straight.optimizer_state.items():
        for key, value in state.items():
            assert torch.equal(value, resumed.optimizer_state[name][key]), (name, key)
