"""The one error type users see: the CLI prints its message on one line and exits with code 2.

It lives in ``recipes`` (pure data) so that recipes raise it without importing ``bridge_ext``;
``bridge_ext.errors`` re-exports the same class, so ``except UserError`` catches it from either import path.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable

__all__ = ["UserError", "closest"]


class UserError(Exception):
    """Bad input from the user. The message names the problem and the fix; nothing has been written."""


def closest(name: str, choices: Iterable[str]) -> str:
    """`` (did you mean 'x'?)`` for the nearest choice, or an empty string."""
    match = difflib.get_close_matches(name, list(choices), n=1, cutoff=0.5)
    return f" (did you mean '{match[0]}'?)" if match else ""
