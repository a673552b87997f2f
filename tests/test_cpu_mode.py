"""CPU mode: it refuses stacks it was not written for, CUDA stays redirected where it should, models run on CPU."""

from __future__ import annotations

import importlib
import inspect
import sys
from importlib import metadata

import pytest
import torch

from bridge_ext import cpu as cm
from bridge_ext.hf import apply_config_stated_fields
from bridge_ext.process_state import init_single_process_distributed, reset_megatron_globals
from bridge_ext.patches.import_time import MISSING_TE, guard_source, guarded_modules
from bridge_ext.stack import UpstreamDrift, have_transformer_engine
from bridge_ext.without_te.sdpa_attention import SDPACoreAttention

pytestmark = pytest.mark.stack  # CPU-mode fixes, matched by content in each stack: .ci/run runs these on every stack


# Whether every CPU patch still fits upstream, and that drift stops CPU mode in one line: tests/test_patches.py.


def test_enable_refuses_drifted_upstream_in_one_line_and_applies_nothing(monkeypatch):
    from bridge_ext.patches import Patch, registry

    drifted = [Patch(name=f"drifted-{n}", area="cpu", scope="cpu", module="megatron.core.timers", attr="torch",
                     upstream="u", why="w", snippets=(f"torch.cuda.no_such_call_{n}()",),
                     make=lambda old: pytest.fail("patched despite drift")) for n in (1, 2)]
    monkeypatch.setattr(registry, "REGISTRY", (*registry.REGISTRY, *drifted))
    monkeypatch.setattr(cm.mode, "_active", False)  # the switch's state (bridge_ext.cpu.mode)
    with pytest.raises(UpstreamDrift) as raised:
        cm.enable_cpu_mode()
    message = str(raised.value)
    assert "\n" not in message and f"megatron-core {metadata.version('megatron-core')}" in message
    assert message.startswith("CPU mode does not fit the installed code") and "1 more" in message
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
    lora_layers = importlib.import_module("megatron.bridge.peft.lora_layers")
    assert lora_layers.te is MISSING_TE
    # the modules megatron-bridge imports TE in unguarded, found by their content: lora.py and lora_layers.py in
    # 0.3, lora_layers.py alone in 0.6
    unguarded = {name for name in ("megatron.bridge.peft.lora", "megatron.bridge.peft.lora_layers")
                 if guard_source(inspect.getsource(importlib.import_module(name))) is not None}
    assert "megatron.bridge.peft.lora_layers" in unguarded and unguarded <= set(guarded_modules())
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


def test_te_import_guard_binds_tes_extension_module_too():
    """megatron-bridge 0.4's diffusion/models/wan/utils.py: `import transformer_engine_torch as tex`."""
    guarded = guard_source("import torch\nimport transformer_engine_torch as tex\n")
    assert guarded.splitlines() == ["import torch", "from bridge_ext.patches.import_time import MISSING_TEX as tex"]


# --- models on CPU ----------------------------------------------------------------------------------------


@pytest.fixture
def single_process():
    """A gloo process group + Megatron parallel state for one test, torn down after it."""
    import torch.distributed as dist

    reset_megatron_globals()
    init_single_process_distributed()
    yield
    reset_megatron_globals()
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
        assert isinstance(attention.core_attention, SDPACoreAttention)
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
    if hasattr(moe_utils, "save_to_aux_losses_tracker"):  # megatron-core 0.16-0.17
        moe_utils.save_to_aux_losses_tracker("load_balancing_loss", torch.tensor(0.5), 2, 2)
        tracked = moe_utils.get_moe_layer_wise_logging_tracker
    else:  # 0.19: moe_logging's MoEMetricsTracker
        from megatron.core.transformer.moe import moe_logging

        moe_logging.get_moe_metrics_tracker().record("load_balancing_loss", torch.tensor(0.5), 2, 2)

        def tracked():
            return moe_logging.get_moe_metrics_tracker().metrics
    assert tracked() != {}
    reset_megatron_globals()
    assert moe_utils.MoEAuxLossAutoScaler.main_loss_backward_scale is None
    assert tracked() == {}
    init_num_microbatches_calculator(0, None, 8, 4, 1)  # would assert "already initialized" without the reset
    reset_megatron_globals()


