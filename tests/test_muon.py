"""Muon presets (moonlight, kimi_k2): pinned fields, the schedule shape, the update against the paper's
formula, MuonClip on an MLA proxy, and telemetry. Models are the shipped proxies, built on CPU through
``bridge_ext.build.build_config`` and Megatron Bridge's own ``setup_optimizer``."""

from __future__ import annotations

import copy
import dataclasses
import math

import pytest

from bridge_ext.stack import optimizer_muon_fields
from recipes import get_recipe
from recipes.optimizers import PRESETS

pytestmark = pytest.mark.stack  # Muon from emerging-optimizers (0.1.0 / 0.3.0): .ci/run runs these on every stack

MUON_PRESETS = ("moonlight", "kimi_k2")


# --------------------------------------------------------------------------------------------- presets
def test_moonlight_fields_are_pinned():
    p = PRESETS["moonlight"]
    assert p.kind == "muon" and p.ns_coefficients == "simple"
    o = p.optimizer
    assert (o["muon_momentum"], o["muon_nesterov"], o["muon_num_ns_steps"]) == (0.95, True, 5)
    assert o["muon_coefficient_type"] == p.ns_coefficients  # the field (megatron-core 0.17+) and the 0.16 install
    assert (o["muon_scale_mode"], o["muon_extra_scale_factor"]) == ("spectral", 0.2)
    assert (o["adam_beta1"], o["adam_beta2"], o["weight_decay"], o["decoupled_weight_decay"]) == (0.9, 0.95, 0.1, True)
    assert o["lr"] == PRESETS["adamw"].optimizer["lr"] and o["min_lr"] == PRESETS["adamw"].optimizer["min_lr"]
    s = p.scheduler  # the scheduler writes every group's weight decay each step: it must agree
    assert (s["start_weight_decay"], s["end_weight_decay"], s["weight_decay_incr_style"]) == (0.1, 0.1, "constant")
    assert dict(p.model) == {}


def test_the_coefficients_that_run_are_the_configs_and_the_dry_run_says_so(nemo):
    """One source (issue 39): the preset's muon_coefficient_type. Where the installed OptimizerConfig has the field
    (megatron-core 0.17+) an override of it is what runs and what the dry run prints; on 0.16 the preset's set is
    installed (its field does not exist there)."""
    import dataclasses as dc

    from megatron.core.optimizer import OptimizerConfig

    from bridge_ext.api import recipe_config
    from bridge_ext.muon.presets import install_preset, installed_ns_coefficients

    has_field = "muon_coefficient_type" in {f.name for f in dc.fields(OptimizerConfig)}
    overrides = ["optimizer.muon_coefficient_type=quintic"] if has_field else []
    expected = "quintic" if has_field else "simple"
    cfg = recipe_config("qwen3_proxy_muon", overrides=overrides)
    try:
        install_preset(get_recipe("qwen3_proxy_muon").preset, cfg)
        assert installed_ns_coefficients() == expected
    finally:
        install_preset(PRESETS["adamw"])  # process-wide: megatron-core's defaults for the other tests
    done = nemo(["llm", "pretrain", "--recipe", "qwen3_proxy_muon", "--dryrun", *overrides])
    assert done.code == 0, done.stderr[-2000:]
    (line,) = [line for line in done.stdout.splitlines() if line.startswith("muon ")]
    assert f"coefficients={expected}," in line and "coefficient_type=" not in line, line


def test_installing_a_preset_sets_exactly_its_settings_and_a_second_one_replaces_them():
    """One source (issue 39): install_preset installs MuonSettings.of(preset, cfg) whole, in one step; the next
    preset's settings replace them (nothing of the first survives); AdamW's are megatron-core's defaults."""
    from types import SimpleNamespace

    from bridge_ext.muon import muon_settings
    from bridge_ext.muon.presets import MuonSettings, install_preset

    try:
        install_preset(PRESETS["kimi_k2"])  # Keller Jordan's set, gate and up apart
        assert muon_settings() == MuonSettings(ns_coefficients="simple", split_gate_up=True)
        install_preset(PRESETS["nvidia_perf"])  # megatron-core's quintic, linear_fc1 whole
        assert muon_settings() == MuonSettings(ns_coefficients="quintic", split_gate_up=False)
        install_preset(PRESETS["kimi_k2_fused_mlp"])
        assert muon_settings() == MuonSettings(ns_coefficients="simple", split_gate_up=False)
        cfg = SimpleNamespace(optimizer=SimpleNamespace(muon_coefficient_type="quintic"))  # 0.17+: the config's
        install_preset(PRESETS["moonlight"], cfg)
        assert muon_settings() == MuonSettings(ns_coefficients="quintic", split_gate_up=True)
        install_preset(PRESETS["adamw"])
        assert muon_settings() == MuonSettings() == MuonSettings(ns_coefficients="quintic", split_gate_up=False)
        with pytest.raises(dataclasses.FrozenInstanceError):
            muon_settings().split_gate_up = True  # type: ignore[misc]
    finally:
        install_preset(PRESETS["adamw"])


