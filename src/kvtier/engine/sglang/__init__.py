"""The SGLang HiCache storage backend: ``KvtierStorage``, loaded by SGLang with
``--hicache-storage-backend dynamic`` and a config naming
``"module_path": "kvtier.engine.sglang"``, ``"class_name": "KvtierStorage"``
(docs/sglang.md). Only the backend itself imports SGLang and torch, on first
use, so the settings and page keys load without them."""

from __future__ import annotations

from typing import Any

__all__ = ["KvtierStorage"]


def __getattr__(name: str) -> Any:
    if name == "KvtierStorage":
        from kvtier.engine.sglang.storage import KvtierStorage

        return KvtierStorage
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