def test_reset_megatron_globals_closes_the_process_groups_of_the_run_that_ended(cpu_mode, single_process):
    """megatron-core's destroy_model_parallel forgets its groups without destroying them: each gloo group keeps
    its threads and sockets, so runs in one process slowed down run by run. Counted by the OS (this process's
    threads and open descriptors), not by torch's table the reset reads."""
    import os

    from megatron.core import parallel_state

    def resources() -> tuple[int, int]:
        return len(os.listdir("/proc/self/task")), len(os.listdir("/proc/self/fd"))

    def one_run() -> None:
        parallel_state.initialize_model_parallel(1, 1)
        parallel_state.get_tensor_model_parallel_group()  # a run's groups exist
        reset_megatron_globals()

    one_run()
    before = resources()
    for _ in range(3):
        one_run()
    threads, fds = resources()
    # one run's groups hold dozens of threads and descriptors (measured at TP2: ~50 and ~75); three runs, none kept
    assert threads <= before[0] + 2 and fds <= before[1] + 2, (before, (threads, fds))


@pytest.mark.slow
def test_training_runs_in_one_process_free_their_models_and_compile_nothing(cpu_mode, tmp_path):
    """Kimi K2's proxy (MoE with expert bias, MLA, its preset's train.manual_gc) trained twice in this process,
    as the Python API, a notebook or the layout matrix do. Counted by Python's collector, the OS and
    torch.compile's own counter, not by the code under test:

    - no model is alive after a run (megatron-core's DDP hooks held theirs forever: patch ``ddp-hook-cycle``),
      so no process group is, and the second run leaves the process's threads as the first did (each MoE run
      kept ~49 more);
    - the garbage collector is on again (Megatron Bridge's manual_gc turned it off for good:
      ``manual-gc-restored``);
    - nothing was compiled (megatron-core's torch.compile'd expert-bias update cost ~10 s per process on CPU:
      ``router-expert-bias-eager``).
    """
    import gc
    import os

    from torch._dynamo.utils import counters

    from bridge_ext import commands
    from megatron.core.distributed import DistributedDataParallel
    from megatron.core.models.gpt import GPTModel

    def threads() -> int:
        return len(os.listdir("/proc/self/task"))

    def alive() -> int:
        gc.collect()  # cycles the collector can see are freed by it; the ones through C++ hooks are not
        return sum(isinstance(o, (GPTModel, DistributedDataParallel)) for o in gc.get_objects())

    def run(number: int) -> None:
        reset_megatron_globals()
        argv = ["llm", "pretrain", "--recipe", "kimi_k2_proxy_muon", "layout=cpu", "train.train_iters=2",
                f"checkpoint.save={tmp_path / str(number)}", f"logger.tensorboard_dir={tmp_path / str(number)}/tb"]
        try:
            assert commands.main(argv) == 0
        finally:
            reset_megatron_globals()

    gc.collect()
    models_before = alive()
    torch._dynamo.reset()  # compiled code from earlier tests in this process would hide a compilation
    frames = counters["frames"]["total"]
    run(1)
    after_first = threads()
    assert gc.isenabled()
    assert counters["frames"]["total"] == frames, "torch.compile compiled a function on CPU"
    assert alive() == models_before, "a model (or its DDP wrapper) outlived its run"
    run(2)
    assert alive() == models_before
    # the second run's process groups are gone with it (measured without the fix: +49 threads per run; with it,
    # +1, TensorBoard's writer thread)
    assert threads() <= after_first + 2, (after_first, threads())


def test_validation_without_gpu_turns_off_only_te_kernel_flags():
    """The TE-kernel check it sidesteps (``bridge_ext.validation.TE_KERNEL_FLAGS``) is still where it was; the skipped
    GPU call is the ``validate-without-gpu`` patch (tests/test_patches.py)."""
    import inspect

    from megatron.core.transformer import transformer_config

    source = inspect.getsource(transformer_config.TransformerConfig.__post_init__)
    assert "if self.moe_permute_fusion:" in source and "fused_permute" in source
