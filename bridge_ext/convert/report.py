"""Conversion summary, progress bar over tensors, and upstream chatter kept out of the CLI's output."""

from __future__ import annotations

import contextlib
import os
import sys
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bridge_ext.units import human_bytes
from bridge_ext.convert.parallel import is_rank0
from bridge_ext.errors import UserError

__all__ = ["ConversionSummary", "TensorProgress", "human_bytes", "quiet_upstream", "record_source_use", "say_on_rank0",
           "shard_totals"]


@dataclass
class ConversionSummary:
    """What a conversion did: the final line the CLI prints (tensors, bytes, time, throughput)."""

    direction: str
    out: Path
    tensors: int = 0
    bytes: int = 0
    seconds: float = 0.0
    max_logit_diff: float | None = None
    notes: list[str] = field(default_factory=list)
    shards: list[tuple[str, int, int]] = field(default_factory=list)  # (file, tensors, bytes) read or written

    @property
    def throughput(self) -> float:
        """Bytes per second over the whole conversion."""
        return self.bytes / self.seconds if self.seconds > 0 else 0.0

    def line(self) -> str:
        verified = "" if self.max_logit_diff is None else f", verified: max |logit diff| {self.max_logit_diff:.2e}"
        return (
            f"{self.direction}: {self.tensors} tensors, {human_bytes(self.bytes)} in {self.seconds:.1f} s "
            f"({human_bytes(self.throughput)}/s){verified} -> {self.out}"
        )


    def shard_lines(self) -> list[str]:
        """One line per safetensors shard the conversion read (import) or wrote (export)."""
        verb = "read" if self.direction == "import" else "written"
        return [f"  {file}: {tensors} tensors, {human_bytes(nbytes)} {verb}" for file, tensors, nbytes in self.shards]


def shard_totals(tensors: Iterable[tuple[str, int]]) -> list[tuple[str, int, int]]:
    """``(file, nbytes)`` per tensor -> ``(file, tensors, bytes)`` per file, by file name."""
    totals: dict[str, list[int]] = {}
    for file, nbytes in tensors:
        entry = totals.setdefault(file, [0, 0])
        entry[0] += 1
        entry[1] += nbytes
    return [(file, count, nbytes) for file, (count, nbytes) in sorted(totals.items())]


def record_source_use(summary: ConversionSummary, source: Any, used: set[str]) -> None:
    """An import's totals from the HF tensors it read (``used``, over all ranks): tensors, bytes, per source shard,
    and a note naming what the architecture left unread. ``source``: ``bridge_ext.hf.directory.HFSource``."""
    infos = [source.tensors[name] for name in used]
    summary.tensors, summary.bytes = len(infos), sum(info.nbytes for info in infos)
    summary.shards = shard_totals((info.file, info.nbytes) for info in infos)
    unused = sorted(set(source.tensors) - used)
    if unused:
        summary.notes.append(f"{len(unused)} HF tensors not used by {source.architecture} (e.g. {unused[0]})")


class TensorProgress:
    """A rich progress bar over tensors (with bytes, rate and, given ``total_bytes``, the time left at the rate so
    far), or nothing when disabled / not on rank 0."""

    def __init__(self, description: str, *, total: int, enabled: bool, total_bytes: int | None = None):
        self._bar = None
        if enabled:
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

            from rich.console import Console

            self._bar = Progress(
                TextColumn("{task.description}"),
                BarColumn(),
                MofNCompleteColumn(),
                TextColumn("tensors"),
                TextColumn("{task.fields[size]}"),
                TextColumn("{task.fields[rate]}"),
                TimeElapsedColumn(),
                TextColumn("{task.fields[eta]}"),
                transient=False,
                console=Console(file=_REAL_STREAMS[1]) if _REAL_STREAMS else None,
            )
        self._description = description
        self._total = total
        self._total_bytes = total_bytes
        self._bytes = 0

    def __enter__(self) -> TensorProgress:
        self._start = time.perf_counter()
        if self._bar is not None:
            self._bar.__enter__()
            self._task = self._bar.add_task(self._description, total=self._total, size="", rate="", eta="")
        return self

    def __exit__(self, *exc: Any) -> None:
        if self._bar is not None:
            if exc[0] is not None:  # a refusal mid-way (NaN weights, ...) ends in its one error line, no bar
                self._bar.live.transient = True
            self._bar.__exit__(*exc)

    def advance(self, nbytes: int, *, tensors: int = 1) -> None:
        """``tensors`` more done (HF tensors: a fused Megatron parameter counts its parts), ``nbytes`` more."""
        self._bytes += nbytes
        if self._bar is not None:
            elapsed = max(time.perf_counter() - self._start, 1e-9)
            rate = self._bytes / elapsed
            eta = ""
            if self._total_bytes and rate > 0:
                left = int(max(self._total_bytes - self._bytes, 0) / rate)
                eta = f"ETA {left // 3600}:{left // 60 % 60:02d}:{left % 60:02d}"
            self._bar.update(self._task, advance=tensors, size=human_bytes(self._bytes),
                             rate=f"{human_bytes(rate)}/s", eta=eta)  # fmt: skip


# (stdout, stderr) while :func:`quiet_upstream` captures upstream chatter; our own output goes here.
_REAL_STREAMS: tuple[Any, Any] | None = None


@contextlib.contextmanager
def quiet_upstream(*, verbose: bool) -> Iterator[Callable[[str], None]]:
    """Keep Megatron / transformers / torch chatter (prints, tqdm bars, warnings) out of the CLI's output.

    Yields the function that prints our own progress lines. Upstream output is buffered and shown (last 60
    lines) only if the conversion fails with something other than a :class:`UserError`.
    """
    global _REAL_STREAMS
    import io
    import logging
    import warnings

    real_out, real_err = sys.stdout, sys.stderr

    def say(message: str) -> None:
        print(message, file=real_out, flush=True)

    if verbose:
        yield say
        return
    # Environment, not imports: importing transformers here would cost seconds before input is validated.
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    os.environ.setdefault("PYTHONWARNINGS", "ignore")  # child processes (checkpoint writers) import torch too
    for name in ("megatron", "torch", "transformers", "nvidia_resiliency_ext", "root"):
        logging.getLogger(None if name == "root" else name).setLevel(logging.ERROR)
    buffer = io.StringIO()
    _REAL_STREAMS = (real_out, real_err)
    try:
        with warnings.catch_warnings(), contextlib.redirect_stdout(buffer), contextlib.redirect_stderr(buffer):
            warnings.simplefilter("ignore")
            yield say
    except (UserError, KeyboardInterrupt, SystemExit):
        raise
    except BaseException:
        tail = buffer.getvalue().splitlines()[-60:]
        if tail:
            print("--- last upstream output ---\n" + "\n".join(tail), file=real_err)
        raise
    finally:
        _REAL_STREAMS = None


def say_on_rank0(console: Callable[[str], None] | None, message: str) -> None:
    """``console(message)`` on rank 0 (a torchrun conversion reports once); nothing without a console."""
    if console is not None and is_rank0():
        console(message)
