"""Let ``import megatron.bridge`` succeed without Transformer Engine (TE).

megatron-bridge 0.3.x imports TE unguarded at module level in ``megatron/bridge/peft/lora_layers.py`` and
``megatron/bridge/peft/lora.py`` (``import transformer_engine.pytorch as te``), reached from
``megatron.bridge.__init__``. On a machine without TE (a CPU, a dev box) every import of Megatron Bridge
fails there. The guard below finds such a line by its content in any ``megatron.bridge`` module as it is
imported, and binds the name to :data:`MISSING_TE` instead: TE stays absent, so every ``HAVE_TE`` guard
upstream takes its non-TE path. Modules without such a line import unchanged; with TE installed the guard is
never installed.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import re
import sys

from bridge_ext.stack import have_transformer_engine

__all__ = ["MISSING_TE", "guarded_modules", "install_te_import_guard"]

# A module-level (column 0) unguarded import of TE's PyTorch API under any alias.
_UNGUARDED_TE = re.compile(r"^import transformer_engine\.pytorch as (\w+)[ \t]*$", re.MULTILINE)
_GUARDED_PACKAGE = "megatron.bridge."


class _MissingTENamespace:
    """Stands in for ``transformer_engine.pytorch`` in modules that subclass or isinstance-check TE classes.

    Attribute access yields placeholder classes that nothing is an instance of and that cannot be
    instantiated, so upstream's TE-only code paths stay unreachable.
    """

    def __init__(self, prefix: str):
        self._prefix = prefix
        self._members: dict[str, object] = {}

    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        if name not in self._members:
            qualname = f"{self._prefix}.{name}"
            if name[:1].islower():  # submodule, e.g. te.ops
                self._members[name] = _MissingTENamespace(qualname)
            else:
                def _unavailable(cls, *args, **kwargs):
                    raise ImportError(f"{cls.__qualname__} needs Transformer Engine, which is not installed")

                self._members[name] = type(name, (), {"__new__": _unavailable, "__qualname__": qualname})
        return self._members[name]


MISSING_TE = _MissingTENamespace("transformer_engine.pytorch")

_guarded: list[str] = []


def guard_source(source: str) -> str | None:
    """``source`` with each unguarded TE import bound to :data:`MISSING_TE`, or None when it has none."""
    guarded, count = _UNGUARDED_TE.subn(r"from bridge_ext.te_guard import MISSING_TE as \1", source)
    return guarded if count else None


class _GuardedSourceLoader(importlib.machinery.SourceFileLoader):
    """Loads one upstream module from its source with the unguarded TE import replaced."""

    def __init__(self, fullname: str, path: str, source: str):
        super().__init__(fullname, path)
        self._source = source

    def get_code(self, fullname):  # bypass the bytecode cache: the cached code is the unpatched one
        return compile(self._source, self.path, "exec", dont_inherit=True)


class _TEImportGuard(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path=None, target=None):
        if not fullname.startswith(_GUARDED_PACKAGE):
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or not (spec.origin or "").endswith(".py"):
            return None
        with open(spec.origin, encoding="utf-8") as handle:
            guarded = guard_source(handle.read())
        if guarded is None:
            return None
        _guarded.append(fullname)
        spec.loader = _GuardedSourceLoader(fullname, spec.origin, guarded)
        return spec


def install_te_import_guard() -> bool:
    """Install the guard when TE is absent (idempotent). Returns True when the guard is active."""
    if have_transformer_engine():
        return False
    if not any(isinstance(finder, _TEImportGuard) for finder in sys.meta_path):
        sys.meta_path.insert(0, _TEImportGuard())
    return True


def guarded_modules() -> tuple[str, ...]:
    """The modules imported so far whose unguarded TE import the guard replaced."""
    return tuple(_guarded)


__all__ += ["peft_without_te"]


def peft_without_te() -> bool:
    """Megatron Bridge's LoRA without TE: ``megatron/bridge/peft/utils.py`` sets ``HAVE_TE`` from
    ``safe_import_from(megatron.core.extensions.transformer_engine, ...)``, which succeeds without TE because
    megatron-core binds placeholders (mocks, not classes) there; ``get_adapter_attributes_from_linear`` then
    calls ``isinstance(m, <placeholder>)`` -> TypeError. Turns that flag off when the names are not classes.
    Returns True when it did."""
    if have_transformer_engine():
        return False
    install_te_import_guard()
    import importlib

    utils = importlib.import_module("megatron.bridge.peft.utils")
    names = [getattr(utils, n, None) for n in ("TEColumnParallelLinear", "TERowParallelLinear")]
    if getattr(utils, "HAVE_TE", False) and not all(isinstance(n, type) for n in names):
        utils.HAVE_TE = False
        return True
    return False
