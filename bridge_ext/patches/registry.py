"""The registry: every patch, and applying, checking and listing them.

:data:`REGISTRY` lists every patch of the package, by upstream area (one module each); it is loaded on first use.
A process that applies a scope imports only the tables that hold that scope's rows (:data:`TABLES`): a GPU run
never imports CPU mode's or the rehearsal's tables (nor, with them, ``bridge_ext.cpu``). ``apply(scope)`` applies
a scope's patches that the installed code needs, once per process, after checking that each still fits
(nothing is changed when one does not: one line of :class:`~bridge_ext.stack.UpstreamDrift`). ``drift()`` is
the same check for every patch, ``table()`` the rows of docs/patches.md and ``applied()`` what this process
changed. ``bridge_ext.upstream_patch.apply`` / ``temporarily`` hand to these (:func:`bridge_ext.upstream_patch.serve`): the
packages whose behaviour the rows wire in (``muon``, ``cpu``) switch their rows on through them without importing
this module, which imports theirs.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
from collections.abc import Callable, Collection, Iterable, Iterator
from typing import Any

from bridge_ext.patches import evidence
from bridge_ext.stack import UpstreamDrift, describe_stack
from bridge_ext import upstream_patch
from bridge_ext.upstream_patch import Patch, Scope, problems, set_value

__all__ = ["REGISTRY", "TABLES", "TABLES_IN_ORDER", "applied", "applied_here", "apply", "drift", "markdown",
           "register_hooks", "rows", "rows_of", "switched_off", "table", "temporarily"]

# One loader per table (function-level imports: the import graph sees them), in REGISTRY's order.
def _import_time() -> tuple[Patch, ...]:
    from bridge_ext.patches import import_time
    return import_time.PATCHES


def _optimizer() -> tuple[Patch, ...]:
    from bridge_ext.patches import optimizer
    return optimizer.PATCHES


def _transformer() -> tuple[Patch, ...]:
    from bridge_ext.patches import transformer
    return transformer.PATCHES


def _tensor_parallel() -> tuple[Patch, ...]:
    from bridge_ext.patches import tensor_parallel
    return tensor_parallel.PATCHES


def _training() -> tuple[Patch, ...]:
    from bridge_ext.patches import training
    return training.PATCHES


def _checkpointing() -> tuple[Patch, ...]:
    from bridge_ext.patches import checkpointing
    return checkpointing.PATCHES


def _conversion() -> tuple[Patch, ...]:
    from bridge_ext.patches import conversion
    return conversion.PATCHES


def _without_te() -> tuple[Patch, ...]:
    from bridge_ext.without_te import patches as without_te
    return without_te.PATCHES


def _cpu() -> tuple[Patch, ...]:
    from bridge_ext.cpu import patches as cpu
    return cpu.PATCHES


def _rehearse() -> tuple[Patch, ...]:
    from bridge_ext.patches import rehearse
    return rehearse.PATCHES


def _launch() -> tuple[Patch, ...]:
    from bridge_ext.patches import launch
    return launch.PATCHES


TABLES_IN_ORDER = (_import_time, _optimizer, _transformer, _tensor_parallel, _training,
                   _checkpointing, _conversion, _without_te, _cpu, _rehearse, _launch)
# Scope -> the tables holding its rows (tests/test_patches.py checks it against every row).
TABLES: dict[str, tuple[Callable[[], tuple[Patch, ...]], ...]] = {
    "import": (_import_time,),
    "lora": (_import_time,),
    "muon": (_optimizer,),
    "lora-muon": (_optimizer,),
    "stack": (_optimizer, _transformer, _tensor_parallel, _training),
    "config": (_training,),
    "dryrun": (_training,),
    "checkpointing": (_checkpointing,),
    "conversion": (_transformer, _conversion),
    "without-te": (_without_te,),
    "cpu": (_cpu,),
    "rehearse": (_rehearse,),
    "launch": (_launch,),
}


def _load(tables: Iterable[Callable[[], tuple[Patch, ...]]]) -> tuple[Patch, ...]:
    return tuple(row for table in tables for row in table())


def __getattr__(name: str) -> Any:
    if name == "REGISTRY":  # every table, loaded once (docs, drift checks, tests)
        globals()["REGISTRY"] = _load(TABLES_IN_ORDER)
        return globals()["REGISTRY"]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def rows(scope: Scope | None = None) -> tuple[Patch, ...]:
    """The rows of ``scope`` (all: None), importing only the tables that hold them unless all are loaded."""
    return rows_of(None if scope is None else (scope,))


def rows_of(scopes: Iterable[Scope] | None) -> tuple[Patch, ...]:
    """The rows of ``scopes`` (all: None) in REGISTRY's order, importing only the tables that hold them unless all
    are loaded (a GPU run's dry run lists its fixes without importing CPU mode's or the rehearsal's tables)."""
    loaded = globals().get("REGISTRY")
    wanted = None if scopes is None else set(scopes)
    if loaded is None:
        tables = TABLES_IN_ORDER if wanted is None else {t for s in wanted for t in TABLES.get(s, ())}
        loaded = _load(t for t in TABLES_IN_ORDER if t in tables)
    return tuple(p for p in loaded if wanted is None or p.scope in wanted)

# What a refusal names: the scope's part of the package.
_WHAT: dict[str, str] = {"cpu": "CPU mode", "stack": "the stack fixes", "muon": "the Muon patches",
                         "checkpointing": "the checkpointing patches", "conversion": "the conversion patches",
                         "without-te": "the patches that build MLA and MoE without TE",
                         "rehearse": "the rehearsal patches", "launch": "the launch patches"}

_applied: dict[str, Patch] = {}

# Rows a process runs without, to see whether a row is still needed (tests/prove_patches.py, docs/patches.md).
SWITCH_OFF_ENV = "BRIDGE_EXT_PATCHES_OFF"


def switched_off() -> frozenset[str]:
    """The rows named in ``BRIDGE_EXT_PATCHES_OFF`` (comma-separated): :func:`apply` and :func:`temporarily` leave
    them out."""
    return frozenset(n.strip() for n in os.environ.get(SWITCH_OFF_ENV, "").split(",") if n.strip())


def apply(scope: Scope, *, only: Collection[str] = ()) -> tuple[str, ...]:
    """Apply the scope's patches (``only``: those named) that the installed code needs; returns their names.

    Idempotent. Every one is decided (``needed()``) and checked first: an unknown upstream shape raises
    :class:`~bridge_ext.stack.UpstreamDrift` (one line) and nothing is changed.
    """
    chosen = [p for p in rows(scope) if not only or p.name in only]
    if only and len(chosen) != len(set(only)):
        raise KeyError(f"no {scope} patch named {sorted(set(only) - {p.name for p in chosen})}")
    pending = [p for p in chosen if p.name not in _applied and p.name not in switched_off()]
    needed = [p for p in pending if p.needed()]  # decide every one before changing anything
    found = [line for p in needed for line in problems(p)]
    if found:
        more = f" (and {len(found) - 1} more; tests/test_patches.py lists them)" if len(found) > 1 else ""
        raise UpstreamDrift(f"{_WHAT.get(scope, scope)} does not fit the installed code: {found[0]}{more}")
    for patch in needed:
        if patch.install is not None:
            patch.install()
        elif patch.make is not None:
            set_value(patch)
        _applied[patch.name] = patch  # a hook row: registered on each provider by register_hooks
    return tuple(p.name for p in chosen if p.name in _applied)


def register_hooks(provider: Any) -> tuple[str, ...]:
    """Register every applied hook row on ``provider`` (a Megatron Bridge model provider) as a pre-wrap hook, in
    the order applied; returns their names. Call it once per provider, after applying the run's scopes and before
    registering hooks that read what these set (``bridge_ext.initialization`` reads the tensor-parallel
    attributes)."""
    rows_ = [p for p in _applied.values() if p.hook is not None]
    for patch in rows_:
        provider.register_pre_wrap_hook(patch.hook)
    return tuple(p.name for p in rows_)


@contextlib.contextmanager
def temporarily(scope: Scope) -> Iterator[tuple[str, ...]]:
    """Apply the scope's needed patches for the duration of a ``with`` block, then restore upstream's values."""
    needed = [p for p in rows(scope) if p.name not in _applied and p.name not in switched_off() and p.needed()]
    found = [line for p in needed for line in problems(p)]
    if found:
        raise UpstreamDrift(f"{_WHAT.get(scope, scope)} does not fit the installed code: {found[0]}")
    restore: list[tuple[Any, str, Any]] = []
    try:
        for patch in needed:
            if patch.make is None:
                raise TypeError(f"patch {patch.name} cannot be undone (install= or hook=)")
            restore.append(set_value(patch))
        yield tuple(p.name for p in needed)
    finally:
        for owner, name, old in reversed(restore):
            setattr(owner, name, old)


upstream_patch.serve(apply=apply, temporarily=temporarily)


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
    return tuple(p.name for p in rows_of(scopes) if _decide(p) is True)


def drift() -> list[str]:
    """What no longer fits upstream, one line each, for every patch the installed code needs; empty when all
    fit (tests/test_patches.py). A patch that is applied already is checked by its snippets and target only."""
    out: list[str] = []
    for patch in rows():
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
    out, proofs = [], evidence.read_proofs()
    for patch in rows():
        decided = _decide(patch)
        here = "yes" if decided is True else "no" if decided is False else f"drift: {decided}"
        out.append({"name": patch.name, "area": patch.area, "scope": patch.scope, "target": patch.target,
                     "how": patch.how, "upstream": patch.upstream, "condition": patch.when, "why": patch.why,
                     "applies here": here, "proven by": evidence.proven_by(patch.name) or "",
                     "last proven": evidence.last_proven(patch.name, proofs), "reported": evidence.reported(patch.name)})
    return out


_AREAS = ("import", "optimizer", "transformer", "tensor_parallel", "training", "checkpointing", "conversion", "launch",
          "without-te", "cpu", "rehearse")


def markdown() -> str:
    """docs/patches.md: every patch by area, its upstream code, condition and whether it applies here."""
    listed = table()
    rewrites = [row["name"] for row in listed if row["how"] == "source rewrite"]
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
        "How a row changes upstream (column \"how\"): a pre-wrap hook (Megatron Bridge's model-provider extension "
        "point: nothing upstream is changed), a replaced value (a wrapper, a subclass, a stand-in), an install "
        f"(a hook into Python's import system), or a source rewrite. Source rewrites: {len(rewrites)} in all, none "
        "on the GPU path; each recompiles one upstream function from its text with a few exact replacements, "
        "where no extension point reaches the code:",
        "",
        *(f"- `{name}`: {evidence.NO_EXTENSION_POINT.get(name, 'no reason given')}." for name in rewrites),
        "",
        "\"Proven by\": the test that fails where the row applies once the row is switched off "
        f"(`{SWITCH_OFF_ENV}=<name>[,<name>...]`: a process leaves those rows out); `python tests/prove_patches.py "
        "[NAME ...]` runs each applying row's test so and lists the rows whose test still passes (upstream fixed "
        "it, or the test does not reach it). \"Last proven\": per stack, the commit at which that run last showed the "
        "row needed (`bridge_ext/patches/proofs.json`, written by `tests/prove_patches.py --record`; "
        "`tests/test_patch_proofs.py` fails once the row's code or its proving test changed since, and names the "
        "command that proves it again: `python tests/prove_patches.py --stale --record` on that stack). "
        "\"Reported\": the upstream issue or pull request, the release from "
        "which upstream no longer needs it, or \"not reported\" (the fixes still to send upstream).",
        "",
    ]
    for area in _AREAS:
        mine = [row for row in listed if row["area"] == area]
        if not mine:
            continue
        lines += [f"## {area} ({len(mine)})", "",
                  "| patch | scope | target | how | upstream | condition | why | here | proven by | last proven | "
                  "reported |",
                  "|---|---|---|---|---|---|---|---|---|---|---|"]
        lines += ["| " + " | ".join(_cell(row[key]) for key in ("name", "scope", "target", "how", "upstream",
                                                                 "condition", "why", "applies here", "proven by",
                                                                 "last proven", "reported")) + " |"
                  for row in mine]
        lines.append("")
    return "\n".join(lines)


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")