def test_kimi_k2_fields_are_pinned():
    p = PRESETS["kimi_k2"]
    m = PRESETS["moonlight"]
    assert p.ns_coefficients == "simple"
    assert {k: v for k, v in p.optimizer.items() if k not in ("lr", "min_lr")} == \
        {k: v for k, v in m.optimizer.items() if k not in ("lr", "min_lr")}
    assert (p.optimizer["lr"], p.optimizer["min_lr"]) == (2e-4, 2e-5)
    assert dict(p.model) == {"qk_clip": True, "qk_clip_threshold": 100.0, "qk_clip_alpha": 0.5,
                             "log_max_attention_logit": True}
    s = p.scheduler
    # the report's 500 warm-up steps, whatever the run length (not a fraction of train.train_iters)
    assert (s["lr_decay_style"], s["lr_wsd_decay_style"], s["lr_warmup_iters"]) == ("WSD", "cosine", 500)
    assert s.get("lr_warmup_fraction") is None
    assert p.schedule_fractions["lr_wsd_decay_fraction"] == pytest.approx(5.5 / 15.5)
    assert (s["start_weight_decay"], s["end_weight_decay"]) == (0.1, 0.1)


@pytest.mark.parametrize("name", MUON_PRESETS)
def test_every_installed_muon_field_is_set(name):
    from bridge_ext.upstream_api import installed_optimizer_fields

    preset = PRESETS[name]
    fields = {k for k in installed_optimizer_fields(preset.name, preset.optimizer) if k.startswith("muon_")}
    assert fields == set(optimizer_muon_fields()), set(optimizer_muon_fields()) ^ fields


@pytest.mark.parametrize("name", MUON_PRESETS)
def test_preset_fields_exist_upstream(name):
    """Every optimizer/scheduler/model key is a real field of the installed Megatron classes."""
    from megatron.bridge.training.config import OptimizerConfig, SchedulerConfig
    from megatron.core.transformer.transformer_config import MLATransformerConfig

    from bridge_ext.upstream_api import installed_optimizer_fields

    p = PRESETS[name]
    OptimizerConfig(**installed_optimizer_fields(p.name, p.optimizer))  # under the installed release's names
    SchedulerConfig(**p.scheduler)
    names = {f.name for f in dataclasses.fields(MLATransformerConfig)}
    assert set(p.model) <= names


def test_a_model_field_unknown_upstream_fails_clearly():
    from bridge_ext.errors import UserError
    from bridge_ext.muon import apply_preset

    bad = dataclasses.replace(PRESETS["kimi_k2"], model={"qk_clip_tau": 100.0})
    cfg = type("Cfg", (), {"model": type("M", (), {"qk_clip": False})()})()
    with pytest.raises(UserError, match="model.qk_clip_tau"):
        apply_preset(cfg, bad, runtime=False)


# ------------------------------------------------------------------------------------------- schedule
def _scheduler_lrs(preset_name: str, train_iters: int, iterations: list[int], *, overrides=None):
    """LR of Megatron's OptimizerParamScheduler at ``iterations`` for the proxy recipe with ``preset_name``."""
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    from bridge_ext.build import build_config
    from bridge_ext.muon import apply_preset, resolve_schedule

    preset = PRESETS[preset_name]
    recipe = dataclasses.replace(get_recipe("kimi_k2_proxy_muon"), preset=preset, overrides=overrides or {})
    cfg = build_config(recipe)
    apply_preset(cfg, preset, runtime=False)
    cfg.train.train_iters = train_iters
    resolve_schedule(cfg, preset)
    cfg._calculate_scheduler_steps()  # what ConfigContainer.validate() does for the scheduler
    s, o, gbs = cfg.scheduler, cfg.optimizer, cfg.train.global_batch_size
    opt = type("Opt", (), {"param_groups": [{}]})()
    sched = OptimizerParamScheduler(
        opt, init_lr=s.lr_warmup_init, max_lr=o.lr, min_lr=o.min_lr, lr_warmup_steps=s.lr_warmup_steps,
        lr_decay_steps=s.lr_decay_steps, lr_decay_style=s.lr_decay_style, start_wd=s.start_weight_decay,
        end_wd=s.end_weight_decay, wd_incr_steps=s.wd_incr_steps, wd_incr_style=s.weight_decay_incr_style,
        use_checkpoint_opt_param_scheduler=False, override_opt_param_scheduler=True,
        wsd_decay_steps=s.wsd_decay_steps, lr_wsd_decay_style=s.lr_wsd_decay_style)
    lrs, wds, done = {}, {}, 0
    for it in iterations:
        sched.step((it - done) * gbs)  # Bridge steps the scheduler by samples
        done = it
        lrs[it], wds[it] = opt.param_groups[0]["lr"], opt.param_groups[0]["weight_decay"]
    return lrs, wds, cfg


