"""Muon telemetry: update RMS per parameter group, Newton-Schulz orthogonality error, max attention logit.

Every N iterations, to the console and TensorBoard (a Megatron Bridge callback). References: Keller Jordan,
"Muon" (2024); emerging-optimizers ``orthogonalized_optimizers.muon_utils``. Imports neither torch nor Megatron.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from bridge_ext.muon.attention_logits import attentions, track_attention_logits
from bridge_ext.muon.presets import installed_ns_coefficients

if TYPE_CHECKING:
    import torch

__all__ = ["MuonTelemetry", "orthogonality_error"]


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
            for attention in attentions(model):
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
