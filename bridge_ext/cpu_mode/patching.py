"""The patch machinery: what a targeted patch is, how one upstream function is recompiled with a few exact
text replacements, and how every target is matched against the installed code by content.

A target is matched by a snippet that must still occur in the upstream module's source (never a line
number), so patch releases that move lines keep working and a real change stops CPU mode with one line
naming the package, its version and the missing code.
"""

from __future__ import annotations

import importlib
import inspect
import sys
import textwrap
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from bridge_ext.cpu_mode.redirect import TorchOnCPU, real_torch
from bridge_ext.stack import UpstreamDrift, missing_snippets, package_of

__all__ = ["Patch", "apply", "owner_of", "problems", "rewrite", "rewritten"]


@dataclass(frozen=True)
class Patch:
    """Replace ``module.attr`` (or set it, when ``must_exist`` is False) to work around upstream code.

    ``snippets``: code that must still occur in the module's source for the patch to be right.
    """

    name: str
    module: str
    attr: str
    snippets: tuple[str, ...]
    why: str
    make: Callable[[Any], Any]  # old value (or None) -> new value
    must_exist: bool = True


def rewritten(qualname: str, replacements: tuple[tuple[str, str], ...]) -> Callable[[Any], Any]:
    """``make`` for a patch that recompiles one upstream function with a few exact text replacements.

    The function's own source is read, each ``old`` must occur in it (the patch's snippets are the
    ``old`` strings, so ``check_patch_targets`` reports drift first), and the result is compiled in the
    upstream module's globals under the same name: every other line is upstream's, unchanged.
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
        exec(compile(source, f"<bridge_ext.cpu_mode: {function.__module__}.{qualname}>", "exec"),
             module.__dict__, namespace)
        return namespace[function.__name__]

    return make


def rewrite(name: str, module: str, qualname: str, replacements: tuple[tuple[str, str], ...], *, why: str,
            helpers: Mapping[str, tuple[Callable, str]] | None = None,
            also_expects: tuple[str, ...] = ()) -> tuple[Patch, ...]:
    """The patches that recompile ``module.qualname`` with ``replacements`` (:func:`rewritten`).

    ``helpers``: ``{global name: (function, why)}``, functions of ours that the replacement code calls,
    bound in the upstream module first (each a patch of its own, ``"<name> (helper)"``, so that the patch
    table lists it, matched by the upstream code its call replaces). ``also_expects``: further code of that
    function the replacements rely on. Every ``old`` text is a snippet of the rewrite, so drift is reported
    before anything is recompiled.
    """
    olds = tuple(old for old, _ in replacements)
    bound = tuple(
        Patch(name=f"{name} (helper)", module=module, attr=attr, why=helper_why,
              snippets=tuple(old for old, new in replacements if attr in new),
              make=lambda old, function=function: function, must_exist=False)
        for attr, (function, helper_why) in (helpers or {}).items()
    )
    return (*bound, Patch(name=name, module=module, attr=qualname, snippets=(*olds, *also_expects), why=why,
                          make=rewritten(qualname, replacements)))


def owner_of(module: Any, attr: str) -> Any:
    """The object that holds ``attr`` (``"Class.method"`` -> the class), or None when it is gone."""
    owner = module
    *path, name = attr.split(".")
    for part in path:
        owner = getattr(owner, part, None)
    return owner if owner is not None and hasattr(owner, name) else None


def problems(torch_on_cpu: Mapping[str, tuple[str, ...]], patches: tuple[Patch, ...],
             tensor_cuda_callers: Mapping[str, tuple[str, ...]]) -> list[str]:
    """What no longer matches upstream: one line per drifted target; empty when all patches fit."""
    targets = [(module, snippets, "CUDA redirect") for module, snippets in torch_on_cpu.items()]
    targets += [(patch.module, patch.snippets, patch.name) for patch in patches]
    targets += [(module, snippets, "Tensor.cuda caller") for module, snippets in tensor_cuda_callers.items()]
    out: list[str] = []
    for module_name, snippets, what in targets:
        try:
            module = importlib.import_module(module_name)
        except ImportError as exc:
            out.append(f"{package_of(module_name)}: cannot import {module_name} ({exc})")
            continue
        out += [f"{package_of(module_name)}: {module_name} no longer contains {code!r} ({what})"
                for code in missing_snippets(module_name, snippets)]
        if what == "CUDA redirect":
            current = module.__dict__.get("torch")
            if current is not real_torch() and not isinstance(current, TorchOnCPU):
                out.append(f"{package_of(module_name)}: {module_name}'s global `torch` is {current!r}")
    for patch in patches:
        module = sys.modules.get(patch.module)
        if module is not None and patch.must_exist and owner_of(module, patch.attr) is None:
            out.append(f"{package_of(patch.module)}: {patch.module}.{patch.attr} is gone ({patch.name})")
    return out


def apply(patch: Patch) -> None:
    """Replace (or set) the patch's attribute with what its ``make`` builds from the current value."""
    module = importlib.import_module(patch.module)
    owner = owner_of(module, patch.attr) or module
    name = patch.attr.rsplit(".", 1)[-1]
    setattr(owner, name, patch.make(owner.__dict__.get(name, getattr(owner, name, None))))
