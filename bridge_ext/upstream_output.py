"""What Megatron, torch and transformers print: silenced for the fast paths and tools, each warning once for
real runs, and a run's console (:func:`run_console`): our lines and Megatron's iteration lines, the rest of what
upstream prints in a log file. Process-wide settings; nothing here imports Megatron (``quiet_megatron`` imports
torch)."""

from __future__ import annotations

import contextlib
import io
import os
import re
import sys
import sysconfig
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from bridge_ext.runtime import launcher_rank, launcher_world_size

__all__ = ["CHILD_WARNINGS", "NOISE", "PROGRESS", "Noise", "RunConsole", "destination", "log_file",
           "megatron_warnings_once", "quiet_megatron", "run_console"]


def quiet_megatron() -> None:
    """Megatron warns at import about every optional kernel it lacks; users need none of that.

    Process-wide: for the fast CLI paths, the dry run and tools only. A real run calls
    :func:`megatron_warnings_once` instead, so that warnings raised while training stay visible.
    """
    import logging
    import os
    import warnings

    for category in (UserWarning, FutureWarning, DeprecationWarning):
        warnings.filterwarnings("ignore", category=category)
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("MEGATRON_SUPPRESS_FUSION_WARNINGS", "1")
    import torch  # noqa: F401  (configures torch's loggers; ours must come after)

    logging.getLogger("torch.utils.cpp_extension").setLevel(logging.ERROR)  # "No CUDA runtime is found"
    for name in ("megatron", "transformers"):
        logging.getLogger(name).setLevel(logging.ERROR)
    _drop_optional_import_tracebacks()


def megatron_warnings_once() -> None:
    """For real runs: warnings stay visible, each distinct message once (Megatron repeats some per module).

    A ``showwarning`` that drops repeats of a (category, text) already shown: the "once" filter action
    does not do it, CPython keeps its registry per module.
    """
    import warnings

    _drop_optional_import_tracebacks()
    for category in (UserWarning, FutureWarning):  # undo a quiet_megatron() earlier in this process
        first = next((f[0] for f in warnings.filters if f[1] is None and f[3] is None and issubclass(category, f[2])),
                     "default")
        if first == "ignore":  # (changing the filters would also show again what was shown already)
            warnings.filterwarnings("default", category=category)
    if getattr(warnings.showwarning, "_bridge_ext_once", False):
        return
    shown: set[tuple[type, str]] = set()
    show = warnings.showwarning

    def show_once(message, category, filename, lineno, file=None, line=None):
        if (category, str(message)) not in shown:
            shown.add((category, str(message)))
            show(message, category, filename, lineno, file, line)

    show_once._bridge_ext_once = True  # type: ignore[attr-defined]
    warnings.showwarning = show_once


def _drop_optional_import_tracebacks() -> None:
    """megatron-bridge 0.6's safe_import_from logs each optional symbol it cannot import at INFO with a full
    traceback (peft/utils.py asks megatron-core's TE extension for FP8GlobalStateManager on every machine without
    TE): a "Traceback" in every run's and dry run's output that is no error. Its module sets that logger's level and
    handler at import (a parent's level does not reach it), so a filter (which stays) drops them; warnings from
    there stay visible."""
    import logging

    optional_imports = logging.getLogger("megatron.bridge.utils.import_utils")
    if _warning_or_above not in optional_imports.filters:
        optional_imports.addFilter(_warning_or_above)


def _warning_or_above(record) -> bool:
    import logging

    return record.levelno >= logging.WARNING


# ------------------------------------------------------------------------------------------ a run's console
@dataclass(frozen=True)
class Noise:
    """Upstream output that no user can act on: it goes to the run's log file, not the console."""

    pattern: str  # re.search on one line (a warning: its message)
    why: str
    without_gpu_only: bool = False  # with a GPU visible the same line is actionable (it stays on the console)


