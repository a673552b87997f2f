"""A recipe's plan (``bridge_ext.plan.plan``): the layout with its ``key=value`` overrides, the parameters each
pipeline rank holds, memory per optimizer, FLOPs, tokens and GPU-hours; the throughput figures it defaults to."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

from bridge_ext.errors import UserError
from bridge_ext.overrides import LAYOUT_KEYS, layout_sizes, parse_overrides, positive_int
from bridge_ext.plan.memory import GB, GPUS, HEADROOM, Memory, OptimizerKind, activation_bytes, model_state, verdict
from bridge_ext.plan.ranks import RankParams, Spec, rank_params
from recipes.budget import tokens_per_step
from recipes.optimizers import is_muon

__all__ = ["BLOG", "BLOG_URL", "LABELS", "OVERRIDABLE", "OVERRIDE_KEYS", "Plan", "pipeline_ranks", "plan",
           "selected_optimizer"]

# NVIDIA Technical Blog, "Advancing Emerging Optimizers for Accelerated LLM Training with NVIDIA Megatron"
# (2026-04-22), Table 1, GB300 NVL72, MXFP8, Megatron Bridge 26.02, TFLOP/s per GPU. Muon's figure counts
# model + Newton-Schulz FLOPs (Kimi K2: 1,029 + 51; Qwen3-30B-A3B: 686 + 35).
BLOG_URL = ("https://developer.nvidia.com/blog/advancing-emerging-optimizers-for-accelerated-llm-training-with-"
            "nvidia-megatron/")
BLOG = {("kimi_k2", "gb300", "muon"): 1080.0, ("kimi_k2", "gb300", "adamw"): 1051.0,
        ("qwen3_30b_a3b", "gb300", "muon"): 721.0, ("qwen3_30b_a3b", "gb300", "adamw"): 713.0}

# `key=value` overrides the plan understands (the layout's and the run's sizes), and the Layout field each sets.
OVERRIDABLE = LAYOUT_KEYS
_RECOMPUTE = ("model.recompute_granularity", "model.recompute_modules", "model.recompute_method",
              "model.recompute_num_layers")
_OPTIMIZER = ("optimizer.optimizer", "optimizer.use_distributed_optimizer")
_OTHER = ("train.train_iters",)
OVERRIDE_KEYS = (*OVERRIDABLE, *_RECOMPUTE, *_OPTIMIZER, *_OTHER)  # every key=value a plan reads

LABELS: dict[OptimizerKind, str] = {
    "dist_muon": "Muon, layer-wise sharded (dist_muon)", "muon": "Muon, unsharded (muon)",
    "adam_distributed": "AdamW, distributed optimizer", "adam": "AdamW, unsharded",
}


@dataclass(frozen=True)
class Plan:
    recipe: str
    preset: str
    layout: str
    spec: Spec
    parallel: dict[str, Any]
    micro_batches: int
    params_total: int
    params_active: int
    ranks: tuple[RankParams, ...]
    memory: dict[OptimizerKind, Memory]  # the pipeline rank with the largest total, per optimizer
    selected: OptimizerKind
    model_flops_per_step: float
    ns_flops_per_step: int
    tokens_per_step: int
    train_iters: int
    tflops_per_gpu: float | None
    tflops_source: str
    notes: tuple[str, ...] = field(default_factory=tuple)

    @property
    def total_tokens(self) -> int:
        return self.tokens_per_step * self.train_iters

    @property
    def muon_saving_gb(self) -> float:
        """AdamW (distributed optimizer) minus layer-wise Muon, per GPU."""
        return (self.memory["adam_distributed"].total - self.memory["dist_muon"].total) / GB

    @property
    def gpu_hours(self) -> float | None:
        if not self.tflops_per_gpu:
            return None
        flops = (self.model_flops_per_step + self.ns_flops_per_step) * self.train_iters
        return flops / (self.tflops_per_gpu * 1e12) / 3600

    def verdicts(self, kind: OptimizerKind | None = None) -> dict[str, str]:
        total = self.memory[kind or self.selected].total
        return {gpu: verdict(total, gpu) for gpu in GPUS}

    def to_json(self) -> dict[str, Any]:
        return {
            "recipe": self.recipe, "preset": self.preset, "layout": self.layout, "spec": self.spec,
            "parallel": self.parallel, "micro_batches_per_step": self.micro_batches,
            "params_total": self.params_total, "params_active": self.params_active,
            "params_per_rank": [{"pp_rank": r.pp_rank, "layers": len(r.layers), "total": r.total, "dense": r.dense,
                                 "expert": r.expert, "muon": r.routed("muon")} for r in self.ranks],
            "memory_per_gpu": {kind: m.as_dict() for kind, m in self.memory.items()},
            "selected_optimizer": self.selected, "fit": self.verdicts(),
            "gpus_gb": GPUS, "fits_at_most": HEADROOM,
            "muon_saving_gb_per_gpu": self.muon_saving_gb,
            "model_flops_per_step": self.model_flops_per_step, "ns_flops_per_step": self.ns_flops_per_step,
            "ns_over_model": self.ns_flops_per_step / self.model_flops_per_step,
            "tokens_per_step": self.tokens_per_step, "train_iters": self.train_iters,
            "total_tokens": self.total_tokens, "tflops_per_gpu": self.tflops_per_gpu,
            "tflops_source": self.tflops_source, "gpu_hours": self.gpu_hours, "notes": list(self.notes),
        }


def _apply_overrides(layout, overrides: list[str]) -> tuple[Any, dict[str, Any], dict[str, Any], int | None]:
    values = parse_overrides(overrides, keys=OVERRIDE_KEYS, command="nemo llm plan",
                             example="train.global_batch_size=2048")
    recompute = {**layout.model, **{k.removeprefix("model."): v for k, v in values.items() if k in _RECOMPUTE}}
    optimizer = {k.removeprefix("optimizer."): v for k, v in values.items() if k in _OPTIMIZER}
    iters = positive_int("train.train_iters", values["train.train_iters"]) if "train.train_iters" in values else None
    return replace(layout, **layout_sizes(values)), recompute, optimizer, iters


def _selected(opt: dict[str, Any]) -> OptimizerKind:
    name = opt.get("optimizer", "adam")
    if is_muon(name):
        return name
    if name != "adam":
        raise UserError(f"optimizer.optimizer={name} is not planned; use muon, dist_muon or adam")
    return "adam_distributed" if opt.get("use_distributed_optimizer") else "adam"


def _default_tflops(recipe, layout, kind: str) -> tuple[float | None, str]:
    model = recipe.model.name
    gpu = layout.cluster.split("x")[0]
    value = BLOG.get((model, gpu, kind))
    if value is None:
        return None, "no measured figure for this model and GPU: pass --tflops-per-gpu"
    return value, f"NVIDIA's measured {value:,.0f} TFLOP/s/GPU ({recipe.model.display}, {kind}, GB300 MXFP8; {BLOG_URL})"


def pipeline_ranks(recipe: Any, layout: Any, *, spec: Spec, manifest: Any = None) -> list[RankParams]:
    """What each pipeline rank of ``recipe`` (a ``recipes.Recipe``) holds on ``layout`` (a ``Layout``), the
    routes as Muon would take them (for the Muon rows of an AdamW recipe too: 2-D, not embedding/output)."""
    from bridge_ext.muon import muon_plan
    from recipes import RECIPES

    if manifest is None:
        manifest = muon_plan(replace(recipe, layouts={layout.cluster: layout}), layout=layout.cluster)
    muon_twin = next((r for r in (recipe, RECIPES.get(recipe.name), RECIPES.get(recipe.twin))
                      if r and r.preset.kind == "muon"), None)
    routes = manifest if muon_twin is None or recipe.preset.kind == "muon" else muon_plan(
        replace(muon_twin, layouts={layout.cluster: layout}), layout=layout.cluster)
    return rank_params(recipe.model.architecture, routes.rows, layout, spec=spec)


def selected_optimizer(recipe: Any, overrides: dict[str, Any] | None = None) -> OptimizerKind:
    """The optimizer kind ``recipe``'s preset (with ``optimizer.*`` ``overrides``) builds."""
    return _selected({**recipe.preset.optimizer, **(overrides or {})})


