"""CPU mode: its patches still fit upstream, it refuses stacks it was not written for, models run on CPU."""

from __future__ import annotations

import dataclasses
import importlib
import math
import sys
from importlib import metadata

import pytest
import torch

from bridge_ext import cpu_mode as cm
from bridge_ext.hf import apply_config_stated_fields
from bridge_ext.stack import UpstreamDrift, have_transformer_engine
from bridge_ext.patches.import_time import MISSING_TE, guard_source, guarded_modules

pytestmark = pytest.mark.stack  # CPU-mode fixes, matched by content in each stack: .ci/run runs these on every stack


def test_every_patch_target_matches_upstream():
    assert cm.check_patch_targets() == []


def test_every_target_is_code_that_needs_the_patch():
    """A redirect is only justified by CUDA code in that module; a .cuda() caller by a .cuda( call."""
    for module, snippets in cm._TORCH_ON_CPU.items():
        assert snippets, module
        assert all("cuda" in code or "nccl" in code for code in snippets), module
    for module, snippets in cm._TENSOR_CUDA_CALLERS.items():
        assert all(".cuda(" in code for code in snippets), module
    assert all(patch.snippets for patch in cm._PATCHES)


def test_drift_in_a_torch_redirect_is_reported(monkeypatch):
    monkeypatch.setitem(cm._TORCH_ON_CPU, "megatron.core.timers", ("torch.cuda.no_such_call()",))
    problems = cm.check_patch_targets()
    version = metadata.version("megatron-core")
    assert problems == [f"megatron-core {version}: megatron.core.timers no longer contains "
                        "'torch.cuda.no_such_call()' (CUDA redirect)"]


def test_drift_in_an_attribute_patch_is_reported(monkeypatch):
    patch = cm._PATCHES[0]
    moved = dataclasses.replace(patch, snippets=(patch.snippets[0] + "  # changed",))
    monkeypatch.setattr(cm, "_PATCHES", (moved, *cm._PATCHES[1:]))
    problems = cm.check_patch_targets()
    assert len(problems) == 1 and patch.name in problems[0] and patch.module in problems[0]


def test_a_vanished_attribute_is_reported(monkeypatch):
    patch = next(p for p in cm._PATCHES if p.must_exist)
    monkeypatch.delattr(importlib.import_module(patch.module), patch.attr)
    assert any(f"{patch.module}.{patch.attr} is gone" in p for p in cm.check_patch_targets())


def test_patch_table_names_every_patch_with_its_code():
    rows = cm.patch_table()
    assert len(rows) == len(cm._TORCH_ON_CPU) + len(cm._PATCHES) + 1  # + Tensor.cuda
    assert all(row["code"] and row["why"] for row in rows)


def test_enable_refuses_drifted_upstream_in_one_line_and_applies_nothing(monkeypatch):
    monkeypatch.setattr(cm, "_active", False)
    monkeypatch.setattr(cm, "check_patch_targets", lambda: ["megatron-core 9.9: x no longer contains 'y' (z)"] * 2)
    monkeypatch.setattr(cm, "_apply_patches", lambda: pytest.fail("patched despite drift"))
    with pytest.raises(UpstreamDrift) as raised:
        cm.enable_cpu_mode()
    assert "\n" not in str(raised.value) and "megatron-core 9.9" in str(raised.value) and "1 more" in str(raised.value)
    assert not cm.cpu_mode_active()


def test_cuda_redirect_is_scoped_to_the_listed_modules(cpu_mode):
    timers = importlib.import_module("megatron.core.timers")
    assert cm.cpu_mode_active()
    assert timers.torch.cuda.current_device() == torch.device("cpu")
    assert timers.torch.zeros(2, device="cuda").device.type == "cpu"
    assert timers.torch.Tensor is torch.Tensor
    # the real torch is untouched: outside those modules CUDA is still absent, loudly
    assert sys.modules["torch"] is torch and not torch.cuda.is_available()
    with pytest.raises((RuntimeError, AssertionError)):
        torch.cuda.current_device()
    with pytest.raises((RuntimeError, AssertionError)):
        torch.zeros(1, device="cuda")
    # the one process-wide patch: .cuda() keeps tensors (and modules) on the CPU
    x = torch.ones(2)
    assert x.cuda(non_blocking=True) is x
    assert next(torch.nn.Linear(2, 2).cuda(torch.device("cpu")).parameters()).device.type == "cpu"