def test_kimi_k2_schedule_shape_on_1000_iterations():
    its = [0, 1, 250, 500, 600, 645, 646, 823, 999, 1000]
    lrs, wds, cfg = _scheduler_lrs("kimi_k2", 1000, its, overrides={})
    assert cfg.scheduler.lr_wsd_decay_iters == round(1000 * 5.5 / 15.5) == 355
    assert lrs[0] == 0.0  # linear warm-up over the report's 500 steps
    assert lrs[1] == pytest.approx(2e-4 / 500, rel=1e-12) and lrs[250] == pytest.approx(1e-4, rel=1e-12)
    for it in (500, 600, 645):  # constant peak until the last 355 iterations
        assert lrs[it] == pytest.approx(2e-4, rel=1e-12), it
    assert lrs[646] < 2e-4
    mid = 2e-5 + 0.5 * (1 + math.cos(math.pi * (823 - 645) / 355)) * (2e-4 - 2e-5)
    assert lrs[823] == pytest.approx(mid)
    assert lrs[1000] == pytest.approx(2e-5, rel=1e-9)  # end of the cosine
    assert set(wds.values()) == {0.1}


def test_kimi_k2_schedule_scales_and_explicit_warmup_wins():
    lrs, _, cfg = _scheduler_lrs("kimi_k2", 100_000, [100_000], overrides={"scheduler.lr_warmup_iters": 5})
    assert cfg.scheduler.lr_warmup_fraction is None and cfg.scheduler.lr_warmup_iters == 5
    assert cfg.scheduler.lr_wsd_decay_iters == round(100_000 * 5.5 / 15.5)
    assert lrs[100_000] == pytest.approx(2e-5)


def test_resolve_schedule_recomputes_its_own_value_but_keeps_explicit_ones():
    from bridge_ext.build import build_config
    from bridge_ext.muon import resolve_schedule

    preset = PRESETS["kimi_k2"]
    cfg = build_config(dataclasses.replace(get_recipe("kimi_k2_muon"), preset=preset))
    cfg.train.train_iters = 1000
    assert resolve_schedule(cfg, preset) == {"lr_wsd_decay_iters": 355}
    cfg.train.train_iters = 2000  # e.g. a command-line override after a first resolution
    assert resolve_schedule(cfg, preset) == {"lr_wsd_decay_iters": 710}
    assert resolve_schedule(cfg, preset) == {"lr_wsd_decay_iters": 710}
    cfg.scheduler.lr_wsd_decay_iters = 123  # explicit
    explicit = {"scheduler.lr_wsd_decay_iters"}
    assert resolve_schedule(cfg, preset, explicit=explicit) == {} and cfg.scheduler.lr_wsd_decay_iters == 123
    assert cfg.scheduler.lr_warmup_iters == 500 and cfg.scheduler.lr_warmup_fraction is None


def test_moonlight_weight_decay_is_not_overridden_by_the_scheduler():
    # a warm-up shorter than the run: MB 0.3.0 passes moonlight's 2,000 warm-up iterations of a 1,000-iteration
    # run to Megatron's scheduler unclamped, which asserts (0.3.1 clamps it)
    lrs, wds, _ = _scheduler_lrs("moonlight", 1000, [1, 500, 1000], overrides={"scheduler.lr_warmup_iters": 5})
    assert set(wds.values()) == {0.1}
    assert lrs[1000] == pytest.approx(PRESETS["moonlight"].optimizer["min_lr"])


# ---------------------------------------------------------------------------- the update vs the paper
KJ = (3.4445, -4.7750, 2.0315)


def moonlight_reference(w0, grads, *, lr, weight_decay, momentum=0.95, steps=5, scale=0.2):
    """Moonlight (arXiv 2502.16982) Algorithm 1 with Nesterov momentum, in plain fp32 torch.

    M_t = mu M_{t-1} + G_t; O_t = NS5(mu M_t + G_t) * 0.2 sqrt(max(A, B)); W_t = W_{t-1} - lr (O_t + wd W_{t-1}).
    NS5: X = U / ||U||_F (on the wide orientation), 5 x {A = X X^T; X = a X + (b A + c A^2) X}.
    """
    import torch

    a, b, c = KJ
    w, m = w0.clone().double(), torch.zeros_like(w0, dtype=torch.float64)
    for g in grads:
        g = g.double()
        m = momentum * m + g
        u = momentum * m + g
        tall = u.shape[0] > u.shape[1]
        x = u.T if tall else u
        x = x / (x.norm() + 1e-7)
        for _ in range(steps):
            A = x @ x.T
            x = a * x + (b * A + c * A @ A) @ x
        o = (x.T if tall else x) * scale * math.sqrt(max(w.shape))
        w = w - lr * (o + weight_decay * w)
    return w.float()


