"""Schedule arithmetic, the one place it lives: tokens per step, iterations for a token budget, the decay length,
the warm-up, the WSD decay from a fraction, and the run length that follows (pure Python, no torch or Megatron).

Callers hand it values and use what it returns: ``recipes.Recipe`` (``train_iters``, ``run_length``: recipe data,
for ``nemo llm info``), ``bridge_ext.build.derived_values`` (the resolved config's ``train.train_iters`` and
scheduler values) and ``bridge_ext.muon.resolve_schedule`` each ask :func:`derived_schedule`, the one place a
preset's schedule fractions become iterations; and the dry run's summary
(``bridge_ext.commands.common``, :func:`run_length` of the resolved config). ``lr_decay_iters`` None means
``train_iters`` throughout, as Megatron Bridge's ``SchedulerConfig`` reads it.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Mapping
from dataclasses import asdict, dataclass
from typing import Any

from recipes.errors import UserError

__all__ = ["SCHEDULE_FIELDS", "UNSTATED_TRAIN_ITERS", "RunLength", "decay_iters", "derived_schedule", "iters_for_tokens", "run_length",
           "tokens_per_step", "warmup_iters", "wsd_decay_iters"]

# Megatron Bridge's pretrain template length (recipes/common.py::_pretrain_common, both 0.3 releases), kept
# for models without a published token budget; pinned here so that `info` needs no Megatron import
# (tests/test_upstream_fidelity.py checks it against the installed template).
UNSTATED_TRAIN_ITERS = 300_000

# The SchedulerConfig fields the arithmetic below reads (Megatron Bridge's names).
SCHEDULE_FIELDS = ("lr_decay_style", "lr_decay_iters", "lr_warmup_iters", "lr_warmup_fraction", "lr_wsd_decay_iters")


@dataclass(frozen=True, kw_only=True)
class RunLength:
    tokens_per_step: int  # global batch x sequence length
    train_iters: int
    warmup_iters: float  # iterations; a warm-up fraction can make it fractional
    decay_start: int | None  # WSD: the last iteration at peak lr (the final decay follows); None otherwise

    @property
    def total_tokens(self) -> int:
        return self.tokens_per_step * self.train_iters

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self), "total_tokens": self.total_tokens}


def tokens_per_step(global_batch_size: int, seq_length: int) -> int:
    """Tokens one optimizer step trains on: global batch x sequence length."""
    return global_batch_size * seq_length


def iters_for_tokens(tokens: float, tokens_per_step: int) -> int:
    """Optimizer steps that train at least ``tokens`` tokens (the last step may overshoot by < one step)."""
    return math.ceil(tokens / tokens_per_step)


def decay_iters(lr_decay_iters: int | None, train_iters: int) -> int:
    """Iterations the learning rate decays over: ``lr_decay_iters``, else (None or 0) the whole run."""
    return lr_decay_iters or train_iters


def warmup_iters(lr_warmup_iters: int | None, lr_warmup_fraction: float | None, decay: int) -> float:
    """Warm-up iterations: a non-zero ``lr_warmup_iters`` wins, else ``lr_warmup_fraction`` of the decay length."""
    return lr_warmup_iters or (lr_warmup_fraction or 0.0) * decay


def wsd_decay_iters(fraction: float, decay: int) -> int:
    """A WSD schedule's final decay as ``fraction`` of the decay length, in whole iterations (at least one)."""
    return max(1, round(fraction * decay))


def derived_schedule(scheduler: Mapping[str, Any] | Any, preset: Any, *, train_iters: int | None,
                     explicit: Collection[str] = ()) -> dict[str, Any]:
    """The scheduler values that follow from ``scheduler`` (``SchedulerConfig`` field -> value, or a Megatron Bridge
    ``SchedulerConfig``), the run's ``train_iters`` and ``preset``'s schedule fractions (``schedule_fractions``, a
    ``recipes.optimizers`` preset); returns field -> value for those that change.

    Megatron Bridge 0.3.1's ``SchedulerConfig`` knows ``lr_warmup_fraction`` (of the decay length) but has only
    iteration counts for the WSD decay, so ``fractions["lr_wsd_decay_fraction"]`` becomes ``lr_wsd_decay_iters``
    (:func:`wsd_decay_iters`) when the decay style is WSD. Explicit settings win: a non-zero ``lr_warmup_iters``
    drops ``lr_warmup_fraction`` (Megatron rejects both), and an ``lr_wsd_decay_iters`` named in ``explicit``
    (the keys someone set: field names or ``scheduler.`` dotted keys) is kept unless it is unset. The error raised
    when a fraction needs ``train_iters`` and there is none (sample-based training) names the preset.
    """
    if not isinstance(scheduler, Mapping):
        scheduler = {name: getattr(scheduler, name, None) for name in SCHEDULE_FIELDS}
    fractions: Mapping[str, float] = getattr(preset, "schedule_fractions", {})
    explicit = {key.removeprefix("scheduler.") for key in explicit}
    out: dict[str, Any] = {}
    if scheduler.get("lr_warmup_fraction") is not None and scheduler.get("lr_warmup_iters"):
        out["lr_warmup_fraction"] = None
    fraction = fractions.get("lr_wsd_decay_fraction")
    unset = scheduler.get("lr_wsd_decay_iters") is None or "lr_wsd_decay_iters" not in explicit
    if fraction is not None and unset and scheduler.get("lr_decay_style") == "WSD":
        if train_iters is None:
            raise UserError(f"preset '{preset.name}' sets its decay as a fraction of train.train_iters; "
                            "set train.train_iters (sample-based training is not supported by this preset)")
        out["lr_wsd_decay_iters"] = wsd_decay_iters(fraction, decay_iters(scheduler.get("lr_decay_iters"),
                                                                          train_iters))
    return out


def run_length(
    *,
    global_batch_size: int,
    seq_length: int,
    train_iters: int,
    lr_warmup_iters: int | None,
    lr_warmup_fraction: float | None,
    lr_decay_iters: int | None,
    lr_decay_style: str,
    lr_wsd_decay_iters: int | None,
) -> RunLength:
    """The run length as Megatron's scheduler will see it."""
    decay = decay_iters(lr_decay_iters, train_iters)
    wsd = lr_decay_style == "WSD" and lr_wsd_decay_iters
    return RunLength(tokens_per_step=tokens_per_step(global_batch_size, seq_length), train_iters=train_iters,
                     warmup_iters=warmup_iters(lr_warmup_iters, lr_warmup_fraction, decay),
                     decay_start=decay - lr_wsd_decay_iters if wsd else None)
