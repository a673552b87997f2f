"""Rehearse ranks of a recipe (:func:`rehearse`): the layout with its size overrides, then per rank the fake
process group, the rank's model and optimizer, one micro-batch and one optimizer step, measured beside ``plan``."""

from __future__ import annotations

import contextlib
import resource
import sys
import time
from collections.abc import Sequence
from typing import Any

from bridge_ext.errors import UserError
from bridge_ext.rehearse.rehearsal import Coordinates, Device, Rehearsal
from recipes.optimizers import is_muon

__all__ = ["rehearse", "select_ranks", "with_layout_overrides"]


def select_ranks(text: str, *, world: int, pp: int) -> tuple[int, ...]:
    """Ranks from ``--ranks``: comma-separated global ranks and the names ``first`` (0), ``last`` (world - 1)
    and ``all-pp`` (the first rank of every pipeline stage; megatron-core's default order puts PP outermost)."""
    out: list[int] = []
    for item in (part.strip() for part in text.split(",")):
        if item == "first":
            out.append(0)
        elif item == "last":
            out.append(world - 1)
        elif item == "all-pp":
            out += [stage * (world // pp) for stage in range(pp)]
        elif item.lstrip("-").isdigit():
            out.append(int(item))
        else:
            raise UserError(f"--ranks takes global ranks and first, last, all-pp (comma-separated); got '{item}'")
    for rank in out:
        if not 0 <= rank < world:
            raise UserError(f"rank {rank} is outside this layout's world of {world} ranks (0-{world - 1})")
    return tuple(dict.fromkeys(out))


def _coordinates(rank: int, world: int) -> Coordinates:
    from megatron.core import parallel_state as ps

    return Coordinates(rank=rank, world=world, tp=ps.get_tensor_model_parallel_rank(),
                       pp=ps.get_pipeline_model_parallel_rank(), cp=ps.get_context_parallel_rank(),
                       dp=ps.get_data_parallel_rank(with_context_parallel=True),
                       dp_size=ps.get_data_parallel_world_size(with_context_parallel=True),
                       ep=ps.get_expert_model_parallel_rank(), etp=ps.get_expert_tensor_parallel_rank(),
                       expert_dp=ps.get_expert_data_parallel_rank(),
                       expert_dp_size=ps.get_expert_data_parallel_world_size())


def _planned(recipe: Any, layout: Any, where: Coordinates, *, spec: str) -> tuple[str, dict[str, int], int]:
    """``nemo llm plan``'s numbers for this rank: (optimizer kind, footprint, NS FLOPs per step)."""
    from bridge_ext.plan import pipeline_ranks, selected_optimizer
    from bridge_ext.plan.memory import model_state, ns_flops_on_rank

    stage = pipeline_ranks(recipe, layout, spec=spec)[where.pp]
    kind = selected_optimizer(recipe)
    state = model_state(stage, layout, kind, muon=is_muon(kind), dp_rank=where.dp,
                        expert_dp_rank=where.expert_dp)
    footprint = {"params": stage.total, "expert_params": stage.expert, **{k: round(v) for k, v in state.items()}}
    return kind, footprint, ns_flops_on_rank(stage, layout, kind, dp_rank=where.dp, expert_dp_rank=where.expert_dp)


def _planned_micro_batch(recipe: Any, layout: Any, where: Coordinates, *, spec: str) -> tuple[float, float]:
    """``plan``'s activation bytes (one micro-batch in flight, the layout's recompute settings; at the precision
    rehearsed: MXFP8 layouts run bf16 on CPU) and Megatron Bridge's model FLOPs of one micro-batch on this
    rank's layers."""
    import dataclasses

    from bridge_ext.plan import pipeline_ranks
    from bridge_ext.plan.flops import model_flops_on_rank
    from bridge_ext.plan.memory import activation_bytes, holds_logits

    arch = recipe.model.architecture
    stage = pipeline_ranks(recipe, layout, spec=spec)[where.pp]
    rehearsed = dataclasses.replace(layout, precision="bf16_mixed") if (
        spec == "local" and "mxfp8" in layout.precision) else layout
    planned_bytes = activation_bytes(arch, rehearsed, stage, micro_batches=1, recompute=dict(layout.model))
    flops = model_flops_on_rank(arch, layers=stage.layers, logits=holds_logits(arch, layout, stage),
                                seq_length=layout.seq_length, tp=layout.tp, cp=layout.cp,
                                micro_batch_size=layout.micro_batch_size)
    return planned_bytes, flops


def _run_micro_batch(model: list[Any], cfg: Any, layout: Any, *, device: Device) -> dict[str, Any]:
    import torch

    from bridge_ext.rehearse.activations import attention_paths, micro_batch

    m = cfg.model
    dtype = torch.bfloat16 if m.bf16 else torch.float16 if m.fp16 else torch.float32
    start = time.perf_counter()
    measured = micro_batch(model, micro_batch_size=layout.micro_batch_size, seq_length=layout.seq_length,
                           hidden_size=m.hidden_size, tp=layout.tp, cp=layout.cp,
                           sequence_parallel=bool(m.sequence_parallel), dtype=dtype,
                           device="cuda" if device == "cuda" else "cpu")
    return {"peak_activation_bytes": measured.peak_bytes, "square_bytes": measured.square_bytes,
            "peak_by_op": measured.peak_by_op, "model_flops": measured.flops,
            "flops_by_op": measured.flops_by_op, "micro_batch_size": measured.micro_batch_size,
            "seq_length": measured.seq_length, "chunks": measured.chunks, "attention": attention_paths(model),
            "recompute": {k: getattr(m, k, None) for k in ("recompute_granularity", "recompute_method",
                                                           "recompute_num_layers", "recompute_modules")},
            "seconds": round(time.perf_counter() - start, 2)}


def _one_rank(recipe: Any, layout: Any, cfg: Any, rank: int, *, device: Device, step: bool,
              notes: list[str], activations: bool = True) -> Rehearsal:
    import torch
    from torch.utils.flop_counter import FlopCounterMode

    from bridge_ext.rehearse.one_rank import build_rank
    from bridge_ext.rehearse.fake import fake_process_group, fake_tensors, initialize_parallel_state
    from bridge_ext.rehearse.measure import describe_optimizer, footprint, initialize_state

    seconds: dict[str, float] = {}
    start = time.perf_counter()
    with fake_process_group(rank=rank, world_size=layout.gpus):
        initialize_parallel_state(cfg.model, cfg.dist,
                                  num_distributed_optimizer_instances=cfg.ddp.num_distributed_optimizer_instances)
        where = _coordinates(rank, layout.gpus)
        seconds["parallel_state"] = time.perf_counter() - start
        if device == "cpu":
            from torch._subclasses.fake_tensor import FakeTensorMode

            tensors = fake_tensors(FakeTensorMode(allow_non_fake_inputs=True))
        else:
            torch.cuda.reset_peak_memory_stats()
            tensors = contextlib.nullcontext()
        with tensors, contextlib.redirect_stdout(sys.stderr):  # Megatron's prints: stdout is the report's
            model, optimizer = build_rank(cfg, use_cpu_initialization=device == "cpu")
            seconds["build"] = time.perf_counter() - start - seconds["parallel_state"]
            micro, skipped = None, None
            if activations:
                try:
                    micro = _run_micro_batch(model, cfg, layout, device=device)
                except Exception as error:  # noqa: BLE001 - reported as "not measured: <reason>"
                    skipped = f"{type(error).__name__}: {str(error).strip().splitlines()[0] if str(error).strip() else ''}"
                seconds["micro_batch"] = time.perf_counter() - start - seconds["parallel_state"] - seconds["build"]
            ns_flops = None
            if step:
                counter = FlopCounterMode(display=False)
                with counter:
                    optimizer.step()
                ns_flops = counter.get_total_flops()
                seconds["step"] = (time.perf_counter() - start - seconds["parallel_state"] - seconds["build"]
                                   - seconds.get("micro_batch", 0.0))
            else:
                initialize_state(optimizer)
        measured = footprint(model, optimizer).as_dict()
        built = describe_optimizer(optimizer)
        cuda_peak = torch.cuda.max_memory_allocated() if device == "cuda" else None
        del model, optimizer
    spec = "local" if device == "cpu" else "te"
    kind, planned, planned_ns = _planned(recipe, layout, where, spec=spec)
    if micro is not None:
        micro["planned_activation_bytes"], micro["planned_model_flops"] = _planned_micro_batch(
            recipe, layout, where, spec=spec)
    seconds["total"] = time.perf_counter() - start
    return Rehearsal(recipe=recipe.name, preset=recipe.preset.name, layout=layout.cluster, device=device,
                     parallel=layout.parallelism(), coordinates=where, optimizer=built, planned_optimizer=kind,
                     measured=measured, planned=planned, ns_flops=ns_flops, planned_ns_flops=planned_ns,
                     seconds={k: round(v, 2) for k, v in seconds.items()},
                     peak_rss_gb=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,
                     cuda_max_allocated=cuda_peak, notes=tuple(notes), micro_batch=micro,
                     micro_batch_skipped=skipped)


def with_layout_overrides(recipe: Any, layout: str | None, overrides: Sequence[str]) -> tuple[Any, Any]:
    """(recipe, layout) with ``key=value`` layout sizes applied (``bridge_ext.overrides.LAYOUT_KEYS``:
    ``model.tensor_model_parallel_size=2``, ``gpus=16``, ...); the recipe holds only that layout."""
    import dataclasses

    from bridge_ext.overrides import LAYOUT_KEYS, layout_sizes, parse_overrides

    chosen = recipe.layout(layout)
    sizes = layout_sizes(parse_overrides(overrides, keys=LAYOUT_KEYS, command="nemo llm rehearse",
                                         example="model.tensor_model_parallel_size=2"))
    if not sizes:
        return recipe, chosen
    chosen = dataclasses.replace(chosen, **sizes)
    return dataclasses.replace(recipe, layouts={chosen.cluster: chosen}), chosen


def rehearse(recipe: Any, *, layout: str | None = None, preset: str | None = None, ranks: Sequence[int] = (0,),
             device: Device = "cpu", step: bool = True, overrides: Sequence[str] = (),
             activations: bool = True) -> tuple[Rehearsal, ...]:
    """Rehearse ``ranks`` of ``recipe`` (a name or ``recipes.Recipe``) on ``layout`` (default: the recipe's first)
    with optimizer ``preset`` (default: the recipe's). ``step``: run one optimizer step (the state a step leaves,
    Newton-Schulz FLOPs); otherwise the state is allocated as megatron-core does before a checkpoint load
    (``measure.initialize_state``: the same tensors, without Adam's step counters) and no FLOPs are counted.
    ``overrides``: layout sizes (:func:`with_layout_overrides`). ``activations``: one micro-batch forward +
    backward before the step (peak activation bytes, model FLOPs; see the module). Only each rank's own objects
    are built, one rank at a time."""
    import torch

    from bridge_ext import patches
    from bridge_ext.build import quiet_megatron
    from bridge_ext.muon.presets import install_preset
    from bridge_ext.rehearse.one_rank import rehearsal_config
    from recipes import get_recipe

    recipe = get_recipe(recipe) if isinstance(recipe, str) else recipe
    if preset:
        recipe = recipe.with_preset(preset)
    recipe, chosen = with_layout_overrides(recipe, layout, overrides)
    for rank in ranks:
        if not 0 <= rank < chosen.gpus:
            raise UserError(f"rank {rank} is outside layout {chosen.cluster}'s world of {chosen.gpus} ranks "
                            f"(0-{chosen.gpus - 1})")
    if device == "cuda" and not torch.cuda.is_available():
        raise UserError("--device cuda needs a visible GPU; without one, rehearse on CPU fake tensors (the default)")
    quiet_megatron()
    patches.apply("stack")
    if device == "cpu":
        from bridge_ext.cpu import enable_cpu_mode

        enable_cpu_mode()
    else:
        from bridge_ext.cpu import cpu_mode_active

        if cpu_mode_active():
            raise UserError("--device cuda in a process where CPU mode is on; run it in a process of its own")
    cfg, notes = rehearsal_config(recipe, layout=chosen.cluster, device=device)
    install_preset(recipe.preset, cfg)  # Newton-Schulz coefficients, the gate/up split: what the step runs
    with patches.temporarily("rehearse"):
        return tuple(_one_rank(recipe, chosen, cfg, rank, device=device, step=step, notes=notes,
                               activations=activations) for rank in ranks)
