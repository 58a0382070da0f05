"""``L1Tables``: the tables of L1's state machine and the bookkeeping every
transition shares (``L1Manager`` is the transitions; its docstring has the
rules these helpers keep).

Everything here runs with ``self._lock`` held, except ``__init__``.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence

from kvtier.counters import Counters
from kvtier.keys import ObjectKey
from kvtier.l1.arena import Arena
from kvtier.l1.config import L1Config
from kvtier.l1.eviction import make_policy
from kvtier.l1.leases import LeaseHeap
from kvtier.l1.objects import L1Object, ObjectState, WriterTag
from kvtier.l1.quotas import QuotaBook

log = logging.getLogger("kvtier.l1.manager")

Clock = Callable[[], float]
COUNTERS = (
    "evictions",
    "evicted_bytes",
    "eviction_failures",
    "expired_write_leases",
    "expired_read_leases",
    "out_of_memory",
    "too_large",
    "watermark_unreachable",
    "duplicate_writes",
    "over_quota",
    "quota_evictions",
)


class L1Tables:
    """L1's fields and shared bookkeeping; see the module docstring."""

    def __init__(self, config: L1Config | None = None, *, clock: Clock = time.monotonic) -> None:
        self.config = config or L1Config()
        self._clock = clock
        self._lock = threading.Lock()
        self._arena = Arena(
            self.config.size_bytes,
            shm_dir=self.config.shm_dir,
            populate=self.config.populate,
            reaper=self.config.reaper,
        )
        self._policy = make_policy(self.config.eviction_policy)
        self._resident: dict[ObjectKey, L1Object] = {}
        self._staging: dict[tuple[ObjectKey, WriterTag], L1Object] = {}
        self._zombies: set[L1Object] = set()  # expired while fenced, memory not yet freed
        self._leases = LeaseHeap()
        self._staging_bytes = 0
        self._locked_bytes = 0
        self._locked_objects = 0  # resident objects with read_locks > 0
        self._fenced_objects = 0  # objects (any table) with io_fences > 0
        self._counters = Counters()
        self._counters.set(**dict.fromkeys(COUNTERS, 0))
        self._quotas = QuotaBook(lambda salt: "")  # one owner, no limits, until set_owners
        # Told of every object that becomes resident (True) or stops being
        # resident (False), under the lock: it must only record (KV events).
        self.on_residency: Callable[[bool, Sequence[ObjectKey]], None] | None = None

    def _evict_to_watermark(self, fresh_bytes: int) -> None:
        """After an admission: evict down to the low watermark if usage passed
        the high one, unless unevictable bytes alone are above the low mark."""
        capacity = self._arena.capacity
        used = self._arena.used_bytes
        if used <= self.config.high_watermark * capacity:
            return
        low = self.config.low_watermark * capacity
        if self._staging_bytes + self._locked_bytes + fresh_bytes > low:
            self._counters.add("watermark_unreachable", 1)
            return
        self._evict(int(used - low))

    def _allocate(self, sizes: list[int]) -> list[int] | None:
        offsets = self._arena.allocate(sizes)
        need = sum(self._arena.reserved_bytes(s) for s in sizes)
        pinned = self._staging_bytes + self._locked_bytes  # eviction cannot free these
        if offsets is None and need > self._arena.capacity - pinned:
            return None  # cannot fit even if everything evictable went: evict nothing
        while offsets is None:
            if self._evict(max(need - (self._arena.capacity - self._arena.used_bytes), 1)) == 0:
                return None
            offsets = self._arena.allocate(sizes)
        return offsets

    def _evictable(self, key: ObjectKey) -> bool:
        obj = self._resident.get(key)
        return (
            obj is not None
            and obj.read_locks == 0
            and obj.io_fences == 0
            and not self._quotas.pinned(key, self._clock())
        )

    def _evict(self, need_bytes: int) -> int:
        """Evict at least ``need_bytes`` if possible; return the bytes freed."""
        try:
            victims = self._policy.select(need_bytes, self._evictable)
        except Exception:
            self._counters.add("eviction_failures", 1)
            log.exception("L1: eviction policy %s failed; nothing evicted", self._policy.name)
            return 0
        freed = 0
        for key in victims:
            obj = self._resident[key]
            freed += obj.reserved
            self._drop_resident(obj)
        self._counters.add("evictions", len(victims))
        self._counters.add("evicted_bytes", freed)
        return freed

    def _unstage(self, obj: L1Object) -> None:
        self._staging_bytes -= obj.reserved
        self._quotas.unstage(self._quotas.owner(obj.key), obj.reserved)

    def _evict_own(self, owner: str, spare: set[ObjectKey], now: float) -> int:
        """Evict ``owner``'s least recently used objects (not ``spare``) down
        to its soft limit; return the bytes freed."""
        need = self._quotas.excess(owner)
        freed = 0
        for key, size in self._quotas.oldest(owner):
            if freed >= need:
                break
            if key in spare or not self._evictable(key):
                continue
            self._policy.remove(key)
            self._drop_resident(self._resident[key])
            freed += size
            self._counters.add("quota_evictions", 1)
        return freed

    def _drop_resident(self, obj: L1Object) -> None:
        self._quotas.drop(obj.key)
        del self._resident[obj.key]
        self._arena.free([obj.offset])
        if self.on_residency is not None:
            self.on_residency(False, (obj.key,))

    def _release_memory(self, obj: L1Object) -> None:
        if obj.io_fences:
            obj.reclaimed = True
            self._zombies.add(obj)
        else:
            self._arena.free([obj.offset])

    def _lock_read(self, obj: L1Object, n: int, now: float) -> None:
        if obj.read_locks == 0:
            self._locked_bytes += obj.reserved
            self._locked_objects += 1
        obj.read_locks += n
        self._leases.start(obj, now + self.config.read_lease_s)

    def _reap(self, now: float) -> None:
        for obj in self._leases.expired(now):
            self._leases.end(obj)
            if obj.state is ObjectState.STAGING:
                assert obj.tag is not None
                if self._staging.get((obj.key, obj.tag)) is not obj:
                    continue
                del self._staging[(obj.key, obj.tag)]
                self._unstage(obj)
                self._release_memory(obj)
                self._counters.add("expired_write_leases", 1)
                log.warning("L1: write lease of %s (tag %s) expired; reclaimed", obj.key, obj.tag)
            elif self._resident.get(obj.key) is obj and obj.read_locks:
                log.warning("L1: %d read lock(s) on %s expired", obj.read_locks, obj.key)
                obj.read_locks = 0
                self._locked_bytes -= obj.reserved
                self._locked_objects -= 1
                self._counters.add("expired_read_leases", 1)

    def _all_objects(self) -> list[L1Object]:
        return [*self._resident.values(), *self._staging.values(), *self._zombies]

    @staticmethod
    def _check_count(n: int, method: str) -> None:
        if isinstance(n, bool) or not isinstance(n, int) or n <= 0:
            raise ValueError(f"{method}: n must be a positive int, got {n!r}")
