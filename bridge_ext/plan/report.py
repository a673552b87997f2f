"""A plan as text: the table of ``nemo llm plan`` (:func:`format_plan`) and the one paragraph of the recipe cards
(:func:`plan_summary`)."""

from __future__ import annotations

from bridge_ext.plan.estimate import LABELS, Plan
from bridge_ext.plan.memory import GB, GPUS
from recipes.optimizers import is_muon

__all__ = ["format_plan", "plan_summary"]


def _n(value: float) -> str:
    for unit, scale in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(value) >= scale:
            return f"{value / scale:.4g} {unit}"
    return f"{value:.4g}"


def format_plan(p: Plan) -> str:
    par = p.parallel
    shape = " ".join(f"{k.upper()}{v}" for k, v in par.items() if k != "gpus" and v is not None)
    worst = max(p.ranks, key=lambda r: r.total)
    largest = max(m.total for m in p.memory.values())
    unit, scale = ("GiB", GB) if largest >= GB else ("MiB", 2**20)
    lines = [f"plan {p.recipe} (preset {p.preset}; layout {p.layout}: {par['gpus']} GPUs, {shape}; "
             f"{p.micro_batches} micro-batches per step)", "",
             f"parameters   {_n(p.params_total)} total, {_n(p.params_active)} active; per GPU at most "
             f"{_n(worst.total)} (pipeline rank {worst.pp_rank}: {len(worst.layers)} layers, dense {_n(worst.dense)}, "
             f"experts {_n(worst.expert)}, Muon-routed {_n(worst.routed('muon'))})", "",
             f"memory per GPU, {unit:<8} weights   grads  fp32 main  opt state  activations    total  "
             + "  ".join(f"{g} {c}" for g, c in GPUS.items())]
    for kind, label in LABELS.items():
        m = p.memory[kind]
        mark = "*" if kind == p.selected else " "
        fits = "  ".join(f"{'ok' if v == 'fits' else 'tight' if v == 'tight' else 'NO':>{len(g) + len(str(c)) + 1}}"
                         for (g, c), v in zip(GPUS.items(), p.verdicts(kind).values()))
        lines.append(f"{mark}{label:<37}"[:38] + f"{m.weights / scale:>8.1f}{m.grads / scale:>8.1f}"
                     f"{m.main_params / scale:>11.1f}{m.optimizer_state / scale:>11.1f}{m.activations / scale:>13.1f}"
                     f"{m.total / scale:>9.1f}  {fits}")
    saving = p.muon_saving_gb * GB / scale
    lines.append(f"(* this recipe's optimizer; against AdamW with the distributed optimizer, layer-wise Muon "
                 f"{'saves' if saving >= 0 else 'needs'} {abs(saving):.1f} {unit} per GPU"
                 f"{'' if saving >= 0 else ' more'})")
    total = p.memory[p.selected].total
    for gpu, v in p.verdicts().items():
        share = total / (GPUS[gpu] * GB)
        text = {"fits": "fits on", "tight": "tight on (over 90 %)", "does not fit": "does not fit on"}[v]
        lines.append(f"  {text} {gpu} ({GPUS[gpu]} GB): {share:.0%} of its memory")
    lines += ["",
              f"FLOPs/step   model {p.model_flops_per_step:.3e} (Megatron Bridge flop_utils), Newton-Schulz "
              f"{p.ns_flops_per_step:.3e} ({p.ns_flops_per_step / p.model_flops_per_step:.2%} of model)",
              f"tokens       {p.tokens_per_step:,} per step x {p.train_iters:,} steps = {_n(p.total_tokens)} tokens"]
    if p.gpu_hours is not None:
        days = p.gpu_hours / par["gpus"] / 24
        lines.append(f"GPU-hours    {p.gpu_hours:,.0f} at {p.tflops_per_gpu:,.0f} TFLOP/s/GPU (model + NS): "
                     f"{days:,.1f} days on {par['gpus']} GPUs; source: {p.tflops_source}")
    else:
        lines.append(f"GPU-hours    {p.tflops_source}")
    lines += [f"note: {n}" for n in p.notes]
    return "\n".join(lines)


def plan_summary(p: Plan) -> str:
    """The plan in one paragraph (the recipe cards in docs/recipes.md)."""
    m = p.memory[p.selected]
    largest = max(x.total for x in p.memory.values())
    unit, scale = ("GiB", GB) if largest >= GB else ("MiB", 2**20)
    other = "adam_distributed" if is_muon(p.selected) else "dist_muon"
    verdicts = p.verdicts()
    fits = [g for g, v in verdicts.items() if v == "fits"]
    tight = [g for g, v in verdicts.items() if v == "tight"]
    no = [g for g, v in verdicts.items() if v == "does not fit"]
    fit_text = "; ".join(text for text in (f"fits {', '.join(fits)}" if fits else "",
                                           f"tight on {', '.join(tight)}" if tight else "",
                                           f"does not fit {', '.join(no)}" if no else "") if text)
    hours = (f"; {p.gpu_hours:,.0f} GPU-hours at {p.tflops_per_gpu:,.0f} TFLOP/s/GPU" if p.gpu_hours is not None
             else "")
    return (f"{m.total / scale:,.1f} {unit} per GPU with {LABELS[p.selected]} (weights {m.weights / scale:,.1f}, "
            f"grads {m.grads / scale:,.1f}, fp32 main {m.main_params / scale:,.1f}, optimizer state "
            f"{m.optimizer_state / scale:,.1f}, activations ~{m.activations / scale:,.1f}); {fit_text}; "
            f"{LABELS[other]}: {p.memory[other].total / scale:,.1f} {unit}; "
            f"{p.model_flops_per_step:.3g} model FLOP/step, Newton-Schulz {p.ns_flops_per_step:.3g} "
            f"({p.ns_flops_per_step / p.model_flops_per_step:.2%}); {p.tokens_per_step:,} tokens/step x "
            f"{p.train_iters:,} steps = {_n(p.total_tokens)} tokens{hours}")
