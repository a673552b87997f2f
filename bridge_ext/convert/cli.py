"""``nemo llm import`` / ``nemo llm export`` on the console: the conversion with upstream output kept quiet, then
its notes and one summary line (rank 0). Keyword arguments; the options are ``bridge_ext.commands.hf_import``'s
and ``hf_export``'s."""

from __future__ import annotations

from pathlib import Path

from bridge_ext.convert.hf_to_megatron import import_hf
from bridge_ext.convert.megatron_to_hf import DEFAULT_SHARD_BYTES, export_hf
from bridge_ext.convert.parallel import is_rank0
from bridge_ext.convert.report import ConversionSummary, quiet_upstream
from bridge_ext.convert.verify import VERIFY_TOLERANCE

__all__ = ["run_export", "run_import"]


def _finish(summary: ConversionSummary) -> int:
    if is_rank0():
        for note in summary.notes:
            print(f"note: {note}")
        print("\n".join([*summary.shard_lines(), summary.line()]))
    return 0


def run_import(*, hf: Path, out: Path, verify: bool = False, overwrite: bool = False,
               tolerance: float = VERIFY_TOLERANCE, tp: int = 1, pp: int = 1, ep: int = 1,
               verbose: bool = False, stream: bool = True) -> int:
    """``nemo llm import``: exit code 0, or :class:`UserError` for bad input."""
    with quiet_upstream(verbose=verbose) as say:
        summary = import_hf(hf, out, verify=verify, overwrite=overwrite, tolerance=tolerance, tp=tp, pp=pp, ep=ep,
                            progress=True, console=say, stream=stream)
    return _finish(summary)


def run_export(*, ckpt: Path, out: Path, iteration: int | None = None, hf_config: Path | None = None,
               shard_bytes: int = DEFAULT_SHARD_BYTES, overwrite: bool = False, tp: int = 1, pp: int = 1, ep: int = 1,
               verbose: bool = False, stream: bool = True, checksums: bool = True) -> int:
    """``nemo llm export``: exit code 0, or :class:`UserError` for bad input."""
    with quiet_upstream(verbose=verbose) as say:
        summary = export_hf(ckpt, out, iteration=iteration, overwrite=overwrite, hf_config=hf_config,
                            shard_bytes=shard_bytes, tp=tp, pp=pp, ep=ep, progress=True, console=say, stream=stream,
                            checksums=checksums)
    return _finish(summary)
