"""Several CPU processes (torchrun, gloo): what the layout matrix (tests/test_layout_matrix.py: every family's
layout cycle, users' pairs, exports, on every stack) does not run.

One 1-process reference run per proxy (in this process, `nemo llm pretrain` as a user runs it) saves every
iteration; one 2-process launch (``tests/parallel_driver.py``) then runs `nemo llm pretrain` phases, each
resuming the previous phase's checkpoint (or the reference's first iteration) in another layout:

- MoE proxy with the unsharded ``muon`` optimizer (the matrix runs the presets' layer-wise ``dist_muon``):
  1 -> EP2 -> DP2 -> TP2;
- dense proxy, TP2 with blockwise Muon: checked against the per-shard definition, computed here;
- dense proxy, AdamW with the distributed optimizer on DP2 (its preset's; one process has it off): two
  steps from the dense reference's first weights (fresh Adam state), against the same two steps here.

Each phase's loss must equal the reference's at that iteration, and its saved weights and Muon momentum
(read back from the torch_dist files as global tensors, layout-independent) the reference's. fp32,
``muon_fp32_matmul_prec=highest``, duplicated TP mode (each TP shard gathered: the 1-process update).
Every ordered pair of layouts per family: tests/test_layout_matrix.py (Kimi K2 and Qwen3 on 26.02 and newest,
the other two families in ``make test``). Everything is one
heavy test: under ``pytest -n 2`` a shared module fixture would run once per worker.
"""

from __future__ import annotations

import math
import shutil
import time
from pathlib import Path

import pytest
import torch

from ckpt_io import read_global_tensors
from hand_muon import newton_schulz
from parallel_driver import launch

MOE, DENSE = "qwen3_moe_proxy_muon", "qwen3_proxy_muon"
ADAMW = "qwen3_proxy_adamw"  # distributed optimizer on (both ddp. and optimizer.) wherever DP > 1
# AdamW from the dense reference's iteration-1 weights with a fresh optimizer (that checkpoint holds Muon's state)
ADAMW_RUN = ["checkpoint.load_optim=false", "train.train_iters=3"]
# exact arithmetic settings; a fixed decay horizon so that every phase sees the same schedule
EXACT = ["optimizer.muon_fp32_matmul_prec=highest", "optimizer.muon_tp_mode=duplicated",
         "scheduler.lr_decay_iters=8", "logger.log_interval=1", "checkpoint.save_interval=1"]
LOSS_TOL = 2e-6  # measured: <= 4.8e-7 (fp32 reductions in another order)
TENSOR_TOL = 5e-7  # Muon-stepped weights and momentum; measured <= 9.3e-8
# Adam-stepped tensors (embedding, output layer, norms): rows whose gradient is float noise (tokens absent
# from the batch) get m/sqrt(v) of that noise, up to a full lr step; measured <= 5.1e-5 (lr 4e-3..8e-3)
ADAM_TOL = 2e-4


def _pretrain_here(*args: str) -> None:
    """`nemo llm pretrain ARGS` in this process (one process, CPU mode)."""
    from bridge_ext import commands
    from bridge_ext.process_state import reset_megatron_globals

    reset_megatron_globals()
    save = next(a.split("=", 1)[1] for a in args if a.startswith("checkpoint.save="))
    try:
        assert commands.main(["llm", "pretrain", *args, f"logger.tensorboard_dir={save}/tb"]) == 0, args
    finally:
        reset_megatron_globals()


def _start(ref: Path, iteration: int, into: Path) -> Path:
    """A checkpoint directory holding only ``ref``'s iteration (with its tracker)."""
    name = f"iter_{iteration:07d}"
    shutil.copytree(ref / name, into / name)
    (into / "latest_checkpointed_iteration.txt").write_text(str(iteration))
    return into


def _losses(run: Path) -> dict[int, float]:
    from bridge_ext.training import read_losses

    return read_losses(run / "losses.jsonl")


def _max_differences(a: Path, b: Path) -> dict[str, float]:
    x, y = read_global_tensors(a), read_global_tensors(b)
    assert x.keys() == y.keys(), sorted(set(x) ^ set(y))
    return {key: (x[key] - y[key]).abs().max().item() for key in x}


