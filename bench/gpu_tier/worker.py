"""The GPU tier's workers, each a process of its own (``python bench/gpu_check.py --worker KIND``): the machine
(:func:`worker_env`: GPU, stack, a bf16 matmul's TFLOP/s) and one training run through the CLI's own pipeline
(:func:`worker_train`: losses, and with ``timed`` the step, optimizer-step and Newton-Schulz times)."""

from __future__ import annotations

import os
import socket
import time
from pathlib import Path
from typing import Any

from gpu_tier.plan import LAYOUT

__all__ = ["StepClock", "free_port", "single_process_env", "worker_env", "worker_train"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def single_process_env() -> None:
    """torchrun's variables for one process, so Megatron Bridge's initialization makes an NCCL group of one."""
    for key, value in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1"), ("MASTER_ADDR", "127.0.0.1")):
        os.environ.setdefault(key, value)
    os.environ.setdefault("MASTER_PORT", str(free_port()))


def worker_env() -> dict[str, Any]:
    import torch

    from bridge_ext.stack import describe_stack, have_transformer_engine

    out: dict[str, Any] = {"torch": torch.__version__, "cuda": torch.version.cuda, "stack": describe_stack(),
                           "transformer_engine": have_transformer_engine(),
                           "cuda_available": torch.cuda.is_available()}
    if not torch.cuda.is_available():
        return out
    props = torch.cuda.get_device_properties(0)
    out.update(gpu=props.name, memory_gib=round(props.total_memory / 2**30, 1), sms=props.multi_processor_count)
    n = 8192
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(10):
        a @ b
    end.record()
    torch.cuda.synchronize()
    out["bf16_matmul_tflops"] = round(10 * 2 * n**3 / (start.elapsed_time(end) / 1e3) / 1e12, 1)
    return out


class StepClock:
    """Megatron Bridge callback: wall time of each iteration (synchronized), CUDA-event time of each
    ``optimizer.step()`` and of each Newton-Schulz call inside it (megatron-core's ``newton_schulz_tp``)."""

    def __init__(self, *, cuda: bool = True):
        self.cuda = cuda
        self.steps: list[float] = []
        self.optimizer_ms: list[float] = []
        self.ns_ms: list[float] = []
        self._events: list[tuple[Any, Any]] = []
        self._t0 = 0.0

    def install_ns_timer(self) -> bool:
        import torch

        try:
            from megatron.core.optimizer import muon as core_muon
        except ImportError:
            return False
        original = getattr(core_muon, "newton_schulz_tp", None)
        if original is None or not self.cuda:
            return False

        def timed(*args: Any, **kwargs: Any) -> Any:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            out = original(*args, **kwargs)
            end.record()
            self._events.append((start, end))
            return out

        core_muon.newton_schulz_tp = timed
        return True

    def callback(self) -> Any:
        import torch
        from megatron.bridge.training.callbacks import Callback

        clock = self

        class StepClock(Callback):
            def on_train_start(self, context: Any) -> None:
                if not clock.cuda:
                    return
                optimizer = context.optimizer
                original = optimizer.step

                def timed_step(*args: Any, **kwargs: Any) -> Any:
                    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    start.record()
                    out = original(*args, **kwargs)
                    end.record()
                    end.synchronize()
                    clock.optimizer_ms.append(start.elapsed_time(end))
                    clock.ns_ms.append(sum(s.elapsed_time(e) for s, e in clock._events))
                    clock._events.clear()
                    return out

                optimizer.step = timed_step

            def on_train_step_start(self, context: Any) -> None:
                if clock.cuda:
                    torch.cuda.synchronize()
                clock._t0 = time.perf_counter()

            def on_train_step_end(self, context: Any) -> None:
                if clock.cuda:
                    torch.cuda.synchronize()
                clock.steps.append(time.perf_counter() - clock._t0)

        return StepClock()


def worker_train(recipe_name: str, *, iters: int, data: str, work: Path, timed: bool,
                 device: str = "gpu", precision: str | None = None) -> dict[str, Any]:
    """Train one recipe at layout h200x1 through the CLI's own pipeline; losses (and timings). ``device="cpu"``
    runs the same code in CPU mode (fp32), only to try this script without a GPU."""
    import statistics

    import torch

    from bridge_ext.build import build_config
    from bridge_ext.training import loss_recorder, prepare, read_losses, run_pretrain
    from recipes import get_recipe

    single_process_env()
    recipe = get_recipe(recipe_name)
    work.mkdir(parents=True, exist_ok=True)
    cfg = build_config(recipe, layout=LAYOUT, values={
        "train.train_iters": iters, "logger.log_interval": 1, "checkpoint.save": None, "checkpoint.load": None,
        "logger.tensorboard_dir": None, "scheduler.lr_warmup_iters": max(1, min(5, iters // 5)),
        "train.eval_iters": 0, **({"mixed_precision": precision} if precision else {})})
    prepared = prepare(recipe, cfg, device=device, data=data, telemetry=False)
    cuda = not prepared.use_cpu
    cfg.dataset.path_to_cache = str(work / "index-cache")  # runs side by side: no shared index files
    losses_path = work / "losses.jsonl"
    losses_path.unlink(missing_ok=True)
    clock = StepClock(cuda=cuda)
    callbacks = [loss_recorder(losses_path)]
    if timed:
        clock.install_ns_timer()
        callbacks.append(clock.callback())
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    run_pretrain(cfg, prepared, callbacks=callbacks)
    wall = time.perf_counter() - start
    losses = read_losses(losses_path)
    out: dict[str, Any] = {"recipe": recipe_name, "layout": LAYOUT, "iters": iters, "wall_s": round(wall, 1),
                           "losses": [losses[i] for i in sorted(losses)],
                           "peak_allocated_bytes": torch.cuda.max_memory_allocated() if cuda else 0,
                           "transformer_engine": not getattr(cfg.model, "transformer_impl", "") == "local"}
    if timed and clock.steps:
        from megatron.bridge.training.utils.flop_utils import num_floating_point_operations

        skip = min(3, len(clock.steps) - 1)  # warm-up: allocator, cuBLAS heuristics
        step_s = statistics.median(clock.steps[skip:])
        flops = num_floating_point_operations(cfg, cfg.train.global_batch_size)
        opt_ms = statistics.median(clock.optimizer_ms[skip:]) if clock.optimizer_ms[skip:] else None
        ns_ms = statistics.median(clock.ns_ms[skip:]) if clock.ns_ms[skip:] else None
        out.update(step_ms=round(step_s * 1e3, 1), model_tflops=round(flops / step_s / 1e12, 1),
                   flops_per_step=flops, optimizer_step_ms=None if opt_ms is None else round(opt_ms, 2),
                   newton_schulz_ms=None if ns_ms is None else round(ns_ms, 2),
                   newton_schulz_share=None if not ns_ms else round(ns_ms / (step_s * 1e3), 4),
                   tokens_per_step=cfg.train.global_batch_size * cfg.model.seq_length)
    return out
