"""Muon vs AdamW optimizer-step time on one proxy recipe, measured in one run.

    .venv/bin/python bench/optimizer_step.py [--recipe kimi_k2_proxy_muon] [--steps 50] [--threads 1]

Builds the Muon recipe and its AdamW twin (``Recipe.twin``) through ``bridge_ext.build.build_config``, in
CPU mode when no GPU is visible (or ``--device cpu``), each with the same model and the same gradients
(one forward/backward on a fixed batch), then times Megatron's full ``optimizer.step()`` (grad copy, grad
norm and clipping, the update itself, chained Muon + Adam for the non-matrix parameters) ``--steps``
times after ``--warmup`` untimed steps. Prints the median and mean in ms and the Muon/AdamW ratio.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def _build(recipe_name: str, cpu: bool, seed: int) -> tuple[Any, Any, Any, str]:
    """(model chunks, MegatronOptimizer, config, optimizer name) for a recipe, built by Megatron Bridge."""
    import torch
    from megatron.bridge.training.optim import setup_optimizer
    from megatron.core import tensor_parallel

    from bridge_ext.build import build_config
    from bridge_ext.cpu import configure_for_cpu
    from recipes import get_recipe

    cfg = build_config(get_recipe(recipe_name))
    if cpu:
        configure_for_cpu(cfg)
    cfg.validate()
    torch.manual_seed(seed)
    if tensor_parallel.get_cuda_rng_tracker().is_initialized():
        tensor_parallel.model_parallel_cuda_manual_seed(seed)  # the same initial weights for every recipe
    kind = cfg.optimizer.optimizer  # read first: get_megatron_muon_optimizer rewrites it to "adam"
    model = cfg.model.provide_distributed_model(ddp_config=cfg.ddp, use_cpu_initialization=cpu)
    optimizer, _ = setup_optimizer(cfg.optimizer, cfg.scheduler, model, use_gloo_process_groups=True)
    return model, optimizer, cfg, kind


def _gradients(model: list[Any], cfg: Any, seed: int) -> None:
    """One forward/backward on a fixed random batch; the grads land in DDP's buffers."""
    import torch

    generator = torch.Generator().manual_seed(seed)
    device = next(model[0].parameters()).device
    batch, seq = cfg.train.micro_batch_size, cfg.model.seq_length
    tokens = torch.randint(0, cfg.model.vocab_size, (batch, seq), generator=generator).to(device)
    positions = torch.arange(seq, device=device).expand_as(tokens)
    for chunk in model:
        chunk.zero_grad_buffer()
    logits = model[0](tokens, positions, None)
    torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), tokens.flatten()).backward()
    for chunk in model:
        chunk.finish_grad_sync()


def _time_steps(optimizer: Any, steps: int, warmup: int, cuda: bool) -> list[float]:
    import torch

    times = []
    for i in range(warmup + steps):
        if cuda:
            torch.cuda.synchronize()
        start = time.perf_counter()
        ok, _, _ = optimizer.step()
        if cuda:
            torch.cuda.synchronize()
        elapsed = (time.perf_counter() - start) * 1000
        if not ok:
            raise RuntimeError("optimizer step was skipped (non-finite gradients?)")
        if i >= warmup:
            times.append(elapsed)
    return times


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--recipe", default="kimi_k2_proxy_muon", help="a Muon recipe with an AdamW twin")
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads (CPU mode)")
    parser.add_argument("--device", choices=["auto", "cpu", "gpu"], default="auto")
    parser.add_argument("--seed", type=int, default=1234)
    args = parser.parse_args(argv)

    from bridge_ext.build import quiet_megatron

    quiet_megatron()
    import torch

    from recipes import get_recipe

    cpu = args.device == "cpu" or (args.device == "auto" and not torch.cuda.is_available())
    if cpu:
        from bridge_ext.cpu import enable_cpu_mode
        from bridge_ext.process_state import init_single_process_distributed

        enable_cpu_mode()
        torch.set_num_threads(args.threads)
        init_single_process_distributed()
    else:
        from bridge_ext import patches

        patches.apply("stack")
    muon_name = args.recipe
    adamw_name = get_recipe(muon_name).twin
    if not adamw_name:
        parser.error(f"{muon_name} has no AdamW twin")

    results: dict[str, list[float]] = {}
    for name in (muon_name, adamw_name):
        model, optimizer, cfg, kind = _build(name, cpu, args.seed)
        _gradients(model, cfg, args.seed)
        results[name] = _time_steps(optimizer, args.steps, args.warmup, cuda=not cpu)
        n_params = sum(p.numel() for p in model[0].parameters())
        print(f"{name:28s} ({kind}, {n_params / 1e6:.2f} M params): median {statistics.median(results[name]):8.3f} ms"
              f"  mean {statistics.mean(results[name]):8.3f} ms  over {args.steps} steps")
    ratio = statistics.median(results[muon_name]) / statistics.median(results[adamw_name])
    device = "CPU, %d thread(s)" % torch.get_num_threads() if cpu else torch.cuda.get_device_name()
    print(f"Muon/AdamW optimizer-step time ratio: {ratio:.2f}x (median; {device})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
