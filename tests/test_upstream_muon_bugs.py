"""One test per known upstream Muon bug (shared/reference/containers.md, "Known upstream Muon bugs"), on every
stack: each asserts that the bug's symptom is absent, through our patch where the installed code has the bug
(``bridge_ext/patches/transformer.py``, ``bridge_ext/patches/checkpointing.py``; each decided by probing or reading the
installed code: ``bridge_ext/muon/checks.py``), or that the combination is refused in one line.

- Megatron-LM PR 7382, QK-clip: a head whose max logit is <= 0 (NaN), the distributed optimizer's flat master.
- Megatron-LM PR 6920 (a resume under layer-wise Muon continues from another model) and issue 2625 (a
  ``dist_muon`` checkpoint whose param groups differ by override values fails to load under PP): one 2-process
  launch (``tests/parallel_driver.py``) serves both.
- Megatron-LM issue 2164 (``dist_muon`` with the distributed optimizer: a confusing error at launch).
- Megatron-Bridge issue 2307 (``layer_wise_optimizer_*.pt`` in the checkpoint root with the ``torch`` format).
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import pytest
import torch
from ckpt_io import read_global_tensors
from parallel_driver import launch

from bridge_ext import commands
from bridge_ext.muon import checks
from bridge_ext.stack import module_source
from recipes import get_recipe

pytestmark = pytest.mark.stack

ROOT = Path(__file__).resolve().parent.parent
MLA, GQA = "megatron.core.transformer.multi_latent_attention", "megatron.core.transformer.attention"


def _dryrun(capsys, tmp_path, monkeypatch, *argv: str) -> tuple[int, str]:
    """``nemo llm pretrain ARGV --dryrun`` in this process, in an empty directory; (exit code, stderr)."""
    monkeypatch.chdir(tmp_path)
    code = commands.main(["llm", "pretrain", *argv, "--dryrun"])
    return code, capsys.readouterr().err


def _refused(code: int, err: str, tmp_path: Path, *names: str) -> None:
    assert code == 2 and err.startswith("error: ") and err.count("\n") == 1, err
    assert all(name in err for name in names), err
    assert list(tmp_path.iterdir()) == []  # nothing written


# ---------------------------------------------------------------------------------------- PR 7382: QK-clip
TAU = 100.0
FORCED = (400.0, -3.0, 250.0, 0.0)  # layer 2's per-head max logits: two above tau, one negative, one zero


@pytest.fixture
def kimi_proxy(cpu_mode):
    """The kimi_k2 proxy (MLA, the kimi_k2 preset: QK-clip tau 100, alpha 0.5) built on CPU, one process."""
    from bridge_ext.build import build_config
    from bridge_ext.cpu import configure_for_cpu
    from bridge_ext.process_state import init_single_process_distributed, reset_megatron_globals

    init_single_process_distributed()
    cfg = build_config(get_recipe("kimi_k2_proxy_muon"))
    configure_for_cpu(cfg)
    cfg.validate()
    torch.manual_seed(0)
    model = cfg.model.provide_distributed_model(ddp_config=cfg.ddp, use_cpu_initialization=True)
    yield cfg, model
    reset_megatron_globals()
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


@pytest.mark.slow
def test_qk_clip_leaves_a_head_with_a_nonpositive_max_logit_untouched(kimi_proxy):
    """Megatron-LM PR 7382: megatron-core's MLA ``clip_qk`` takes eta = tau / S_max, then eta ** alpha: a head
    whose max logit is negative gets NaN weights. After MuonClip's step (``bridge_ext.muon.clip_qk``) on the
    Kimi K2 proxy, with layer 2's maxima forced to (400, -3, 250, 0): no NaN anywhere, the heads at or under
    tau bit for bit untouched, the others scaled by gamma = min(1, tau / S_max) (arXiv 2507.20534, Algorithm 1:
    q_nope and k_nope by sqrt(gamma) for alpha 0.5, q_rope by gamma, v and the shared k_rope untouched)."""
    from megatron.core.transformer.multi_latent_attention import MLASelfAttention

    from bridge_ext import patches
    from bridge_ext.muon import clip_qk

    cfg, model = kimi_proxy
    m = cfg.model
    assert m.qk_clip and (m.qk_clip_threshold, m.qk_clip_alpha, m.num_attention_heads) == (TAU, 0.5, 4)
    nope, rope, v = m.qk_head_dim, m.qk_pos_emb_head_dim, m.v_head_dim
    buggy = checks.nonpositive_logit_nans(MLA, "MLASelfAttention")  # the installed upstream, on a stub
    assert ("qk-clip-nonpositive-logit-mla" in patches.applied()) == buggy
    layers = model[0].module.decoder.layers
    attention = layers[2].self_attention
    start = {n: p.detach().clone() for n, p in model[0].named_parameters()}

    def force() -> None:
        for layer in layers:
            layer.self_attention.core_attention.current_max_attn_logits = None
        layers[1].self_attention.core_attention.current_max_attn_logits = torch.tensor([-1.0, -2.0, -0.5, -4.0])
        attention.core_attention.current_max_attn_logits = torch.tensor(FORCED)

    # upstream's own clip_qk on this model: NaN exactly where the stub probe says the installed code has the bug
    force()
    with torch.no_grad():
        getattr(MLASelfAttention.clip_qk, "_bridge_ext_original", MLASelfAttention.clip_qk)(attention)
        assert bool(torch.isnan(attention.linear_q_up_proj.weight).any()) == buggy
        for name, param in model[0].named_parameters():
            param.copy_(start[name])

    force()
    assert clip_qk(model) == 400.0  # the logged maximum: the real one
    after = {n: p.detach().clone() for n, p in model[0].named_parameters()}
    prefix = "module.decoder.layers.2.self_attention."
    for name, tensor in after.items():
        assert torch.isfinite(tensor).all(), name
        if name not in (prefix + "linear_q_up_proj.weight", prefix + "linear_kv_up_proj.weight"):
            assert torch.equal(tensor, start[name]), name  # layer 1 (all maxima negative), k_rope, v, ...
    q0, q1 = (w[prefix + "linear_q_up_proj.weight"].view(4, nope + rope, -1) for w in (start, after))
    kv0, kv1 = (w[prefix + "linear_kv_up_proj.weight"].view(4, nope + v, -1) for w in (start, after))
    for head, s_max in enumerate(FORCED):
        if s_max <= TAU:
            assert torch.equal(q1[head], q0[head]) and torch.equal(kv1[head], kv0[head]), head
            continue
        gamma = TAU / s_max
        torch.testing.assert_close(q1[head, :nope], q0[head, :nope] * math.sqrt(gamma), rtol=1e-6, atol=0)
        torch.testing.assert_close(q1[head, nope:], q0[head, nope:] * gamma, rtol=1e-6, atol=0)
        torch.testing.assert_close(kv1[head, :nope], kv0[head, :nope] * math.sqrt(gamma), rtol=1e-6, atol=0)
        assert torch.equal(kv1[head, nope:], kv0[head, nope:]), head


def test_qk_clip_as_it_runs_now_keeps_a_negative_head_on_mla_and_gqa(cpu_mode):
    """Megatron-LM PR 7382, GQA too (``SelfAttention.clip_qk`` has the same eta): the ``clip_qk`` that runs now
    (patched where needed) leaves a head with a negative max logit untouched on a two-head probe, and still
    scales the head above tau."""
    from megatron.core.transformer.attention import SelfAttention
    from megatron.core.transformer.multi_latent_attention import MLASelfAttention

    for module, cls in ((MLA, MLASelfAttention), (GQA, SelfAttention)):
        assert not checks.nonpositive_logit_nans(module, cls.__name__, clip_qk=cls.clip_qk), cls.__name__


def test_qk_clip_on_adamws_sharded_master_is_refused_in_one_line(capsys, tmp_path, monkeypatch):
    """Megatron-LM PR 7382, the distributed optimizer: ``clip_qk`` views the fp32 master of q/k as the whole
    matrix; AdamW's distributed optimizer keeps a flat shard of it (bf16 runs): refused before the launch
    where the installed ``clip_qk`` fails on such a shard."""
    code, err = _dryrun(capsys, tmp_path, monkeypatch, "--recipe", "kimi_k2_adamw", "model.qk_clip=true")
    if checks.sharded_master_fails():
        _refused(code, err, tmp_path, "model.qk_clip", "PR 7382", "use_distributed_optimizer=false")
    else:
        assert "PR 7382" not in err


# ----------------------------------------------------------------------------------------- issue 2164
def test_dist_muon_with_the_distributed_optimizer_is_one_clear_line(capsys, tmp_path, monkeypatch):
    """Megatron-LM issue 2164: where megatron-core's Muon refuses the distributed optimizer ("muon with dist
    optimizer is not supported", after the model is built), the dry run says so in one line with the fix."""
    code, err = _dryrun(capsys, tmp_path, monkeypatch, "--recipe", "qwen3_0p6b_muon",
                        "optimizer.use_distributed_optimizer=true")
    if "muon with dist optimizer is not supported" in module_source("megatron.core.optimizer.muon"):
        _refused(code, err, tmp_path, "dist_muon", "issue 2164", "use_distributed_optimizer=false")
    else:
        assert "issue 2164" not in err