# Each entry names its source; anything upstream prints that looks like a warning or an error and is not here
# stays on the console (a new one on another stack shows until it is judged).
NOISE: tuple[Noise, ...] = (
    Noise(r"The pynvml package is deprecated", "torch/cuda/__init__.py imports pynvml, which torch's own packaging "
          "installs; nothing for a user to change"),
    Noise(r"Transformer Engine and Apex are not installed|Apex is not installed|legacy GroupedMLP will be deprecated",
          "megatron-core falling back from optional GPU kernels: without a GPU (CPU mode) there is nothing to install",
          without_gpu_only=True),
    Noise(r"No CUDA runtime is found", "torch/utils/cpp_extension.py on a machine without CUDA", without_gpu_only=True),
    Noise(r"full scope is deprecated", "megatron-core's TransformerConfig converting the provider's default "
          "cuda_graph_scope 'full' itself (CUDA graphs are off in every recipe)"),
    Noise(r"`torch_dtype` is deprecated", "transformers reading the torch_dtype key of the shipped HF config.json"),
    Noise(r"^\[Gloo\] Rank \d+ is connected to \d+ peer ranks", "torch's gloo backend, one line per process group"),
    Noise(r"Function 'pretrain' is experimental", "megatron-bridge marks its own pretrain() experimental "
          "(utils/decorators.py experimental_fn; stacklevel 2 names our call of it)"),
    Noise(r"Could not determine local rank from LOCAL_RANK", "megatron-bridge utils/common_utils.py in one process "
          "without a launcher, which is local rank 0 (torchrun sets LOCAL_RANK)"),
    Noise(r"'pin_memory' argument is set as true but no accelerator", "torch's data loader without a GPU",
          without_gpu_only=True),
    Noise(r"CPU RNG state changed within GPU RNG context", "megatron-core's RNG tracker (tensor_parallel/random.py) "
          "in CPU mode, where the 'GPU' generator it forks is the CPU's own", without_gpu_only=True),
    Noise(r"Only transformer-engine>=[\d.]+ supports MoE experts", "megatron-core 0.19's TE spec provider without TE: "
          "the local expert implementation (CPU mode)", without_gpu_only=True),
    Noise(r"Could not determine rank from torch.distributed, RANK, or SLURM_PROCID", "megatron-core 0.19 "
          "_rank_utils.py before the process group exists, in one process without a launcher (rank 0)"),
    Noise(r"MimoModelConfig is experimental", "megatron-core 0.19 importing a model family no recipe uses"),
    # Stack churn: an API the newest releases deprecate, called by upstream code or by this package for every
    # stack at once (the recipes' train.eval_*, the tokenizer's hf_tokenizer_kwargs: docs/stacks.md); a user
    # cannot change either, the maintainers read them in the log
    Noise(r"`torch\.jit\.script` is deprecated|`torch\.distributed\.all_gather_into_tensor` is deprecated",
          "torch 2.14 deprecating APIs that megatron-core calls"),
    Noise(r"`build_tokenizer` is deprecated|`hf_tokenizer_kwargs` is deprecated", "megatron-bridge 0.6.2 "
          "deprecating its own tokenizer helpers and the tokenizer field this package sets on every stack"),
    Noise(r"TrainingConfig\.eval_(iters|interval) is deprecated", "megatron-bridge 0.6 moving eval_iters / "
          "eval_interval to ValidationConfig; it maps the train.* values the recipes set on every stack"),
)

# What a helper process of the run (spawned: it imports torch again) would print on its stderr, which goes to
# the terminal (:class:`RunConsole`): the same warnings as the run's own, which its log holds (PYTHONWARNINGS).
CHILD_WARNINGS = ("ignore:The pynvml package is deprecated:FutureWarning",)

# Megatron's lines that the console keeps: progress, not chatter (Step Time's TFLOP/s mean nothing on CPU).
PROGRESS: tuple[Noise, ...] = (
    Noise(r"\biteration\s+\d+/\s*\d+ \|", "megatron-bridge train_utils.training_log: the iteration line"),
    Noise(r"^\s*(saving|successfully saved) checkpoint|^\s*(loading|successfully loaded) checkpoint",
          "megatron-bridge checkpointing: what is saved and loaded, where"),
    Noise(r"^Step Time : ", "megatron-bridge train_utils.training_log: throughput", without_gpu_only=True),
)

_LOOKS_LIKE_A_PROBLEM = re.compile(r"Traceback \(most recent call last\)|\b[A-Z]\w*(Warning|Error|Exception)\b:"
                                   r"|\b(WARNING|ERROR|CRITICAL|FATAL)\b|^[WEF]\d{4} \d\d:")