def _end_process_state() -> None:
    """Parallel state, rerun state machine (set up implicitly by optimizer.step) and the process group."""
    import torch.distributed as dist
    from megatron.bridge.training.initialize import destroy_global_state

    from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler

    destroy_global_state()
    if dist.is_initialized():
        dist.destroy_process_group()
    # a backward outside Megatron's schedules leaves a 0-d scale that the schedules' 1-element one cannot
    # be copied into (moe_utils.py:267 vs :286): reset it as a fresh process has it
    MoEAuxLossAutoScaler.main_loss_backward_scale = None


def build_kimi_proxy(preset):
    """The kimi_k2 proxy with ``preset``, built on CPU (model only; optimizers per test); see release_proxy."""
    import torch

    from bridge_ext.build import build_config
    from bridge_ext.cpu import configure_for_cpu
    from bridge_ext.process_state import init_single_process_distributed
    from bridge_ext.muon import apply_preset

    init_single_process_distributed()
    cfg = build_config(dataclasses.replace(get_recipe("kimi_k2_proxy_muon"), preset=preset))
    apply_preset(cfg, preset)
    configure_for_cpu(cfg)
    cfg.validate()
    torch.manual_seed(0)
    return cfg, cfg.model.provide_distributed_model(ddp_config=cfg.ddp, use_cpu_initialization=True)


def release_proxy() -> None:
    """Undo what build_kimi_proxy installed process-wide, for whatever runs next in this process."""
    from bridge_ext.muon.presets import MuonSettings, install_settings

    install_settings(MuonSettings())  # megatron-core's defaults: "quintic", no gate/up split
    _end_process_state()


@pytest.fixture
def proxy(cpu_mode):
    """The kimi_k2 proxy with the moonlight preset, built on CPU (model only; optimizers per test)."""
    yield build_kimi_proxy(PRESETS["moonlight"])
    release_proxy()


def _run_optimizer(cfg, model, name, grads, *, precision, coefficients):
    """Steps Megatron's optimizer for ``cfg`` with ``grads`` on ``name`` (others 0); returns (W0, W, group)."""
    import torch
    from megatron.bridge.training.optim import setup_optimizer

    from bridge_ext.muon import muon_settings
    from bridge_ext.muon.presets import install_settings

    install_settings(dataclasses.replace(muon_settings(), ns_coefficients=coefficients))  # the preset's, this set
    opt_cfg = copy.deepcopy(cfg.optimizer)
    opt_cfg.muon_fp32_matmul_prec = precision
    if hasattr(opt_cfg, "muon_coefficient_type"):  # megatron-core 0.17+ passes it explicitly: it decides there
        opt_cfg.muon_coefficient_type = coefficients
    params = dict(model[0].named_parameters())
    param = params[name]
    w0 = param.detach().clone()
    optimizer, scheduler = setup_optimizer(opt_cfg, cfg.scheduler, model, use_gloo_process_groups=True)
    scheduler.step(cfg.scheduler.lr_warmup_steps)  # past the warm-up: the peak lr
    muon = optimizer.chained_optimizers[0].optimizer
    assert type(muon).__name__ == "TensorParallelMuon" and muon.coefficient_type == coefficients
    group = next(g for g in muon.param_groups if any(p is param for p in g["params"]))
    for g in grads:
        for p in params.values():
            p.main_grad.zero_()
        param.main_grad.copy_(g)
        ok, grad_norm, _ = optimizer.step()
        assert ok and grad_norm < cfg.optimizer.clip_grad  # no clipping: the reference has none
    result = param.detach().clone()
    with torch.no_grad():
        param.copy_(w0)  # leave the model as it was for the next optimizer
    return w0, result, group


@pytest.mark.slow
def test_moonlight_update_matches_the_paper(proxy):
    import torch

    cfg, model = proxy
    name = "module.decoder.layers.1.self_attention.linear_q_up_proj.weight"  # 96 x 48: tall, not square
    gen = torch.Generator().manual_seed(7)
    shape = dict(model[0].named_parameters())[name].shape
    grads = [0.01 * torch.randn(shape, generator=gen) for _ in range(2)]  # two steps: momentum + Nesterov

    w0, ours, group = _run_optimizer(cfg, model, name, grads, precision="highest", coefficients="simple")
    lr, wd = group["lr"], group["weight_decay"]
    assert lr == cfg.optimizer.lr and wd == 0.1  # the scheduler kept the preset's weight decay
    ref = moonlight_reference(w0, grads, lr=lr, weight_decay=wd)
    rel = float((ours - w0 - (ref - w0)).norm() / (ref - w0).norm())
    print(f"moonlight update vs paper formula (fp32): relative difference {rel:.2e}")
    assert rel < 1e-3

    # the update's RMS on a matrix whose Newton-Schulz output is known exactly: test_update_rms_of_a_known_matrix

    # The preset's bf16 Newton-Schulz ("medium") stays close; megatron-core's default coefficients do not.
    _, bf16, _ = _run_optimizer(cfg, model, name, grads, precision="medium", coefficients="simple")
    rel_bf16 = float((bf16 - ref).norm() / (ref - w0).norm())
    _, quintic, _ = _run_optimizer(cfg, model, name, grads, precision="highest", coefficients="quintic")
    rel_quintic = float((quintic - ref).norm() / (ref - w0).norm())
    print(f"bf16 NS: {rel_bf16:.2e}; quintic coefficients: {rel_quintic:.2e}")
    assert rel_bf16 < 3e-2
    assert rel_quintic > 3e-2