# ----------------------------------------------------------------------------------------- issue 2307
def test_layer_wise_optimizer_files_with_the_torch_format(capsys, tmp_path, monkeypatch):
    """Megatron-Bridge issue 2307: with ``ckpt_format=torch`` Megatron Bridge writes the layer-wise optimizer's
    state to ``<save>/layer_wise_optimizer_<rank>.pt``, overwritten by every save: refused in one line where the
    installed ``save_checkpoint`` puts it there; elsewhere the 2-process launch below saves twice and checks
    that each iteration keeps its own files."""
    code, err = _dryrun(capsys, tmp_path, monkeypatch, "--recipe", "qwen3_proxy_muon", "layout=cpu-dp2",
                        "checkpoint.ckpt_format=torch", f"checkpoint.save={tmp_path / 'ckpt'}")
    if checks.layer_wise_file_in_root():
        _refused(code, err, tmp_path, "checkpoint.ckpt_format=torch", "issue 2307", "torch_dist")
    else:
        assert "issue 2307" not in err


# ------------------------------------------------------------ PR 6920 and issue 2625: one 2-process launch
RECIPE = "qwen3_proxy_muon"  # the moonlight preset: dist_muon (layer-wise), AdamW for the rest
EXACT = ["optimizer.muon_fp32_matmul_prec=highest", "optimizer.muon_tp_mode=duplicated", "scheduler.lr_decay_iters=8",
         "logger.log_interval=1", "checkpoint.save_interval=1", "logger.tensorboard_dir=null"]
