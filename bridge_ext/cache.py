"""Where the package keeps what it builds once and reuses: datasets, converted tokenizers, imports."""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["ENV_CACHE", "cache_root"]

ENV_CACHE = "MUON_RECIPES_CACHE"


def cache_root() -> Path:
    """``$MUON_RECIPES_CACHE``, or ``~/.cache/muon-recipes``."""
    env = os.environ.get(ENV_CACHE)
    return Path(env).expanduser() if env else Path.home() / ".cache" / "muon-recipes"
