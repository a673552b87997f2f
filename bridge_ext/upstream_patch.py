"""The one patch mechanism: what a patch is, how it is checked against the installed code, how it is applied.
The rows are declared in ``bridge_ext.patches`` (the GPU path's deviations) and ``bridge_ext.cpu.patches`` (CPU
mode's), and listed in one registry (``bridge_ext.patches.registry``); this module sits below all of them and
below the packages whose behaviour the rows wire in (``muon``, ``cpu``, ``kill_safe``, ``relayout``).

A :class:`Patch` replaces (or sets) one upstream attribute, ``module.attr``, with what its ``make`` builds from
the current value; or, for the few changes that are not one attribute (an import hook, a function every module
imported by name), runs its ``install``; or, where upstream offers an extension point for it, is a ``hook``:
a model-provider pre-wrap hook (Megatron Bridge's ``ModelProviderMixin.register_pre_wrap_hook``, the row's
target), which changes nothing upstream and is registered on each provider a run builds from
(``bridge_ext.patches.register_hooks``). It applies where ``needed()`` says the installed code needs it (a
capability check: a signature, a call site, a file, a snippet of source; CPU patches: always, once CPU mode is
on) and fits where its ``snippets`` (code it relies on) still occur in the upstream module, matched by content,
never by line number: a patch release that moves lines keeps working, a real change is one line naming the
package, its version and the missing code (:class:`~bridge_ext.stack.UpstreamDrift`).
"""

from __future__ import annotations

import importlib
import inspect
import sys
import textwrap
from collections.abc import Callable, Collection, Mapping
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any, Literal

from bridge_ext.stack import UpstreamDrift, missing_snippets, package_of

__all__ = ["Area", "Patch", "Scope", "Snippet", "always", "apply", "one_of", "owner_of", "problems", "rewrite",
           "rewritten", "serve", "set_value", "temporarily"]

# The upstream area a patch works around (how docs/patches.md groups them).
Area = Literal["optimizer", "transformer", "tensor_parallel", "training", "checkpointing", "conversion", "import",
              "cpu", "rehearse", "launch"]
# When it is applied (``patches.apply(scope)``): at import of bridge_ext, on every run (stack fixes), when a
# Muon preset is installed, for LoRA, around checkpoint saves and loads, for conversion, in CPU mode, and
# for the duration of a dry run's validation (``patches.temporarily("dryrun")``), before user YAML is read
# into a config (``config``), for the duration of a rank rehearsal on fake tensors (``rehearse``).
Scope = Literal["import", "stack", "muon", "lora", "lora-muon", "checkpointing", "conversion", "without-te", "cpu",
                "dryrun", "config", "rehearse", "launch"]


# Code a patch relies on: one exact text, or a tuple of alternatives (:func:`one_of`).
Snippet = str | tuple[str, ...]


def always() -> bool:
    return True


def one_of(*forms: str) -> tuple[str, ...]:
    """A snippet that different releases write differently (the same code moved or reworded in place): it fits
    where any one of ``forms`` occurs."""
    return forms


@dataclass(frozen=True, kw_only=True)
class Patch:
    """One change to upstream behaviour (see the module docstring).

    ``upstream``: the upstream file and function it works around, one line. ``when``: its condition in words
    (docs/patches.md). ``needed``: decides it from the installed code; raises ``UpstreamDrift`` when that code
    has a shape the patch does not know. ``snippets``: code that must still occur in ``module``;
    ``elsewhere``: ``((module, snippets), ...)`` in other modules. ``accepts``: whether the target's current
    value is one ``make`` knows how to replace. ``must_exist``: False when the patch binds a new name.
    ``hook``: ``hook(model_chunks) -> model_chunks``, a pre-wrap hook instead of a change to upstream.
    """

    name: str
    area: Area
    scope: Scope
    module: str
    attr: str
    upstream: str
    why: str
    when: str = "always"
    needed: Callable[[], bool] = always
    snippets: tuple[Snippet, ...] = ()
    elsewhere: tuple[tuple[str, tuple[Snippet, ...]], ...] = ()
    make: Callable[[Any], Any] | None = None
    install: Callable[[], None] | None = None
    hook: Callable[[list[Any]], list[Any]] | None = None
    accepts: Callable[[Any], bool] | None = None
    must_exist: bool = True

    def __post_init__(self) -> None:
        if sum(way is not None for way in (self.make, self.install, self.hook)) != 1:
            raise TypeError(f"patch {self.name}: give exactly one of make=, install= and hook=")

    @property
    def target(self) -> str:
        return f"{self.module}.{self.attr}"

    @property
    def how(self) -> Literal["pre-wrap hook", "source rewrite", "replaces the value", "installs"]:
        """How the row changes upstream: a source rewrite recompiles upstream code from edited text (the few
        that have no extension point; docs/patches.md counts them)."""
        if self.hook is not None:
            return "pre-wrap hook"
        if getattr(self.make or self.install, "rewrites_source", False):
            return "source rewrite"
        return "replaces the value" if self.make is not None else "installs"


def owner_of(module: Any, attr: str) -> Any:
    """The object that holds ``attr`` (``"Class.method"`` -> the class), or None when it is gone."""
    owner = module
    *path, name = attr.split(".")
    for part in path:
        owner = getattr(owner, part, None)
    return owner if owner is not None and hasattr(owner, name) else None


def _current(module: Any, attr: str) -> tuple[Any, str, Any]:
    """(owner, name, current value) of a target; the value as the owner itself holds it (a staticmethod stays)."""
    owner = owner_of(module, attr) or module
    name = attr.rsplit(".", 1)[-1]
    return owner, name, owner.__dict__.get(name, getattr(owner, name, None))