def _kj_singular_value(s: float, steps: int = 5) -> float:
    """Where Keller Jordan's Newton-Schulz polynomial p(s) = a s + b s^3 + c s^5 takes one singular value."""
    a, b, c = KJ
    for _ in range(steps):
        s = a * s + b * s**3 + c * s**5
    return s


@pytest.mark.slow
def test_update_rms_of_a_known_matrix(proxy):
    """Moonlight's update RMS, 0.2 * lr * sigma, on a gradient with equal singular values.

    G = 0.01 Q (Q: 96 x 48, orthonormal columns). Newton-Schulz normalizes it to singular values 1/sqrt(48)
    and maps each through p five times to sigma, so O = sigma Q and the update 0.2 sqrt(96) O has RMS
    0.2 sqrt(96) sigma sqrt(48 / (96 x 48)) = 0.2 sigma: ~2e-3 at the proxies' lr 1e-2. Without the 0.2 factor
    it would be 5x larger; with AdamW-like scaling, or sqrt(min) instead of sqrt(max), different again.
    """
    import torch

    cfg, model = proxy
    name = "module.decoder.layers.1.self_attention.linear_q_up_proj.weight"
    q, _ = torch.linalg.qr(torch.randn(96, 48, generator=torch.Generator().manual_seed(3), dtype=torch.float64))
    w0, ours, group = _run_optimizer(cfg, model, name, [0.01 * q.float()], precision="highest",
                                     coefficients="simple")
    lr, wd = group["lr"], group["weight_decay"]
    update = (w0 * (1 - lr * wd) - ours) / lr  # decoupled weight decay first, then the orthogonalized step
    sigma = _kj_singular_value(1 / math.sqrt(48))
    rms = float(update.pow(2).mean().sqrt())
    print(f"update RMS / lr {rms:.6f}, Moonlight's 0.2 x sigma {0.2 * sigma:.6f} (sigma {sigma:.4f}); "
          f"update RMS {rms * lr:.3e} at lr {lr}")
    assert lr == pytest.approx(1e-2) and wd == 0.1
    assert rms == pytest.approx(0.2 * sigma, rel=1e-3)
    # and every singular value of the update is 0.2 sqrt(96) sigma: the direction is Q's
    singular = torch.linalg.svdvals(update.double())
    assert torch.allclose(singular, torch.full_like(singular, 0.2 * math.sqrt(96) * sigma), rtol=1e-3)


# ------------------------------------------------------------------------------------------- MuonClip
THRESHOLD = 100.0
# layer -> head -> max logit forced before the step. Clipping a layer changes the input of the layers after
# it, so the heads above tau are in the last layer; layer 1 has a head just under tau (left untouched).
FORCED = {1: {1: 99.0}, 2: {0: 400.0, 2: 250.0, 3: 1000.0}}


def _clipped(layer: int, head: int) -> bool:
    return FORCED.get(layer, {}).get(head, 0.0) > THRESHOLD


@pytest.fixture
def mla_proxy(cpu_mode):
    """The kimi_k2 proxy (MLA + MoE) with the kimi_k2 preset (QK-clip on), on CPU."""
    import torch

    from bridge_ext.build import build_config
    from bridge_ext.cpu import configure_for_cpu
    from bridge_ext.process_state import init_single_process_distributed
    from bridge_ext.muon import apply_preset, install_preset, resolve_schedule, track_attention_logits

    init_single_process_distributed()
    preset = PRESETS["kimi_k2"]
    recipe = dataclasses.replace(get_recipe("kimi_k2_proxy_muon"), preset=preset)
    cfg = build_config(recipe)
    apply_preset(cfg, preset)
    configure_for_cpu(cfg)
    resolve_schedule(cfg, preset)
    cfg.validate()
    assert cfg.model.qk_clip and cfg.model.qk_clip_threshold == THRESHOLD
    torch.manual_seed(0)
    model = cfg.model.provide_distributed_model(ddp_config=cfg.ddp, use_cpu_initialization=True)
    tracker = track_attention_logits(model)
    yield cfg, model
    tracker.remove()
    install_preset(PRESETS["adamw"])  # megatron-core's defaults for the other tests
    _end_process_state()


def _attention(model, layer):
    return model[0].module.decoder.layers[layer].self_attention


def _forward_backward(cfg, model, tokens):
    import torch

    for chunk in model:
        chunk.zero_grad_buffer()
    positions = torch.arange(tokens.shape[1]).expand_as(tokens)
    logits = model[0](tokens, positions, None)
    torch.nn.functional.cross_entropy(logits.flatten(0, 1), tokens.flatten()).backward()
    for chunk in model:
        chunk.finish_grad_sync()


