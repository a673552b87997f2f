"""What initialization by name costs (docs/cpu.md, "The same run from step 0 in every layout"), in one run:

1. a proxy's model on one process: megatron-core building it (``provide_distributed_model``, its own init
   included) against ``bridge_ext.initialization.init_by_name`` redrawing it;
2. the draw itself at the real layout's tensor sizes: Kimi K2's routed-expert matrices (7168 x 2048, bf16), each
   seeded by name, against the same draws from one running generator (megatron-core's way); the rate times a
   ``gb300x256`` rank's bytes (TP1, PP4 x VP4, EP64: ~5 B parameters, 10 GB in bf16) gives the seconds per rank
   on this machine's CPU (a GPU draws on the device, orders of magnitude faster; not measured here).

    python bench/init_by_name.py [RECIPE] [MATRICES]
"""

from __future__ import annotations

import functools
import sys
import time

import torch

RANK_BYTES_KIMI = 10e9  # bf16: ~4 B routed-expert + ~1 B attention, shared-expert and embedding parameters per rank


def model_cost(recipe: str) -> tuple[float, float]:
    from bridge_ext import initialization
    from bridge_ext.api import prepare_for_this_machine, recipe_config

    cfg = recipe_config(recipe, overrides=["train.train_iters=1", "checkpoint.save=null", "checkpoint.load=null"])
    callbacks = prepare_for_this_machine(cfg, data="mock")  # CPU mode first: it makes Megatron importable here
    from megatron.bridge.training.gpt_step import forward_step
    from megatron.bridge.training.pretrain import pretrain

    seconds = {}
    provide = cfg.model.provide_distributed_model

    @functools.wraps(provide)
    def timed_provide(*args, **kwargs):
        start = time.perf_counter()
        try:
            return provide(*args, **kwargs)
        finally:
            seconds["build"] = time.perf_counter() - start

    redraw = initialization.init_by_name

    def timed_redraw(model, **kwargs):
        start = time.perf_counter()
        try:
            return redraw(model, **kwargs)
        finally:
            seconds["redraw"] = time.perf_counter() - start

    cfg.model.provide_distributed_model = timed_provide
    cfg.model._pre_wrap_hooks = [functools.partial(timed_redraw, seed=cfg.rng.seed)]  # ours, timed
    pretrain(cfg, forward_step, callbacks=callbacks)
    return seconds["build"] - seconds["redraw"], seconds["redraw"]


def draw_rate(matrices: int) -> tuple[float, float]:
    from bridge_ext.initialization import name_seed

    shape, std = (7168, 2048), 0.006
    out = torch.empty(shape, dtype=torch.bfloat16)
    start = time.perf_counter()
    torch.manual_seed(0)
    for _ in range(matrices):
        out.normal_(0, std)
    running = time.perf_counter() - start
    start = time.perf_counter()
    for i in range(matrices):
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(name_seed(1234, f"decoder.layers.{i}.mlp.experts.linear_fc1.weight{i}"))
            out.normal_(0, std)
    by_name = time.perf_counter() - start
    return matrices * out.numel() * 2 / by_name, by_name / running


def main(recipe: str = "kimi_k2_proxy_muon", matrices: int = 40) -> None:
    build, redraw = model_cost(recipe)
    rate, ratio = draw_rate(matrices)
    print(f"{recipe} on one process: megatron-core builds the model in {build:.2f} s, init_by_name redraws it in "
          f"{redraw:.3f} s ({redraw / build:.1%} of the build)")
    print(f"Kimi K2 expert matrices (7168 x 2048 bf16): seeded by name {rate / 1e9:.2f} GB/s on {torch.get_num_threads()}"
          f" CPU threads, {ratio:.2f}x the draws from one running generator; a gb300x256 rank's "
          f"{RANK_BYTES_KIMI / 1e9:.0f} GB: {RANK_BYTES_KIMI / rate:.0f} s at this CPU rate")


if __name__ == "__main__":
    main(*(sys.argv[1:2] or ["kimi_k2_proxy_muon"]), *(int(a) for a in sys.argv[2:3]))