def test_cpu_rng_tracker_forks_and_restores(cpu_mode):
    from megatron.core import tensor_parallel

    tracker = tensor_parallel.get_cuda_rng_tracker()
    tracker.reset()
    tracker.add("test-stream", 7)
    torch.manual_seed(0)
    before = torch.get_rng_state()
    with tracker.fork("test-stream"):
        a = torch.rand(3)
    assert torch.equal(torch.get_rng_state(), before)  # the default stream is restored
    tracker.reset()
    tracker.add("test-stream", 7)
    with tracker.fork("test-stream"):
        assert torch.equal(torch.rand(3), a)  # the forked stream is the seeded one


def test_te_import_guard_keeps_te_absent(cpu_mode):
    assert not have_transformer_engine()
    lora = importlib.import_module("megatron.bridge.peft.lora")
    assert lora.te is MISSING_TE
    # the modules megatron-bridge 0.3 imports TE in unguarded, found by their content
    assert {"megatron.bridge.peft.lora", "megatron.bridge.peft.lora_layers"} <= set(guarded_modules())
    with pytest.raises(ImportError, match="needs Transformer Engine"):
        MISSING_TE.Linear(4, 4)
    assert not isinstance(object(), MISSING_TE.Linear)


def test_te_import_guard_rewrites_only_module_level_unguarded_imports():
    source = ("import os\nimport transformer_engine.pytorch as te\ntry:\n"
              "    import transformer_engine.pytorch as te2\nexcept ImportError:\n    pass\n")
    guarded = guard_source(source)
    assert guarded.splitlines() == ["import os", "from bridge_ext.patches.import_time import MISSING_TE as te", "try:",
                                    "    import transformer_engine.pytorch as te2", "except ImportError:", "    pass"]
    assert guard_source("import torch\n") is None  # nothing to guard: the module imports unchanged


def test_muon_stack_fix(cpu_mode):
    from megatron.core.optimizer.muon import TensorParallelMuon

    weight = torch.nn.Parameter(torch.randn(16, 8, generator=torch.Generator().manual_seed(0)))
    opt = TensorParallelMuon([weight], lr=0.1, momentum_beta=0.9, use_nesterov=True, weight_decay=0.0,
                             num_ns_steps=5, scale_mode="spectral", mode="blockwise")
    assert getattr(opt, "nesterov", getattr(opt, "use_nesterov", None)) is True  # 0.3.0 / 0.1.0 name
    weight.grad = torch.ones_like(weight)
    before = weight.detach().clone()
    opt.step()
    assert torch.equal(opt.state[weight]["momentum_buffer"], 0.1 * torch.ones_like(weight))
    update = (before - weight.detach()) / 0.1
    # an orthogonalized rank-1 update: one singular value, scaled by sqrt(max(rows, cols)) ("spectral"). Its
    # normalized singular value 1 goes through modded-nanogpt's five "quintic" polynomials a s + b s^3 + c s^5
    sigma = 1.0
    for a, b, c in ((4.0848, -6.8946, 2.9270), (3.9505, -6.3029, 2.6377), (3.7418, -5.5913, 2.3037),
                    (2.8769, -3.1427, 1.2046), (2.8366, -3.0525, 1.2012)):
        sigma = a * sigma + b * sigma**3 + c * sigma**5
    singular = torch.linalg.svdvals(update)
    assert singular[0] == pytest.approx(math.sqrt(16) * sigma, rel=2e-3) and singular[1] < 1e-3 * singular[0]


def test_dataset_helpers_are_the_prebuilt_ones(cpu_mode):
    initialize = importlib.import_module("megatron.bridge.training.initialize")
    initialize.compile_helpers()  # would run `make` and sys.exit(1) upstream
    assert importlib.import_module("megatron.core.datasets.helpers_cpp").build_sample_idx_int32


# --- models on CPU ----------------------------------------------------------------------------------------


@pytest.fixture
def single_process():
    """A gloo process group + Megatron parallel state for one test, torn down after it."""
    import torch.distributed as dist

    cm.reset_megatron_globals()
    cm.init_single_process_distributed()
    yield
    cm.reset_megatron_globals()
    if dist.is_initialized():
        dist.destroy_process_group()


def _hf_model(family: str):
    from transformers import AutoModelForCausalLM

    from tests.test_cpu_training import tiny_hf_config

    config = tiny_hf_config(family)
    if family == "deepseek_v3":
        config.first_k_dense_replace = config.num_hidden_layers  # MLA only (see test below)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, torch_dtype=torch.float32)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight") or "layernorm" in name:
                param.add_(0.1 * torch.randn_like(param))  # norms not all ones, so a swap would show
    return model.eval()


