"""Bytes per GPU: weights, gradients, fp32 main weights, optimizer state and activations (no torch).

Model state (megatron-core 0.16 with Megatron Bridge's ``bf16_mixed`` / ``bf16_with_mxfp8_mixed``):
bf16 weights (2 B; MXFP8 parameter all-gather keeps row- and column-wise fp8 copies, about the same), fp32
gradient buffer (``grad_reduce_in_fp32=True``: 4 B, full size on every rank, also under the distributed
optimizer), fp32 main weights (4 B) for the parameters this rank's optimizer updates; ``fp32`` layouts keep
4 B weights and gradients and no main copy. Optimizer state per updated parameter: Adam two fp32 moments
(8 B); Muon one fp32 momentum (4 B) for the matrices it takes, Adam for the rest. Which parameters a rank
updates:

- ``adam`` with ``use_distributed_optimizer``: 1/(DP x CP) of the dense parameters and 1/(expert DP) of the
  experts (``distrib_optimizer.py``: contiguous buffer ranges);
- ``dist_muon``: whole tensors dealt to the DP ranks by ``LayerWiseDistributedOptimizer.shard_params``
  (``layer_wise_optimizer.py``: sorted by size, ping-pong order, experts over the expert-DP group),
  simulated here tensor by tensor; reported: the largest dense share plus the largest expert share;
- ``muon`` and ``adam`` without the distributed optimizer: every parameter.

Activations: an estimate, per tensor megatron-core keeps for the backward pass (bf16, sequence parallel
with TP, flash attention so no s x s tensors), the accounting of Korthikanti et al. 2022 (arXiv 2205.05198,
sec. 4) applied to GQA/MLA, SwiGLU and top-k experts, times the micro-batches in flight on the pipeline
rank (1F1B: PP - rank; interleaved: ``(PP - rank - 1) * 2 + (VP - 1) * PP + 1`` model chunks, as
``schedules.py`` warms up), plus fp32 logits on the last stage. Recompute: ``full`` keeps each recomputed
layer's input only; ``selective`` drops what the named modules recompute (``core_attn`` nothing with
flash attention; ``mla_up_proj``, ``layernorm``, ``mlp``, ``moe_act``, ``moe``, ``shared_experts``).
This is Transformer Engine's kernels (GPUs); ``nemo llm rehearse`` measures one micro-batch of megatron-core's
local spec (CPU), which also keeps the ``s x s`` probabilities and masks, fp32 copies inside its norms and the
unfused SwiGLU's intermediates, beside the tensors counted here at these sizes (docs/launch.md).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Literal

from bridge_ext.plan.ranks import RankParams, Tensor
from recipes.architecture import Architecture
from recipes.layouts import Layout
from recipes.optimizers import is_muon

__all__ = ["GPUS", "Memory", "OptimizerKind", "activation_bytes", "holds_logits", "layer_wise_share", "model_state",
           "ns_flops_on_rank", "verdict"]

GB = 2**30  # GiB: nvidia-smi's unit; the datasheets' "80 GB" H100 has 81,559 MiB
# Memory per GPU as NVIDIA's datasheets state it, taken as GiB.
GPUS = {"GB300": 288, "B200": 180, "H200": 141, "H100": 80}
HEADROOM = 0.9  # fits when the estimate is at most 90 %: the rest for CUDA context, NCCL/TE buffers, fragmentation

OptimizerKind = Literal["dist_muon", "muon", "adam_distributed", "adam"]


@dataclass(frozen=True)
class Memory:
    optimizer: OptimizerKind
    pp_rank: int
    params: int
    weights: float
    grads: float
    main_params: float
    optimizer_state: float
    activations: float

    @property
    def total(self) -> float:
        return self.weights + self.grads + self.main_params + self.optimizer_state + self.activations

    def as_dict(self) -> dict[str, Any]:
        return {"optimizer": self.optimizer, "pp_rank": self.pp_rank, "params": self.params,
                "weights_gb": self.weights / GB, "grads_gb": self.grads / GB, "main_params_gb": self.main_params / GB,
                "optimizer_state_gb": self.optimizer_state / GB, "activations_gb": self.activations / GB,
                "total_gb": self.total / GB}


def verdict(total_bytes: float, gpu: str) -> Literal["fits", "tight", "does not fit"]:
    capacity = GPUS[gpu] * GB
    return "fits" if total_bytes <= HEADROOM * capacity else "tight" if total_bytes <= capacity else "does not fit"


def layer_wise_share(tensors: list[Tensor], size: int) -> list[list[Tensor]]:
    """``LayerWiseDistributedOptimizer.shard_params``: the tensors each of ``size`` ranks updates.

    Sorted by size (stable, Muon's group before Adam's as ``get_megatron_muon_optimizer`` chains them) and
    dealt in ping-pong order 0, 1, ..., n-1, n-1, ..., 0."""
    ordered = sorted(sorted(tensors, key=lambda t: t.route != "muon"), key=lambda t: t.numel)
    loop = list(range(size)) + list(range(size))[::-1]
    out: list[list[Tensor]] = [[] for _ in range(size)]
    for i, tensor in enumerate(ordered):
        out[loop[i % len(loop)]].append(tensor)
    return out


def _group_sizes(layout: Layout) -> tuple[int, int]:
    """(DP x CP, expert DP) group sizes: the groups the layer-wise and distributed optimizers shard over."""
    return layout.gpus // (layout.tp * layout.pp), layout.gpus // (layout.ep * layout.etp * layout.pp)


def _layer_wise_shares(rank: RankParams, layout: Layout, state: Any, dp_rank: int | None,
                       expert_dp_rank: int | None) -> list[list[Tensor]]:
    """``dist_muon``: the dense share (over DP x CP) and the expert share (over expert DP) one GPU updates; the
    largest of each where its rank is not given (the worst case, exact when either group has one rank)."""
    dp_cp, expert_dp = _group_sizes(layout)
    shares = []
    for expert, size, index in ((False, dp_cp, dp_rank), (True, expert_dp, expert_dp_rank)):
        dealt = layer_wise_share([t for t in rank.tensors if t.expert == expert], size)
        shares.append(max(dealt, key=state) if index is None else dealt[index])
    return shares


def model_state(rank: RankParams, layout: Layout, optimizer: OptimizerKind, *, muon: bool,
                dp_rank: int | None = None, expert_dp_rank: int | None = None) -> dict[str, float]:
    """Weights, gradients, main weights and optimizer state (bytes) on one DP rank of pipeline rank ``rank``:
    ``dp_rank`` (in DP x CP) and ``expert_dp_rank`` (in expert DP) where given, else the most loaded one."""
    fp32 = layout.precision == "fp32"
    weight_b, grad_b, main_b = (4, 4, 0) if fp32 else (2, 4, 4)
    dp_cp, expert_dp = _group_sizes(layout)

    def state(tensors: Any) -> float:
        return sum(t.numel * (main_b + (4 if muon and t.route == "muon" else 8)) for t in tensors)

    tensors = list(rank.tensors)
    if optimizer == "adam_distributed":
        owned = state(t for t in tensors if not t.expert) / dp_cp + state(t for t in tensors if t.expert) / expert_dp
        main = (sum(t.numel for t in tensors if not t.expert) / dp_cp
                + sum(t.numel for t in tensors if t.expert) / expert_dp) * main_b
    elif optimizer == "dist_muon" and max(dp_cp, expert_dp) > 1:
        shares = _layer_wise_shares(rank, layout, state, dp_rank, expert_dp_rank)
        owned, main = sum(map(state, shares)), sum(t.numel for share in shares for t in share) * main_b
    else:
        owned, main = state(tensors), rank.total * main_b
    return {"weights": rank.total * weight_b, "grads": rank.total * grad_b, "main_params": main,
            "optimizer_state": owned - main}


def ns_flops_on_rank(rank: RankParams, layout: Layout, optimizer: OptimizerKind, *, dp_rank: int,
                     expert_dp_rank: int) -> int:
    """Newton-Schulz FLOPs one optimizer step runs on one GPU of pipeline rank ``rank``: the Muon matrices its
    optimizer updates (``dist_muon``: its layer-wise shares; ``muon``: every one; AdamW: none), each on this
    rank's TP shard (``Tensor.ns_flops``)."""
    if not is_muon(optimizer):
        return 0
    if optimizer == "dist_muon" and max(_group_sizes(layout)) > 1:
        tensors = [t for share in _layer_wise_shares(rank, layout, lambda ts: 0, dp_rank, expert_dp_rank)
                   for t in share]
    else:
        tensors = list(rank.tensors)
    return sum(t.ns_flops for t in tensors if t.route == "muon")


