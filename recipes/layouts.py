"""Layouts: parallelism, batch and precision of one model on a named cluster.

Adding a cluster for a model: one ``Layout`` in that model's entry of ``LAYOUTS`` (the first entry is the
model's default). ``Layout.problems`` checks a layout against the model's layer count without Megatron.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from types import MappingProxyType
from typing import Any

__all__ = ["LAYOUTS", "Layout", "pipeline_stages"]


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


# Kimi K2's 61 layers over 16 pipeline stages: embedding + 4 layers first, 1 layer + loss last
# (Megatron Bridge 0.3 recipes/kimi/kimi_k2.py::_get_kimi_k2_pipeline_layout, PP4 VP4 and PP16).
_KIMI_K2_16_STAGES = "Etttt|(tttt|)*14,tL"

_SELECTIVE_RECOMPUTE = {"recompute_granularity": "selective"}

_CPU = Layout(
    cluster="cpu", gpus=1, global_batch_size=8, micro_batch_size=4, seq_length=128, precision="fp32",
    why="one process on a laptop-class CPU; fp32 because megatron-core 0.16's bf16 optimizers reject CPU tensors",
)

# NVIDIA's 2026-04 benchmark layout, with the real router. The benchmark itself forced the router to balance
# (`gb300x256-bench`): a setting megatron-core marks benchmark-only, never in a layout that trains weights.
_KIMI_K2_GB300 = Layout(
    cluster="gb300x256", gpus=256, tp=1, pp=4, vp=4, ep=64, global_batch_size=4096, micro_batch_size=2,
    precision="bf16_with_mxfp8_mixed", pipeline_layout=_KIMI_K2_16_STAGES,
    model={
        "recompute_granularity": "selective",
        "recompute_modules": ["mla_up_proj"],
        "moe_token_dispatcher_type": "flex",
        "moe_flex_dispatcher_backend": "hybridep",
        "moe_shared_expert_overlap": False,  # megatron-core allows it only with the alltoall dispatcher
    },
    why="NVIDIA's 2026-04 benchmark layout (1,080 TFLOP/s/GPU with Muon, MXFP8), training the real router; "
        "`gb300x256-bench` is the benchmark itself",
)

# Several CPU processes (torchrun --nproc-per-node N, gloo): the same global batch as `cpu`, split over
# data-parallel ranks or a model-parallel group, so a run in any of them computes what `cpu` computes
# (docs/cpu.md, "Several processes").
_CPU_WHY = "{what} across {n} CPU processes (torchrun --nproc-per-node {n}, gloo); the same global batch as `cpu`"


def _cpu_parallel(name: str, *, what: str, **sizes: Any) -> Layout:
    gpus = sizes.pop("gpus", 2)
    return replace(_CPU, cluster=name, gpus=gpus, why=_CPU_WHY.format(what=what, n=gpus), **sizes)


_CPU_DP2 = _cpu_parallel("cpu-dp2", what="data parallelism")
# Experts split over TP too (ETP = TP, megatron-core's default): with EP1 and ETP1 megatron-core 0.16 treats the
# experts as dense parameters and reduces their gradients over data-parallel ranks only, while under sequence
# parallelism each TP rank's experts see only its half of the tokens (expert weights then differ from a
# 1-process run by 1e-3 after one step; measured, tests/test_parallel_cpu.py). bridge_ext.build refuses that
# combination (MoE, TP > 1, EP1, ETP != TP) on any device.
_CPU_TP2 = _cpu_parallel("cpu-tp2", what="tensor parallelism with sequence parallelism", tp=2)
_CPU_TP2_MOE = _cpu_parallel("cpu-tp2", what="tensor parallelism with sequence parallelism, experts too", tp=2, etp=2)
_CPU_PP2 = _cpu_parallel("cpu-pp2", what="two pipeline stages", pp=2)
_CPU_EP2 = _cpu_parallel("cpu-ep2", what="expert parallelism over the two data-parallel ranks", ep=2)
_CPU_TP2_EP2 = _cpu_parallel("cpu-tp2-ep2", what="TP2 x DP2 with the experts split EP2", gpus=4, tp=2, ep=2)
# One GPU (the GPU tier: bench/gpu_check.sh): a proxy at the `cpu` layout's batch, in bf16.
_H200_PROXY = replace(_CPU, cluster="h200x1", precision="bf16_mixed",
                      why="one H200 in bf16 at the cpu layout's batch: the GPU tier's loss curves (bench/gpu_check.sh)")
_CPU_DENSE = {"cpu": _CPU, "cpu-dp2": _CPU_DP2, "cpu-tp2": _CPU_TP2, "cpu-pp2": _CPU_PP2}
_CPU_MOE = {**_CPU_DENSE, "cpu-tp2": _CPU_TP2_MOE, "cpu-ep2": _CPU_EP2, "cpu-tp2-ep2": _CPU_TP2_EP2}

# Moonlight-16B-A3B at its paper's batch and sequence (arXiv 2502.16982, sec. 3.3): 4,096 sequences of 8K tokens
# (33.6 M tokens per step: the paper's batch from 200 B tokens on; 2,048 before, which one fixed global batch
# cannot follow) on one node or two. EP8 puts 8 of the 64 experts on each GPU; the all-to-all dispatcher.
_MOONLIGHT = {"moe_token_dispatcher_type": "alltoall"}
_MOONLIGHT_BATCH = {"global_batch_size": 4096, "seq_length": 8192}

LAYOUTS: dict[str, dict[str, Layout]] = {
    # Kimi K2 proxy: 3 layers over 2 stages, embedding + 2 layers first, 1 layer + loss last
    "kimi_k2_proxy": {**_CPU_MOE, "cpu-pp2": replace(_CPU_PP2, pipeline_layout="Ett|tL"), "h200x1": _H200_PROXY},
    "moonlight_proxy": {**_CPU_MOE, "cpu-pp2": replace(_CPU_PP2, pipeline_layout="Ett|tL"),  # as kimi_k2_proxy
                        "h200x1": _H200_PROXY},
    "qwen3_proxy": {**_CPU_DENSE, "h200x1": _H200_PROXY},
    "qwen3_moe_proxy": {**_CPU_MOE, "h200x1": _H200_PROXY},
    "kimi_k2": {
        "gb300x256": _KIMI_K2_GB300,
        "gb300x256-bench": replace(
            _KIMI_K2_GB300, cluster="gb300x256-bench",
            model={**_KIMI_K2_GB300.model, "moe_router_force_load_balancing": True},
            why="reproduces the 1,080 TFLOP/s benchmark; the router is forced to balance, do not keep the weights "
                "(megatron-core: random router logits, for benchmarking only)",
        ),
        "h100x512": Layout(
            cluster="h100x512", gpus=512, tp=2, pp=16, ep=32, global_batch_size=4096, micro_batch_size=1,
            pipeline_layout=_KIMI_K2_16_STAGES,
            model={**_SELECTIVE_RECOMPUTE, "moe_token_dispatcher_type": "alltoall"},
            why="Megatron Bridge's upstream Kimi K2 recipe layout (TP2 PP16 EP32)",
        ),
    },
    "moonlight_16b_a3b": {
        "h100x8": Layout(
            cluster="h100x8", gpus=8, tp=2, ep=8, micro_batch_size=1, **_MOONLIGHT_BATCH,
            model={**_SELECTIVE_RECOMPUTE, **_MOONLIGHT},
            why="one node of 80 GB (H100; H200 likewise): TP2 with sequence parallelism halves the dense weights and "
                "activations of the 8K sequences, EP8 over TP x DP, selective recompute; the tested 8-GPU layout",
        ),
        "gb300x8": Layout(
            cluster="gb300x8", gpus=8, ep=8, micro_batch_size=2, **_MOONLIGHT_BATCH,
            model={**_SELECTIVE_RECOMPUTE, **_MOONLIGHT},
            why="one GB300 node (288 GB): no tensor parallelism, EP8 over the 8 data-parallel ranks, two sequences "
                "per micro-batch",
        ),
        "h100x16": Layout(
            cluster="h100x16", gpus=16, tp=2, ep=8, micro_batch_size=1, **_MOONLIGHT_BATCH,
            model={**_SELECTIVE_RECOMPUTE, **_MOONLIGHT},
            why="two nodes of 80 GB: h100x8's TP2 EP8 inside a node, data parallelism 8 across both",
        ),
    },
    "qwen3_30b_a3b": {
        "gb300x8": Layout(
            cluster="gb300x8", gpus=8, ep=8, global_batch_size=512, micro_batch_size=8,
            precision="bf16_with_mxfp8_mixed", model={"moe_token_dispatcher_type": "alltoall"},
            why="NVIDIA's 2026-04 benchmark layout (721 TFLOP/s/GPU with Muon, MXFP8)",
        ),
        "h100x16": Layout(
            cluster="h100x16", gpus=16, tp=2, ep=8, global_batch_size=512, micro_batch_size=2,
            model={**_SELECTIVE_RECOMPUTE, "moe_token_dispatcher_type": "alltoall"},
            why="80 GB GPUs: TP2 halves activation and dense-weight memory; EP8 over the 8 DP ranks",
        ),
    },
    "qwen3_235b_a22b": {
        "h100x128": Layout(
            cluster="h100x128", gpus=128, tp=2, pp=8, ep=16, global_batch_size=1024, micro_batch_size=1,
            pipeline_layout="Et*11|(t*12|)*6,t*11L",  # 94 layers; embedding and loss weigh one layer each
            model={**_SELECTIVE_RECOMPUTE, "moe_token_dispatcher_type": "alltoall"},
            why="16 nodes of 8x80 GB: PP8 over nodes, EP16 across 2 nodes of DP, TP2 inside NVLink",
        ),
    },
    "qwen3_0p6b": {
        "h100x8": Layout(cluster="h100x8", gpus=8, global_batch_size=256, micro_batch_size=4,
                         why="fits one GPU: pure data parallelism"),
        "h200x1": Layout(cluster="h200x1", gpus=1, global_batch_size=16, micro_batch_size=1,
                         why="one H200: the GPU tier's Muon vs AdamW step (bench/gpu_check.sh); micro-batch 1 "
                             "keeps the local spec's unfused 4K x 4K attention scores within memory"),
    },
    "qwen3_1p7b": {
        "h100x8": Layout(cluster="h100x8", gpus=8, global_batch_size=256, micro_batch_size=2,
                         why="fits one GPU: pure data parallelism"),
    },
    "qwen3_4b": {
        "h100x8": Layout(cluster="h100x8", gpus=8, tp=2, global_batch_size=256, micro_batch_size=2,
                         why="TP2 leaves room for fp32 main weights, grads and Muon momentum"),
    },
    "qwen3_8b": {
        "h100x8": Layout(cluster="h100x8", gpus=8, tp=4, global_batch_size=256, micro_batch_size=1,
                         why="Megatron Bridge's upstream Qwen3-8B parallelism (TP4) on one node"),
    },
    "qwen3_14b": {
        "h100x16": Layout(cluster="h100x16", gpus=16, tp=8, global_batch_size=256, micro_batch_size=1,
                          why="TP8 inside a node (upstream Qwen3-14B recipe), DP2 across two nodes"),
    },
    "qwen3_32b": {
        "h100x32": Layout(cluster="h100x32", gpus=32, tp=8, pp=2, global_batch_size=256, micro_batch_size=1,
                          model=_SELECTIVE_RECOMPUTE,
                          why="upstream Qwen3-32B parallelism (TP8 PP2), DP2"),
    },
}
