"""The Muon routing manifest: every parameter of a recipe's model, from its shipped HF ``config.json`` alone.

For each parameter: the optimizer megatron-core 0.16 routes it to (``optimizer/muon.py``), how Muon splits it
before Newton-Schulz and its Newton-Schulz FLOPs (emerging-optimizers ``orthogonalized_optimizers``).
Pure Python: imports neither torch nor Megatron.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any, Literal

from recipes.budget import tokens_per_step

if TYPE_CHECKING:
    from recipes import Recipe
    from recipes.architecture import Architecture

__all__ = ["MuonPlan", "PlanRow", "Route", "format_plan", "muon_plan", "newton_schulz_flops"]

Route = Literal["muon", "adam"]


def newton_schulz_flops(rows: int, cols: int, steps: int) -> int:
    """FLOPs of ``steps`` Newton-Schulz iterations on a rows x cols matrix (emerging-optimizers 0.3.0).

    With m = min(rows, cols), n = max(rows, cols) (the iteration runs on the wide orientation), one step is
    A = X X^T (2 m^2 n), B = b A + c A A (2 m^3), X = a X + B X (2 m^2 n): 4 m^2 n + 2 m^3 FLOPs.
    """
    m, n = min(rows, cols), max(rows, cols)
    return steps * (4 * m * m * n + 2 * m ** 3)


@dataclass(frozen=True)
class PlanRow:
    """One parameter name pattern: ``{layer}`` and ``{expert}`` stand for the listed indices."""

    pattern: str
    shape: tuple[int, ...]
    layers: tuple[int, ...] | None  # decoder layer indices, None outside the decoder
    experts: int | None  # per-layer copies (routed experts), None otherwise
    route: Route
    split: str  # how Muon splits the matrix before Newton-Schulz
    ns_matrices: tuple[tuple[int, int], ...]  # the matrices Newton-Schulz runs on, per copy
    ns_flops: int  # per optimizer step, all copies, every TP rank's work (duplicated mode: TP x the whole matrix)

    @property
    def copies(self) -> int:
        return (len(self.layers) if self.layers is not None else 1) * (self.experts or 1)

    @property
    def params(self) -> int:
        return math.prod(self.shape) * self.copies

    def names(self) -> Iterator[str]:
        for layer in self.layers if self.layers is not None else (None,):
            for expert in range(self.experts) if self.experts else (None,):
                yield self.pattern.format(layer=layer, expert=expert)


@dataclass(frozen=True)
class MuonPlan:
    recipe: str
    preset: str
    layout: str
    rows: tuple[PlanRow, ...]
    ns_steps: int
    tokens_per_step: int
    params_total: int
    params_muon: int
    ns_flops_per_step: int
    model_flops_per_step: int  # 6 * (active matmul params) * tokens + causal attention
    notes: tuple[str, ...] = field(default_factory=tuple)

    @property
    def muon_share(self) -> float:
        return self.params_muon / self.params_total

    @property
    def ns_over_model(self) -> float:
        return self.ns_flops_per_step / self.model_flops_per_step

    @property
    def ns_share_of_total(self) -> float:
        return self.ns_flops_per_step / (self.model_flops_per_step + self.ns_flops_per_step)

    def to_json(self) -> dict[str, Any]:
        rows = []
        for row in self.rows:
            item = asdict(row)
            item.update(copies=row.copies, params=row.params)
            rows.append(item)
        return {
            "recipe": self.recipe, "preset": self.preset, "layout": self.layout, "ns_steps": self.ns_steps,
            "tokens_per_step": self.tokens_per_step, "params_total": self.params_total,
            "params_muon": self.params_muon, "muon_share": self.muon_share,
            "ns_flops_per_step": self.ns_flops_per_step, "model_flops_per_step": self.model_flops_per_step,
            "ns_over_model": self.ns_over_model, "ns_share_of_total": self.ns_share_of_total,
            "notes": list(self.notes), "rows": rows,
        }


def _blocks(shape: tuple[int, int], tp: int, dim: int | None) -> tuple[tuple[int, int], ...]:
    """Blockwise TP (``muon_tp_mode="blockwise"``): each rank orthogonalizes its own shard."""
    if tp == 1 or dim is None:
        return (shape,)
    rows, cols = shape
    block = (rows // tp, cols) if dim == 0 else (rows, cols // tp)
    return (block,) * tp


def _ranges(indices: Sequence[int]) -> str:
    parts, start = [], None
    for i, value in enumerate(indices):
        if start is None:
            start = value
        if i + 1 == len(indices) or indices[i + 1] != value + 1:
            parts.append(f"{start}" if start == value else f"{start}-{value}")
            start = None
    return ",".join(parts)


class _PlanBuilder:
    def __init__(self, *, muon: bool, steps: int, split_qkv: bool, tp: int, etp: int,
                 tp_mode: Literal["blockwise", "duplicated"], split_gate_up: bool = False):
        self.muon, self.steps, self.split_qkv, self.tp, self.etp = muon, steps, split_qkv, tp, etp
        self.tp_mode, self.split_gate_up = tp_mode, split_gate_up
        self.rows: list[PlanRow] = []

    def add(self, pattern: str, shape: tuple[int, ...], *, layers: Sequence[int] | None = None,
            experts: int | None = None, embedding: bool = False, split: str = "none",
            pieces: Sequence[tuple[int, int]] | None = None, tp_dim: int | None = None) -> None:
        # megatron-core 0.16 optimizer/muon.py:215: 2-D and not embedding/output -> Muon, else Adam
        to_muon = self.muon and len(shape) == 2 and not embedding
        runs = 1  # how many TP ranks run Newton-Schulz on each of ``matrices``
        if to_muon:
            tp = self.etp if experts else self.tp
            sharded = tp > 1 and tp_dim is not None
            if self.tp_mode == "blockwise":  # each rank its own shard
                matrices = tuple(b for piece in (pieces or [shape]) for b in _blocks(piece, tp, tp_dim))
            else:  # emerging-optimizers newton_schulz_tp(mode="duplicated"): all-gathered, whole on every TP rank
                matrices, runs = tuple(pieces or [shape]), tp if sharded else 1
            if sharded:
                mode = f"TP{tp} {self.tp_mode}" + (f" (dim {tp_dim})" if self.tp_mode == "blockwise" else "")
                split = f"{split}; {mode}" if split != "none" else mode
        else:
            matrices, split = (), "-"
        layers_t = tuple(layers) if layers is not None else None
        copies = (len(layers_t) if layers_t is not None else 1) * (experts or 1)
        flops = copies * runs * sum(newton_schulz_flops(r, c, self.steps) for r, c in matrices)
        self.rows.append(PlanRow(pattern=pattern, shape=tuple(shape), layers=layers_t, experts=experts,
                                 route="muon" if to_muon else "adam", split=split, ns_matrices=matrices,
                                 ns_flops=flops))


def _plan_rows(arch: Architecture, b: _PlanBuilder) -> None:
    h, vocab, n_layers = arch.hidden_size, arch.vocab_size, arch.num_layers
    heads = arch.num_attention_heads
    moe_layers, dense_layers = list(arch.moe_layers), list(arch.dense_layers)
    every = list(range(n_layers))
    L = "decoder.layers.{layer}."

    b.add("embedding.word_embeddings.weight", (vocab, h), embedding=True)
    b.add(L + "input_layernorm.weight", (h,), layers=every)
    if arch.mla is not None:  # MLA: projections orthogonalized whole (no split)
        nope, rope, v = arch.mla.qk_nope_head_dim, arch.mla.qk_rope_head_dim, arch.mla.v_head_dim
        q_rank, kv_rank = arch.mla.q_lora_rank, arch.mla.kv_lora_rank
        A = L + "self_attention."
        if q_rank:
            b.add(A + "linear_q_down_proj.weight", (q_rank, h), layers=every, split="none (MLA)")
            b.add(A + "q_layernorm.weight", (q_rank,), layers=every)
            b.add(A + "linear_q_up_proj.weight", (heads * (nope + rope), q_rank), layers=every,
                  split="none (MLA: all heads, q_nope and q_rope together)", tp_dim=0)
        else:
            b.add(A + "linear_q_proj.weight", (heads * (nope + rope), h), layers=every, split="none (MLA)",
                  tp_dim=0)
        b.add(A + "linear_kv_down_proj.weight", (kv_rank + rope, h), layers=every,
              split="none (MLA: kv latent and the shared k_rope together)")
        b.add(A + "kv_layernorm.weight", (kv_rank,), layers=every)
        b.add(A + "linear_kv_up_proj.weight", (heads * (nope + v), kv_rank), layers=every,
              split="none (MLA: all heads, k_nope and v together)", tp_dim=0)
        b.add(A + "linear_proj.weight", (h, heads * v), layers=every, tp_dim=1)
    else:
        d, groups = arch.head_dim, arch.num_kv_heads
        A = L + "self_attention."
        shape = ((heads + 2 * groups) * d, h)
        if b.split_qkv:
            # optimizer/muon.py:138: view (groups, (heads/groups + 2) d, h), split Q|K|V within each group,
            # then each part reshaped to one matrix over all groups
            pieces = [(heads * d, h), (groups * d, h), (groups * d, h)]
            split = f"Q | K | V (per-group rows of {groups} query groups gathered): 3 matrices"
        else:
            pieces, split = None, "none (fused QKV)"
        b.add(A + "linear_qkv.weight", shape, layers=every, split=split, pieces=pieces, tp_dim=0)
        if arch.attention_bias:
            b.add(A + "linear_qkv.bias", (shape[0],), layers=every)
            b.add(A + "linear_proj.bias", (h,), layers=every)
        if arch.qk_norm:
            b.add(A + "q_layernorm.weight", (d,), layers=every)
            b.add(A + "k_layernorm.weight", (d,), layers=every)
        b.add(A + "linear_proj.weight", (h, heads * d), layers=every, tp_dim=1)
    b.add(L + "pre_mlp_layernorm.weight", (h,), layers=every)
    # linear_fc1 = [gate; up]: one matrix, or two with the preset's split_gate_up (bridge_ext.muon.split)
    split_gate_up = b.split_gate_up
    fused = ("gate and up orthogonalized apart" if split_gate_up
             else "none (gate and up fused, orthogonalized together)")

    def halves(rows: int) -> list[tuple[int, int]] | None:
        return [(rows // 2, h)] * 2 if split_gate_up else None

    if dense_layers:
        ffn = arch.ffn_hidden_size
        b.add(L + "mlp.linear_fc1.weight", (2 * ffn, h), layers=dense_layers, split=fused, pieces=halves(2 * ffn),
              tp_dim=0)
        b.add(L + "mlp.linear_fc2.weight", (h, ffn), layers=dense_layers, tp_dim=1)
    if arch.moe is not None and moe_layers:
        experts, width = arch.moe.experts, arch.moe.ffn_hidden_size
        b.add(L + "mlp.router.weight", (experts, h), layers=moe_layers, split="none (2-D: Muon by default)")
        E = L + "mlp.experts.local_experts.{expert}."
        b.add(E + "linear_fc1.weight", (2 * width, h), layers=moe_layers, experts=experts,
              split="per expert; " + fused, pieces=halves(2 * width), tp_dim=0)
        b.add(E + "linear_fc2.weight", (h, width), layers=moe_layers, experts=experts, split="per expert", tp_dim=1)
        shared = arch.moe.shared_experts
        if shared:
            S = L + "mlp.shared_experts."
            b.add(S + "linear_fc1.weight", (2 * shared * width, h), layers=moe_layers, split=fused,
                  pieces=halves(2 * shared * width), tp_dim=0)
            b.add(S + "linear_fc2.weight", (h, shared * width), layers=moe_layers, tp_dim=1)
    b.add("decoder.final_layernorm.weight", (h,))
    if not arch.tie_word_embeddings:
        b.add("output_layer.weight", (vocab, h), embedding=True)


def _attention_flops_per_token(arch: Architecture, seq: int) -> int:
    """Causal attention (QK^T and AV), forward + backward, per token, all layers: 3 * 2 * (s/2) * 2 matmuls."""
    if arch.mla is not None:
        qk, v = arch.mla.qk_head_dim, arch.mla.v_head_dim
    else:
        qk = v = arch.head_dim
    return 3 * seq * arch.num_attention_heads * (qk + v) * arch.num_layers


def muon_plan(recipe: Recipe | str, *, layout: str | None = None) -> MuonPlan:
    """The routing manifest of a recipe's model on a layout, from its shipped HF config (no torch)."""
    from recipes.finetune import get_full_recipe  # pre-training and full SFT

    recipe = get_full_recipe(recipe) if isinstance(recipe, str) else recipe
    chosen = recipe.layout(layout)
    arch, preset = recipe.model.architecture, recipe.preset
    opt = preset.optimizer
    muon = preset.kind == "muon"
    b = _PlanBuilder(muon=muon, steps=opt.get("muon_num_ns_steps", 5), split_qkv=opt.get("muon_split_qkv", True),
                     tp=chosen.tp, etp=chosen.etp or 1, tp_mode=opt.get("muon_tp_mode", "blockwise"),
                     split_gate_up=muon and getattr(preset, "split_gate_up", False))
    _plan_rows(arch, b)
    rows = tuple(b.rows)
    total = sum(r.params for r in rows)
    muon_params = sum(r.params for r in rows if r.route == "muon")
    tokens = tokens_per_step(chosen.global_batch_size, chosen.seq_length)
    active = recipe.model.params.active
    embedding = arch.vocab_size * arch.hidden_size  # a lookup, not a matmul
    router_bias = 0
    if arch.moe is not None and arch.moe.expert_bias:  # recipes.params counts it; Megatron keeps a buffer
        router_bias = arch.moe.experts * len(arch.moe.layers)
    attention = _attention_flops_per_token(arch, chosen.seq_length)
    model_flops = (6 * (active - embedding - router_bias) + attention) * tokens
    notes = [
        "names follow Megatron's local (non-TE) layer spec; with Transformer Engine the norms before "
        "linear_qkv / dense linear_fc1 / linear_q_up_proj / linear_kv_up_proj are fused into them as "
        "`layer_norm_weight` and grouped-GEMM experts are `experts.linear_fc{1,2}.weight{expert}`: the "
        "same shapes and routes",
        "NS FLOPs per matrix: steps * (4 m^2 n + 2 m^3), m = min(rows, cols), n = max(rows, cols)",
        "model FLOPs per step: 6 * (active params - input embedding) * tokens + causal attention "
        "3 * seq * heads * (d_qk + d_v) * layers * tokens",
    ]
    if router_bias:
        notes.append(f"the router expert bias ({router_bias:,} values) is a buffer updated by the "
                     "aux-loss-free rule, not an optimizer parameter (recipes.params counts it)")
    if not muon:
        notes.append(f"preset '{preset.name}' is AdamW: every parameter goes to Adam")
    return MuonPlan(recipe=recipe.name, preset=preset.name, layout=chosen.cluster, rows=rows,
                    ns_steps=b.steps, tokens_per_step=tokens, params_total=total, params_muon=muon_params,
                    ns_flops_per_step=sum(r.ns_flops for r in rows), model_flops_per_step=model_flops,
                    notes=tuple(notes))


