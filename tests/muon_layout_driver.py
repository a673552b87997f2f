"""One Muon step per case, from the same weights on the same batch, in whatever layout the case names.

    python tests/fork_launch.py --nproc-per-node N tests/muon_layout_driver.py PLAN.json   (or torchrun)

PLAN.json: ``{"out": DIR, "cases": [{"name", "recipe", "layout", "overrides": [...], "values": {...}, "init": bool},
...]}`` (``overrides``: ``key=value`` strings; ``values``: dotted key -> value, as ``build_config`` takes them).
Each case builds the recipe's model and optimizer as a run does (``bridge_ext.build.build_config`` with the
case's overrides, the stack patches and the preset's run-time parts, CPU mode on gloo), then:

- ``init``: keeps the model's seeded weights and saves them to ``DIR/<recipe>-w0`` (torch_dist, through
  ``megatron.core.dist_checkpointing``); else loads them from there (resharded to this layout by the same code
  that resumes a run in another layout);
- one forward/backward of one fixed batch through megatron-core's schedule, ``finalize_model_grads``, one
  ``optimizer.step()`` at a fixed learning rate, and QK-clip where the config has it on;
- saves the stepped weights to ``DIR/<name>`` (torch_dist: the test reads them back as global tensors) and, on
  rank 0, ``DIR/<name>.json`` (loss, grad norm, max attention logit, layout, the optimizer's mode) and, in a
  1-process case, every gradient as ``DIR/<name>-grads.pt`` (by parameter name).

Used by tests/test_muon_layouts.py; one launch serves every case of its world size (Megatron's globals are
reset between cases).
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

LR = 0.02  # every param group's learning rate for the step (the schedule's warm-up would start at 0)
BATCH, SEQ = 2, 32  # one micro-batch; SEQ divisible by TP (sequence parallelism)


def batch(vocab: int):
    import torch

    gen = torch.Generator().manual_seed(1234)
    tokens = torch.randint(0, vocab, (BATCH, SEQ + 1), generator=gen)
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


def _core(chunk):
    while hasattr(chunk, "module"):
        chunk = chunk.module
    return chunk


def run_case(case: dict, out: Path) -> None:
    import torch
    import torch.distributed as dist
    from megatron.bridge.training.optim import setup_optimizer
    from megatron.core import dist_checkpointing, parallel_state
    from megatron.core.distributed.finalize_model_grads import finalize_model_grads
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from bridge_ext import patches
    from bridge_ext.build import build_config
    from bridge_ext.cpu.config import configure_for_cpu
    from bridge_ext.process_state import reset_megatron_globals
    from bridge_ext.muon import clip_qk, track_attention_logits
    from bridge_ext.muon.presets import install_preset
    from recipes import get_recipe

    reset_megatron_globals()
    recipe = get_recipe(case["recipe"])
    cfg = build_config(recipe, layout=case["layout"], overrides=case["overrides"], values=case.get("values"))
    patches.apply("stack")
    install_preset(recipe.preset)  # as bridge_ext.training.prepare: NS coefficients, gate/up split, MuonClip
    configure_for_cpu(cfg, world_size=dist.get_world_size())
    cfg.validate()
    patches.register_hooks(cfg.model)  # as bridge_ext.training.prepare: the stack rows' pre-wrap hooks
    torch.manual_seed(0)
    model = cfg.model.provide_distributed_model(ddp_config=cfg.ddp, use_cpu_initialization=True)
    tracker = track_attention_logits(model) if cfg.model.qk_clip else None
    rank = dist.get_rank()
    tp_mode = cfg.optimizer.muon_tp_mode  # megatron-core's Muon setup renames cfg.optimizer.optimizer
    kind = cfg.optimizer.optimizer

    w0 = out / f"{case['recipe']}-w0"
    state = [_core(chunk).sharded_state_dict() for chunk in model]
    assert len(state) == 1, "one model chunk per stage (no virtual pipeline here)"
    if case.get("init"):
        if rank == 0:
            w0.mkdir(parents=True)
        dist.barrier()
        dist_checkpointing.save(state[0], str(w0))
    else:
        loaded = dist_checkpointing.load(state[0], str(w0))
        missing, unexpected = _core(model[0]).load_state_dict(loaded, strict=False)
        assert not [k for k in missing if not k.endswith("_extra_state")] and not unexpected, (missing, unexpected)

    optimizer, _ = setup_optimizer(cfg.optimizer, cfg.scheduler, model, use_gloo_process_groups=True)
    for group in optimizer.param_groups:
        group["lr"] = LR
    tokens, labels = batch(cfg.model.vocab_size)
    positions = torch.arange(SEQ).expand_as(tokens)

    def forward_step(data_iterator, chunk):
        output = chunk(tokens, positions, None, labels=labels)

        def loss_func(per_token):
            loss = per_token.float().mean()
            return loss, {"loss": loss.detach()}

        return output, loss_func

    for chunk in model:
        chunk.zero_grad_buffer()
    results = get_forward_backward_func()(forward_step_func=forward_step, data_iterator=iter([None]), model=model,
                                          num_microbatches=1, seq_length=SEQ, micro_batch_size=BATCH,
                                          forward_only=False)
    finalize_model_grads(model)
    if dist.get_world_size() == 1 or case.get("rank_grads"):
        grads = {name: p.main_grad.detach().clone() for name, p in _core(model[0]).named_parameters()}
        suffix = "" if dist.get_world_size() == 1 else f"-rank{rank}"
        torch.save(grads, out / f"{case['name']}-grads{suffix}.pt")
    ok, grad_norm, _ = optimizer.step()
    assert ok
    head_max = []  # this rank's per-head maxima of the step, before the clip (every head in a 1-process case)
    if cfg.model.qk_clip:
        from bridge_ext.muon.attention_logits import attentions

        head_max = [a.core_attention.current_max_attn_logits.tolist() for a in attentions(model)]
    max_logit = clip_qk(model) if cfg.model.qk_clip else None
    if tracker is not None:
        tracker.remove()

    target = out / case["name"]
    if rank == 0:
        target.mkdir(parents=True)
    dist.barrier()
    dist_checkpointing.save(_core(model[0]).sharded_state_dict(), str(target))
    loss = torch.tensor([results[0]["loss"].item() if results else 0.0])
    dist.all_reduce(loss, op=dist.ReduceOp.MAX)  # only the last pipeline stage has it (every TP rank there)
    if rank == 0:
        o = cfg.optimizer
        (out / f"{case['name']}.json").write_text(json.dumps({
            "loss": loss.item(), "grad_norm": float(grad_norm), "max_logit": max_logit, "head_max": head_max,
            "tp": parallel_state.get_tensor_model_parallel_world_size(),
            "pp": parallel_state.get_pipeline_model_parallel_world_size(),
            "ep": parallel_state.get_expert_model_parallel_world_size(),
            "etp": parallel_state.get_expert_tensor_parallel_world_size(),
            "optimizer": kind, "muon_tp_mode": tp_mode, "lr": LR, "weight_decay": o.weight_decay,
            "qk_clip": bool(cfg.model.qk_clip), "qk_clip_threshold": cfg.model.qk_clip_threshold,
            "patches": list(patches.applied())}))
    del optimizer, model
    parallel_state.destroy_model_parallel()
    reset_megatron_globals()


def main(plan_path: str) -> int:
    from bridge_ext.cpu import enable_cpu_mode

    enable_cpu_mode()
    import torch

    from bridge_ext.build import quiet_megatron
    from bridge_ext.cpu.config import init_cpu_distributed

    quiet_megatron()
    torch.set_num_threads(1)
    plan = json.loads(Path(plan_path).read_text())
    init_cpu_distributed()
    for case in plan["cases"]:
        start = time.time()
        run_case(case, Path(plan["out"]))
        if torch.distributed.get_rank() == 0:
            print(f"CASE {case['name']} OK {time.time() - start:.1f}", flush=True)
    torch.distributed.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    sys.exit(main(sys.argv[1]))
