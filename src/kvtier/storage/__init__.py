"""The storage core in one process: ``StorageManager`` (``manager``), the
facade over L1, the L2 adapters and the controllers between them, and its
base ``StorageTiers`` (``tiers``), what acts on one tier at a time.

Callers use the manager's operations, never its parts: L1, the adapters and
the controllers are private to it.
"""

from kvtier.storage.manager import (
    LOOKUP_GRACE_S,
    Buffer,
    StorageConfig,
    StorageManager,
    byte_view,
)
from kvtier.storage.tiers import L1, Owners

__all__ = [
    "L1",
    "LOOKUP_GRACE_S",
    "Buffer",
    "Owners",
    "StorageConfig",
    "StorageManager",
    "byte_view",
]