def plan(recipe: Any, *, layout: str | None = None, preset: str | None = None, overrides: list[str] = (),
         tflops_per_gpu: float | None = None, spec: Spec | None = None) -> Plan:
    """The plan of ``recipe`` (a name or ``recipes.Recipe``) on a layout, with ``key=value`` overrides.

    ``spec``: the layer spec the ranks build: ``te`` (GPUs) or ``local`` (CPU); default by the layout's name."""
    from bridge_ext.muon import muon_plan
    from bridge_ext.plan.flops import model_flops_per_step
    from recipes.finetune import get_full_recipe  # pre-training and full SFT

    recipe = get_full_recipe(recipe) if isinstance(recipe, str) else recipe
    if preset:
        recipe = recipe.with_preset(preset)
    chosen, recompute, optimizer, iters = _apply_overrides(recipe.layout(layout), list(overrides))
    arch = recipe.model.architecture
    problems = chosen.problems(arch.num_layers)
    if chosen.tp > 1 and arch.num_attention_heads % chosen.tp:
        problems.append(f"{arch.num_attention_heads} attention heads do not split over tp={chosen.tp}")
    experts = arch.moe.experts if arch.moe else None
    if experts and experts % chosen.ep:
        problems.append(f"{experts} experts do not split over ep={chosen.ep}")
    if problems:
        raise UserError(f"layout {chosen.cluster} does not fit {recipe.model.display}: {'; '.join(problems)}")
    spec = spec or ("local" if chosen.cluster.startswith("cpu") else "te")
    manifest = muon_plan(replace(recipe, layouts={chosen.cluster: chosen}), layout=chosen.cluster)
    ranks = pipeline_ranks(recipe, chosen, spec=spec, manifest=manifest)
    micro_batches = chosen.global_batch_size // (chosen.micro_batch_size * chosen.dp)
    activations = {r.pp_rank: activation_bytes(arch, chosen, r, micro_batches=micro_batches, recompute=recompute)
                   for r in ranks}
    memory = {}
    for kind in LABELS:
        per_rank = [Memory(optimizer=kind, pp_rank=r.pp_rank, params=r.total, activations=activations[r.pp_rank],
                           **model_state(r, chosen, kind, muon=is_muon(kind)))
                    for r in ranks]
        memory[kind] = max(per_rank, key=lambda m: m.total)
    selected = selected_optimizer(recipe, optimizer)
    if iters is None:
        iters = recipe.train_iters(chosen)  # the published token budget at this layout's tokens per step
    kind = "muon" if recipe.preset.kind == "muon" else "adamw"
    source = "--tflops-per-gpu"
    if tflops_per_gpu is None:
        tflops_per_gpu, source = _default_tflops(recipe, chosen, kind)
    notes = [f"memory: the pipeline rank with the largest total; GB = GiB (2^30 bytes); fits = at most {HEADROOM:.0%} of "
             "the GPU (the rest: CUDA context, NCCL/TE buffers, fragmentation); activations are an estimate",
             f"layer spec: {'Transformer Engine (GPUs)' if spec == 'te' else 'local (CPU)'}"]
    if chosen.precision.endswith("mxfp8_mixed"):
        notes.append("MXFP8 parameter all-gather: weights counted at 2 B (fp8 row- and column-wise copies + scales)")
    return Plan(
        recipe=recipe.name, preset=recipe.preset.name, layout=chosen.cluster, spec=spec,
        parallel=chosen.parallelism(), micro_batches=micro_batches,
        params_total=manifest.params_total, params_active=recipe.model.params.active, ranks=tuple(ranks),
        memory=memory, selected=selected,
        model_flops_per_step=model_flops_per_step(arch, seq_length=chosen.seq_length, tp=chosen.tp,
                                                  global_batch_size=chosen.global_batch_size),
        ns_flops_per_step=manifest.ns_flops_per_step,
        tokens_per_step=tokens_per_step(chosen.global_batch_size, chosen.seq_length),
        train_iters=iters, tflops_per_gpu=tflops_per_gpu, tflops_source=source, notes=tuple(notes))
