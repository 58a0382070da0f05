"""Controllers: background work between L1 and L2 (write-back and prefetch)."""

from kvtier.controllers.lookups import L1_TIER, LookupResult, MissReason, PrefetchHandle
from kvtier.controllers.prefetch import PrefetchConfig, PrefetchController
from kvtier.controllers.store import StoreConfig, StoreController, StoreGate

__all__ = [
    "L1_TIER",
    "LookupResult",
    "MissReason",
    "PrefetchConfig",
    "PrefetchController",
    "PrefetchHandle",
    "StoreConfig",
    "StoreController",
    "StoreGate",
]
