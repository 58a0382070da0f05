"""L1: kvtier's host-memory tier (a shared-memory arena and its state machine)."""

from kvtier.l1.arena import Arena
from kvtier.l1.config import GiB, L1Config, MiB
from kvtier.l1.eviction import EvictionPolicy
from kvtier.l1.manager import L1Manager
from kvtier.l1.objects import IOFence, L1Result, ObjectState, Placement, WriterTag
from kvtier.l1.policies import EVICTION_POLICIES, make_policy
from kvtier.l1.region import SharedRegion, remove_stale_regions

__all__ = [
    "EVICTION_POLICIES",
    "Arena",
    "EvictionPolicy",
    "GiB",
    "IOFence",
    "L1Config",
    "L1Manager",
    "L1Result",
    "MiB",
    "ObjectState",
    "Placement",
    "SharedRegion",
    "WriterTag",
    "make_policy",
    "remove_stale_regions",
]
