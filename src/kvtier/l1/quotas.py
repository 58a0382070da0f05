"""``QuotaBook``: what each owner (a tenant) holds in L1, its limits, and
its objects in recency order, for ``L1Manager``.

Recency is kept only for owners with a soft limit, the only ones whose own
oldest objects are ever evicted first: a hit on an owner without one costs
no bookkeeping here. An owner given a soft limit later starts from the
admission order of what it holds.

An object's owner is ``owner_of(key.salt)`` (the cache server: the tenant
that owns the salt). Per owner, ``OwnerLimit``:

- ``soft`` bytes: after an admission takes the owner past it, the owner's
  *own* least recently used objects are evicted down to it (tenant-scoped
  eviction), never another owner's. Bytes an owner holds past it (objects
  locked or pinned when it was trimmed) are its own to carry: they are the
  first to go when room is needed and never make room at another owner's
  expense;
- ``hard`` bytes: a write that would take resident + staging bytes past it
  is refused (``L1Result.OVER_QUOTA``);
- ``pins`` bytes: the most its pinned objects may take (None: no cap of its
  own; L1 bounds all pins together).

Every method runs under the manager's lock (the book has none of its own).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from itertools import islice

from kvtier.keys import ObjectKey


@dataclass(frozen=True, slots=True)
class OwnerLimit:
    soft: int | None = None
    hard: int | None = None
    pins: int | None = None


NO_LIMIT = OwnerLimit()


class QuotaBook:
    """See the module docstring."""

    def __init__(
        self, owner_of: Callable[[str], str], limits: Mapping[str, OwnerLimit] | None = None
    ) -> None:
        self._owner_of = owner_of
        self._owners: dict[str, str] = {}  # salt -> owner, cached
        self.limits: dict[str, OwnerLimit] = dict(limits or {})
        self._resident: dict[str, int] = {}  # owner -> bytes
        self._staging: dict[str, int] = {}
        self._order: dict[str, OrderedDict[ObjectKey, int]] = {}  # owner -> key -> bytes
        self._pins: dict[ObjectKey, tuple[float, int]] = {}  # key -> (until, bytes)
        self._owner_pins: dict[str, set[ObjectKey]] = {}

    def owner(self, key: ObjectKey) -> str:
        owner = self._owners.get(key.salt)
        if owner is None:
            owner = self._owners[key.salt] = self._owner_of(key.salt)
        return owner

    def limit(self, owner: str) -> OwnerLimit:
        return self.limits.get(owner, NO_LIMIT)

    # -------------------------------------------------------------- changes

    def stage(self, owner: str, size: int) -> None:
        self._staging[owner] = self._staging.get(owner, 0) + size

    def unstage(self, owner: str, size: int) -> None:
        self._staging[owner] -= size

    def admit(self, key: ObjectKey, size: int) -> None:
        owner = self.owner(key)
        self._resident[owner] = self._resident.get(owner, 0) + size
        order = self._order.setdefault(owner, OrderedDict())
        order[key] = size
        order.move_to_end(key)

    def drop(self, key: ObjectKey) -> None:
        owner = self.owner(key)
        size = self._order[owner].pop(key)
        self._resident[owner] -= size
        self.unpin(key)

    def pin(self, key: ObjectKey, size: int, until: float) -> None:
        """Pin (or renew the pin of) a resident object until ``until``."""
        self._pins[key] = (until, size)
        self._owner_pins.setdefault(self.owner(key), set()).add(key)

    def unpin(self, key: ObjectKey) -> bool:
        if self._pins.pop(key, None) is None:
            return False
        self._owner_pins[self.owner(key)].discard(key)
        return True

    def unpin_past(self, owner: str, cap: int | None, now: float) -> int:
        """Unpin the owner's pins that end soonest until what it has pinned is
        within ``cap`` (None: no cap); return how many were unpinned."""
        if cap is None:
            return 0
        pinned = self.pinned_bytes(owner, now)
        ending = sorted(self._owner_pins.get(owner, ()), key=lambda k: self._pins[k][0])
        unpinned = 0
        for key in ending:
            if pinned <= cap:
                break
            pinned -= self._pins[key][1]
            self.unpin(key)
            unpinned += 1
        return unpinned

    def touch(self, keys: Iterable[ObjectKey]) -> None:
        salt, order = None, None  # a lookup's keys share a salt: its owner is found once
        for key in keys:
            if key.salt != salt:
                salt, owner = key.salt, self.owner(key)
                order = self._order.get(owner) if self.limit(owner).soft is not None else None
            if order is not None and key in order:
                order.move_to_end(key)

    # -------------------------------------------------------------- queries

    def would_pass_hard(self, owner: str, size: int) -> bool:
        hard = self.limit(owner).hard
        if hard is None:
            return False
        return self._resident.get(owner, 0) + self._staging.get(owner, 0) + size > hard

    def excess(self, owner: str, incoming: int = 0) -> int:
        """Resident bytes above the owner's soft limit once ``incoming`` more
        bytes land (0 if it has none)."""
        soft = self.limit(owner).soft
        return 0 if soft is None else max(0, self._resident.get(owner, 0) + incoming - soft)

    def total_excess(self) -> int:
        """Resident bytes above their owners' soft limits, all owners together."""
        return sum(self.excess(owner) for owner in self.soft_limited())

    def soft_limited(self) -> list[str]:
        return [owner for owner, limit in self.limits.items() if limit.soft is not None]

    def overflow(self, asked: Mapping[str, int], capacity: int) -> int | None:
        """By how many bytes what owners hold within their soft limits, with
        ``asked`` more bytes per owner, passes ``capacity`` (resident and
        staging counted). None: an owner asking has no soft limit, so all it
        asks is within its quota."""
        if any(self.limit(owner).soft is None for owner in asked):
            return None
        within = 0
        for owner in set(self._resident) | set(self._staging) | set(asked):
            used = self._resident.get(owner, 0) + self._staging.get(owner, 0) + asked.get(owner, 0)
            soft = self.limit(owner).soft
            within += used if soft is None else min(used, soft)
        return max(0, within - capacity)

    def oldest(self, owner: str, skip: int, count: int) -> list[tuple[ObjectKey, int]]:
        """Up to ``count`` of the owner's objects, least recently used first,
        after the first ``skip`` (a copy: the caller may drop them)."""
        return list(islice(self._order.get(owner, {}).items(), skip, skip + count))

    def pinned(self, key: ObjectKey, now: float) -> bool:
        """Whether ``key`` is pinned now (an expired pin is dropped here)."""
        pin = self._pins.get(key)
        if pin is None:
            return False
        if pin[0] <= now:
            self.unpin(key)
            return False
        return True

    def pinned_bytes(self, owner: str | None, now: float) -> int:
        """Bytes pinned by ``owner`` (None: by everyone), expired pins dropped."""
        keys = self._pins if owner is None else self._owner_pins.get(owner, set())
        for key in [k for k in keys if self._pins[k][0] <= now]:
            self.unpin(key)
        keys = self._pins if owner is None else self._owner_pins.get(owner, set())
        return sum(self._pins[k][1] for k in keys)

    def usage(self) -> dict[str, int]:
        owners = set(self._resident) | set(self._staging)
        return {o: self._resident.get(o, 0) + self._staging.get(o, 0) for o in sorted(owners)}

    def resident(self, owner: str) -> int:
        return self._resident.get(owner, 0)


__all__ = ["NO_LIMIT", "OwnerLimit", "QuotaBook"]
