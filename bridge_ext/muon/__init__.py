"""Muon done right: preset application, MuonClip (QK-clip), a routing manifest and Newton-Schulz telemetry.

Muon's run-time state and code live here, nowhere else (tests/test_layering.py): ``bridge_ext.patches`` only
declares the rows (``patches/optimizer.py``, ``patches/transformer.py``) that put these functions in place of
megatron-core's, as ``patches/checkpointing.py`` does with ``bridge_ext.kill_safe``. One module per job, each
usable alone:

* :mod:`bridge_ext.muon.settings`: the settings the patched code reads at every call (:class:`MuonSettings`:
  Newton-Schulz coefficients, gate/up split; one immutable object built from the preset, installed whole,
  read through :func:`~bridge_ext.muon.settings.muon_settings`) and the names of the ``muon`` scope's patches.

* :mod:`bridge_ext.muon.presets`: presets at run time (:func:`apply_preset`, :func:`install_preset`,
  :func:`resolve_schedule`): what a ``recipes.optimizers.MuonPreset`` needs beyond the
  ``OptimizerConfig``/``SchedulerConfig`` fields that ``bridge_ext.build`` already applies.
* :mod:`bridge_ext.muon.split`: the gate/up split (:func:`~bridge_ext.muon.split.install_gate_up_split`):
  a gated MLP's ``[gate; up]`` orthogonalized per half, as Moonlight's reference Muon does.
* :mod:`bridge_ext.muon.clip`: MuonClip (:func:`clip_qk`, :func:`install_muon_clip`), the per-head QK-clip of
  Kimi K2 (arXiv 2507.20534, Algorithm 1) through megatron-core 0.16's ``MultiLatentAttention.clip_qk``.
* :mod:`bridge_ext.muon.attention_logits`: the per-head maximum attention logit QK-clip and telemetry read.
* :mod:`bridge_ext.muon.checks`: what the installed stack gets wrong about Muon and QK-clip (probes, and the
  launch checks ``bridge_ext.build.launch_problems`` runs).
* :mod:`bridge_ext.muon.manifest`: the routing manifest (:func:`muon_plan`): every parameter of a recipe's
  model, from its shipped HF ``config.json`` alone (no torch), its optimizer, Muon split and NS FLOPs.
* :mod:`bridge_ext.muon.telemetry`: :class:`MuonTelemetry`, update RMS, NS orthogonality error and the
  maximum attention logit every N iterations.

``nemo llm muon-plan`` is ``bridge_ext.commands.muon_plan``. References: Moonlight, arXiv 2502.16982;
Kimi K2, arXiv 2507.20534; Keller Jordan, "Muon" (2024); megatron-core 0.16.1 ``optimizer/muon.py``,
``optimizer/qk_clip.py``, ``transformer/multi_latent_attention.py``; emerging-optimizers 0.3.0
``orthogonalized_optimizers``. Importing this package imports neither torch nor Megatron.
"""

from bridge_ext.muon.attention_logits import track_attention_logits
from bridge_ext.muon.clip import clip_qk, install_muon_clip
from bridge_ext.muon.manifest import MuonPlan, PlanRow, format_plan, muon_plan, newton_schulz_flops
from bridge_ext.muon.presets import (
    CoefficientType,
    apply_preset,
    install_ns_coefficients,
    install_preset,
    installed_ns_coefficients,
    resolve_schedule,
)
from bridge_ext.muon.settings import MuonSettings, muon_settings
from bridge_ext.muon.telemetry import MuonTelemetry, orthogonality_error

__all__ = [
    "CoefficientType",
    "MuonPlan",
    "MuonSettings",
    "MuonTelemetry",
    "PlanRow",
    "apply_preset",
    "clip_qk",
    "format_plan",
    "install_muon_clip",
    "install_ns_coefficients",
    "install_preset",
    "installed_ns_coefficients",
    "muon_plan",
    "muon_settings",
    "newton_schulz_flops",
    "orthogonality_error",
    "resolve_schedule",
    "track_attention_logits",
]