def _fmt(n: float) -> str:
    for unit, scale in (("P", 1e15), ("T", 1e12), ("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.2f}{unit}"
    return f"{n:.0f}"


def format_plan(plan: MuonPlan) -> str:
    """The manifest as a table plus totals."""
    lines = [f"muon-plan {plan.recipe} (preset {plan.preset}, layout {plan.layout}, {plan.ns_steps} NS steps, "
             f"{plan.tokens_per_step:,} tokens/step)", ""]
    header = f"{'parameter':<72} {'shape':<13} {'copies':>7} {'params':>8} {'opt':<4} {'NS FLOP/step':>12}  split"
    lines += [header, "-" * len(header)]
    for row in plan.rows:
        pattern = row.pattern
        if row.layers is not None:
            pattern = pattern.replace("{layer}", f"[{_ranges(row.layers)}]")
        if row.experts:
            pattern = pattern.replace("{expert}", f"[0-{row.experts - 1}]")
        shape = "x".join(map(str, row.shape))
        lines.append(f"{pattern:<72} {shape:<13} {row.copies:>7} {_fmt(row.params):>8} {row.route:<4} "
                     f"{_fmt(row.ns_flops) if row.ns_flops else '-':>12}  {row.split}")
    lines += [
        "",
        f"parameters          {plan.params_total:,} ({_fmt(plan.params_total)}); under Muon {plan.params_muon:,} "
        f"({plan.muon_share:.2%})",
        f"Newton-Schulz       {_fmt(plan.ns_flops_per_step)}FLOP per step",
        f"model (6ND + attn)  {_fmt(plan.model_flops_per_step)}FLOP per step",
        f"NS / model          {plan.ns_over_model:.2%}  (NS share of model + NS: {plan.ns_share_of_total:.2%})",
    ]
    lines += [f"note: {note}" for note in plan.notes]
    return "\n".join(lines)
