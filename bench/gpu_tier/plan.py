"""What the GPU tier runs and how it judges a curve: the steps (:func:`plan_steps`, printed and checked by the dry
run), the overrides a ``--te`` step trains with, the recipes, layout and tolerances of each check."""

from __future__ import annotations

from pathlib import Path
from typing import Any

__all__ = ["CURVE_MEAN_ABS_TOL", "CURVE_TAIL_REL_TOL", "DENSE", "FP8_CURVE_MEAN_ABS_TOL", "FP8_CURVE_TAIL_REL_TOL",
           "FP8_PRECISIONS", "FP8_PROXIES", "LAYOUT", "PRESETS", "PROXIES", "QK_CLIP_ITERS", "QK_CLIP_RECIPES",
           "QK_CLIP_TAU", "REFERENCE", "REPO", "ROUND_TRIP_RECIPES", "ROUND_TRIP_REL_TOL", "TE_CURVE_MEAN_ABS_TOL",
           "TE_CURVE_TAIL_REL_TOL", "compare_curve", "plan_steps", "step_values"]

REPO = Path(__file__).resolve().parents[2]
PROXIES = ("kimi_k2_proxy", "moonlight_proxy", "qwen3_moe_proxy")
PRESETS = ("muon", "adamw")
DENSE = "qwen3_0p6b"
LAYOUT = "h200x1"
REFERENCE = REPO / "tests" / "gpu" / "reference" / "proxy_curves.json"
# bf16 runs are not bit-reproducible (atomics in backward kernels): a curve matches its reference when the mean
# absolute difference over the run is under this, and the last-10 mean within 3 %.
CURVE_MEAN_ABS_TOL = 0.05
CURVE_TAIL_REL_TOL = 0.03
# --te: the same curves on Transformer Engine's layer specs against the *local-spec* reference. Not the same
# kernels (cuDNN fused attention vs SDPA / unfused softmax, TE grouped GEMM vs SequentialMLP experts, fused RoPE,
# cross-entropy and norms), so the bf16 rounding differs from the first step and the noisy 8 x 128-token curves
# (the reference swings by up to 0.5 between iterations) drift apart: a wider band that still catches a broken
# path (a wrong spec, unclipped logits, a mis-split fused weight shows as a curve 0.5-2 nats off). Provisional:
# set from these reasons, not yet from a measured TE-vs-local spread (docs/launch.md).
TE_CURVE_MEAN_ABS_TOL = 0.25
TE_CURVE_TAIL_REL_TOL = 0.05
# fp8 (Hopper's delayed / current scaling) on top: E4M3 forward GEMMs add ~1e-2 relative error per GEMM.
FP8_CURVE_MEAN_ABS_TOL = 0.35
FP8_CURVE_TAIL_REL_TOL = 0.08
# Layouts that ask for fp8 ask for MXFP8 (Blackwell): kimi_k2 (gb300x256), qwen3_30b_a3b (gb300x8). Hopper has
# no MXFP8; their proxies run the two fp8 recipes Hopper has, each a row of its own.
FP8_PROXIES = ("kimi_k2_proxy", "qwen3_moe_proxy")
FP8_PRECISIONS = ("bf16_with_fp8_delayed_scaling_mixed", "bf16_with_fp8_current_scaling_mixed")
# QK-clip and the max-logit telemetry on TE's attention: MLA (Kimi K2) and GQA (Qwen3); after a clip the max
# logit of the same batch must be <= tau.
QK_CLIP_RECIPES = {"kimi_k2_proxy_muon": "MLA", "qwen3_proxy_muon": "GQA"}
# The proxies' logits start near 0.1: bench/te/workers.py scales a few heads' initial query weights so that they start
# at 40-120 and the clip acts from step 1; tau low so that the clipped heads stay at it while the rest train freely.
QK_CLIP_TAU = 5.0
QK_CLIP_ITERS = 5
# HF import -> one training step -> export, TE spec vs local spec, in fp32 (TF32 off): the same weights within the
# summation-order noise of one step. bf16 would not do: one bf16 ulp of a weight is about half of the step's
# per-element update, so rounding flips alone would be ~5-10 % of the update (bench/te/workers.py).
ROUND_TRIP_RECIPES = ("qwen3_proxy_muon", "kimi_k2_proxy_muon")
ROUND_TRIP_REL_TOL = 2e-2  # per tensor: ||te - local|| / ||local - imported||, i.e. of the step's own update