@pytest.mark.slow
@pytest.mark.parametrize("family", ["qwen3", "deepseek_v3"])
def test_logits_match_hf(cpu_mode, single_process, tmp_path, family):
    """Megatron on CPU (local spec; SDPA core attention for MLA) computes the HF model's logits."""
    from megatron.bridge import AutoBridge

    hf = _hf_model(family)
    hf.save_pretrained(tmp_path / "hf")
    bridge = AutoBridge.from_hf_pretrained(tmp_path / "hf")
    provider = bridge.to_megatron_provider(load_weights=True)
    apply_config_stated_fields(provider, hf.config)  # as recipes and conversion do (head_dim on MB 0.3.0)
    cm.configure_for_cpu(provider)
    provider.finalize()
    model = provider.provide_distributed_model(wrap_with_ddp=False)[0].eval()

    tokens = torch.randint(0, hf.config.vocab_size, (2, 24), generator=torch.Generator().manual_seed(1))
    positions = torch.arange(tokens.shape[1]).expand_as(tokens)
    with torch.no_grad():
        ours = model(tokens, positions, None)
        theirs = hf(tokens).logits
    assert ours.shape == theirs.shape
    assert (ours - theirs).abs().max().item() < 2e-6  # fp32; measured 3.6e-7 (qwen3), 0 (MLA vs HF sdpa)
    assert ours.abs().max().item() > 0.1  # not trivially zero


@pytest.mark.slow
@pytest.mark.parametrize("family", ["qwen3", "qwen3_moe", "deepseek_v3"])
def test_models_build_forward_and_backward(cpu_mode, single_process, family):
    from megatron.bridge import AutoBridge

    from tests.test_cpu_training import SEQ, tiny_hf_config

    provider = AutoBridge.from_hf_config(tiny_hf_config(family)).to_megatron_provider(load_weights=False)
    cm.configure_for_cpu(provider)
    provider.seq_length = SEQ
    provider.finalize()
    model = provider.provide_distributed_model(wrap_with_ddp=False, use_cpu_initialization=True)[0]
    if family == "deepseek_v3":
        attention = model.decoder.layers[0].self_attention
        assert isinstance(attention.core_attention, cm.SDPACoreAttention)
        router = model.decoder.layers[1].mlp.router
        assert router.score_function == "sigmoid" and router.expert_bias is not None
        assert model.decoder.layers[1].mlp.shared_experts is not None
    tokens = torch.randint(0, 256, (2, SEQ), generator=torch.Generator().manual_seed(0))
    logits = model(tokens, torch.arange(SEQ).expand_as(tokens), None)
    assert logits.shape == (2, SEQ, 256) and torch.isfinite(logits).all()
    logits.float().logsumexp(-1).mean().backward()
    grads = {n: p.grad for n, p in model.named_parameters()}
    assert grads["embedding.word_embeddings.weight"].abs().sum() > 0
    assert all(g is not None and g.abs().sum() > 0 for n, g in grads.items() if "self_attention" in n)


def test_reset_megatron_globals_clears_what_outlives_a_run(cpu_mode):
    from megatron.core.num_microbatches_calculator import (
        get_num_microbatches, init_num_microbatches_calculator,
    )
    from megatron.core.transformer.moe import moe_utils

    init_num_microbatches_calculator(0, None, 8, 4, 1)
    assert get_num_microbatches() == 2
    moe_utils.MoEAuxLossAutoScaler.main_loss_backward_scale = torch.tensor(1.0)
    moe_utils.save_to_aux_losses_tracker("load_balancing_loss", torch.tensor(0.5), 2, 2)
    cm.reset_megatron_globals()
    assert moe_utils.MoEAuxLossAutoScaler.main_loss_backward_scale is None
    assert moe_utils.get_moe_layer_wise_logging_tracker() == {}
    init_num_microbatches_calculator(0, None, 8, 4, 1)  # would assert "already initialized" without the reset
    cm.reset_megatron_globals()


def test_validation_without_gpu_targets_still_exist():
    """The upstream call it skips and the TE-kernel check it sidesteps are still where they were."""
    import inspect

    from megatron.bridge.training import config as mb_config
    from megatron.core.transformer import transformer_config

    assert "validate_flex_dispatcher_backend(self.model)" in inspect.getsource(mb_config.ConfigContainer.validate)
    assert "torch.cuda.get_device_properties(0)" in inspect.getsource(mb_config.validate_flex_dispatcher_backend)
    source = inspect.getsource(transformer_config.TransformerConfig.__post_init__)
    assert "if self.moe_permute_fusion:" in source and "fused_permute" in source
