"""Muon done right: preset application, MuonClip (QK-clip), a routing manifest and Newton-Schulz telemetry.

One module per job, each usable alone:

* :mod:`bridge_ext.muon.presets`: presets at run time (:func:`apply_preset`, :func:`resolve_schedule`,
  :func:`install_ns_coefficients`): what a ``recipes.optimizers.MuonPreset`` needs beyond the
  ``OptimizerConfig``/``SchedulerConfig`` fields that ``bridge_ext.build`` already applies.
* :mod:`bridge_ext.muon.clip`: MuonClip (:func:`clip_qk`, :func:`install_muon_clip`), the per-head QK-clip of
  Kimi K2 (arXiv 2507.20534, Algorithm 1) through megatron-core 0.16's ``MultiLatentAttention.clip_qk``.
* :mod:`bridge_ext.muon.manifest`: the routing manifest (:func:`muon_plan`): every parameter of a recipe's
  model, from its shipped HF ``config.json`` alone (no torch), its optimizer, Muon split and NS FLOPs.
* :mod:`bridge_ext.muon.telemetry`: :class:`MuonTelemetry`, update RMS, NS orthogonality error and the
  maximum attention logit every N iterations.

``nemo llm muon-plan`` is ``bridge_ext.commands.muon_plan``. References: Moonlight, arXiv 2502.16982;
Kimi K2, arXiv 2507.20534; Keller Jordan, "Muon" (2024); megatron-core 0.16.1 ``optimizer/muon.py``,
``optimizer/qk_clip.py``, ``transformer/multi_latent_attention.py``; emerging-optimizers 0.3.0
``orthogonalized_optimizers``. Importing this package imports neither torch nor Megatron.
"""

from bridge_ext.attention_logits import track_attention_logits
from bridge_ext.muon.clip import clip_qk, install_muon_clip
from bridge_ext.muon.manifest import MuonPlan, PlanRow, format_plan, muon_plan, newton_schulz_flops
from bridge_ext.muon.presets import (
    CoefficientType,
    apply_preset,
    install_ns_coefficients,
    installed_ns_coefficients,
    resolve_schedule,
)
from bridge_ext.muon.telemetry import MuonTelemetry, orthogonality_error

__all__ = [
    "CoefficientType",
    "MuonPlan",
    "MuonTelemetry",
    "PlanRow",
    "apply_preset",
    "clip_qk",
    "format_plan",
    "install_muon_clip",
    "install_ns_coefficients",
    "installed_ns_coefficients",
    "muon_plan",
    "newton_schulz_flops",
    "orthogonality_error",
    "resolve_schedule",
    "track_attention_logits",
]