def plan_steps(*, iters: int, steps: int, te: bool = False) -> list[dict[str, Any]]:
    """Every step the check runs, with the recipe and layout each names (what ``--dry-run`` prints and checks).
    ``te``: the same on Transformer Engine's layer specs, plus the fp8 rows, QK-clip and the round trip."""
    out: list[dict[str, Any]] = [{"step": "env", "what": "GPU, stack, Transformer Engine, bf16 matmul ceiling"}]
    if te:
        out.append({"step": "te_probe", "what": "bench/te/probe.py: import, te.Linear fwd/bwd, fused attention"})
    for model in PROXIES:
        for preset in PRESETS:
            out.append({"step": "proxies", "recipe": f"{model}_{preset}", "layout": LAYOUT, "iters": iters,
                        "what": f"{iters} iterations, text corpus, bf16, loss curve vs reference"})
    for preset in PRESETS:
        out.append({"step": "qwen3_0p6b", "recipe": f"{DENSE}_{preset}", "layout": LAYOUT, "iters": steps,
                    "what": "step time, model TFLOP/s, optimizer step, Newton-Schulz share, peak memory"})
    out.append({"step": "rehearse", "recipe": f"{DENSE}_muon", "layout": LAYOUT,
                "what": "nemo llm rehearse --device cuda and nemo llm plan beside the real run's peak memory"})
    if not te:
        return out
    for step in out:
        if step["step"] == "proxies":
            step["what"] += f" (local-spec reference; TE band {TE_CURVE_MEAN_ABS_TOL}/{TE_CURVE_TAIL_REL_TOL:.0%})"
    for model in FP8_PROXIES:
        for precision in FP8_PRECISIONS:
            out.append({"step": "fp8", "recipe": f"{model}_muon", "layout": LAYOUT, "iters": iters,
                        "precision": precision, "what": f"{precision}: loss curve vs the bf16 reference "
                                                        f"({FP8_CURVE_MEAN_ABS_TOL}/{FP8_CURVE_TAIL_REL_TOL:.0%})"})
    for recipe, kind in QK_CLIP_RECIPES.items():
        out.append({"step": "qk_clip", "recipe": recipe, "layout": LAYOUT, "iters": QK_CLIP_ITERS, "attention": kind,
                    "what": f"{kind} on TE attention{' (QK-norm off)' if kind == 'GQA' else ''}: kernel max logit "
                            f"logged; after the last clip max logit <= tau={QK_CLIP_TAU} (+5 %)"})
    for recipe in ROUND_TRIP_RECIPES:
        out.append({"step": "round_trip", "recipe": recipe, "layout": LAYOUT, "iters": 1,
                    "what": f"HF import -> 1 step (fp32) -> export on the TE spec vs the local spec "
                            f"(rel {ROUND_TRIP_REL_TOL:g} of the step's update)"})
    return out


def step_values(step: dict[str, Any]) -> dict[str, Any]:
    """Config overrides a --te step trains with (the dry run builds the same)."""
    if "precision" in step:
        return {"mixed_precision": step["precision"]}
    if step["step"] == "qk_clip":  # Qwen3's recipes leave QK-clip off: turned on here, tau low enough to clip
        values = {"model.qk_clip": True, "model.qk_clip_threshold": QK_CLIP_TAU, "model.log_max_attention_logit": True}
        if step.get("attention") == "GQA":  # QK-norm undoes any scaling of W_q / W_k: no weight-level clip can act
            values["model.qk_layernorm"] = False  # under it (docs/muon.md); GQA's clip is checked without it
        return values
    return {}


def compare_curve(losses: list[float], reference: list[float], *, mean_tol: float = CURVE_MEAN_ABS_TOL,
                  tail_tol: float = CURVE_TAIL_REL_TOL) -> dict[str, Any]:
    """Mean absolute difference and last-10 relative difference of two loss curves (the shorter length)."""
    n = min(len(losses), len(reference))
    if n == 0:
        return {"match": False, "why": "no losses"}
    mean_abs = sum(abs(a - b) for a, b in zip(losses[:n], reference[:n])) / n
    tail = min(10, n)
    ours, ref = sum(losses[n - tail:n]) / tail, sum(reference[n - tail:n]) / tail
    tail_rel = abs(ours - ref) / abs(ref)
    return {"match": mean_abs <= mean_tol and tail_rel <= tail_tol,
            "mean_abs_diff": round(mean_abs, 4), "tail_rel_diff": round(tail_rel, 4)}
