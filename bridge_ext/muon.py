"""Muon done right: preset application, MuonClip (QK-clip), a routing manifest and Newton-Schulz telemetry.

Four parts, each usable alone:

* **Presets at run time** (:func:`apply_preset`, :func:`resolve_schedule`, :func:`install_ns_coefficients`,
  :func:`install_muon_clip`): what a ``recipes.optimizers.MuonPreset`` needs beyond the
  ``OptimizerConfig``/``SchedulerConfig`` fields that ``bridge_ext.build`` already applies.
* **MuonClip** (:func:`clip_qk`): the per-head QK-clip of Kimi K2 (arXiv 2507.20534, Algorithm 1) through
  megatron-core 0.16's ``MultiLatentAttention.clip_qk``, unwrapping fp32 models; the step's max logit over
  every micro-batch comes from ``bridge_ext.attention_logits``.
* **Routing manifest** (:func:`muon_plan`, ``nemo llm muon-plan``): every parameter of a recipe's model,
  from its shipped HF ``config.json`` alone (no torch), with the optimizer megatron-core routes it to, how
  Muon splits it and its Newton-Schulz FLOPs.
* **Telemetry** (:class:`MuonTelemetry`): update RMS per parameter group, Newton-Schulz orthogonality
  error and the maximum attention logit every N iterations, to the console and TensorBoard.

References: Moonlight, arXiv 2502.16982 ("Muon is Scalable for LLM Training"); Kimi K2, arXiv 2507.20534;
Keller Jordan, "Muon" (2024); megatron-core 0.16.1 ``optimizer/muon.py``, ``optimizer/qk_clip.py``,
``transformer/multi_latent_attention.py``; emerging-optimizers 0.3.0 ``orthogonalized_optimizers``.
Importing this module imports neither torch nor Megatron.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any, Literal

from bridge_ext.attention_logits import attentions as _attentions
from bridge_ext.attention_logits import track_attention_logits
from bridge_ext.errors import UserError

if TYPE_CHECKING:
    import torch

    from recipes import Recipe
    from recipes.optimizers import OptimizerPreset

__all__ = [
    "CoefficientType",
    "MuonPlan",
    "MuonTelemetry",
    "PlanRow",
    "apply_preset",
    "clip_qk",
    "cmd_muon_plan",
    "format_plan",
    "install_muon_clip",
    "install_ns_coefficients",
    "installed_ns_coefficients",
    "muon_plan",
    "newton_schulz_flops",
    "orthogonality_error",
    "register",
    "resolve_schedule",
    "track_attention_logits",
]

CoefficientType = Literal["simple", "quintic", "polar_express", "cans", "aol"]

# =========================================================================================================
# Presets at run time
# =========================================================================================================

_ns_coefficients: str = "quintic"  # what TensorParallelMuon uses when nothing is installed (0.16 default)


def install_ns_coefficients(coefficient_type: CoefficientType) -> None:
    """Make every ``TensorParallelMuon`` built from now on use ``coefficient_type`` (process-wide).

    megatron-core 0.16's ``get_megatron_muon_optimizer`` (``optimizer/muon.py:236``) builds
    ``TensorParallelMuon`` without a ``coefficient_type``, so it is always the class default "quintic"
    (modded-nanogpt's 5 per-step sets), and ``OptimizerConfig`` has no field for it. This wraps
    ``TensorParallelMuon.__init__`` so that an unspecified ``coefficient_type`` is ours. Idempotent; an
    explicit ``coefficient_type=`` argument still wins. "simple" is Keller Jordan's (3.4445, -4.7750, 2.0315).
    """
    global _ns_coefficients
    from emerging_optimizers.orthogonalized_optimizers.muon_utils import _COEFFICIENT_SETS
    from megatron.core.optimizer import muon

    if coefficient_type not in _COEFFICIENT_SETS:
        raise UserError(f"unknown Newton-Schulz coefficient set '{coefficient_type}'; "
                        f"emerging-optimizers has: {', '.join(_COEFFICIENT_SETS)}")
    _ns_coefficients = coefficient_type
    cls = muon.TensorParallelMuon
    if getattr(cls.__init__, "_bridge_ext_ns", False):
        return
    original = cls.__init__

    def __init__(self, *args: Any, coefficient_type: str | None = None, **kwargs: Any) -> None:
        original(self, *args, coefficient_type=coefficient_type or _ns_coefficients, **kwargs)
        self.coefficient_type = coefficient_type or _ns_coefficients  # for telemetry and tests

    __init__._bridge_ext_ns = True  # type: ignore[attr-defined]
    cls.__init__ = __init__  # type: ignore[method-assign]


def installed_ns_coefficients() -> str:
    """The coefficient set ``TensorParallelMuon`` gets when none is passed."""
    return _ns_coefficients


def apply_preset(cfg: Any, preset: OptimizerPreset, *, runtime: bool = True) -> None:
    """Apply a preset's non-``OptimizerConfig`` settings to ``cfg`` (a Bridge ``ConfigContainer``).

    Writes the preset's model fields (QK-clip: ``qk_clip``, ``qk_clip_threshold``, ``qk_clip_alpha``,
    ``log_max_attention_logit`` on the TransformerConfig / provider) and, when ``runtime``, installs its
    Newton-Schulz coefficients and the MuonClip fix (:func:`install_muon_clip`). Plain presets
    (``nvidia_perf``, ``adamw``) get "quintic", megatron-core's default. A model field the installed
    megatron-core does not have fails with a ``UserError``.
    """
    for key, value in getattr(preset, "model", {}).items():
        if not hasattr(cfg.model, key):
            raise UserError(f"optimizer preset '{preset.name}' sets model.{key}, which the installed "
                            "megatron-core's TransformerConfig does not have; pick another preset")
        setattr(cfg.model, key, value)
    if runtime and preset.kind == "muon":
        from bridge_ext.muon_split import install_gate_up_split

        install_ns_coefficients(getattr(preset, "ns_coefficients", "quintic"))
        install_gate_up_split(getattr(preset, "split_gate_up", False))
        install_muon_clip()


def resolve_schedule(cfg: Any, preset: OptimizerPreset) -> dict[str, Any]:
    """Turn the preset's schedule fractions into iteration counts for ``cfg.train.train_iters``.

    Call after every override (recipe, ``--yaml``, command line) and before ``validate()``/``pretrain``.
    Megatron Bridge 0.3.1's ``SchedulerConfig`` knows ``lr_warmup_fraction`` (of ``lr_decay_iters``) but
    has only iteration counts for the WSD decay, so ``lr_wsd_decay_fraction`` becomes
    ``lr_wsd_decay_iters = round(fraction * lr_decay_iters)``. Explicit settings win: a non-zero
    ``lr_warmup_iters`` (e.g. the proxies' 5) drops ``lr_warmup_fraction`` (Megatron rejects both), and a
    set ``lr_wsd_decay_iters`` is kept. Idempotent; calling it again after ``train.train_iters`` changed
    recomputes what it set itself (a value read back from YAML counts as explicit). Returns what it changed.
    """
    sched, changed = cfg.scheduler, {}
    if sched.lr_warmup_fraction is not None and sched.lr_warmup_iters:
        sched.lr_warmup_fraction = None
        changed["lr_warmup_fraction"] = None
    fraction = getattr(preset, "schedule_fractions", {}).get("lr_wsd_decay_fraction")
    ours = getattr(sched, "_bridge_ext_wsd_iters", None)  # set by an earlier call: recompute, not explicit
    unset = sched.lr_wsd_decay_iters is None or sched.lr_wsd_decay_iters == ours
    if fraction is not None and unset and sched.lr_decay_style == "WSD":
        iters = cfg.train.train_iters
        if iters is None:
            raise UserError(f"preset '{preset.name}' sets its decay as a fraction of train.train_iters; "
                            "set train.train_iters (sample-based training is not supported by this preset)")
        decay_iters = sched.lr_decay_iters or iters
        sched.lr_wsd_decay_iters = max(1, round(fraction * decay_iters))
        sched._bridge_ext_wsd_iters = sched.lr_wsd_decay_iters
        changed["lr_wsd_decay_iters"] = sched.lr_wsd_decay_iters
    return changed


# =========================================================================================================
# MuonClip
# =========================================================================================================


def clip_qk(model: Any, *, log_max_only: bool = False) -> float | None:
    """MuonClip's QK-clip after the optimizer step; returns the max attention logit (None if unmeasured).

    What ``megatron.core.optimizer.qk_clip.clip_qk`` does (all-reduce the per-head maxima over DP x CP,
    then ``self_attention.clip_qk()``), except that it finds the decoder through any wrapper: upstream
    reads ``model_chunk.module.module.decoder``, which assumes a Float16Module and fails for fp32 models.
    For MLA, megatron-core's ``clip_qk`` scales per head h with gamma_h = min(1, tau / S_max_h):
    q_nope by gamma^alpha, q_rope by gamma, k_nope by gamma^(1 - alpha) (rows of ``linear_kv_up_proj``), v
    and the shared k_rope (``linear_kv_down_proj``) untouched: Kimi K2's per-head QK-clip with alpha = 0.5.
    """
    import torch
    from megatron.core import parallel_state

    best = None
    with torch.no_grad():
        for attention in _attentions(model):
            logits = getattr(attention.core_attention, "current_max_attn_logits", None)
            if logits is None or not hasattr(attention, "clip_qk"):
                continue
            if torch.distributed.is_initialized() and parallel_state.model_parallel_is_initialized():
                torch.distributed.all_reduce(logits, op=torch.distributed.ReduceOp.MAX,
                                             group=parallel_state.get_data_parallel_group(with_context_parallel=True))
            best = max(best or -math.inf, float(logits.max()))
            if log_max_only:
                attention.core_attention.current_max_attn_logits = None
            else:
                attention.clip_qk()
    return best


def install_muon_clip() -> None:
    """Make Megatron Bridge's training step use :func:`clip_qk` (idempotent).

    ``megatron/bridge/training/train.py:757`` calls ``megatron.core.optimizer.qk_clip.clip_qk(model)``
    after ``optimizer.step()`` when ``model.qk_clip`` is set; that one reaches the decoder as
    ``model_chunk.module.module`` and raises ``AttributeError`` for fp32 models (no Float16Module).
    """
    from megatron.bridge.training import train

    if getattr(train.clip_qk, "_bridge_ext", False):
        return

    def bridge_clip_qk(model: Any, log_max_only: bool = False) -> float | None:
        return clip_qk(model, log_max_only=log_max_only)

    bridge_clip_qk._bridge_ext = True  # type: ignore[attr-defined]
    train.clip_qk = bridge_clip_qk


# =========================================================================================================
# Routing manifest (pure Python: no torch)
# =========================================================================================================

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
    ns_flops: int  # per optimizer step, all copies

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
    def __init__(self, *, muon: bool, steps: int, split_qkv: bool, tp: int, etp: int):
        self.muon, self.steps, self.split_qkv, self.tp, self.etp = muon, steps, split_qkv, tp, etp
        self.rows: list[PlanRow] = []

    def add(self, pattern: str, shape: tuple[int, ...], *, layers: Sequence[int] | None = None,
            experts: int | None = None, embedding: bool = False, split: str = "none",
            pieces: Sequence[tuple[int, int]] | None = None, tp_dim: int | None = None) -> None:
        # megatron-core 0.16 optimizer/muon.py:215: 2-D and not embedding/output -> Muon, else Adam
        to_muon = self.muon and len(shape) == 2 and not embedding
        if to_muon:
            tp = self.etp if experts else self.tp
            matrices = tuple(b for piece in (pieces or [shape]) for b in _blocks(piece, tp, tp_dim))
            if tp > 1 and tp_dim is not None:
                split = f"{split}; TP{tp} blockwise (dim {tp_dim})" if split != "none" else f"TP{tp} blockwise"
        else:
            matrices, split = (), "-"
        layers_t = tuple(layers) if layers is not None else None
        copies = (len(layers_t) if layers_t is not None else 1) * (experts or 1)
        flops = copies * sum(newton_schulz_flops(r, c, self.steps) for r, c in matrices)
        self.rows.append(PlanRow(pattern=pattern, shape=tuple(shape), layers=layers_t, experts=experts,
                                 route="muon" if to_muon else "adam", split=split, ns_matrices=matrices,
                                 ns_flops=flops))


def _is_moe(cfg: Mapping[str, Any], layer: int) -> bool:
    from recipes.params import _is_moe_layer

    return _is_moe_layer(dict(cfg), layer)


def _plan_rows(cfg: Mapping[str, Any], b: _PlanBuilder) -> None:
    h, vocab, n_layers = cfg["hidden_size"], cfg["vocab_size"], cfg["num_hidden_layers"]
    heads = cfg["num_attention_heads"]
    moe_layers = [i for i in range(n_layers) if _is_moe(cfg, i)]
    dense_layers = [i for i in range(n_layers) if i not in moe_layers]
    every = list(range(n_layers))
    L = "decoder.layers.{layer}."

    b.add("embedding.word_embeddings.weight", (vocab, h), embedding=True)
    b.add(L + "input_layernorm.weight", (h,), layers=every)
    if "kv_lora_rank" in cfg:  # MLA: projections orthogonalized whole (no split)
        nope, rope, v = cfg["qk_nope_head_dim"], cfg["qk_rope_head_dim"], cfg["v_head_dim"]
        q_rank, kv_rank = cfg.get("q_lora_rank"), cfg["kv_lora_rank"]
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
        d = cfg.get("head_dim") or h // heads
        groups = cfg["num_key_value_heads"]
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
        if cfg.get("attention_bias"):
            b.add(A + "linear_qkv.bias", (shape[0],), layers=every)
            b.add(A + "linear_proj.bias", (h,), layers=every)
        if cfg["model_type"].startswith("qwen3"):
            b.add(A + "q_layernorm.weight", (d,), layers=every)
            b.add(A + "k_layernorm.weight", (d,), layers=every)
        b.add(A + "linear_proj.weight", (h, heads * d), layers=every, tp_dim=1)
    b.add(L + "pre_mlp_layernorm.weight", (h,), layers=every)
    # linear_fc1 = [gate; up]: one matrix, or two with the preset's split_gate_up (bridge_ext.muon_split)
    split_gate_up = getattr(b, "split_gate_up", False)
    fused = ("gate and up orthogonalized apart" if split_gate_up
             else "none (gate and up fused, orthogonalized together)")

    def halves(rows: int) -> list[tuple[int, int]] | None:
        return [(rows // 2, h)] * 2 if split_gate_up else None

    if dense_layers:
        ffn = cfg["intermediate_size"]
        b.add(L + "mlp.linear_fc1.weight", (2 * ffn, h), layers=dense_layers, split=fused, pieces=halves(2 * ffn),
              tp_dim=0)
        b.add(L + "mlp.linear_fc2.weight", (h, ffn), layers=dense_layers, tp_dim=1)
    if moe_layers:
        experts = cfg.get("n_routed_experts") or cfg["num_experts"]
        width = cfg["moe_intermediate_size"]
        b.add(L + "mlp.router.weight", (experts, h), layers=moe_layers, split="none (2-D: Muon by default)")
        E = L + "mlp.experts.local_experts.{expert}."
        b.add(E + "linear_fc1.weight", (2 * width, h), layers=moe_layers, experts=experts,
              split="per expert; " + fused, pieces=halves(2 * width), tp_dim=0)
        b.add(E + "linear_fc2.weight", (h, width), layers=moe_layers, experts=experts, split="per expert", tp_dim=1)
        shared = cfg.get("n_shared_experts") or 0
        if shared:
            S = L + "mlp.shared_experts."
            b.add(S + "linear_fc1.weight", (2 * shared * width, h), layers=moe_layers, split=fused,
                  pieces=halves(2 * shared * width), tp_dim=0)
            b.add(S + "linear_fc2.weight", (h, shared * width), layers=moe_layers, tp_dim=1)
    b.add("decoder.final_layernorm.weight", (h,))
    if not cfg.get("tie_word_embeddings"):
        b.add("output_layer.weight", (vocab, h), embedding=True)


def _attention_flops_per_token(cfg: Mapping[str, Any], seq: int) -> int:
    """Causal attention (QK^T and AV), forward + backward, per token, all layers: 3 * 2 * (s/2) * 2 matmuls."""
    heads = cfg["num_attention_heads"]
    if "kv_lora_rank" in cfg:
        qk, v = cfg["qk_nope_head_dim"] + cfg["qk_rope_head_dim"], cfg["v_head_dim"]
    else:
        qk = v = cfg.get("head_dim") or cfg["hidden_size"] // heads
    return 3 * seq * heads * (qk + v) * cfg["num_hidden_layers"]


def muon_plan(recipe: Recipe | str, *, layout: str | None = None) -> MuonPlan:
    """The routing manifest of a recipe's model on a layout, from its shipped HF config (no torch)."""
    from recipes import get_recipe

    recipe = get_recipe(recipe) if isinstance(recipe, str) else recipe
    chosen = recipe.layout(layout)
    cfg, preset = recipe.model.hf_config, recipe.preset
    opt = preset.optimizer
    muon = preset.kind == "muon"
    b = _PlanBuilder(muon=muon, steps=opt.get("muon_num_ns_steps", 5), split_qkv=opt.get("muon_split_qkv", True),
                     tp=chosen.tp if opt.get("muon_tp_mode", "blockwise") == "blockwise" else 1,
                     etp=(chosen.etp or 1) if opt.get("muon_tp_mode", "blockwise") == "blockwise" else 1)
    b.split_gate_up = muon and getattr(preset, "split_gate_up", False)
    _plan_rows(cfg, b)
    rows = tuple(b.rows)
    total = sum(r.params for r in rows)
    muon_params = sum(r.params for r in rows if r.route == "muon")
    tokens = chosen.global_batch_size * chosen.seq_length
    active = recipe.model.params.active
    embedding = cfg["vocab_size"] * cfg["hidden_size"]  # a lookup, not a matmul
    router_bias = 0
    if cfg.get("topk_method") == "noaux_tc":  # recipes.params counts the expert bias; Megatron keeps a buffer
        router_bias = (cfg.get("n_routed_experts") or 0) * sum(_is_moe(cfg, i) for i in range(cfg["num_hidden_layers"]))
    attention = _attention_flops_per_token(cfg, chosen.seq_length)
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


def cmd_muon_plan(args: argparse.Namespace) -> int:
    plan = muon_plan(args.recipe, layout=args.layout)
    if args.json:
        print(json.dumps(plan.to_json(), indent=2))
    else:
        print(format_plan(plan))
    return 0


def register(subparsers: Any) -> None:
    """Add ``muon-plan`` to ``nemo llm`` (the ``register(subparsers)`` pattern of ``bridge_ext.convert``)."""
    p = subparsers.add_parser("muon-plan", help="which parameters Muon orthogonalizes, how, and at what cost",
                              description="Computed from the recipe's shipped HF config; no torch, no weights.")
    p.add_argument("--recipe", required=True)
    p.add_argument("--layout", help="a layout name from the recipe's list (default: its first)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=cmd_muon_plan)


# =========================================================================================================
# Telemetry
# =========================================================================================================


def orthogonality_error(matrix: torch.Tensor, *, steps: int = 5, coefficient_type: str = "quintic") -> float:
    """|| O^T O - I ||_F / sqrt(k) for O = Newton-Schulz(matrix), k = min(rows, cols), in fp32.

    The small Gram matrix is used (O O^T when rows < cols). 0 means exactly semi-orthogonal; Keller
    Jordan's coefficients deliberately stop at singular values in roughly [0.7, 1.2], so ~0.1-0.3 is normal.
    """
    import torch
    from emerging_optimizers.orthogonalized_optimizers.muon_utils import newton_schulz

    x = matrix.detach().float()
    with torch.no_grad():
        prec = torch.get_float32_matmul_precision()
        torch.set_float32_matmul_precision("highest")
        try:
            o = newton_schulz(x, steps=steps, coefficient_type=coefficient_type)
        finally:
            torch.set_float32_matmul_precision(prec)
        gram = o.mT @ o if o.shape[0] >= o.shape[1] else o @ o.mT
        eye = torch.eye(gram.shape[0], dtype=gram.dtype, device=gram.device)
        return float(torch.linalg.matrix_norm(gram - eye) / math.sqrt(gram.shape[0]))


def _muon_optimizers(optimizer: Any) -> Iterable[Any]:
    chained = getattr(optimizer, "chained_optimizers", [optimizer])
    for opt in chained:
        inner = getattr(opt, "optimizer", opt)
        if inner is not None:  # megatron-core leaves the Adam part None when every trainable param is a matrix (LoRA)
            yield inner


@dataclass
class MuonTelemetry:
    """Every ``interval`` iterations: update RMS per group, NS orthogonality error, max attention logit.

    A Megatron Bridge callback (``pretrain(cfg, forward_step, callbacks=[MuonTelemetry(interval=100)])``):
    ``on_train_start`` installs :func:`track_attention_logits`; before a logged step it snapshots up to
    ``max_params`` parameters per group and starts measuring the max logit, after it logs
    ``update_rms/<group>`` = RMS(p_new - p_old) averaged over the sampled parameters (groups: ``muon``,
    ``muon_experts``, ``adam``), ``ns_orthogonality_error`` (mean over ``sample_matrices`` momentum buffers,
    :func:`orthogonality_error`), ``max_attention_logit/layer_<i>`` (max over the logged iteration's
    micro-batches and the layer's heads) and ``max_attention_logit`` (their max). Nothing is measured on other
    iterations. Printed on rank 0 (without the per-layer values) and written to TensorBoard under ``muon/``.
    ``history`` keeps every record (for tests and notebooks).
    """

    interval: int = 100
    max_params: int = 8  # per group; cloned on logged iterations only (a Kimi K2 expert matrix is 117 MB in fp32)
    sample_matrices: int = 4
    log: Any = None  # a callable(str); default: print to stdout on rank 0
    history: list[dict[str, float]] = field(default_factory=list)

    def __post_init__(self) -> None:
        self._before: dict[str, list[tuple[Any, Any]]] | None = None
        self._tracker: Any = None

    # -- Bridge callback protocol (duck-typed: megatron.bridge.training.callbacks.Callback) ---------------
    def on_train_start(self, context: Any) -> None:
        self._tracker = track_attention_logits(context.model)

    def on_train_step_start(self, context: Any) -> None:
        iteration = context.state.train_state.step + 1  # the iteration about to run, 1-based
        if iteration % self.interval == 0:
            self._before = {g: [(p, p.detach().clone()) for p in ps] for g, ps in self._groups(context).items()}
            if self._tracker is not None:
                self._tracker.start()

    def on_train_step_end(self, context: Any) -> None:
        if self._before is None:
            return
        iteration = context.state.train_state.step + 1  # incremented after on_train_step_end
        if self._tracker is not None:
            self._tracker.stop()
        record = self.measure(context.model, context.optimizer, self._before)
        self._before = None
        record["iteration"] = iteration
        self.history.append(record)
        self._emit(context, iteration, record)

    def on_train_end(self, context: Any) -> None:
        if self._tracker is not None:
            self._tracker.remove()
            self._tracker = None

    # -- measurement ---------------------------------------------------------------------------------------
    def _groups(self, context: Any) -> dict[str, list[Any]]:
        groups: dict[str, list[Any]] = {"muon": [], "muon_experts": [], "adam": []}
        for inner in _muon_optimizers(context.optimizer):
            muon = hasattr(inner, "scaled_orthogonalize_fn")
            for group in inner.param_groups:
                for p in group["params"]:
                    name = ("muon_experts" if getattr(p, "expert_tp", False) else "muon") if muon else "adam"
                    if len(groups[name]) < self.max_params:
                        groups[name].append(p)
        return {k: v for k, v in groups.items() if v}

    def measure(self, model: Any, optimizer: Any, before: Mapping[str, list[tuple[Any, Any]]]) -> dict[str, float]:
        import torch

        record: dict[str, float] = {}
        with torch.no_grad():
            for group, pairs in before.items():
                rms = [float((p.detach().float() - old.float()).pow(2).mean().sqrt()) for p, old in pairs]
                record[f"update_rms/{group}"] = sum(rms) / len(rms)
            errors = []
            for inner in _muon_optimizers(optimizer):
                if not hasattr(inner, "scaled_orthogonalize_fn"):
                    continue
                coefficient_type = getattr(inner, "coefficient_type", installed_ns_coefficients())
                for group in inner.param_groups:
                    for p in group["params"]:
                        buffer = inner.state.get(p, {}).get("momentum_buffer")
                        if buffer is not None and buffer.ndim == 2 and len(errors) < self.sample_matrices:
                            errors.append(orthogonality_error(buffer, coefficient_type=coefficient_type))
            if errors:
                record["ns_orthogonality_error"] = sum(errors) / len(errors)
            logits = {}
            for attention in _attentions(model):
                core = attention.core_attention
                running = getattr(core, "bridge_ext_max_logits", None)
                if running is not None:  # layer_number is global and 1-based (pipeline stages included)
                    logits[f"max_attention_logit/layer_{attention.layer_number - 1}"] = float(running.max())
                    core.bridge_ext_max_logits = None
            if logits:
                record["max_attention_logit"] = max(logits.values())
                record.update(logits)
        return record

    def _emit(self, context: Any, iteration: int, record: Mapping[str, float]) -> None:
        import torch

        if torch.distributed.is_initialized() and torch.distributed.get_rank() != 0:
            return
        text = " | ".join(f"{k} {v:.4g}" for k, v in record.items() if k != "iteration" and "/layer_" not in k)
        (self.log or (lambda s: print(s, file=sys.stdout, flush=True)))(f" [muon] iteration {iteration}: {text}")
        writer = getattr(context.state, "tensorboard_logger", None)
        if writer is not None:
            for key, value in record.items():
                if key != "iteration":
                    writer.add_scalar(f"muon/{key}", value, iteration)
