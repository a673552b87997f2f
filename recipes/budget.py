"""How long a run trains: tokens per step, iterations, warm-up and the final decay (pure Python, no torch).

``nemo llm info`` computes it from recipe data (:meth:`recipes.Recipe.run_length`), the dry run from the
resolved config (``bridge_ext.cli``), with the same :func:`run_length`.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

__all__ = ["UNSTATED_TRAIN_ITERS", "RunLength", "iters_for_tokens", "run_length"]

# Megatron Bridge's pretrain template length (recipes/common.py::_pretrain_common, both 0.3 releases), kept
# for models without a published token budget; pinned here so that `info` needs no Megatron import
# (tests/test_upstream_fidelity.py checks it against the installed template).
UNSTATED_TRAIN_ITERS = 300_000


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


def iters_for_tokens(tokens: float, tokens_per_step: int) -> int:
    """Optimizer steps that train at least ``tokens`` tokens (the last step may overshoot by < one step)."""
    return math.ceil(tokens / tokens_per_step)


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
    """The run length as Megatron's scheduler will see it (``lr_decay_iters`` None means ``train_iters``)."""
    decay_iters = lr_decay_iters or train_iters
    warmup = lr_warmup_iters or (lr_warmup_fraction or 0.0) * decay_iters
    wsd = lr_decay_style == "WSD" and lr_wsd_decay_iters
    return RunLength(tokens_per_step=global_batch_size * seq_length, train_iters=train_iters, warmup_iters=warmup,
                     decay_start=decay_iters - lr_wsd_decay_iters if wsd else None)
