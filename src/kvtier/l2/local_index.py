"""``LocalIndex``: what a node-local L2 adapter (fs, mock) holds, and what
each store there must evict, decided when the store lands.

Keys map to the bytes they take, least recently stored or loaded first. Two
bounds, in this order:

- an owner's **cap** (``set_owners``: a tenant's ``l2_bytes`` quota for this
  adapter): a store that takes its owner past it evicts that owner's *own*
  oldest objects down to it, never another owner's. An object larger than
  its owner's cap alone is refused before it is written (``refuses``);
- the adapter's **capacity**: past it, the oldest objects of all go, the one
  just stored excepted. With every owner within its cap, that happens only
  when owners within their quotas overflow the adapter.

Recency is kept per owner only for owners with a cap, the only ones whose
own objects are looked for. Not thread-safe: the adapter calls it under its
own lock and does the file or memory work for the victims outside it.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass

from kvtier.keys import ObjectKey


def _nobody(salt: str) -> str:
    return ""


@dataclass(frozen=True, slots=True)
class Evicted:
    """The objects one store evicted: its owner's own past the cap, and the
    oldest of all past the capacity (both already out of the index)."""

    own: tuple[ObjectKey, ...] = ()
    oldest: tuple[ObjectKey, ...] = ()

    @property
    def keys(self) -> tuple[ObjectKey, ...]:
        return self.own + self.oldest


class LocalIndex:
    """See the module docstring."""

    def __init__(self, capacity: int = 0) -> None:
        self.capacity = capacity  # 0: unbounded
        self.used = 0
        self._all: OrderedDict[ObjectKey, int] = OrderedDict()  # oldest first
        self._owner_of: Callable[[str], str] = _nobody
        self._owners: dict[str, str] = {}  # salt -> owner, cached
        self._caps: dict[str, int] = {}
        self._capped: dict[str, OrderedDict[ObjectKey, int]] = {}  # owner -> its keys, oldest first
        self._capped_used: dict[str, int] = {}

    def __contains__(self, key: ObjectKey) -> bool:
        return key in self._all

    def __len__(self) -> int:
        return len(self._all)

    def __iter__(self) -> Iterator[ObjectKey]:
        """The keys, oldest first (the index must not change meanwhile)."""
        return iter(self._all)

    def items(self) -> list[tuple[ObjectKey, int]]:
        """Every key and its bytes, oldest first (a copy)."""
        return list(self._all.items())

    def keys(self) -> list[ObjectKey]:
        return list(self._all)

    # -------------------------------------------------------------- owners

    def set_owners(self, owner_of: Callable[[str], str], caps: Mapping[str, int]) -> Evicted:
        """Who owns each salt's objects and each owner's cap in bytes; owners
        already past their caps lose their oldest objects down to them."""
        self._owner_of, self._owners, self._caps = owner_of, {}, dict(caps)
        self._capped, self._capped_used = {}, {}
        for key, size in self._all.items():
            self._count(key, size)
        own = [v for owner in self._caps for v in self._trim(owner, keep=None)]
        return Evicted(own=tuple(own))

    def refuses(self, key: ObjectKey, size: int) -> bool:
        """Whether ``size`` bytes alone are past the cap of ``key``'s owner."""
        cap = self._caps.get(self.owner(key))
        return cap is not None and size > cap

    def owner(self, key: ObjectKey) -> str:
        owner = self._owners.get(key.salt)
        if owner is None:
            owner = self._owners[key.salt] = self._owner_of(key.salt)
        return owner

    # ------------------------------------------------------------- changes

    def admit(self, key: ObjectKey, size: int) -> Evicted:
        """Record a stored object as the most recent (replacing an older copy)
        and evict what its store takes past its owner's cap, then past the
        capacity; never ``key`` itself."""
        self.forget(key)
        self._all[key] = size
        self.used += size
        self._count(key, size)
        own = self._trim(self.owner(key), keep=key)
        oldest = []
        while self.capacity and self.used > self.capacity:
            victim = next(iter(self._all))
            if victim == key:
                break
            self.forget(victim)
            oldest.append(victim)
        return Evicted(tuple(own), tuple(oldest))

    def touch(self, key: ObjectKey) -> None:
        """Mark a held object as used now (a load)."""
        if key in self._all:
            self._all.move_to_end(key)
            order = self._capped.get(self.owner(key))
            if order is not None:
                order.move_to_end(key)

    def forget(self, key: ObjectKey) -> int | None:
        """Drop a key; the bytes it took, or None if it was not held."""
        size = self._all.pop(key, None)
        if size is None:
            return None
        self.used -= size
        owner = self.owner(key)
        order = self._capped.get(owner)
        if order is not None:
            del order[key]
            self._capped_used[owner] -= size
        return size

    def clear(self) -> None:
        for key in list(self._all):
            self.forget(key)

    # ----------------------------------------------------------- internals

    def _count(self, key: ObjectKey, size: int) -> None:
        owner = self.owner(key)
        if owner in self._caps:
            self._capped.setdefault(owner, OrderedDict())[key] = size
            self._capped_used[owner] = self._capped_used.get(owner, 0) + size

    def _trim(self, owner: str, keep: ObjectKey | None) -> list[ObjectKey]:
        cap = self._caps.get(owner)
        if cap is None:
            return []
        order = self._capped.get(owner, OrderedDict())
        victims = []
        while self._capped_used.get(owner, 0) > cap:
            victim = next(iter(order))
            if victim == keep:
                break
            self.forget(victim)
            victims.append(victim)
        return victims


__all__ = ["Evicted", "LocalIndex"]