DECOUPLED_LR = 0.02  # the recipe's lr is 0.01


def _overridden_groups() -> list[str]:
    """Two AdamW param groups equal but for an override value: ``optimizer.decoupled_lr`` gives the embedding
    and output layer a group of their own (``max_lr``); q/k-layernorm weights with weight decay land in the
    default group next to it. (TensorBoard off: Megatron Bridge 0.3 logs a None decoupled lr there.)"""
    from megatron.bridge.training.config import OptimizerConfig, SchedulerConfig

    out = [f"optimizer.decoupled_lr={DECOUPLED_LR}"]
    if "no_weight_decay_cond_type" in {f.name for f in dataclasses.fields(SchedulerConfig)}:  # MB <= 0.4
        out.append("scheduler.no_weight_decay_cond_type=qwen3_next")
    if "apply_wd_to_qk_layernorm" in {f.name for f in dataclasses.fields(OptimizerConfig)}:  # megatron-core 0.17+
        out.append("optimizer.apply_wd_to_qk_layernorm=true")
    return out


def _launch(tmp: Path) -> dict[str, Path]:
    """S: DP2, 3 iterations straight (saved at each). R: DP2 resumed from S's iteration 1 to 2 (PR 6920).
    P1: PP2 resumed from S's iteration 1 to 2, saved by PP2; P2: PP2 resumed from P1 to 3 (issue 2625).
    T (only where the torch format is not refused): DP2, torch format, saved at iterations 1 and 2 (2307)."""
    runs = {name: tmp / name for name in ("S", "R", "P1", "P2", "T")}
    common = [*EXACT, *_overridden_groups()]

    def phase(name: str, layout: str, iters: int, *extra: str) -> list[str]:
        return ["--recipe", RECIPE, f"layout={layout}", f"train.train_iters={iters}",
                f"checkpoint.save={runs[name]}", *common, *extra]

    plan = [phase("S", "cpu-dp2", 3),
            phase("R", "cpu-dp2", 2, f"checkpoint.load={runs['S']}", "checkpoint.ckpt_step=1"),
            phase("P1", "cpu-pp2", 2, f"checkpoint.load={runs['S']}", "checkpoint.ckpt_step=1"),
            phase("P2", "cpu-pp2", 3, f"checkpoint.load={runs['P1']}")]
    if not checks.layer_wise_file_in_root():
        plan.append(phase("T", "cpu-dp2", 2, "checkpoint.ckpt_format=torch"))
    print(launch(plan, tmp, nproc=2, timeout=1200))
    return runs


def _losses(run: Path) -> dict[int, float]:
    from bridge_ext.training import read_losses

    return read_losses(run / "losses.jsonl")