def _run_everything(tmp: Path) -> dict:
    """Both references, the 2-process phases and the resumes back into one process; wall times printed."""
    times = {}
    t0 = time.time()
    ref = {MOE: tmp / "ref-moe", DENSE: tmp / "ref-dense"}
    _pretrain_here("--recipe", MOE, "layout=cpu", "train.train_iters=4", f"checkpoint.save={ref[MOE]}", *EXACT)
    _pretrain_here("--recipe", DENSE, "layout=cpu", "train.train_iters=2", f"checkpoint.save={ref[DENSE]}", *EXACT)
    start = {name: _start(path, 1, tmp / f"start-{name}") for name, path in ref.items()}
    adam = {"ref": tmp / "adamw-1", "dp2": tmp / "adamw-3-cpu-dp2"}
    _pretrain_here("--recipe", ADAMW, "layout=cpu", f"checkpoint.load={start[DENSE]}", f"checkpoint.save={adam['ref']}",
                   *EXACT, *ADAMW_RUN)
    times["references (1 process, in this process)"] = time.time() - t0

    phases: list[tuple[str, str, int, str, list[str]]] = []  # (run dir, recipe, iteration, layout, extra)

    def chain(tag: str, recipe: str, layouts: list[str], extra: list[str]) -> None:
        load = start[recipe]
        for iteration, layout in enumerate(layouts, start=2):
            save = tmp / f"{tag}-{iteration}-{layout}"
            phases.append((str(save), recipe, iteration, layout, [f"checkpoint.load={load}", *extra]))
            load = save

    chain("B", MOE, ["cpu-ep2", "cpu-dp2", "cpu-tp2"], ["optimizer.optimizer=muon"])
    chain("W", DENSE, ["cpu-tp2"], ["optimizer.muon_tp_mode=blockwise"])       # overrides EXACT's duplicated
    plan = [["--recipe", recipe, f"layout={layout}", f"train.train_iters={iteration}", f"checkpoint.save={save}",
             f"logger.tensorboard_dir={save}/tb", *EXACT, *extra] for save, recipe, iteration, layout, extra in phases]
    plan.append(["--recipe", ADAMW, "layout=cpu-dp2", f"checkpoint.load={start[DENSE]}", f"checkpoint.save={adam['dp2']}",
                 f"logger.tensorboard_dir={adam['dp2']}/tb", *EXACT, *ADAMW_RUN])
    t0 = time.time()
    out = launch(plan, tmp, nproc=2)
    times[f"{len(plan)} phases in one 2-process launch"] = time.time() - t0
    print("\n" + "\n".join(f"{what}: {seconds:.1f} s" for what, seconds in times.items()))
    print(out)
    runs = [(Path(save), recipe, iteration, layout) for save, recipe, iteration, layout, _ in phases]
    return {"ref": ref, "runs": runs, "tmp": tmp, "adamw": adam}


def _check_every_layout_and_every_resume_computes_the_one_process_loss(runs):
    worst = {}
    for save, recipe, iteration, layout in runs["runs"]:
        if save.name.startswith("W"):
            continue  # blockwise: another update by definition
        got = _losses(save)
        expected = _losses(runs["ref"][recipe])[iteration]
        assert list(got) == [iteration], (save.name, got)
        assert math.isfinite(got[iteration])
        worst[save.name] = abs(got[iteration] - expected)
        assert worst[save.name] <= LOSS_TOL, (save.name, got[iteration], expected)
    print("\nloss |multi-process or resumed - 1 process|:", {k: f"{v:.1e}" for k, v in worst.items()})


def _adam_updated(key: str) -> bool:
    """Tensors AdamW steps (the preset's Adam part): embedding, output layer, norms, and Adam's own state."""
    return key.startswith("optimizer.state.exp_avg") or not key.endswith("weight") or any(
        part in key for part in ("embedding", "output_layer", "norm"))


def _check_resumed_weights_and_muon_momentum_equal_the_straight_run(runs):
    worst_muon, worst_adam, failures = {}, {}, []
    for save, recipe, iteration, layout in runs["runs"]:
        if save.name.startswith("W"):
            continue
        name = f"iter_{iteration:07d}"
        differences = _max_differences(save / name, runs["ref"][recipe] / name)
        momentum = [k for k in differences if k.startswith("optimizer.state.momentum_buffer.")]
        assert momentum and any(not k.startswith("optimizer.") for k in differences), save.name
        if recipe == MOE:
            assert any(".experts." in k for k in momentum), save.name  # expert momentum resharded too
        muon = {k: v for k, v in differences.items() if not _adam_updated(k)}
        adam = {k: v for k, v in differences.items() if _adam_updated(k)}
        worst_muon[save.name], worst_adam[save.name] = max(muon.values()), max(adam.values())
        failures += [(save.name, k, v) for k, v in muon.items() if v > TENSOR_TOL]
        failures += [(save.name, k, v) for k, v in adam.items() if v > ADAM_TOL]
    print("\nmax |Muon-stepped weight or momentum - straight run|:", {k: f"{v:.1e}" for k, v in worst_muon.items()})
    print("max |Adam-stepped weight or state - straight run|:", {k: f"{v:.1e}" for k, v in worst_adam.items()})
    assert not failures, failures


