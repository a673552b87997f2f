"""The one error type users see: the CLI prints its message on one line and exits with code 2.

Defined in ``recipes.errors`` (recipes import nothing from ``bridge_ext``); this is the same class under the
path ``bridge_ext`` modules use.
"""

from __future__ import annotations

from recipes.errors import UserError, closest

__all__ = ["UserError", "closest"]
