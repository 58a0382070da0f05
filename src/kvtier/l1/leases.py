"""``LeaseHeap``: when the leases of L1 objects (write reservations, read
locks) come due.

Each leased object has at most one live heap entry, due no later than its
lease. A lease that is only extended keeps its entry, which re-arms itself
when it comes due, so the heap holds about one entry per leased object, not
one per ``reserve_read``. Entries of objects whose lease ended (a published
write, a released read) are dropped lazily, and the heap is rebuilt when they
outnumber the live ones, so it never holds more than about twice the leased
objects. Owned by ``L1Manager`` and used under its lock.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Iterator

from kvtier.l1.objects import L1Object


class LeaseHeap:
    def __init__(self) -> None:
        self._heap: list[tuple[float, int, L1Object]] = []  # (due, seq, object)
        self._leased: set[L1Object] = set()  # objects whose lease_expiry is set
        self._seq = itertools.count()

    def __len__(self) -> int:
        """Heap entries, live or stale (for tests and status)."""
        return len(self._heap)

    def start(self, obj: L1Object, expiry: float) -> None:
        """Give ``obj`` a lease until ``expiry``, or move its lease there."""
        obj.lease_expiry = expiry
        self._leased.add(obj)
        self._arm(obj)

    def end(self, obj: L1Object) -> None:
        obj.lease_expiry = None
        self._leased.discard(obj)

    def expired(self, now: float) -> Iterator[L1Object]:
        """Objects whose lease ran out by ``now``. The caller ends or restarts
        each lease it is given."""
        while self._heap and self._heap[0][0] <= now:
            due, _, obj = heapq.heappop(self._heap)
            if obj.armed_at != due:
                continue  # superseded by an earlier entry
            obj.armed_at = None
            if obj.lease_expiry is None:
                continue  # ended normally
            if obj.lease_expiry > now:
                self._arm(obj)  # extended since this entry was pushed
                continue
            yield obj

    def _arm(self, obj: L1Object) -> None:
        expiry = obj.lease_expiry
        if expiry is not None and (obj.armed_at is None or expiry < obj.armed_at):
            obj.armed_at = expiry
            heapq.heappush(self._heap, (expiry, next(self._seq), obj))
            if len(self._heap) > 2 * len(self._leased) + 1024:
                self._compact()

    def _compact(self) -> None:
        for _, _, obj in self._heap:
            obj.armed_at = None
        self._heap = []
        for obj in self._leased:
            assert obj.lease_expiry is not None  # the leased set holds only live leases
            obj.armed_at = obj.lease_expiry
            self._heap.append((obj.lease_expiry, next(self._seq), obj))
        heapq.heapify(self._heap)
