"""What a recipe costs before it launches (``nemo llm plan``): memory per GPU, FLOPs, tokens, GPU-hours.

Pure Python from the recipe's shipped HF ``config.json``, preset and layout: no torch, no model, well under
a second. Parts: ``ranks`` (parameters per pipeline rank under TP/PP/VP/EP/ETP), ``memory`` (bytes per
component, fit verdicts), ``flops`` (Megatron Bridge's own FLOP counter, compiled from its installed source);
Newton-Schulz FLOPs come from the Muon routing manifest (``bridge_ext.muon.muon_plan``), tokens and steps
from ``recipes.budget``. Throughput defaults are NVIDIA's measured figures (``BLOG``).
"""

from bridge_ext.plan.estimate import BLOG, OVERRIDABLE, OVERRIDE_KEYS, Plan, pipeline_ranks, plan, selected_optimizer
from bridge_ext.plan.report import format_plan, plan_summary

__all__ = ["BLOG", "OVERRIDABLE", "OVERRIDE_KEYS", "Plan", "format_plan", "pipeline_ranks", "plan", "plan_summary",
           "selected_optimizer"]