_RANK_PREFIX = re.compile(r"^\[(default)?rank\d+\]:\s?")  # torchrun's --tee / log prefix


def destination(line: str, *, gpu: bool, warning: bool = False) -> Literal["console", "log"]:
    """Where a line upstream printed goes: ``console`` for Megatron's progress (:data:`PROGRESS`) and whatever
    looks like a warning or an error (``warning``: it is one) unless :data:`NOISE` lists it; ``log`` otherwise."""
    line = _RANK_PREFIX.sub("", line)
    if not warning and any(re.search(p.pattern, line) and (gpu or not p.without_gpu_only) for p in PROGRESS):
        return "console"
    if any(re.search(n.pattern, line) and not (gpu and n.without_gpu_only) for n in NOISE):
        return "log"
    return "console" if warning or _LOOKS_LIKE_A_PROBLEM.search(line) else "log"


def log_file(run_dir: str | Path) -> Path:
    """Where a run's upstream output goes: ``upstream.log`` in ``run_dir`` (one per rank under torchrun)."""
    world = launcher_world_size() or 1
    return Path(run_dir) / ("upstream.log" if world == 1 else f"upstream.rank{launcher_rank()}.log")


_OURS = tuple(str(Path(__file__).resolve().parents[1] / package) + os.sep for package in ("bridge_ext", "recipes"))
_STDLIB = os.path.realpath(sysconfig.get_paths()["stdlib"]) + os.sep
_PASS_THROUGH = (f"{os.sep}rich{os.sep}",)  # our spinner's library: its refresh thread has no frame of ours


def _library(filename: str) -> bool:
    """Frames that only carry a write: the standard library (print, logging, warnings, threading), rich, here."""
    if filename.startswith("<") or filename == __file__ or any(part in filename for part in _PASS_THROUGH):
        return True
    return filename.startswith(_STDLIB) and "-packages" not in filename


def _writer(frame) -> tuple[bool, int | None]:
    """(whether our code wrote it, the logging level of the record being written or None), from the stack."""
    level = None
    while frame is not None:
        code = frame.f_code
        if _library(code.co_filename):
            if level is None and code.co_name in ("emit", "handle") and "record" in frame.f_locals:
                level = getattr(frame.f_locals["record"], "levelno", None)
            frame = frame.f_back
            continue
        return code.co_filename.startswith(_OURS), level
    return True, level  # no frame but libraries': our spinner's thread, or the interpreter reporting an exception


