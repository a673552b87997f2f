"""What Megatron, torch and transformers print: silenced for the fast paths and tools, each warning once for
real runs. Process-wide settings; nothing here imports Megatron (``quiet_megatron`` imports torch)."""

from __future__ import annotations

__all__ = ["megatron_warnings_once", "quiet_megatron"]


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