# ---------------------------------------------------------------------------------------------- activations
def _attention_elements(arch: Architecture, drop: set[str]) -> tuple[float, float]:
    """Values kept per token by one attention block (its norm included), before TP/SP sharding:
    (other values, inputs of GEMMs, which FP8 recipes keep quantized)."""
    h, heads = arch.hidden_size, arch.num_attention_heads
    norm = 0 if "layernorm" in drop else h  # the norm's output = the projections' input
    if arch.mla is not None:
        nope, rope, v = arch.mla.qk_nope_head_dim, arch.mla.qk_rope_head_dim, arch.mla.v_head_dim
        q_rank, kv_rank = arch.mla.q_lora_rank or 0, arch.mla.kv_lora_rank
        down = q_rank + kv_rank + rope  # down-projection outputs (the latent norms' inputs)
        up_inputs = q_rank + kv_rank  # normed latents
        up = heads * (nope + rope) + heads * (nope + v)  # up-projection outputs
        qkv = heads * (2 * (nope + rope) + v)  # q, k (k_rope broadcast), v for the attention kernel
        kept = 0 if "mla_up_proj" in drop else up + qkv
        return h + down + kept, norm + up_inputs + heads * v
    d, groups = arch.head_dim, arch.num_kv_heads
    qkv = (heads + 2 * groups) * d
    qk_norm = (heads + groups) * d if arch.qk_norm else 0
    return h + qkv + qk_norm, norm + heads * d