class RunConsole:
    """The console of one run (:func:`run_console`): our lines and Megatron's progress on stdout/stderr as
    before, the rest of what upstream writes in a log file: Python's writes to ``sys.stdout`` / ``sys.stderr`` and
    warnings, and what C code and child processes write to file descriptor 1 (gloo's lines). What they write to
    file descriptor 2 reaches the terminal unfiltered: a fatal error's last words are never held by a thread."""

    def __init__(self, *, gpu: bool | None):
        self._gpu = gpu
        self._lock = threading.RLock()
        self._held: list[str] = []  # log lines until the log file is known (:meth:`log_to`)
        self._log: io.TextIOBase | None = None
        self.path: Path | None = None
        self._traceback: dict[int, bool] = {}  # per console stream: inside a traceback's lines

    # ------------------------------------------------------------------ what goes where
    def gpu(self) -> bool:
        """Whether a GPU is visible, asked of torch once it is imported (until then: yes, to hide nothing)."""
        if self._gpu is None:
            torch = sys.modules.get("torch")
            try:
                self._gpu = bool(torch.cuda.is_available()) if torch is not None else None
            except Exception:  # torch half imported: its own import warns (pynvml)
                pass
        return True if self._gpu is None else self._gpu

    def to_log(self, text: str) -> None:
        with self._lock:
            if self._log is None:
                self._held.append(text)
            elif not self._log.closed:
                self._log.write(text)

    def log_to(self, path: str | Path) -> None:
        """Name the log file. It is written (appending: a resumed run adds to it) and its path printed at the
        first progress line Megatron prints, once every check of the user's input has passed (a bad input writes
        nothing), or at the end of a run that printed none."""
        self.path = Path(path)

    def open_log(self, *, announce: str = "upstream output (Megatron's setup, known warnings)") -> None:
        """Write the log file from here on, with what was held so far, and say where it is (rank 0)."""
        with self._lock:
            if self._log is not None or self.path is None:
                return
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._log = self.path.open("a", buffering=1, encoding="utf-8", errors="backslashreplace")
            self._log.write(f"==== {' '.join(sys.argv)} (pid {os.getpid()})\n")
            self._log.writelines(self._held)
            self._held.clear()
            if launcher_rank() == 0:
                self.console_err.write(f"{announce}: {self.path}; --verbose shows it here\n")
                self.console_err.flush()

    # --------------------------------------------------------------- the streams
    def start(self) -> None:
        import warnings

        for stream in (sys.stdout, sys.stderr):
            stream.flush()
        self._saved = (sys.stdout, sys.stderr, warnings.showwarning)
        self.console_out = _console_stream(sys.stdout, 1)
        self.console_err = sys.stderr  # file descriptor 2 stays the terminal's
        # stdout only: C code's stderr (an NCCL error, an abort's message) must reach the terminal even when the
        # process dies before a reader thread could pass it on; gloo's per-group lines are on stdout
        self._taps = [_FdTap(1, self, self.console_out)]
        self._saved_env = os.environ.get("PYTHONWARNINGS")  # helper processes (spawned) import torch again
        os.environ["PYTHONWARNINGS"] = ",".join(filter(None, [self._saved_env, *CHILD_WARNINGS]))
        sys.stdout = _Filtered(self, self.console_out, self._saved[0])
        sys.stderr = _Filtered(self, self.console_err, self._saved[1])
        warnings.showwarning = self._show_warning

    def stop(self) -> None:
        import warnings

        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()
        sys.stdout, sys.stderr = self._saved[0], self._saved[1]
        if self._saved_env is None:
            os.environ.pop("PYTHONWARNINGS", None)
        else:
            os.environ["PYTHONWARNINGS"] = self._saved_env
        if warnings.showwarning is self._show_warning or getattr(warnings.showwarning, "_bridge_ext_once", False):
            warnings.showwarning = self._saved[2]
        for tap in self._taps:
            tap.close()
        for stream in (self.console_out, self.console_err):
            with contextlib.suppress(Exception):
                stream.flush()
        with self._lock:
            if self._log is not None:
                self._log.close()

    def _show_warning(self, message, category, filename, lineno, file=None, line=None):
        import warnings

        text = warnings.formatwarning(message, category, filename, lineno, line)
        # ours (by the file it names) unless listed: a stacklevel can name our call of upstream code
        if destination(str(message), gpu=self.gpu(), warning=True) == "console":
            self.console_err.write(text)
            self.console_err.flush()
        else:
            self.to_log(text)

    def route(self, line: str, console: io.TextIOBase, *, level: int | None = None) -> None:
        """One line upstream wrote: to ``console`` or the log (:func:`destination`); a traceback whole."""
        warning = level is not None and level >= 30  # logging.WARNING
        in_traceback = self._traceback.get(id(console), False)
        if in_traceback or line.startswith("Traceback (most recent call last)"):
            # the frames' lines are indented; the exception's line ends the block
            self._traceback[id(console)] = line[:1].isspace() or line.startswith("Traceback")
            warning = True
        if level is not None and level < 30 and not any(re.search(p.pattern, line) for p in PROGRESS):
            self.to_log(line)
        elif destination(line.rstrip("\n"), gpu=self.gpu(), warning=warning) == "console":
            if self._log is None and self.path is not None and any(re.search(p.pattern, line) for p in PROGRESS):
                self.open_log()  # training has begun: the checks of the user's input are behind
            with self._lock, contextlib.suppress(ValueError, OSError):  # closed: a child's line after the run
                console.write(line)
                console.flush()
        else:
            self.to_log(line)


def _console_stream(stream, fd: int):
    """Where the console's lines go once ``fd`` is redirected: a copy of ``fd`` when ``stream`` writes to it,
    else ``stream`` itself (pytest's capture)."""
    try:
        same = stream.fileno() == fd
    except (AttributeError, OSError, ValueError):
        same = False
    if not same:
        return stream
    return open(os.dup(fd), "w", buffering=1, encoding=getattr(stream, "encoding", None) or "utf-8",
                errors="backslashreplace")


