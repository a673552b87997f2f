"""The layout part of a recipe: :class:`Layout` (parallelism, batch and precision of one model on a named
cluster), and the layouts every proxy shares (CPU processes, one GPU).

A model's own layouts live with its family (``recipes/families/<family>.py``); ``recipes.layouts.LAYOUTS``
assembles them. ``Layout.problems`` checks a layout against the model's layer count without Megatron.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from types import MappingProxyType
from typing import Any

__all__ = ["CPU", "CPU_DENSE", "CPU_MOE", "CPU_PP2", "H200_PROXY", "SELECTIVE_RECOMPUTE", "Layout", "pipeline_stages"]


def pipeline_stages(layout: str) -> list[str]:
    """Expand megatron-core's layout string (``"Et*3|(tttt|)*14,tL"``) into one string per stage.

    Same grammar as ``megatron.core.transformer.pipeline_parallel_layer_layout.parse_str_to_list``.
    """
    layout = layout.replace(",", "")
    layout = re.sub(r"\(([^)]+)\)\*(\d+)", lambda m: m.group(1) * int(m.group(2)), layout)
    layout = re.sub(r"(.)\*(\d+)", lambda m: m.group(1) * int(m.group(2)), layout)
    return layout.split("|")


@dataclass(frozen=True, kw_only=True)
class Layout:
    cluster: str  # the layout's name: GPU type x count ("gb300x256"), "-bench" for a benchmark-only variant
    gpus: int
    tp: int = 1
    pp: int = 1
    vp: int | None = None
    ep: int = 1
    etp: int = 1
    cp: int = 1
    micro_batch_size: int
    global_batch_size: int
    seq_length: int = 4096
    precision: str = "bf16_mixed"  # a Megatron Bridge mixed-precision recipe name, or "fp32"
    pipeline_layout: str | None = None  # megatron-core layout string, for uneven pipeline splits
    model: Mapping[str, Any] = field(default_factory=dict)  # further provider settings (recompute, ...)
    why: str = ""

    def __post_init__(self):
        object.__setattr__(self, "model", MappingProxyType(dict(self.model)))

    @property
    def dp(self) -> int:
        return self.gpus // (self.tp * self.pp * self.cp)

    @property
    def sequence_parallel(self) -> bool:
        return self.tp > 1

    def parallelism(self) -> dict[str, int | None]:
        return {"tp": self.tp, "pp": self.pp, "vp": self.vp, "ep": self.ep, "etp": self.etp, "cp": self.cp,
                "dp": self.dp, "gpus": self.gpus}

    def problems(self, num_layers: int) -> list[str]:
        """Why this layout cannot run a model with ``num_layers`` layers (empty when it can)."""
        out = []
        model_parallel = self.tp * self.pp * self.cp
        if self.gpus % model_parallel:
            out.append(f"{self.gpus} GPUs are not divisible by tp*pp*cp={model_parallel}")
        if (self.tp * self.cp * self.dp) % (self.ep * self.etp):
            out.append(f"ep*etp={self.ep * self.etp} must divide tp*cp*dp={self.tp * self.cp * self.dp}")
        if self.global_batch_size % (self.micro_batch_size * max(self.dp, 1)):
            out.append(
                f"global_batch_size {self.global_batch_size} is not a multiple of "
                f"micro_batch_size*dp={self.micro_batch_size * self.dp}"
            )
        stages = self.pp * (self.vp or 1)
        if self.pipeline_layout:
            expanded = pipeline_stages(self.pipeline_layout)
            decoders = sum(stage.count("t") for stage in expanded)
            if len(expanded) != stages:
                out.append(f"pipeline_layout has {len(expanded)} stages, pp*vp is {stages}")
            if decoders != num_layers:
                out.append(f"pipeline_layout places {decoders} decoder layers, the model has {num_layers}")
        elif num_layers % stages:
            out.append(f"{num_layers} layers do not split evenly over pp*vp={stages} stages; set pipeline_layout")
        if self.cp > 1 and self.seq_length % (2 * self.cp):
            out.append(f"seq_length {self.seq_length} must be divisible by 2*cp={2 * self.cp}")
        return out


SELECTIVE_RECOMPUTE = {"recompute_granularity": "selective"}

# --- the proxies' layouts (every family's `<name>_proxy` runs on these; a family may adjust one, e.g. its PP split) --

CPU = Layout(
    cluster="cpu", gpus=1, global_batch_size=8, micro_batch_size=4, seq_length=128, precision="fp32",
    why="one process on a laptop-class CPU; fp32 because megatron-core 0.16's bf16 optimizers reject CPU tensors",
)

# Several CPU processes (torchrun --nproc-per-node N, gloo): the same global batch as `cpu`, split over
# data-parallel ranks or a model-parallel group, so a run in any of them computes what `cpu` computes
# (docs/cpu.md, "Several processes").
_CPU_WHY = "{what} across {n} CPU processes (torchrun --nproc-per-node {n}, gloo); the same global batch as `cpu`"


def _cpu_parallel(name: str, *, what: str, **sizes: Any) -> Layout:
    gpus = sizes.pop("gpus", 2)
    return replace(CPU, cluster=name, gpus=gpus, why=_CPU_WHY.format(what=what, n=gpus), **sizes)


_CPU_DP2 = _cpu_parallel("cpu-dp2", what="data parallelism")
# Experts split over TP too (ETP = TP, megatron-core's default): with EP1 and ETP1 megatron-core 0.16 treats the
# experts as dense parameters and reduces their gradients over data-parallel ranks only, while under sequence
# parallelism each TP rank's experts see only its half of the tokens (expert weights then differ from a
# 1-process run by 1e-3 after one step; measured, tests/test_parallel_cpu.py). bridge_ext.build refuses that
# combination (MoE, TP > 1, EP1, ETP != TP) on any device.
_CPU_TP2 = _cpu_parallel("cpu-tp2", what="tensor parallelism with sequence parallelism", tp=2)
_CPU_TP2_MOE = _cpu_parallel("cpu-tp2", what="tensor parallelism with sequence parallelism, experts too", tp=2, etp=2)
CPU_PP2 = _cpu_parallel("cpu-pp2", what="two pipeline stages", pp=2)
_CPU_EP2 = _cpu_parallel("cpu-ep2", what="expert parallelism over the two data-parallel ranks", ep=2)
_CPU_TP2_EP2 = _cpu_parallel("cpu-tp2-ep2", what="TP2 x DP2 with the experts split EP2", gpus=4, tp=2, ep=2)
# One GPU (the GPU tier: bench/gpu_check.sh): a proxy at the `cpu` layout's batch, in bf16.
H200_PROXY = replace(CPU, cluster="h200x1", precision="bf16_mixed",
                     why="one H200 in bf16 at the cpu layout's batch: the GPU tier's loss curves (bench/gpu_check.sh)")
# A dense proxy's CPU layouts, and an MoE proxy's (experts split over TP, EP2, TP2 x EP2).
CPU_DENSE: Mapping[str, Layout] = MappingProxyType({"cpu": CPU, "cpu-dp2": _CPU_DP2, "cpu-tp2": _CPU_TP2,
                                                   "cpu-pp2": CPU_PP2})
CPU_MOE: Mapping[str, Layout] = MappingProxyType({**CPU_DENSE, "cpu-tp2": _CPU_TP2_MOE, "cpu-ep2": _CPU_EP2,
                                                 "cpu-tp2-ep2": _CPU_TP2_EP2})