def _max_logits(model, tokens):
    """Per-layer per-head max attention logit of one forward (the SDPA core attention measures it)."""
    import torch

    for layer in range(3):
        core = _attention(model, layer).core_attention
        core.current_max_attn_logits = core.bridge_ext_max_logits = None
    with torch.no_grad():
        model[0](tokens, torch.arange(tokens.shape[1]).expand_as(tokens), None)
    result = {layer: _attention(model, layer).core_attention.current_max_attn_logits.clone() for layer in range(3)}
    for layer in range(3):
        core = _attention(model, layer).core_attention
        core.current_max_attn_logits = core.bridge_ext_max_logits = None
    return result


def _step(cfg, model, tokens, *, clip: bool, lr: float | None):
    """One training step (forward/backward on two micro-batches, optimizer step, QK-clip or log only)."""
    from megatron.bridge.training.optim import setup_optimizer

    from bridge_ext.muon import clip_qk

    optimizer, scheduler = setup_optimizer(copy.deepcopy(cfg.optimizer), cfg.scheduler, model,
                                           use_gloo_process_groups=True)
    scheduler.step(cfg.scheduler.lr_warmup_steps)
    if lr is not None:
        for group in optimizer.param_groups:
            group["lr"] = lr
    for layer in range(3):  # start of the step: nothing measured yet
        _attention(model, layer).core_attention.current_max_attn_logits = None
    # two micro-batches: the running max must cover both
    for chunk in model:
        chunk.zero_grad_buffer()
    for half in (tokens[:1], tokens[1:]):
        positions = __import__("torch").arange(half.shape[1]).expand_as(half)
        logits = model[0](half, positions, None)
        __import__("torch").nn.functional.cross_entropy(logits.flatten(0, 1), half.flatten()).backward()
    for chunk in model:
        chunk.finish_grad_sync()
    ok, _, _ = optimizer.step()
    assert ok
    return clip_qk(model, log_max_only=not clip)


@pytest.mark.slow
def test_qk_clip_brings_forced_heads_to_the_threshold(mla_proxy):
    import torch

    cfg, model = mla_proxy
    nope, rope, v = cfg.model.qk_head_dim, cfg.model.qk_pos_emb_head_dim, cfg.model.v_head_dim
    gen = torch.Generator().manual_seed(3)
    tokens = torch.randint(0, cfg.model.vocab_size, (2, 64), generator=gen)
    with torch.no_grad():
        for layer, heads in FORCED.items():  # in order: a forced layer changes the input of the next
            before = _max_logits(model, tokens)
            w = _attention(model, layer).linear_q_up_proj.weight.view(-1, nope + rope, cfg.model.q_lora_rank)
            for head, target in heads.items():
                w[head] *= target / float(before[layer][head])
    full = _max_logits(model, tokens)
    first, second = _max_logits(model, tokens[:1]), _max_logits(model, tokens[1:])
    for layer in range(3):
        for head in range(4):
            if head in FORCED.get(layer, {}):
                assert float(full[layer][head]) == pytest.approx(FORCED[layer][head], rel=1e-4)
            else:
                assert float(full[layer][head]) < THRESHOLD / 10
    # the step runs the two sequences as two micro-batches: some clipped head peaks in the first one, so a
    # measurement that kept only the last micro-batch would leave it above tau
    assert any(_clipped(2, h) and first[2][h] > second[2][h] for h in range(4))
    start = {n: p.detach().clone() for n, p in model[0].named_parameters()}

    def restore():
        with torch.no_grad():
            for n, p in model[0].named_parameters():
                p.copy_(start[n])

    # 1. lr = 0: the step itself changes nothing, so QK-clip alone must bring each forced head to tau
    logged = _step(cfg, model, tokens, clip=True, lr=0.0)
    assert logged == pytest.approx(1000.0, rel=1e-4)  # the max over layers and both micro-batches
    after = _max_logits(model, tokens)
    print("max logit per head before -> after one step:")
    for layer in range(3):
        print(f"  layer {layer}: {[round(float(x), 3) for x in full[layer]]} -> "
              f"{[round(float(x), 3) for x in after[layer]]}")
        for head in range(4):
            if _clipped(layer, head):
                assert float(after[layer][head]) <= THRESHOLD * (1 + 1e-5)
                assert float(after[layer][head]) == pytest.approx(THRESHOLD, rel=1e-4)
            else:
                assert torch.equal(after[layer][head], full[layer][head])
    restore()

    # 2. the real step (peak lr): QK-clip vs the same step without it, parameter by parameter
    _step(cfg, model, tokens, clip=False, lr=None)
    unclipped = {n: p.detach().clone() for n, p in model[0].named_parameters()}
    restore()
    _step(cfg, model, tokens, clip=True, lr=None)
    clipped = {n: p.detach().clone() for n, p in model[0].named_parameters()}
    restore()
    for name in clipped:
        if not any(k in name for k in ("linear_q_up_proj", "linear_kv_up_proj")):
            assert torch.equal(clipped[name], unclipped[name]), name  # k_rope (kv_down_proj), v_proj, ...
    for layer in range(3):
        prefix = f"module.decoder.layers.{layer}.self_attention."
        q = clipped[prefix + "linear_q_up_proj.weight"].view(4, nope + rope, -1)
        q0 = unclipped[prefix + "linear_q_up_proj.weight"].view(4, nope + rope, -1)
        kv = clipped[prefix + "linear_kv_up_proj.weight"].view(4, nope + v, -1)
        kv0 = unclipped[prefix + "linear_kv_up_proj.weight"].view(4, nope + v, -1)
        for head in range(4):
            if _clipped(layer, head):
                gamma = THRESHOLD / FORCED[layer][head]
                torch.testing.assert_close(q[head, :nope], q0[head, :nope] * math.sqrt(gamma), rtol=2e-4, atol=0)
                torch.testing.assert_close(q[head, nope:], q0[head, nope:] * gamma, rtol=2e-4, atol=0)
                torch.testing.assert_close(kv[head, :nope], kv0[head, :nope] * math.sqrt(gamma), rtol=2e-4, atol=0)
                assert torch.equal(kv[head, nope:], kv0[head, nope:])  # v untouched
            else:  # heads under the threshold: bit-identical
                assert torch.equal(q[head], q0[head]) and torch.equal(kv[head], kv0[head]), (layer, head)