class _Filtered(io.TextIOBase):
    """``sys.stdout`` / ``sys.stderr`` during a run: our writes go through as they come, upstream's by the line."""

    def __init__(self, owner: RunConsole, console, original):
        self._owner, self._console, self._original = owner, console, original
        self._partial = ""
        self._level: int | None = None

    def write(self, text: str) -> int:
        ours, level = _writer(sys._getframe(1))
        if ours and not self._partial:
            self._console.write(text)
            return len(text)
        with self._owner._lock:
            if not self._partial:
                self._level = level
            self._partial += text
            *lines, self._partial = self._partial.split("\n")
            for line in lines:
                self._owner.route(line + "\n", self._console, level=self._level)
        return len(text)

    def flush(self) -> None:
        self._console.flush()

    def isatty(self) -> bool:
        return self._console.isatty()

    def fileno(self) -> int:
        return self._original.fileno()

    @property
    def encoding(self):
        return getattr(self._console, "encoding", "utf-8")

    def __getattr__(self, name):
        return getattr(self._original, name)


class _FdTap:
    """What is written to file descriptor ``fd`` itself (C code: gloo; child processes; handlers that kept the
    original stream), read from a pipe by a thread and routed by the line."""

    def __init__(self, fd: int, owner: RunConsole, console):
        self._fd, self._owner, self._console = fd, owner, console
        self._saved = os.dup(fd)
        read, write = os.pipe()
        os.dup2(write, fd)
        os.close(write)
        self._read = read
        self._stopping = False
        self._drained = threading.Event()
        self._thread = threading.Thread(target=self._pump, name=f"upstream-output-fd{fd}", daemon=True)
        self._thread.start()

    def _pump(self) -> None:
        import select

        partial = b""
        while True:
            if not select.select([self._read], [], [], 0.05)[0]:
                if self._stopping:  # all this process wrote is routed; a child's later lines still are
                    if partial:
                        self._owner.route(partial.decode(errors="backslashreplace") + "\n", self._console)
                        partial = b""
                    self._drained.set()
                continue
            chunk = os.read(self._read, 1 << 16)
            if not chunk:  # every writer closed its end
                break
            *lines, partial = (partial + chunk).split(b"\n")
            for line in lines:
                self._owner.route(line.decode(errors="backslashreplace") + "\n", self._console)
        if partial:
            self._owner.route(partial.decode(errors="backslashreplace") + "\n", self._console)
        self._drained.set()
        os.close(self._read)

    def close(self) -> None:
        """``fd`` back to where it wrote before; returns once what this process wrote to the pipe is routed. A child
        that inherited the pipe (a checkpoint writer still running) keeps it: its lines keep being routed."""
        os.dup2(self._saved, self._fd)
        os.close(self._saved)
        self._stopping = True
        self._drained.wait(timeout=5)


@contextlib.contextmanager
def run_console(*, verbose: bool = False,
                device: Literal["auto", "gpu", "cpu"] = "auto") -> Iterator[RunConsole | None]:
    """A run's console: ours and Megatron's progress lines; upstream warnings that no user acts on (:data:`NOISE`)
    and Megatron's setup chatter to the log file :meth:`RunConsole.log_to` names (held in memory until training
    begins, :meth:`RunConsole.open_log`).
    ``verbose``: everything on the console, as printed (yields None).

    A user error (one line) writes no log file; another failure shows what was held when no log file was named.
    """
    if verbose:
        yield None
        return
    console = RunConsole(gpu=False if device == "cpu" else None)
    console.start()
    failed = False
    try:
        yield console
    except BaseException as exc:
        from bridge_ext.errors import UserError
        from bridge_ext.stack import UpstreamDrift

        # a one-line refusal (bad input, or installed code a fix does not know): nothing trained, nothing written
        if not isinstance(exc, (UserError, UpstreamDrift, KeyboardInterrupt)) and not (
                isinstance(exc, SystemExit) and exc.code in (0, None)):
            failed = True
        elif console.path is not None and console._log is None:
            console.path = None  # nothing trained: nothing written
        raise
    finally:
        held = list(console._held) if console.path is None and failed else []
        if console.path is not None:
            console.open_log(announce="upstream output of this run" if failed else "upstream output")
        console.stop()
        sys.stderr.writelines(held)
