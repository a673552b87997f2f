"""Selecting a recipe's parts on a command line: the ``key=value`` grammar's parser and ``preset=NAME`` /
``layout=NAME``, which pick recipe parts as ``--preset`` / ``--layout`` do.

Here, below ``bridge_ext`` (recipes import nothing of it), so that the commands, the Python API, ``compare`` and
``bridge_ext.overrides`` (the rest of the grammar: values, YAML, applying them) share one parser.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

__all__ = ["PART_SELECTORS", "choose_recipe", "key_value", "split_part_selectors"]

PART_SELECTORS = ("preset", "layout")  # `preset=NAME` / `layout=NAME` pick recipe parts, like --preset / --layout


def key_value(item: str) -> tuple[str, str] | None:
    """``(key, value text)`` of a ``key=value`` item, split at its first ``=``; None without ``=`` or key. The one
    parser of the grammar (tests/test_layering.py): each caller words its own refusal."""
    key, sep, text = item.partition("=")
    return (key, text) if sep and key else None


def split_part_selectors(overrides: Sequence[str]) -> tuple[dict[str, str], list[str]]:
    """``({part: NAME}, the other overrides)``: the recipe-part selectors (:data:`PART_SELECTORS`:
    ``preset=NAME``, ``layout=NAME``) among ``key=value`` overrides."""
    parts, remaining = {}, []
    for item in overrides:
        pair = key_value(item)
        if pair and pair[0] in PART_SELECTORS:
            parts[pair[0]] = pair[1]
        else:
            remaining.append(item)
    return parts, remaining


def choose_recipe(name: str, *, get: Callable[[str], Any], preset: str | None = None, layout: str | None = None,
                  overrides: Sequence[str] = ()) -> tuple[Any, str | None, list[str]]:
    """``(recipe, layout name or None, the other overrides)``: the recipe ``name`` (by ``get``) with its preset, as
    every command, the Python API and ``compare`` select it: ``preset=NAME`` / ``layout=NAME`` among ``overrides``
    win over ``preset`` / ``layout`` (the flags), as later items win on the command line."""
    parts, rest = split_part_selectors(overrides)
    preset, layout = parts.get("preset", preset), parts.get("layout", layout)
    recipe = get(name)
    return (recipe.with_preset(preset) if preset else recipe), layout, rest
