"""Workarounds for running Megatron Bridge without a GPU or without Transformer Engine.

Every patch names the upstream file and line it works around and the stacks it was written for; it refuses
to apply elsewhere (``tests/test_cpu_mode.py`` notices when upstream changes under it). None of this is
active when Transformer Engine is installed.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import sys
from functools import cache

from bridge_ext.compat import installed_stack

__all__ = ["MISSING_TE", "have_transformer_engine", "install_te_import_guard"]

_TE_IMPORT = "import transformer_engine.pytorch as te"
_GUARDED_TE_IMPORT = "from bridge_ext.cpu_mode import MISSING_TE as te"


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


@cache
def have_transformer_engine() -> bool:
    return importlib.util.find_spec("transformer_engine") is not None


class _GuardedSourceLoader(importlib.machinery.SourceFileLoader):
    """Loads one upstream module with its unguarded TE import wrapped in try/except."""

    def __init__(self, fullname: str, path: str, line: int):
        super().__init__(fullname, path)
        self.line = line

    def source_to_code(self, data, path, *, _optimize=-1):  # noqa: D401 - importlib API
        lines = data.decode("utf-8").splitlines()
        if lines[self.line - 1].strip() != _TE_IMPORT:
            raise ImportError(
                f"{path}:{self.line} is no longer `{_TE_IMPORT}`; bridge_ext.cpu_mode needs updating"
            )
        lines[self.line - 1] = _GUARDED_TE_IMPORT
        return compile("\n".join(lines) + "\n", path, "exec", dont_inherit=True)

    def get_code(self, fullname):  # bypass the bytecode cache: the cached code is the unpatched one
        return self.source_to_code(self.get_data(self.path), self.path)


class _TEImportGuard(importlib.abc.MetaPathFinder):
    def __init__(self, targets: dict[str, int]):
        self.targets = targets

    def find_spec(self, fullname, path=None, target=None):
        if fullname not in self.targets:
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or spec.origin is None:
            return None
        spec.loader = _GuardedSourceLoader(fullname, spec.origin, self.targets[fullname])
        return spec


def install_te_import_guard() -> bool:
    """Let ``import megatron.bridge`` succeed without Transformer Engine.

    Works around ``megatron/bridge/peft/lora_layers.py:20`` and ``megatron/bridge/peft/lora.py:21``
    (megatron-bridge 0.3.x): ``import transformer_engine.pytorch as te`` at module level, reached from
    ``megatron.bridge.__init__``. That line becomes ``te = MISSING_TE``; TE stays absent, so every
    ``HAVE_TE`` guard upstream takes its non-TE path. Returns True when the guard is active.
    """
    if have_transformer_engine():
        return False
    if any(isinstance(finder, _TEImportGuard) for finder in sys.meta_path):
        return True
    targets = dict(installed_stack().unguarded_te_imports)
    sys.meta_path.insert(0, _TEImportGuard(targets))
    return True
