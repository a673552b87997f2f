"""What is installed and what it can do: the ground floor that every patch (``bridge_ext.patches``: stack fixes,
the Transformer Engine import guard, CPU mode) reads. Imports nothing of ours.

Nothing here tests version numbers: versions only name the package in messages. Decisions are made on what
the installed code offers: a dataclass field, a keyword in a signature, a snippet in a function's source.
Upstream code is matched by *content* (a snippet that must still occur in a module), never by line number,
so a patch release that moves lines keeps working and a real change stops with one clear line.
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
import inspect
from functools import cache
from importlib import metadata
from pathlib import Path
from typing import Any

__all__ = [
    "PACKAGES",
    "UpstreamDrift",
    "call_keywords",
    "common_state_inside_checkpoint",
    "describe_stack",
    "expect_snippets",
    "first_defined",
    "have_transformer_engine",
    "missing_snippets",
    "module_source",
    "optimizer_muon_fields",
    "package_of",
    "signature_params",
    "version_of",
]

# The distributions that make a Megatron stack, in the order messages list them.
PACKAGES = ("megatron-bridge", "megatron-core", "emerging-optimizers", "torch", "transformers", "nemo-run")

# Top-level import name -> distribution name, for messages about a module.
_DISTRIBUTION_OF = {"megatron.bridge": "megatron-bridge", "megatron.core": "megatron-core",
                    "megatron.training": "megatron-core",  # megatron-core >= 0.19 ships megatron/training
                    "emerging_optimizers": "emerging-optimizers", "torch": "torch",
                    "transformers": "transformers", "nemo_run": "nemo-run"}


class UpstreamDrift(RuntimeError):
    """Upstream code no longer looks as a fix or patch expects. The message is one line naming the package,
    its version and what changed; the fix (ours) needs updating for that release."""


@cache
def version_of(distribution: str) -> str | None:
    try:
        return metadata.version(distribution)
    except metadata.PackageNotFoundError:
        return None


def package_of(module_name: str) -> str:
    """``"megatron.core.optimizer.muon"`` -> ``"megatron-core 0.16.0"`` (for messages)."""
    for prefix, distribution in _DISTRIBUTION_OF.items():
        if module_name == prefix or module_name.startswith(prefix + "."):
            return f"{distribution} {version_of(distribution) or '(not installed)'}"
    return module_name.split(".")[0]


def describe_stack() -> str:
    """One line: the installed versions of the stack's packages."""
    return ", ".join(f"{name} {version_of(name)}" for name in PACKAGES if version_of(name))


@cache
def have_transformer_engine() -> bool:
    return importlib.util.find_spec("transformer_engine") is not None


@cache
def module_source(module_name: str) -> str:
    """The source text of an installed module (read from its file; the module is imported)."""
    return inspect.getsource(importlib.import_module(module_name))


def missing_snippets(module_name: str, snippets: tuple[str | tuple[str, ...], ...]) -> list[str | tuple[str, ...]]:
    """The snippets that no longer occur in the module's source (whitespace inside a line is compared as is).

    A snippet may be a tuple of alternatives (``one_of``): the same code as different releases write it; it is
    missing when none of them occurs.
    """
    source = module_source(module_name)
    return [snippet for snippet in snippets
            if not any(form in source for form in ((snippet,) if isinstance(snippet, str) else snippet))]


def expect_snippets(module_name: str, snippets: tuple[str, ...], *, fix: str) -> None:
    """Raise :class:`UpstreamDrift` when any snippet is gone from the module (``fix`` names what depends on it)."""
    missing = missing_snippets(module_name, snippets)
    if missing:
        raise UpstreamDrift(f"{package_of(module_name)}: {module_name} no longer contains {missing[0]!r}; "
                            f"bridge_ext's '{fix}' needs updating for this release")


def first_defined(name: str, *modules: str) -> Any:
    """``name`` from the first of ``modules`` that is installed and defines it: a class upstream moved between
    releases (e.g. ``PackedSequenceSpecs``: megatron-bridge 0.3-0.5 ``data.datasets.packed_sequence``, 0.6
    ``data.packing.config``). :class:`UpstreamDrift` naming every home tried when none has it."""
    for module in modules:
        try:
            found = importlib.util.find_spec(module)
        except ModuleNotFoundError:  # a parent package is missing
            found = None
        if found is not None and hasattr(loaded := importlib.import_module(module), name):
            return getattr(loaded, name)
    raise UpstreamDrift(f"{package_of(modules[0])}: {name} is in none of {', '.join(modules)}; "
                        f"bridge_ext needs its new home for this release")


def signature_params(function: Any) -> frozenset[str]:
    """Names of a callable's parameters."""
    return frozenset(inspect.signature(function).parameters)


@cache
def common_state_inside_checkpoint() -> bool:
    """Whether the installed megatron-core keeps a torch_dist checkpoint's common (non-tensor) state inside the
    torch DCP files (0.19: a "common_state" ShardedObject; ``common.pt`` only in checkpoints of older releases,
    which it still reads) rather than in ``common.pt`` (0.16). Read from its ``dist_checkpointing/serialization.py``
    without importing megatron.core."""
    spec = importlib.util.find_spec("megatron")
    for base in (spec.submodule_search_locations or ()) if spec is not None else ():
        path = Path(base) / "core" / "dist_checkpointing" / "serialization.py"
        if path.is_file():
            source = path.read_text(encoding="utf-8")
            return 'ShardedObject("common_state"' in source and "_legacy_common_state_exists(" in source
    return False


@cache
def optimizer_muon_fields() -> tuple[str, ...]:
    """The ``muon_*`` fields of the installed megatron-core's ``OptimizerConfig``."""
    import dataclasses

    from megatron.core.optimizer import OptimizerConfig

    return tuple(f.name for f in dataclasses.fields(OptimizerConfig) if f.name.startswith("muon_"))


@cache
def call_keywords(module_name: str, callee: str, *, inside: str | None = None) -> frozenset[str]:
    """Keyword names passed in calls to ``callee`` (a name or an attribute's last part) in a module's source,
    optionally only inside the class or function named ``inside``."""
    tree = ast.parse(module_source(module_name))
    if inside is not None:
        scopes = [node for node in ast.walk(tree)
                  if isinstance(node, ast.ClassDef | ast.FunctionDef) and node.name == inside]
        tree = ast.Module(body=scopes, type_ignores=[])
    keywords: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            func = node.func
            name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
            if name == callee:
                keywords.update(k.arg for k in node.keywords if k.arg)
    return frozenset(keywords)
