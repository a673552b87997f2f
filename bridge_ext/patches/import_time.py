"""Import-time patches: Megatron Bridge without Transformer Engine (TE).

* ``te-import-guard`` (scope ``import``, applied when ``bridge_ext`` is imported): megatron-bridge 0.3.x imports
  TE unguarded at module level in ``megatron/bridge/peft/lora_layers.py`` and ``megatron/bridge/peft/lora.py``
  (``import transformer_engine.pytorch as te``), reached from ``megatron.bridge.__init__``; on a machine
  without TE (a CPU, a dev box) every import of Megatron Bridge fails there. An import hook finds such a line
  by its content in any ``megatron.bridge`` module as it is imported and binds the name to :data:`MISSING_TE`
  instead: TE stays absent, so every ``HAVE_TE`` guard upstream takes its non-TE path. Modules without such a
  line import unchanged; with TE installed the hook is never installed. megatron-bridge 0.4 adds one for TE's
  C++ extension (``import transformer_engine_torch as tex`` in ``diffusion/models/wan/utils.py``, reached from
  ``megatron.bridge.recipes.__init__`` through the Wan recipes): bound to :data:`MISSING_TEX` alike.
* ``peft-have-te`` (scope ``lora``): ``megatron/bridge/peft/utils.py`` sets ``HAVE_TE`` from
  ``safe_import_from(megatron.core.extensions.transformer_engine, ...)``, which succeeds without TE because
  megatron-core binds placeholders (mocks, not classes) there; ``get_adapter_attributes_from_linear`` then calls
  ``isinstance(m, <placeholder>)`` -> TypeError. The flag is turned off where those names are not classes.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import re
import sys

from bridge_ext.stack import have_transformer_engine
from bridge_ext.upstream_patch import Patch

__all__ = ["MISSING_TE", "MISSING_TEX", "PATCHES", "guard_source", "guarded_modules"]

# A module-level (column 0) unguarded import of TE's PyTorch API under any alias.
_UNGUARDED_TE = re.compile(r"^import transformer_engine\.pytorch as (\w+)[ \t]*$", re.MULTILINE)
# ... and of TE's C++ extension module (megatron-bridge 0.4's diffusion/models/wan/utils.py)
_UNGUARDED_TEX = re.compile(r"^import transformer_engine_torch as (\w+)[ \t]*$", re.MULTILINE)
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
MISSING_TEX = _MissingTENamespace("transformer_engine_torch")

_guarded: list[str] = []


def guard_source(source: str) -> str | None:
    """``source`` with each unguarded TE import bound to :data:`MISSING_TE`, or None when it has none."""
    guarded, count = _UNGUARDED_TE.subn(rf"from {__name__} import MISSING_TE as \1", source)
    guarded, count_tex = _UNGUARDED_TEX.subn(rf"from {__name__} import MISSING_TEX as \1", guarded)
    return guarded if count or count_tex else None


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


def _install_te_import_guard() -> None:
    if not any(isinstance(finder, _TEImportGuard) for finder in sys.meta_path):
        sys.meta_path.insert(0, _TEImportGuard())


_install_te_import_guard.rewrites_source = True  # type: ignore[attr-defined]  # the guarded modules' text (Patch.how)


def guarded_modules() -> tuple[str, ...]:
    """The modules imported so far whose unguarded TE import the guard replaced."""
    return tuple(_guarded)


_PEFT_UTILS = "megatron.bridge.peft.utils"


def _peft_flag_wrong() -> bool:
    if have_transformer_engine():
        return False
    utils = importlib.import_module(_PEFT_UTILS)
    names = [getattr(utils, n, None) for n in ("TEColumnParallelLinear", "TERowParallelLinear")]
    return bool(getattr(utils, "HAVE_TE", False)) and not all(isinstance(n, type) for n in names)


PATCHES: tuple[Patch, ...] = (
    Patch(
        name="te-import-guard", area="import", scope="import",
        module="sys", attr="meta_path",
        upstream="megatron/bridge/peft/lora.py, lora_layers.py: module-level `import transformer_engine.pytorch as te`;"
                 " diffusion/models/wan/utils.py (megatron-bridge 0.4, via recipes/__init__.py): "
                 "`import transformer_engine_torch as tex`",
        why="without TE every import of megatron.bridge (0.4: of any of its recipes) fails there; the name is bound "
            "to a stand-in instead",
        when="Transformer Engine is not installed",
        needed=lambda: not have_transformer_engine(),
        install=_install_te_import_guard,
    ),
    Patch(
        name="peft-have-te", area="import", scope="lora",
        module=_PEFT_UTILS, attr="HAVE_TE",
        upstream="megatron/bridge/peft/utils.py HAVE_TE (safe_import_from megatron.core.extensions.transformer_engine)",
        why="without TE megatron-core binds mocks there, HAVE_TE is True and isinstance(m, <mock>) raises TypeError",
        when="Transformer Engine is not installed and peft/utils.py's TE names are not classes",
        needed=_peft_flag_wrong,
        make=lambda old: False,
    ),
)
