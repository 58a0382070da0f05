"""Eviction policies for L1, by name.

A policy only orders objects; the manager decides what is evictable (resident,
unlocked, not fenced by an I/O) and frees memory. Contract:

- ``admit(key, size, cost)`` when an object becomes resident;
  ``touch(keys)`` on explicit use (later keys end up more recent);
  ``remove(key)`` when it is deleted.
- ``select(need_bytes, evictable)`` returns keys, best victim first, whose
  sizes add up to at least ``need_bytes`` (or every evictable key if that is
  not enough). It forgets the keys it returns; the caller must evict them all.

Policies (registered by name in ``kvtier.l1.policies``):

===========  ==============================================================
``lru``      least recently admitted or touched first. Exact order.
``gdsf``     Greedy-Dual-Size-Frequency, the cost-aware policy. Each object
             has priority ``H = L + hits * cost / size`` where ``cost`` is
             the recompute time it saves (seconds; defaults to ``size`` so
             all objects weigh the same per byte), ``hits`` is 1 + touches
             and ``L`` is the priority of the last victim. The lowest ``H``
             goes first: the least saved recompute per byte, aged by
             recency through ``L`` (objects untouched since ``L`` rose are
             behind everything admitted later). Ties: oldest first.
``probation`` new objects on probation, kept on a hit or a second sighting;
             how much room probation gets is chosen by miniature
             simulations of the live traffic (``kvtier.l1.probation``).
===========  ==============================================================
"""

from __future__ import annotations

import heapq
import itertools
from abc import ABC, abstractmethod
from collections import OrderedDict
from collections.abc import Callable, Iterable

from kvtier.keys import ObjectKey

Evictable = Callable[[ObjectKey], bool]


class EvictionPolicy(ABC):
    """Orders resident objects for eviction; see the module docstring."""

    name: str

    @abstractmethod
    def admit(self, key: ObjectKey, size: int, cost: float | None = None) -> None: ...

    @abstractmethod
    def touch(self, keys: Iterable[ObjectKey]) -> None: ...

    @abstractmethod
    def remove(self, key: ObjectKey) -> None: ...

    @abstractmethod
    def select(self, need_bytes: int, evictable: Evictable) -> list[ObjectKey]: ...

    @abstractmethod
    def __len__(self) -> int: ...


class LRUPolicy(EvictionPolicy):
    """Least recently used first; an ``OrderedDict`` holds exact order."""

    name = "lru"

    def __init__(self) -> None:
        self._order: OrderedDict[ObjectKey, int] = OrderedDict()  # key -> size, oldest first

    def admit(self, key: ObjectKey, size: int, cost: float | None = None) -> None:
        self._order[key] = size
        self._order.move_to_end(key)

    def touch(self, keys: Iterable[ObjectKey]) -> None:
        order = self._order
        for key in keys:
            if key in order:
                order.move_to_end(key)

    def remove(self, key: ObjectKey) -> None:
        self._order.pop(key, None)

    def select(self, need_bytes: int, evictable: Evictable) -> list[ObjectKey]:
        chosen: list[ObjectKey] = []
        freed = 0
        for key, size in self._order.items():
            if freed >= need_bytes:
                break
            if evictable(key):
                chosen.append(key)
                freed += size
        for key in chosen:
            del self._order[key]
        return chosen

    def __len__(self) -> int:
        return len(self._order)


class GDSFPolicy(EvictionPolicy):
    """Greedy-Dual-Size-Frequency over a heap with lazy invalidation."""

    name = "gdsf"

    def __init__(self) -> None:
        self._inflation = 0.0  # L: the priority of the last victim
        self._seq = itertools.count()
        # key -> [priority, seq, hits, cost_per_byte, size]; the heap holds
        # (priority, seq, key) and an entry is current only if seq matches.
        self._meta: dict[ObjectKey, list[float]] = {}
        self._heap: list[tuple[float, int, ObjectKey]] = []

    def admit(self, key: ObjectKey, size: int, cost: float | None = None) -> None:
        per_byte = (size if cost is None else cost) / size
        self._push(key, hits=1.0, per_byte=per_byte, size=size)

    def touch(self, keys: Iterable[ObjectKey]) -> None:
        for key in keys:
            meta = self._meta.get(key)
            if meta is not None:
                self._push(key, hits=meta[2] + 1, per_byte=meta[3], size=int(meta[4]))

    def remove(self, key: ObjectKey) -> None:
        self._meta.pop(key, None)  # its heap entries become stale

    def select(self, need_bytes: int, evictable: Evictable) -> list[ObjectKey]:
        chosen: list[ObjectKey] = []
        skipped: list[tuple[float, int, ObjectKey]] = []
        freed = 0
        while self._heap and freed < need_bytes:
            entry = heapq.heappop(self._heap)
            priority, seq, key = entry
            meta = self._meta.get(key)
            if meta is None or meta[1] != seq:
                continue  # stale
            if not evictable(key):
                skipped.append(entry)
                continue
            del self._meta[key]
            self._inflation = priority
            chosen.append(key)
            freed += int(meta[4])
        for entry in skipped:
            heapq.heappush(self._heap, entry)
        return chosen

    def __len__(self) -> int:
        return len(self._meta)

    def _push(self, key: ObjectKey, *, hits: float, per_byte: float, size: int) -> None:
        seq = next(self._seq)
        priority = self._inflation + hits * per_byte
        self._meta[key] = [priority, seq, hits, per_byte, size]
        heapq.heappush(self._heap, (priority, seq, key))
        if len(self._heap) > 2 * len(self._meta) + 64:
            self._compact()

    def _compact(self) -> None:
        self._heap = [(m[0], int(m[1]), k) for k, m in self._meta.items()]
        heapq.heapify(self._heap)


__all__ = ["Evictable", "EvictionPolicy", "GDSFPolicy", "LRUPolicy"]