def test_upstream_clip_qk_needs_a_float16_wrapper(mla_proxy):
    """Why ``install_muon_clip`` exists: megatron-core 0.16's ``clip_qk`` reads ``chunk.module.module.decoder``."""
    from megatron.core.optimizer.qk_clip import clip_qk as upstream

    from bridge_ext.muon import clip_qk

    _, model = mla_proxy
    with pytest.raises(AttributeError):
        upstream(model)
    assert clip_qk(model) is None  # nothing measured yet: nothing to clip, no error


# ------------------------------------------------------------------------------------------ telemetry
def test_orthogonality_error():
    import torch

    from bridge_ext.muon import orthogonality_error

    g = torch.randn(96, 48, generator=torch.Generator().manual_seed(0))
    simple, quintic = (orthogonality_error(g, coefficient_type=c) for c in ("simple", "quintic"))
    print(f"NS orthogonality error, 96x48 Gaussian: simple {simple:.3f}, quintic {quintic:.3f}")
    # Keller Jordan's coefficients trade exactness for speed: singular values land in ~[0.7, 1.2]
    assert 0.1 < simple < 0.6
    assert quintic < 0.1 and quintic < simple
    assert orthogonality_error(g, steps=1, coefficient_type="simple") > simple  # one step: far from it


@pytest.mark.slow
def test_pretrain_with_kimi_k2_preset_logs_telemetry(cpu_mode, tmp_path):
    """Megatron Bridge's real pretrain() with the kimi_k2 preset: MuonClip in the loop, telemetry every 2 steps."""
    import torch
    from megatron.bridge.training.callbacks import Callback
    from megatron.bridge.training.gpt_step import forward_step
    from megatron.bridge.training.pretrain import pretrain
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from bridge_ext.build import build_config
    from bridge_ext.cpu import configure_for_cpu
    from bridge_ext.process_state import init_single_process_distributed, reset_megatron_globals
    from bridge_ext.hf import read_config_json
    from bridge_ext.muon import MuonTelemetry, apply_preset, install_preset, resolve_schedule

    preset = PRESETS["kimi_k2"]
    cfg = build_config(dataclasses.replace(get_recipe("kimi_k2_proxy_muon"), preset=preset))
    apply_preset(cfg, preset)
    cfg.train.train_iters = 6
    cfg.train.global_batch_size, cfg.train.micro_batch_size = 4, 2  # two micro-batches per step
    cfg.checkpoint.save = cfg.checkpoint.load = None
    cfg.logger.tensorboard_dir = str(tmp_path / "tb")
    cfg.logger.log_interval = 2
    configure_for_cpu(cfg)
    resolve_schedule(cfg, preset)
    lines, rows = [], []
    telemetry = MuonTelemetry(interval=2, log=lines.append)

    class EmbeddingRows(Callback):
        def on_train_start(self, context):
            rows.extend(p.shape[0] for n, p in context.model[0].named_parameters()
                        if n.endswith("embedding.word_embeddings.weight"))

    reset_megatron_globals()
    # an in-memory gloo group instead of pretrain()'s TCP rendezvous on port 29500: concurrent runs cannot collide
    init_single_process_distributed()
    try:
        pretrain(cfg, forward_step, callbacks=[telemetry, EmbeddingRows()])
    finally:
        install_preset(PRESETS["adamw"])  # megatron-core's defaults for the other tests
        reset_megatron_globals()
        torch.distributed.destroy_process_group()
    # the model's vocabulary is its config.json's on every stack (megatron-bridge 0.6's template would let the
    # tokenizer's replace it, padded to a multiple of 1280 here: 5120 rows)
    assert rows == [read_config_json(get_recipe("kimi_k2_proxy_muon").model.config_dir)["vocab_size"]]
    assert [r["iteration"] for r in telemetry.history] == [2, 4, 6]
    for record in telemetry.history:
        # Megatron steps the scheduler after each optimizer step: step i runs at the lr of i - 1 steps of
        # the proxies' 5-step linear warm-up to 1e-2
        lr = 1e-2 * (record["iteration"] - 1) / 5
        # Moonlight: RMS 0.2 x lr x the RMS of Newton-Schulz's singular values, which Keller Jordan's
        # coefficients put in ~[0.7, 1.1] (0.857 for equal ones: test_update_rms_of_a_known_matrix)
        for group in ("muon", "muon_experts"):
            assert 0.75 < record[f"update_rms/{group}"] / (0.2 * lr) < 1.0, (group, record)
        assert 0.2 < record["update_rms/adam"] / lr < 1.05, record  # |Adam's step| <= lr early on
        assert 0.25 < record["ns_orthogonality_error"] < 0.6  # "simple" coefficients: ~0.37 (docs/muon.md)
        assert 0.0 < record["max_attention_logit"] < 100.0
    assert len(lines) == 3 and "max_attention_logit" in lines[0]
    events = EventAccumulator(str(tmp_path / "tb")).Reload()
    tags = set(events.Tags()["scalars"])
    assert {"muon/update_rms/muon", "muon/ns_orthogonality_error", "muon/max_attention_logit",
            "max-attention-logit"} <= tags, tags  # the last one: Bridge's own log of clip_qk's value