def _check_dp2_adamw_with_the_distributed_optimizer_computes_the_one_process_steps(runs):
    """Two AdamW steps on DP2 with the distributed optimizer (Adam state sharded over the two ranks, saved as
    its per-bucket shards) give the 1-process run's losses and weights."""
    ref, dp2 = runs["adamw"]["ref"], runs["adamw"]["dp2"]
    got, expected = _losses(dp2), _losses(ref)
    assert list(got) == list(expected) == [2, 3], (got, expected)
    loss = max(abs(got[i] - expected[i]) for i in got)
    x, y = read_global_tensors(dp2 / "iter_0000003"), read_global_tensors(ref / "iter_0000003")
    # the distributed optimizer saved its sharded buckets; one process saved per-parameter Adam state
    assert any(k.startswith("optimizer.distributed.") for k in x), sorted(x)
    assert not any(k.startswith("optimizer.distributed.") for k in y)
    assert any(k.startswith("optimizer.state.exp_avg_sq.") for k in y)
    weights = sorted(k for k in y if not k.startswith("optimizer."))
    assert weights and weights == sorted(k for k in x if not k.startswith("optimizer.")), sorted(set(x) ^ set(y))
    assert any("embedding" in k for k in weights) and any("linear_fc1.weight" in k for k in weights)
    worst = max((x[k] - y[k]).abs().max().item() for k in weights)
    print(f"\nDP2 AdamW distributed optimizer vs 1 process: loss {loss:.1e}, weights {worst:.1e}")
    assert loss <= LOSS_TOL
    assert worst <= ADAM_TOL  # every tensor here is Adam-stepped


def _check_tp2_blockwise_orthogonalizes_each_shard_alone(runs):
    """W2 = W1 (1 - lr wd) - lr * 0.2 sqrt(max(shard shape)) NS(u_shard), per TP shard of linear_proj (row
    parallel: split along its input dimension), with u the Nesterov vector recovered from the saved momenta
    (m2 = m1 lerp g by 1-beta; u = g lerp m2 by beta) and lr the warm-up's 1e-2 * 1/5 (the scheduler has
    stepped once when iteration 2 steps). The same formula with the whole matrix must give the duplicated
    (1-process) run's W2: a control that the formula is Muon's."""
    from recipes.optimizers import MOONLIGHT

    before = read_global_tensors(runs["ref"][DENSE] / "iter_0000001")
    after = read_global_tensors(runs["tmp"] / "W-2-cpu-tp2" / "iter_0000002")
    duplicated = read_global_tensors(runs["ref"][DENSE] / "iter_0000002")
    key = "decoder.layers.self_attention.linear_proj.weight"
    beta, lr, wd, extra = MOONLIGHT.optimizer["muon_momentum"], 1e-2 / 5, 0.1, 0.2
    for layer in range(before[key].shape[0]):
        w1, w2 = before[key][layer].double(), after[key][layer].double()
        m1 = before[f"optimizer.state.momentum_buffer.{key}"][layer].double()
        m2 = after[f"optimizer.state.momentum_buffer.{key}"][layer].double()
        g = (m2 - beta * m1) / (1 - beta)
        u = g + beta * (m2 - g)
        shards = torch.chunk(u, 2, dim=1)
        blockwise = torch.cat([newton_schulz(s) * extra * math.sqrt(max(s.shape)) for s in shards], dim=1)
        whole = newton_schulz(u) * extra * math.sqrt(max(u.shape))
        error = (w2 - (w1 * (1 - lr * wd) - lr * blockwise)).abs().max().item()
        control = (duplicated[key][layer].double() - (w1 * (1 - lr * wd) - lr * whole)).abs().max().item()
        other = (w2 - (w1 * (1 - lr * wd) - lr * whole)).abs().max().item()
        print(f"\nlayer {layer}: |W2 - blockwise definition| {error:.1e}; whole-matrix formula vs the 1-process "
              f"run {control:.1e}, vs blockwise W2 {other:.1e}")
        assert error <= 1e-6 and control <= 1e-6
        assert other > 100 * max(error, 1e-7)  # the check tells the two modes apart


