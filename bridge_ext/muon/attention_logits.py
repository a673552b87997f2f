"""The maximum attention logit per head: measured at bounded cost, kept as a running max over a step.

QK-clip (:func:`bridge_ext.muon.clip_qk`) needs, after every optimizer step, each head's maximum
pre-softmax logit over *all* micro-batches of the step; telemetry (:class:`bridge_ext.muon.MuonTelemetry`)
logs it on the iterations it logs. Who measures it:

* **The attention itself**, when ``model.qk_clip`` or ``model.log_max_attention_logit`` is on: Transformer
  Engine >= 2.9 returns it from the fused kernel (``transformer_engine.py:1413``, megatron-core 0.16), at no
  extra cost, as a running max until ``clip_qk`` resets it; the SDPA attention without TE does the same with
  :func:`bridge_ext.without_te.sdpa_attention.max_logits`. :func:`use_kernel_max_logit` switches TE's on for GPU runs that log it.
* **Our hooks** (:class:`LogitTracker`), for attentions that do not (Megatron's local ``DotProductAttention``,
  e.g. Qwen3 on CPU, or any attention with both options off): every forward when ``qk_clip`` is on (the clip
  needs it), otherwise only on iterations telemetry logs.

Our hooks measure with the SDPA attention's :func:`~bridge_ext.without_te.sdpa_attention.max_logits` (bounded tiles,
never the ``b * h * s * s`` logits). Importing this module imports neither torch nor Megatron.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

from bridge_ext.without_te import sdpa_attention

__all__ = ["LogitTracker", "QKClipTracking", "attentions", "track_attention_logits", "use_kernel_max_logit"]

def _decoders(model: Any) -> Iterator[Any]:
    """The ``TransformerBlock`` of each model chunk, whatever wraps it (DDP, Float16Module or none)."""
    chunks = model if isinstance(model, (list, tuple)) else [model]
    for chunk in chunks:
        module = chunk
        while not hasattr(module, "decoder") and hasattr(module, "module"):
            module = module.module
        if hasattr(module, "decoder"):
            yield module.decoder


def attentions(model: Any) -> Iterator[Any]:
    """Every self-attention module (with a ``core_attention``) of the model's decoder layers."""
    for decoder in _decoders(model):
        for layer in decoder.layers:
            attention = getattr(layer, "self_attention", None)
            if attention is not None and hasattr(attention, "core_attention"):
                yield attention


def _measures_itself(core: Any) -> bool:
    # TE's attention creates the attribute only when one of the options is on; CPU mode's SDPA attention
    # always has it and measures when one is on. Megatron's local attention never has it.
    return bool(getattr(core, "_bridge_ext_has_max", False)
                and (core.config.qk_clip or core.config.log_max_attention_logit))


class LogitTracker:
    """Forward hooks on every core attention of a model (``track_attention_logits``).

    For attentions that measure themselves, the hook only keeps a reference while logging. For the others
    it computes :func:`max_logits` from the forward's query and key when ``qk_clip`` is on (then it keeps
    ``current_max_attn_logits`` as the running max that ``clip_qk`` reads and resets, as TE does) or while
    logging (:meth:`start`/:meth:`stop`, around the iterations telemetry logs). While logging, every core
    attention's ``bridge_ext_max_logits`` is its running max over the iteration's micro-batches.
    """

    def __init__(self, model: Any):
        self.logging = False
        self._cores = [attention.core_attention for attention in attentions(model)]
        self._handles = []
        for core in self._cores:
            core._bridge_ext_has_max = hasattr(core, "current_max_attn_logits")  # before we ever set it
            self._handles.append(core.register_forward_hook(self._hook, with_kwargs=True))

    def _hook(self, module: Any, args: tuple, kwargs: dict, output: Any) -> None:
        import torch

        if _measures_itself(module):
            if self.logging:  # already the running max over the step (TE, SDPA): no work
                module.bridge_ext_max_logits = module.current_max_attn_logits
            return
        clip = module.config.qk_clip
        if not (clip or self.logging):
            return  # the common case: no work at all
        query = args[0] if args else kwargs["query"]
        key = args[1] if len(args) > 1 else kwargs["key"]
        scale = getattr(module, "softmax_scale", None) or 1.0 / math.sqrt(query.shape[-1])
        # the call's mask type, else the module's; an enum (Megatron) or a string (TE), "causal" if unknown
        mask_type = (kwargs.get("attn_mask_type") or (args[4] if len(args) > 4 else None)
                     or getattr(module, "attn_mask_type", None) or "causal")
        measured = sdpa_attention.max_logits(query, key, scale, causal="causal" in str(getattr(mask_type, "name", mask_type)))
        if clip:
            previous = getattr(module, "current_max_attn_logits", None)
            module.current_max_attn_logits = measured if previous is None else torch.maximum(previous, measured)
        if self.logging:
            running = getattr(module, "bridge_ext_max_logits", None)
            module.bridge_ext_max_logits = measured if running is None else torch.maximum(running, measured)

    def start(self) -> None:
        """Measure from now on (the first forward of a logged iteration)."""
        for core in self._cores:
            core.bridge_ext_max_logits = None
            if _measures_itself(core) and not core.config.qk_clip:
                # without QK-clip nothing resets TE's running max; start the iteration afresh
                core.current_max_attn_logits = None
        self.logging = True

    def stop(self) -> None:
        self.logging = False

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []


def track_attention_logits(model: Any) -> LogitTracker:
    """Install a :class:`LogitTracker` on ``model`` (a model chunk or a list of them)."""
    return LogitTracker(model)


class QKClipTracking:
    """A Megatron Bridge callback for runs without telemetry: QK-clip's running max where the attention
    does not measure it (installed by ``bridge_ext.training.prepare`` whenever ``model.qk_clip`` is on)."""

    def __init__(self) -> None:
        self.tracker: LogitTracker | None = None

    def on_train_start(self, context: Any) -> None:
        self.tracker = track_attention_logits(context.model)

    def on_train_end(self, context: Any) -> None:
        if self.tracker is not None:
            self.tracker.remove()


def use_kernel_max_logit(cfg: Any) -> bool:
    """Let Transformer Engine's attention measure the max logit (free in its kernel); True when it will.

    For GPU runs that log it: sets ``model.log_max_attention_logit`` when TE >= 2.9 is installed (older TE
    asserts on the option, ``transformer_engine.py:1310``); without it the hooks measure on logged iterations.
    """
    if cfg.model.qk_clip or cfg.model.log_max_attention_logit:
        return True
    import importlib.util

    available = importlib.util.find_spec("transformer_engine") is not None
    if available:
        from megatron.core.utils import is_te_min_version

        available = is_te_min_version("2.9.0")
    if available:
        cfg.model.log_max_attention_logit = True
    return available