@pytest.mark.slow
def test_qwen3_logs_max_logit_and_weight_qk_clip_is_a_no_op_under_qk_norm(cpu_mode):
    """Qwen3 (GQA + QK-norm) on CPU: the max logit is measured (local attention, by our hooks); megatron-core's
    GQA ``clip_qk`` scales W_q/W_k rows, which QK-norm (RMSNorm after the projection) undoes entirely."""
    import torch

    from bridge_ext.build import build_config
    from bridge_ext.cpu import configure_for_cpu
    from bridge_ext.process_state import init_single_process_distributed
    from bridge_ext.muon import apply_preset, clip_qk, track_attention_logits

    init_single_process_distributed()
    try:
        preset = PRESETS["moonlight"]
        cfg = build_config(dataclasses.replace(get_recipe("qwen3_proxy_muon"), preset=preset))
        apply_preset(cfg, preset, runtime=False)
        cfg.model.qk_clip = True  # the option; threshold 100, alpha 0.5 (megatron-core defaults)
        configure_for_cpu(cfg)
        cfg.validate()
        torch.manual_seed(0)
        model = cfg.model.provide_distributed_model(ddp_config=cfg.ddp, use_cpu_initialization=True)
        track_attention_logits(model)
        tokens = torch.randint(0, cfg.model.vocab_size, (2, 64), generator=torch.Generator().manual_seed(1))
        positions = torch.arange(64).expand_as(tokens)
        layers = model[0].module.decoder.layers

        def measure():
            for layer in layers:
                layer.self_attention.core_attention.current_max_attn_logits = None
            with torch.no_grad():
                model[0](tokens, positions, None)
            return torch.stack([layer.self_attention.core_attention.current_max_attn_logits for layer in layers])

        natural = measure()
        assert natural.shape == (len(layers), cfg.model.num_attention_heads) and 0 < natural.max() < 100
        with torch.no_grad():  # the QK-norm gain of the keys scales every logit of the layer
            for i, layer in enumerate(layers):  # in order: a layer's output is the next one's input
                layer.self_attention.k_layernorm.weight.mul_(400.0 / float(measure()[i].max()))
        forced = measure()
        torch.testing.assert_close(forced.amax(dim=1), torch.full((len(layers),), 400.0), rtol=1e-4, atol=0)
        qkv = [layer.self_attention.linear_qkv.weight.detach().clone() for layer in layers]
        assert clip_qk(model) == pytest.approx(400.0, rel=1e-4)
        assert not torch.equal(layers[0].self_attention.linear_qkv.weight, qkv[0])  # W_q, W_k were scaled ...
        after = measure()
        # ... and the logits did not move (RMSNorm's eps aside): still 4x tau, where MLA would be at tau
        torch.testing.assert_close(after, forced, rtol=1e-3, atol=1e-3)
        assert float(after.max()) > 3.9 * 100
        print(f"qwen3 proxy: max logit {float(forced.max()):.1f} before and {float(after.max()):.1f} after clip_qk")
    finally:
        _end_process_state()
