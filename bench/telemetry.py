"""Muon telemetry's cost per iteration on a proxy recipe, measured in one run.

    .venv/bin/python bench/telemetry.py [--recipe qwen3_proxy_muon] [--iters 60] [--threads 1]

Trains the recipe with Megatron Bridge's real ``pretrain()`` (``gpt_step.forward_step``, mock data; CPU mode
when no GPU is visible), prepared by ``bridge_ext.training.prepare`` exactly as ``nemo llm pretrain`` does,
with ``MuonTelemetry`` logging every second iteration: the logged iterations (parameter snapshots, update
RMS, Newton-Schulz orthogonality error, the max attention logit) alternate with unlogged ones in the same
run, so a busy machine slows both alike. Then a run without telemetry, for the cost of the idle hooks.
Each iteration is timed from before the first callback of ``on_train_step_start`` to after the last of
``on_train_step_end`` (the callbacks' own work is inside); the first ``--warmup`` iterations and those on
which Megatron itself logs (``logger.log_interval``) are dropped. Prints the medians, the ratio logged /
unlogged, and what telemetry costs per iteration at the recipe's log interval L (it logs only then):
1 + (ratio - 1) / L.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import statistics
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


class _Clock:
    """Two callbacks around all others: one opens each iteration's timer, the other closes it."""

    def __init__(self) -> None:
        self.times: dict[int, float] = {}  # iteration -> ms
        self._start = 0.0
        clock = self

        class Open:
            def on_train_step_start(self, context: Any) -> None:
                clock._sync()
                clock._start = time.perf_counter()

        class Close:
            def on_train_step_end(self, context: Any) -> None:
                clock._sync()
                clock.times[context.state.train_state.step + 1] = (time.perf_counter() - clock._start) * 1000

        self.open, self.close = Open(), Close()

    @staticmethod
    def _sync() -> None:
        import torch

        if torch.cuda.is_available():
            torch.cuda.synchronize()


def _run(recipe_name: str, *, telemetry: bool, iters: int, device: str) -> tuple[dict[int, float], int]:
    """Milliseconds per iteration of one run, and the recipe's log interval."""
    import torch
    from megatron.bridge.training.gpt_step import forward_step
    from megatron.bridge.training.pretrain import pretrain

    from bridge_ext import training
    from bridge_ext.build import build_config
    from bridge_ext.process_state import init_single_process_distributed, reset_megatron_globals
    from recipes import get_recipe

    recipe = get_recipe(recipe_name)
    cfg = build_config(recipe, values={"train.train_iters": iters})
    cfg.checkpoint.save = cfg.checkpoint.load = cfg.logger.tensorboard_dir = None
    log_interval = cfg.logger.log_interval
    prepared = training.prepare(recipe, cfg, device=device, data="mock", quiet=True, telemetry=telemetry)
    for callback in prepared.callbacks:
        if hasattr(callback, "interval"):  # MuonTelemetry: logged and unlogged iterations alternate
            callback.interval = 2
            callback.log = lambda line: None
    clock = _Clock()
    reset_megatron_globals()
    if prepared.use_cpu:
        init_single_process_distributed()
    try:
        with contextlib.redirect_stdout(io.StringIO()):  # Megatron's own progress lines
            pretrain(cfg, forward_step, callbacks=[clock.open, *prepared.callbacks, clock.close])
    finally:
        reset_megatron_globals()
        if prepared.use_cpu and torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
    return clock.times, log_interval


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--recipe", default="qwen3_proxy_muon", help="a Muon recipe (telemetry is for Muon runs)")
    parser.add_argument("--iters", type=int, default=60, help="iterations per run")
    parser.add_argument("--warmup", type=int, default=6, help="first iterations of each run not counted")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads (CPU mode)")
    parser.add_argument("--device", choices=["auto", "cpu", "gpu"], default="auto")
    args = parser.parse_args(argv)

    from bridge_ext.build import quiet_megatron

    quiet_megatron()
    import torch

    from recipes import get_recipe

    if get_recipe(args.recipe).preset.kind != "muon":
        parser.error(f"{args.recipe} does not use Muon: no telemetry to measure")
    torch.set_num_threads(args.threads)
    with_telemetry, log_interval = _run(args.recipe, telemetry=True, iters=args.iters, device=args.device)
    without, _ = _run(args.recipe, telemetry=False, iters=args.iters, device=args.device)

    def median(times: dict[int, float], logged: bool | None = None) -> float:
        return statistics.median(ms for i, ms in times.items() if i > args.warmup and i % log_interval
                                 and (logged is None or (i % 2 == 0) == logged))

    logged, unlogged, none = median(with_telemetry, True), median(with_telemetry, False), median(without)
    ratio = logged / unlogged
    gpu = torch.cuda.is_available()
    device = torch.cuda.get_device_name() if gpu else f"CPU, {torch.get_num_threads()} thread(s)"
    print(f"{args.recipe} ({device}), median ms per iteration: logged {logged:.2f}, unlogged {unlogged:.2f} "
          f"(same run, alternating); a run without telemetry {none:.2f}")
    print(f"telemetry: {ratio:.3f}x on a logged iteration vs an unlogged one; at the recipe's log interval "
          f"({log_interval}): {1 + (ratio - 1) / log_interval:.3f}x per iteration; idle hooks "
          f"{unlogged / none:.3f}x (separate runs)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
