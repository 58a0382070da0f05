"""L1's eviction policies by name: what ``L1Config.eviction_policy``,
``kvtier serve --set l1.eviction_policy=...`` and ``kvtier plan --policies``
accept."""

from __future__ import annotations

from kvtier.l1.eviction import EvictionPolicy, GDSFPolicy, LRUPolicy
from kvtier.l1.probation import ProbationPolicy

EVICTION_POLICIES: dict[str, type[EvictionPolicy]] = {
    LRUPolicy.name: LRUPolicy,
    GDSFPolicy.name: GDSFPolicy,
    ProbationPolicy.name: ProbationPolicy,
}


def make_policy(name: str, capacity_bytes: int | None = None) -> EvictionPolicy:
    """A fresh policy; ``capacity_bytes`` (the bytes it orders when full)
    sizes the ``probation`` policy's miniatures, and the others ignore it."""
    try:
        kind = EVICTION_POLICIES[name]
    except KeyError:
        raise ValueError(
            f"unknown eviction policy {name!r}; choose one of {sorted(EVICTION_POLICIES)}"
        ) from None
    return ProbationPolicy(capacity_bytes) if kind is ProbationPolicy else kind()


__all__ = ["EVICTION_POLICIES", "make_policy"]
