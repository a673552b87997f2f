"""The registry: every patch, and applying, checking and listing them.

:data:`REGISTRY` lists every patch of the package, by upstream area (one module each). ``apply(scope)`` applies
a scope's patches that the installed code needs, once per process, after checking that each still fits
(nothing is changed when one does not: one line of :class:`~bridge_ext.stack.UpstreamDrift`). ``drift()`` is
the same check for every patch, ``table()`` the rows of docs/patches.md and ``applied()`` what this process
changed. ``bridge_ext.patching.apply`` / ``temporarily`` hand to these (:func:`bridge_ext.patching.serve`): the
packages whose behaviour the rows wire in (``muon``, ``cpu``) switch their rows on through them without importing
this module, which imports theirs.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Collection, Iterable, Iterator
from typing import Any

from bridge_ext import patching
from bridge_ext.cpu import patches as cpu
from bridge_ext.patches import (checkpointing, conversion, import_time, launch, optimizer, optimizer_fields,
                                 rehearse, tensor_parallel, training, transformer)
from bridge_ext.patching import Patch, Scope, problems, set_value
from bridge_ext.stack import UpstreamDrift, describe_stack

__all__ = ["REGISTRY", "applied", "applied_here", "apply", "drift", "markdown", "table", "temporarily"]

REGISTRY: tuple[Patch, ...] = (
    *import_time.PATCHES,
    *optimizer.PATCHES,
    *optimizer_fields.PATCHES,
    *transformer.PATCHES,
    *tensor_parallel.PATCHES,
    *training.PATCHES,
    *checkpointing.PATCHES,
    *conversion.PATCHES,
    *cpu.PATCHES,
    *rehearse.PATCHES,
    *launch.PATCHES,
)

# What a refusal names: the scope's part of the package.
_WHAT: dict[str, str] = {"cpu": "CPU mode", "stack": "the stack fixes", "muon": "the Muon patches",
                         "checkpointing": "the checkpointing patches", "conversion": "the conversion patches",
                         "rehearse": "the rehearsal patches", "launch": "the launch patches"}

_applied: dict[str, Patch] = {}


def apply(scope: Scope, *, only: Collection[str] = ()) -> tuple[str, ...]:
    """Apply the scope's patches (``only``: those named) that the installed code needs; returns their names.

    Idempotent. Every one is decided (``needed()``) and checked first: an unknown upstream shape raises
    :class:`~bridge_ext.stack.UpstreamDrift` (one line) and nothing is changed.
    """
    chosen = [p for p in REGISTRY if p.scope == scope and (not only or p.name in only)]
    if only and len(chosen) != len(set(only)):
        raise KeyError(f"no {scope} patch named {sorted(set(only) - {p.name for p in chosen})}")
    pending = [p for p in chosen if p.name not in _applied]
    needed = [p for p in pending if p.needed()]  # decide every one before changing anything
    found = [line for p in needed for line in problems(p)]
    if found:
        more = f" (and {len(found) - 1} more; tests/test_patches.py lists them)" if len(found) > 1 else ""
        raise UpstreamDrift(f"{_WHAT.get(scope, scope)} does not fit the installed code: {found[0]}{more}")
    for patch in needed:
        if patch.install is not None:
            patch.install()
        else:
            set_value(patch)
        _applied[patch.name] = patch
    return tuple(p.name for p in chosen if p.name in _applied)


@contextlib.contextmanager
def temporarily(scope: Scope) -> Iterator[tuple[str, ...]]:
    """Apply the scope's needed patches for the duration of a ``with`` block, then restore upstream's values."""
    needed = [p for p in REGISTRY if p.scope == scope and p.name not in _applied and p.needed()]
    found = [line for p in needed for line in problems(p)]
    if found:
        raise UpstreamDrift(f"{_WHAT.get(scope, scope)} does not fit the installed code: {found[0]}")
    restore: list[tuple[Any, str, Any]] = []
    try:
        for patch in needed:
            if patch.install is not None:
                raise TypeError(f"patch {patch.name} cannot be undone (install=)")
            restore.append(set_value(patch))
        yield tuple(p.name for p in needed)
    finally:
        for owner, name, old in reversed(restore):
            setattr(owner, name, old)


patching.serve(apply=apply, temporarily=temporarily)


def applied() -> tuple[str, ...]:
    """The patches this process has applied, in the order it applied them."""
    return tuple(_applied)


def _decide(patch: Patch) -> bool | str:
    if patch.name in _applied:  # its check now reads our replacement (e.g. a validator that accepts the set)
        return True
    try:
        return patch.needed()
    except UpstreamDrift as exc:
        return str(exc)


def applied_here(scopes: Iterable[Scope] | None = None) -> tuple[str, ...]:
    """The names of the patches (of ``scopes``, default all) that the installed stack needs."""
    wanted = set(scopes) if scopes is not None else None
    return tuple(p.name for p in REGISTRY if (wanted is None or p.scope in wanted) and _decide(p) is True)


def drift() -> list[str]:
    """What no longer fits upstream, one line each, for every patch the installed code needs; empty when all
    fit (tests/test_patches.py). A patch that is applied already is checked by its snippets and target only."""
    out: list[str] = []
    for patch in REGISTRY:
        decided = _decide(patch)
        if isinstance(decided, str):
            out.append(f"{decided} ({patch.name})")
        elif decided:
            out += problems(patch if patch.name not in _applied else _without_value_check(patch))
    return out


def _without_value_check(patch: Patch) -> Patch:
    return dataclasses.replace(patch, accepts=None)  # an applied patch's target holds our value


def table() -> list[dict[str, str]]:
    """One row per patch: name, area, scope, target, upstream, condition, why, and whether it applies on the
    installed stack ("yes", "no", or "drift: ..." when its check meets code it does not know)."""
    rows = []
    for patch in REGISTRY:
        decided = _decide(patch)
        here = "yes" if decided is True else "no" if decided is False else f"drift: {decided}"
        rows.append({"name": patch.name, "area": patch.area, "scope": patch.scope, "target": patch.target,
                     "upstream": patch.upstream, "condition": patch.when, "why": patch.why, "applies here": here})
    return rows


_AREAS = ("import", "optimizer", "transformer", "tensor_parallel", "training", "checkpointing", "conversion", "launch",
          "cpu", "rehearse")


def markdown() -> str:
    """docs/patches.md: every patch by area, its upstream code, condition and whether it applies here."""
    rows = table()
    lines = [
        "# Every change to upstream behaviour",
        "",
        "Generated by `python -m bridge_ext.patches --markdown > docs/patches.md` from `bridge_ext/patches/`; do "
        "not edit here. Each patch names the upstream code it works around; it applies where its condition holds "
        "in the installed code (decided by capability: signatures, call sites, source content, never version "
        "numbers) and is checked against upstream by content (`tests/test_patches.py` on every stack).",
        "",
        f"\"Here\": {describe_stack()}.",
        "",
    ]
    for area in _AREAS:
        mine = [row for row in rows if row["area"] == area]
        if not mine:
            continue
        lines += [f"## {area} ({len(mine)})", "", "| patch | scope | target | upstream | condition | why | here |",
                  "|---|---|---|---|---|---|---|"]
        lines += ["| " + " | ".join(_cell(row[key]) for key in ("name", "scope", "target", "upstream", "condition",
                                                                 "why", "applies here")) + " |" for row in mine]
        lines.append("")
    return "\n".join(lines)


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")