def problems(patch: Patch) -> list[str]:
    """What no longer matches upstream for this patch: one line each; empty when it fits."""
    out: list[str] = []
    for module_name, snippets in ((patch.module, patch.snippets), *patch.elsewhere):
        try:
            importlib.import_module(module_name)
        except ImportError as exc:
            out.append(f"{package_of(module_name)}: cannot import {module_name} ({exc}) ({patch.name})")
            continue
        if snippets:
            out += [f"{package_of(module_name)}: {module_name} no longer contains "
                    f"{repr(code) if isinstance(code, str) else 'any of ' + repr(code)} ({patch.name})"
                    for code in missing_snippets(module_name, snippets)]
    module = sys.modules.get(patch.module)
    if module is None:
        return out
    if patch.must_exist and owner_of(module, patch.attr) is None:
        out.append(f"{package_of(patch.module)}: {patch.target} is gone ({patch.name})")
    elif patch.accepts is not None and not patch.accepts(_current(module, patch.attr)[2]):
        out.append(f"{package_of(patch.module)}: {patch.target} is {_current(module, patch.attr)[2]!r} "
                   f"({patch.name})")
    return out


def set_value(patch: Patch) -> tuple[Any, str, Any]:
    """Replace (or set) the patch's attribute with what its ``make`` builds; returns (owner, name, old value)."""
    owner, name, old = _current(importlib.import_module(patch.module), patch.attr)
    setattr(owner, name, patch.make(old))
    return owner, name, old


def rewritten(qualname: str, replacements: tuple[tuple[str, str], ...]) -> Callable[[Any], Any]:
    """``make`` for a patch that recompiles one upstream function with a few exact text replacements.

    The function's own source is read, each ``old`` must occur in it (the patch's snippets are the ``old``
    strings, so drift is reported first), and the result is compiled in the upstream module's globals under
    the same name: every other line is upstream's, unchanged.
    """

    def make(old_function: Any) -> Any:
        function = getattr(old_function, "__func__", old_function)
        source = textwrap.dedent(inspect.getsource(function))
        for old, new in replacements:
            if old not in source:
                raise UpstreamDrift(f"{package_of(function.__module__)}: {qualname} no longer contains {old!r}")
            source = source.replace(old, new)
        namespace: dict[str, Any] = {}
        module = sys.modules[function.__module__]
        exec(compile(source, f"<bridge_ext.patches: {function.__module__}.{qualname}>", "exec"),
             module.__dict__, namespace)
        new = namespace[function.__name__]
        # inspect.getsource() of it reads upstream's: a needed() that reads it decides the same on a later run
        getattr(new, "__func__", new).__wrapped__ = function
        return new

    make.rewrites_source = True  # type: ignore[attr-defined]  # Patch.how
    return make


def rewrite(name: str, module: str, qualname: str, replacements: tuple[tuple[str, str], ...], *, area: Area,
            scope: Scope, upstream: str, why: str, when: str = "always",
            helpers: Mapping[str, tuple[Callable, str]] | None = None,
            also_expects: tuple[str, ...] = (), needed: Callable[[], bool] = always) -> tuple[Patch, ...]:
    """The patches that recompile ``module.qualname`` with ``replacements`` (:func:`rewritten`).

    ``helpers``: ``{global name: (function, why)}``, functions of ours that the replacement code calls, bound
    in the upstream module first (each a patch of its own, ``"<name> (helper)"``, matched by the upstream code
    its call replaces). ``also_expects``: further code of that function the replacements rely on. ``needed``:
    the condition (for a function that releases write differently: one ``rewrite`` per form, each applying
    where its text occurs).
    """
    olds = tuple(old for old, _ in replacements)
    bound = tuple(
        Patch(name=f"{name} (helper)", area=area, scope=scope, module=module, attr=attr, upstream=upstream,
              why=helper_why, when=when, snippets=tuple(old for old, new in replacements if attr in new),
              make=lambda old, function=function: function, must_exist=False, needed=needed)
        for attr, (function, helper_why) in (helpers or {}).items()
    )
    return (*bound, Patch(name=name, area=area, scope=scope, module=module, attr=qualname, upstream=upstream,
                          why=why, when=when, snippets=(*olds, *also_expects), needed=needed,
                          make=rewritten(qualname, replacements)))


# --- switching rows on, for the packages the rows wire in ---------------------------------------------------------
#
# ``muon`` and ``cpu`` switch their rows on (a Muon preset installed, CPU mode enabled) while the registry imports
# them, to list rows that point at their code. They call :func:`apply` / :func:`temporarily` here, which hand the
# call to the registry's own: ``bridge_ext.patches.registry`` serves them when it is imported, and
# ``bridge_ext/__init__.py`` imports it before any other module of ours runs. The registry stays the one table;
# nothing here holds rows.

_served: dict[str, Callable[..., Any]] = {}


def serve(*, apply: Callable[..., tuple[str, ...]], temporarily: Callable[[Scope], AbstractContextManager]) -> None:
    """Called once by the registry at its import: the functions :func:`apply` and :func:`temporarily` hand to."""
    _served.update(apply=apply, temporarily=temporarily)


def _registry(name: str) -> Callable[..., Any]:
    if name not in _served:
        raise RuntimeError("bridge_ext.patches.registry is not imported (bridge_ext/__init__.py imports it)")
    return _served[name]


def apply(scope: Scope, *, only: Collection[str] = ()) -> tuple[str, ...]:
    """``bridge_ext.patches.apply``: the scope's needed patches (``only``: those named), once per process."""
    return _registry("apply")(scope, only=only)


def temporarily(scope: Scope) -> AbstractContextManager:
    """``bridge_ext.patches.temporarily``: the scope's needed patches for a ``with`` block, then upstream's values."""
    return _registry("temporarily")(scope)