def _mlp_elements(arch: Architecture, moe: bool, drop: set[str]) -> tuple[float, float]:
    """Values kept per token by one MLP / MoE block (its norm included): (other values, GEMM inputs).

    A routed token keeps its dispatched input, its fc1 output (the SwiGLU input; megatron-core applies the
    router probability inside the activation) and its fc2 input, once per expert it is routed to."""
    h = arch.hidden_size
    norm = 0 if "layernorm" in drop else h
    if not moe or arch.moe is None:
        ffn = arch.ffn_hidden_size
        return (h, norm) if "mlp" in drop else (h + 2 * ffn, norm + ffn)
    experts, k, width = arch.moe.experts, arch.moe.top_k, arch.moe.ffn_hidden_size
    shared = arch.moe.shared_ffn_hidden_size
    other, gemm = h + 2 * experts, norm  # residual, router probabilities in fp32 (2 bf16 values)
    if "moe" not in drop:
        other += 0 if "moe_act" in drop else k * 2 * width
        gemm += k * (h + width)
    if shared and "shared_experts" not in drop:
        other, gemm = other + 2 * shared, gemm + shared
    return other, gemm


def holds_logits(arch: Architecture, layout: Layout, rank: RankParams) -> bool:
    """Whether pipeline rank ``rank`` computes the logits (its output layer, or the tied embedding at PP1)."""
    names = {t.name for t in rank.tensors}
    return "output_layer.weight" in names or (layout.pp == 1 and arch.tie_word_embeddings)


def activation_bytes(arch: Architecture, layout: Layout, rank: RankParams, *, micro_batches: int,
                     recompute: dict[str, Any]) -> float:
    """Activation memory of pipeline rank ``rank`` (bytes, estimate; see the module docstring)."""
    tokens = layout.micro_batch_size * layout.seq_length / layout.cp / layout.tp  # per TP rank (SP)
    value = 4 if layout.precision == "fp32" else 2
    gemm_value = 1 + 1 / 32 if "fp8" in layout.precision else value  # FP8 keeps GEMM inputs quantized (+ scales)
    granularity = recompute.get("recompute_granularity")
    drop = set(recompute.get("recompute_modules") or ["core_attn"]) if granularity == "selective" else set()
    per_layer = {}
    for layer in rank.layers:
        parts = (_attention_elements(arch, drop), _mlp_elements(arch, arch.is_moe(layer), drop))
        per_layer[layer] = tokens * sum(other * value + gemm * gemm_value for other, gemm in parts)
    if granularity == "full":
        n = recompute.get("recompute_num_layers") or 1
        stored = [tokens * arch.hidden_size * value] * len(rank.layers)  # each layer's input
        if recompute.get("recompute_method") == "block":
            kept = [per_layer[layer] for layer in rank.layers[n:]]
            stage = sum(stored[:n]) + sum(kept)
        else:
            stage = math.ceil(len(rank.layers) / n) * stored[0] if rank.layers else 0
        live = max(per_layer.values(), default=0) * n  # one recomputed group during its backward
    else:
        stage, live = sum(per_layer.values()), 0
    pp, vp = layout.pp, layout.vp or 1
    if vp > 1:
        chunks = min((pp - rank.pp_rank - 1) * 2 + (vp - 1) * pp + 1, micro_batches * vp)
        in_flight = chunks / vp  # chunks hold 1/vp of the rank's layers each
    else:
        in_flight = min(pp - rank.pp_rank, micro_batches)
    total = stage * in_flight + live
    if holds_logits(arch, layout, rank):
        total += tokens * (arch.hidden_size * value + arch.vocab_size * 4)  # output-layer input, fp32 logits
    return total
