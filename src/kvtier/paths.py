"""Where kvtier keeps files of its own: under the user's cache directory."""

from __future__ import annotations

import os
from pathlib import Path


def cache_home() -> Path:
    """kvtier's directory under the user's cache (``$XDG_CACHE_HOME`` or ~/.cache)."""
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "kvtier"