@pytest.mark.slow
@pytest.mark.heavy
def test_several_processes_compute_what_one_does_and_resume_in_any_layout(cpu_mode, tmp_path):
    """One test (xdist would run a shared module fixture once per worker): the launches, then each check."""
    runs = _run_everything(tmp_path)
    _check_every_layout_and_every_resume_computes_the_one_process_loss(runs)
    _check_resumed_weights_and_muon_momentum_equal_the_straight_run(runs)
    _check_tp2_blockwise_orthogonalizes_each_shard_alone(runs)
    _check_dp2_adamw_with_the_distributed_optimizer_computes_the_one_process_steps(runs)


@pytest.mark.slow
@pytest.mark.once  # CPU mode's distributed-optimizer fixes apply on every stack: tests/prove_patches.py runs it there
def test_adamw_resumes_at_dp2_as_it_ran_on(tmp_path):
    """AdamW with the distributed optimizer (Adam state sharded over DP2) saved at iteration 2 and resumed at DP2
    computes iterations 3 and 4 as the run that went on: the same losses and, after two resumed steps, the same
    weights to the bit, so the same moments and step counts (every parameter here is Adam's). CPU mode's
    distrib-optimizer-* rows: megatron-core's resume path without Apex or TE."""
    common = ["--recipe", ADAMW, "layout=cpu-dp2", "logger.log_interval=1", "checkpoint.save_interval=1",
              "scheduler.lr_decay_iters=8"]
    straight, first, resumed = tmp_path / "straight", tmp_path / "first", tmp_path / "resumed"
    launch([[*common, "train.train_iters=4", f"checkpoint.save={straight}", f"logger.tensorboard_dir={straight}/tb"],
            [*common, "train.train_iters=2", f"checkpoint.save={first}", f"logger.tensorboard_dir={first}/tb"],
            [*common, "train.train_iters=4", f"checkpoint.load={first}", f"checkpoint.save={resumed}",
             f"logger.tensorboard_dir={resumed}/tb"]], tmp_path, nproc=2)
    got, expected = _losses(resumed), _losses(straight)
    assert list(got) == [3, 4] and list(expected) == [1, 2, 3, 4]
    assert got == {i: expected[i] for i in got}
    x, y = read_global_tensors(resumed / "iter_0000004"), read_global_tensors(straight / "iter_0000004")
    assert any(k.startswith("optimizer.distributed.") for k in x)  # the Adam state was saved and loaded sharded
    weights = sorted(k for k in y if not k.startswith("optimizer."))
    assert weights and weights == sorted(k for k in x if not k.startswith("optimizer."))
    assert {k: (x[k] - y[k]).abs().max().item() for k in weights} == {k: 0.0 for k in weights}


def test_relayout_targets_match_upstream():
    from bridge_ext import patches

    assert patches.problems(next(p for p in patches.REGISTRY if p.name == "relayout-optimizer-load")) == []


@pytest.mark.parametrize(("layout", "world", "kept"), [("cpu-tp2", 2, True), ("cpu-ep2", 2, True),
                                                        ("cpu-tp2-ep2", 4, True), ("cpu-tp2", 1, False)])
def test_configure_for_cpu_keeps_the_layout_a_launch_holds(layout, world, kept):
    from bridge_ext.build import build_config
    from bridge_ext.cpu import configure_for_cpu
    from recipes import get_recipe

    recipe = get_recipe(MOE)
    cfg = build_config(recipe, layout=layout)
    sizes = recipe.layout(layout)
    note = configure_for_cpu(cfg, world_size=world)
    m = cfg.model
    got = (m.tensor_model_parallel_size, m.expert_model_parallel_size, m.sequence_parallel)
    if kept:
        assert note is None and got == (sizes.tp, sizes.ep, sizes.tp > 1)
        assert cfg.optimizer.optimizer == "dist_muon"  # the preset's layer-wise Muon runs as it is
    else:
        assert got == (1, 1, False)
        assert note == ("CPU mode: TP2 PP1 CP1 EP1 needs 2 processes and this is one: training with every "
                        "parallel size 1 (launch with `torchrun --nproc-per-node 2` to keep them)")
    assert cfg.model.transformer_impl == "local" and cfg.dist.distributed_backend == "gloo"


def test_configure_for_cpu_refuses_a_world_size_that_cannot_hold_the_layout():
    from bridge_ext.build import build_config
    from bridge_ext.cpu import configure_for_cpu
    from bridge_ext.errors import UserError
    from recipes import get_recipe

    cfg = build_config(get_recipe(MOE), layout="cpu-tp2-ep2")
    with pytest.raises(UserError) as raised:
        configure_for_cpu(cfg, world_size=3)
    assert str(raised.value) == ("TP2 PP1 CP1 EP2 needs a multiple of 2 processes, launched with 3; use "
                                 "`torchrun --nproc-per-node 2` or a layout for 3 processes")
