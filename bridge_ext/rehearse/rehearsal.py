"""What a rehearsal of one rank found (``Rehearsal``), where the rank sits (``Coordinates``) and the names of the
compared rows."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

__all__ = ["ACTIVATIONS", "GB", "MODEL_FLOPS", "SQUARE", "WITHOUT_SQUARE", "Coordinates", "Device", "Rehearsal"]

Device = Literal["cpu", "cuda"]
GB = 2**30


@dataclass(frozen=True)
class Coordinates:
    """Where a global rank sits: its rank in each parallel group, and the sharding groups' sizes."""

    rank: int
    world: int
    tp: int
    pp: int
    cp: int
    dp: int  # in the data-parallel x context-parallel group (what dist_muon and the distributed optimizer shard over)
    dp_size: int
    ep: int
    etp: int
    expert_dp: int
    expert_dp_size: int

    def describe(self) -> str:
        return (f"rank {self.rank} of {self.world}: pipeline stage {self.pp}, TP rank {self.tp}, DP rank {self.dp} of "
                f"{self.dp_size}, EP rank {self.ep}, expert-DP rank {self.expert_dp} of {self.expert_dp_size}")


@dataclass(frozen=True)
class Rehearsal:
    recipe: str
    preset: str
    layout: str
    device: Device
    parallel: dict[str, Any]
    coordinates: Coordinates
    optimizer: str  # what Megatron built, e.g. LayerWiseDistributedOptimizer[Float16...(TensorParallelMuon), ...]
    planned_optimizer: str  # plan's kind: dist_muon, muon, adam_distributed, adam
    measured: dict[str, int]  # bridge_ext.rehearse.measure.Footprint
    planned: dict[str, int]
    ns_flops: int | None  # FLOPs one optimizer.step() ran on this rank (None: no step)
    planned_ns_flops: int
    seconds: dict[str, float]
    peak_rss_gb: float
    cuda_max_allocated: int | None = None
    notes: tuple[str, ...] = field(default_factory=tuple)
    # one micro-batch forward + backward: measured / planned activation bytes and model FLOPs, the attention
    # kernels run, MBS and sequence length (None: not run); micro_batch_skipped: why it was not measured
    micro_batch: dict[str, Any] | None = None
    micro_batch_skipped: str | None = None

    def rows(self) -> list[tuple[str, float, float]]:
        """(component, rehearsal, plan) for every compared quantity."""
        out = [(name, self.measured[key], self.planned[key]) for name, key in _ROWS]
        if self.ns_flops is not None:
            out.append(("Newton-Schulz FLOPs per step", self.ns_flops, self.planned_ns_flops))
        if self.micro_batch is not None:
            mb = self.micro_batch
            out += [(ACTIVATIONS, mb["peak_activation_bytes"], mb["planned_activation_bytes"]),
                    (SQUARE, mb["square_bytes"], 0),
                    (WITHOUT_SQUARE, mb["peak_activation_bytes"] - mb["square_bytes"], mb["planned_activation_bytes"]),
                    (MODEL_FLOPS, mb["model_flops"], mb["planned_model_flops"])]
        return out

    def to_json(self) -> dict[str, Any]:
        return {
            "recipe": self.recipe, "preset": self.preset, "layout": self.layout, "device": self.device,
            "parallel": self.parallel, "coordinates": vars(self.coordinates), "optimizer": self.optimizer,
            "planned_optimizer": self.planned_optimizer, "measured": self.measured, "planned": self.planned,
            "ns_flops": self.ns_flops, "planned_ns_flops": self.planned_ns_flops,
            "ratios": {name: (a / b if b else None) for name, a, b in self.rows()},
            "seconds": self.seconds, "peak_rss_gb": self.peak_rss_gb, "cuda_max_allocated": self.cuda_max_allocated,
            "micro_batch": self.micro_batch, "micro_batch_skipped": self.micro_batch_skipped,
            "notes": list(self.notes),
        }


_ROWS = (("parameters", "params"), ("  of them experts", "expert_params"), ("weights", "weights"),
         ("grad buffer", "grads"), ("fp32 main params", "main_params"), ("optimizer state", "optimizer_state"))
ACTIVATIONS = "activations, one micro-batch"
SQUARE = "  of them s x s attention"
WITHOUT_SQUARE = "  activations less s x s"
MODEL_FLOPS = "model FLOPs, one micro-batch"
