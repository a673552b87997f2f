"""A rehearsal as text (``nemo llm rehearse``): the rank, what Megatron built, and every row beside ``plan``."""

from __future__ import annotations

from bridge_ext.rehearse.rehearsal import ACTIVATIONS, GB, SQUARE, WITHOUT_SQUARE, Rehearsal

__all__ = ["format_rehearsal"]

_BYTES = {"weights", "grad buffer", "fp32 main params", "optimizer state", ACTIVATIONS, SQUARE, WITHOUT_SQUARE}


def _value(name: str, value: float) -> str:
    if name in _BYTES:
        if name in (ACTIVATIONS, SQUARE, WITHOUT_SQUARE) and value < GB:
            return f"{value / 2**20:,.2f} MiB"
        return f"{value / GB:,.3f} GiB"
    return f"{value:.4e}" if "FLOPs" in name else f"{value:,}"


def format_rehearsal(result: Rehearsal) -> str:
    par = result.parallel
    shape = " ".join(f"{k.upper()}{v}" for k, v in par.items() if k != "gpus" and v is not None)
    lines = [f"rehearse {result.recipe} (preset {result.preset}; layout {result.layout}: {par['gpus']} GPUs, {shape}; "
             f"{result.device})",
             f"  {result.coordinates.describe()}",
             f"  built {result.optimizer} (plan: {result.planned_optimizer}); "
             + ", ".join(f"{k} {v:.1f} s" for k, v in result.seconds.items())
             + f"; peak RSS {result.peak_rss_gb:.2f} GiB", "",
             f"  {'component':<30}{'rehearsal (Megatron)':>24}{'plan':>24}{'ratio':>10}"]
    for name, measured, planned in result.rows():
        ratio = f"{measured / planned:.4f}" if planned else "-"
        lines.append(f"  {name:<30}{_value(name, measured):>24}{_value(name, planned):>24}{ratio:>10}")
    if result.micro_batch_skipped is not None:
        lines.append(f"  {'one micro-batch fwd + bwd':<30}not measured: {result.micro_batch_skipped}")
    if result.micro_batch is not None:
        mb = result.micro_batch
        lines.append(f"  micro-batch: MBS {mb['micro_batch_size']} x seq {mb['seq_length']}, {mb['chunks']} chunk(s), "
                     f"attention {', '.join(a.rsplit('.', 1)[-1] for a in mb['attention']) or '-'}; "
                     f"{mb['seconds']:.1f} s")
    if result.cuda_max_allocated is not None:
        lines.append(f"  {'torch.cuda.max_memory_allocated':<30}{_value('weights', result.cuda_max_allocated):>24}")
    lines += [f"  note: {n}" for n in result.notes]
    return "\n".join(lines)
