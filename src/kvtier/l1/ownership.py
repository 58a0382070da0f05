"""``L1Ownership``: the owner side of L1 (a base of ``L1Manager``): who owns
each object (``set_owners``), each owner's limits (``limit``, ``set_limit``)
and pins (``pin``, ``unpin``).

An owner is the tenant of a key's salt; its bytes, recency and pins are kept
in a ``QuotaBook``. The rules these operations keep are in
``kvtier.l1.manager``'s docstring (Owners): a pin protects an object from
eviction only, within the owner's pin limit and ``max_pinned_fraction`` of
the arena; a lower soft limit evicts the owner's own objects at once.

Every method takes ``self._lock``; nothing under it does I/O.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from kvtier.keys import ObjectKey
from kvtier.l1.objects import L1Result
from kvtier.l1.quotas import OwnerLimit, QuotaBook
from kvtier.l1.tables import L1Tables


class L1Ownership(L1Tables):
    """Owners, limits and pins over L1's tables; see the module docstring."""

    def set_owners(
        self, owner_of: Callable[[str], str], limits: dict[str, OwnerLimit] | None = None
    ) -> None:
        """Who owns each salt's objects, and the owners' limits (``QuotaBook``);
        what is resident now is re-counted, staging writes are counted as
        before (one owner)."""
        with self._lock:
            if self._staging:
                raise ValueError("set_owners: call it before writes start")
            book = QuotaBook(owner_of, limits)
            for obj in self._resident.values():  # admission order, oldest first
                book.admit(obj.key, obj.reserved)
            self._quotas = book

    def set_limit(self, owner: str, limit: OwnerLimit) -> int:
        """Change an owner's limits, and keep them now: unpin its pins past a
        lower pin limit (those that end soonest first), then evict its objects
        down to a lower soft limit (returns the bytes freed)."""
        with self._lock:
            self._quotas.limits[owner] = limit
            self._quotas.unpin_past(owner, limit.pins, self._clock())
            return self._evict_own(owner)

    def pin(self, keys: Sequence[ObjectKey], ttl_s: float) -> list[L1Result]:
        """Keep resident objects from eviction for ``ttl_s`` (a pin again
        renews it; 0 unpins, as ``unpin``). NOT_FOUND if not resident;
        OVER_QUOTA past the owner's pin limit or ``max_pinned_fraction`` of
        the arena."""
        if ttl_s == 0:
            return self.unpin(keys)
        if not ttl_s > 0:
            raise ValueError(f"pin: ttl_s must be >= 0, got {ttl_s!r}")
        with self._lock:
            now = self._clock()
            total_cap = self.config.max_pinned_fraction * self._arena.capacity
            results = []
            for key in keys:
                obj = self._resident.get(key)
                if obj is None:
                    results.append(L1Result.NOT_FOUND)
                    continue
                if not self._quotas.pinned(key, now):
                    owner = self._quotas.owner(key)
                    cap = self._quotas.limit(owner).pins
                    mine = self._quotas.pinned_bytes(owner, now) + obj.reserved
                    everyone = self._quotas.pinned_bytes(None, now) + obj.reserved
                    if (cap is not None and mine > cap) or everyone > total_cap:
                        self._counters.add("over_quota", 1)
                        results.append(L1Result.OVER_QUOTA)
                        continue
                self._quotas.pin(key, obj.reserved, now + ttl_s)
                results.append(L1Result.SUCCESS)
            return results

    def unpin(self, keys: Sequence[ObjectKey]) -> list[L1Result]:
        with self._lock:
            return [L1Result.SUCCESS if self._quotas.unpin(k) else L1Result.NOT_FOUND for k in keys]

    def limit(self, owner: str) -> OwnerLimit:
        with self._lock:
            return self._quotas.limit(owner)


__all__ = ["L1Ownership"]