def _param_groups(iteration_dir: Path) -> list[dict]:
    """The optimizers' param groups as saved (the common state: common.pt in megatron-core 0.16, inside the DCP
    files in 0.19, read by its own loader; ``params`` left out), every chained optimizer's."""
    from megatron.core import dist_checkpointing

    found: list[dict] = []

    def walk(node) -> None:
        if isinstance(node, dict):
            if isinstance(node.get("param_groups"), list):
                found.extend({k: v for k, v in g.items() if k != "params"} for g in node["param_groups"])
            for value in node.values():
                walk(value)

    walk(dist_checkpointing.load_common_state_dict(str(iteration_dir))["optimizer"])
    return found


def _check_resume_equals_the_straight_run(runs: dict[str, Path]) -> None:
    """PR 6920: DP2 layer-wise Muon resumed from iteration 1 computes iteration 2 as the straight run did:
    the same loss and, bit for bit, every weight, Muon momentum and Adam state it saves."""
    assert _losses(runs["R"]) == {2: _losses(runs["S"])[2]}
    resumed = read_global_tensors(runs["R"] / "iter_0000002")
    straight = read_global_tensors(runs["S"] / "iter_0000002")
    assert resumed.keys() == straight.keys()
    assert any(k.startswith("optimizer.state.momentum_buffer.") for k in straight)  # Muon's state is in there
    different = [k for k in straight if not torch.equal(resumed[k], straight[k])]
    assert not different, different


def _check_pp2_checkpoint_with_overridden_groups_loads(runs: dict[str, Path]) -> None:
    """Issue 2625: a dist_muon checkpoint saved by PP2, whose AdamW groups differ only by max_lr, loads on PP2
    and trains iteration 3 as the straight run (loss, tensors, each group's learning rate)."""
    identity = ("wd_mult", "lr_mult", "is_expert_parallel", "is_decoupled_lr")
    saved = _param_groups(runs["P1"] / "iter_0000002")
    decoupled = [g for g in saved if g["max_lr"] == DECOUPLED_LR]
    twins = [g for g in saved if g["max_lr"] != DECOUPLED_LR and all(g[k] == decoupled[0][k] for k in identity)]
    assert len(decoupled) == 1 and twins, saved  # what megatron-core 0.16-0.18 could not tell apart
    assert abs(_losses(runs["P2"])[3] - _losses(runs["S"])[3]) <= 2e-6
    got = read_global_tensors(runs["P2"] / "iter_0000003")
    expected = read_global_tensors(runs["S"] / "iter_0000003")
    assert got.keys() == expected.keys()
    worst = {k: (got[k] - expected[k]).abs().max().item() for k in expected}
    assert max(worst.values()) <= 2e-4, worst  # measured 0; another group's lr moves Adam's weights ~4e-3
    lrs = sorted((g["max_lr"], g["wd_mult"], g["lr"]) for g in _param_groups(runs["P2"] / "iter_0000003"))
    assert lrs == sorted((g["max_lr"], g["wd_mult"], g["lr"]) for g in _param_groups(runs["S"] / "iter_0000003"))


def _check_torch_format_keeps_each_iterations_files(run: Path) -> None:
    """Issue 2307, where the installed Megatron Bridge saves them per iteration: none in the root, each
    iteration's own."""
    assert not list(run.glob("layer_wise_optimizer_*.pt")), sorted(p.name for p in run.iterdir())
    files = [sorted((run / f"iter_{i:07d}").rglob("layer_wise_optimizer_*.pt")) for i in (1, 2)]
    assert files[0] and len(files[0]) == len(files[1])
    assert any(a.read_bytes() != b.read_bytes() for a, b in zip(*files))


@pytest.mark.slow
def test_layer_wise_muon_resumes_as_the_straight_run_and_loads_overridden_groups_under_pp(tmp_path):
    """Megatron-LM PR 6920 (resume under layer-wise Muon: the run must continue from the model it saved) and
    issue 2625 (a dist_muon checkpoint with override-dependent param groups must load under PP), one launch.
    fp32 on CPU: PR 6920's bf16 master-to-model staging does not run here; its symptom is what is checked.
    The same on a torch-format save where Megatron-Bridge issue 2307 is not refused."""
    runs = _launch(tmp_path)
    _check_resume_equals_the_straight_run(runs)
    _check_pp2_checkpoint_with_overridden_groups_loads(runs)
    if runs["T"].exists():
        _check_torch_format_keeps_each_iterations_files(runs["T"])
