"""``L1Tables``: the tables of L1's state machine, their read-only views
(status, audit, listings, per-owner usage) and the bookkeeping every
transition shares (``L1Manager`` is the transitions; its docstring has the
rules these helpers keep).

The views take ``self._lock``; the internals run with it held.
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
from kvtier.l1.leases import LeaseHeap
from kvtier.l1.objects import L1Object, ObjectState, WriterTag
from kvtier.l1.policies import make_policy
from kvtier.l1.quotas import QuotaBook

OWN_EVICTION_BATCH = 64  # a tenant's oldest objects looked at per step of its own eviction

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
    "wrong_layout",
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
        # what the policy orders when L1 is full: up to the high watermark
        full = int(self._arena.capacity * self.config.high_watermark)
        self._policy = make_policy(self.config.eviction_policy, full)
        self._resident: dict[ObjectKey, L1Object] = {}
        self._staging: dict[tuple[ObjectKey, WriterTag], L1Object] = {}
        self._zombies: set[L1Object] = set()  # expired while fenced, memory not yet freed
        # Purged while read-locked or fenced: out of the resident table (no
        # reader finds them), memory freed when the last holder lets go.
        self._doomed: dict[ObjectKey, L1Object] = {}
        self._leases = LeaseHeap()
        self._staging_bytes = 0
        self._locked_bytes = 0
        self._locked_objects = 0  # resident and doomed objects with read_locks > 0
        self._fenced_objects = 0  # objects (any table) with io_fences > 0
        self._counters = Counters()
        self._counters.set(**dict.fromkeys(COUNTERS, 0))
        self._quotas = QuotaBook(lambda salt: "")  # one owner, no limits, until set_owners
        # Told of every object that becomes resident (True) or stops being
        # resident (False), under the lock: it must only record (KV events).
        self.on_residency: Callable[[bool, Sequence[ObjectKey]], None] | None = None

    # ------------------------------------------------------- read-only views

    def contains(self, key: ObjectKey) -> bool:
        """Whether ``key`` is resident (staging copies do not count)."""
        with self._lock:
            return key in self._resident

    def resident_objects(self) -> list[tuple[ObjectKey, str]]:
        """Every resident object's key and layout digest, newest admission
        first (a snapshot: any of them may be evicted right after)."""
        with self._lock:
            return [(obj.key, obj.layout) for obj in reversed(self._resident.values())]

    def staging_keys(self) -> list[ObjectKey]:
        """The key of every staged copy (a store or a load in flight)."""
        with self._lock:
            return [key for key, _ in self._staging]

    def doomed_objects(self) -> list[tuple[ObjectKey, int]]:
        """Every purged object a holder still keeps (``L1Manager.purge``) and
        its I/O fences (> 0: an I/O, such as a write-back, still reads it)."""
        with self._lock:
            return [(key, obj.io_fences) for key, obj in self._doomed.items()]

    def resident_sizes(self) -> list[tuple[ObjectKey, int]]:
        """Every resident object's key and the bytes it takes (a snapshot)."""
        with self._lock:
            return [(obj.key, obj.reserved) for obj in self._resident.values()]

    def older_than(self, age_s: float) -> list[ObjectKey]:
        """Resident objects admitted more than ``age_s`` seconds ago."""
        with self._lock:
            cutoff = self._clock() - age_s
            return [k for k, obj in self._resident.items() if obj.admitted_at < cutoff]

    def status(self) -> dict[str, object]:
        with self._lock:
            arena = self._arena.stats()
            return {
                "capacity_bytes": arena["capacity_bytes"],
                "used_bytes": arena["used_bytes"],
                "staging_bytes": self._staging_bytes,
                "locked_bytes": self._locked_bytes,
                "resident_objects": len(self._resident),
                "staging_objects": len(self._staging),
                "doomed_objects": len(self._doomed),
                "locked_objects": self._locked_objects,
                "fenced_objects": self._fenced_objects,
                "fragmentation": arena["fragmentation"],
                "eviction_policy": self._policy.name,
                **self._counters.snapshot(),
                **self._owner_status(),
            }

    def _owner_status(self) -> dict[str, int]:
        """Per named owner (tenant), for /metrics: resident + staging and pinned bytes."""
        now = self._clock()
        out: dict[str, int] = {}
        for owner, used in self._quotas.usage().items():
            if owner:
                out[f"tenant_bytes.{owner}"] = used
                out[f"tenant_pinned_bytes.{owner}"] = self._quotas.pinned_bytes(owner, now)
        return out

    def owner_usage(self) -> dict[str, dict[str, int]]:
        """Per owner: resident + staging bytes, and pinned bytes."""
        with self._lock:
            now = self._clock()
            return {
                owner: {"bytes": used, "pinned_bytes": self._quotas.pinned_bytes(owner, now)}
                for owner, used in self._quotas.usage().items()
            }

    def audit(self) -> dict[str, int]:
        """Recount locks and bytes from the tables (for tests and debugging)."""
        with self._lock:
            live = list(self._all_objects())
            readable = [*self._resident.values(), *self._doomed.values()]
            return {
                "read_locks": sum(o.read_locks for o in readable),
                "locked_objects": sum(1 for o in readable if o.read_locks),
                "fenced_objects": sum(1 for o in live if o.io_fences),
                "staging_objects": len(self._staging),
                "io_fences": sum(o.io_fences for o in live),
                "zombies": len(self._zombies),
                "doomed_objects": len(self._doomed),
                "object_bytes": sum(o.reserved for o in live),
                "arena_used_bytes": self._arena.used_bytes,
                "policy_entries": len(self._policy),
                "resident_objects": len(self._resident),
            }

    # -------------------------------------------------------------- internals

    def _evict_to_watermark(self, fresh_bytes: int) -> None:
        """After an admission: evict down to the low watermark if usage passed
        the high one, unless unevictable bytes alone are above the low mark.
        Owners' bytes past their soft limits do not count: only owners within
        their quotas overflowing L1 may cost another owner its objects."""
        capacity = self._arena.capacity
        used = self._arena.used_bytes - self._quotas.total_excess()
        if used <= self.config.high_watermark * capacity:
            return
        low = self.config.low_watermark * capacity
        if self._staging_bytes + self._locked_bytes + fresh_bytes > low:
            self._counters.add("watermark_unreachable", 1)
            return
        self._evict(int(used - low))

    def _allocate(self, sizes: list[int], asked: dict[str, int]) -> list[int] | None:
        """Memory for a write of ``asked`` bytes per owner. Room comes first
        from owners past their soft limits, the writers included (what their
        write would take past it: publishing would evict it anyway), then
        from anyone's objects, by the policy, for no more than the bytes by
        which owners within their quotas overflow L1: neither a write's
        excess nor what an owner holds past its limit ever costs another
        owner an object."""
        offsets = self._arena.allocate(sizes)
        if offsets is not None:
            return offsets
        need = sum(self._arena.reserved_bytes(s) for s in sizes)
        pinned = self._staging_bytes + self._locked_bytes  # eviction cannot free these
        if need > self._arena.capacity - pinned:
            return None  # cannot fit even if everything evictable went: evict nothing
        self._evict_excess(asked)
        offsets = self._arena.allocate(sizes)
        budget = self._quotas.overflow(asked, self._arena.capacity)  # None: no limit
        while offsets is None:
            want = max(need - (self._arena.capacity - self._arena.used_bytes), 1)
            if budget is not None and want > budget:
                return None
            freed = self._evict(want)
            if freed == 0:
                return None
            if budget is not None:
                budget -= freed
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

    def _evict_excess(self, incoming: dict[str, int] | None = None) -> int:
        """Evict every owner down to its soft limit, less the ``incoming``
        bytes it is about to write; return the bytes freed."""
        incoming = incoming or {}
        return sum(
            self._evict_own(owner, incoming.get(owner, 0)) for owner in self._quotas.soft_limited()
        )

    def _evict_own(self, owner: str, incoming: int = 0) -> int:
        """Evict ``owner``'s least recently used objects down to its soft
        limit, less ``incoming`` bytes; return the bytes freed."""
        need = self._quotas.excess(owner, incoming)
        freed = kept = 0  # kept: the oldest objects that may not go (they stay first)
        while freed < need:
            batch = self._quotas.oldest(owner, kept, OWN_EVICTION_BATCH)
            if not batch:
                break
            for key, size in batch:
                if freed >= need:
                    break
                if not self._evictable(key):
                    kept += 1
                    continue
                self._policy.remove(key)
                self._drop_resident(self._resident[key])
                freed += size
                self._counters.add("quota_evictions", 1)
        return freed

    def _drop_resident(self, obj: L1Object) -> None:
        self._unlist(obj)
        self._arena.free([obj.offset])

    def _doom(self, obj: L1Object) -> None:
        """A held resident object leaves the resident table now; its memory
        stays its holders' until ``_bury``."""
        self._unlist(obj)
        obj.state = ObjectState.DOOMED
        self._doomed[obj.key] = obj

    def _bury(self, obj: L1Object) -> None:
        """Free a doomed object once nothing holds it any more."""
        if obj.read_locks == 0 and obj.io_fences == 0 and self._doomed.get(obj.key) is obj:
            del self._doomed[obj.key]
            self._arena.free([obj.offset])

    def _unlist(self, obj: L1Object) -> None:
        self._quotas.drop(obj.key)
        del self._resident[obj.key]
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
            elif obj.read_locks and (
                self._resident.get(obj.key) is obj or obj.state is ObjectState.DOOMED
            ):
                log.warning("L1: %d read lock(s) on %s expired", obj.read_locks, obj.key)
                obj.read_locks = 0
                self._locked_bytes -= obj.reserved
                self._locked_objects -= 1
                self._counters.add("expired_read_leases", 1)
                self._bury(obj)

    def _all_objects(self) -> list[L1Object]:
        return [
            *self._resident.values(),
            *self._staging.values(),
            *self._zombies,
            *self._doomed.values(),
        ]

    @staticmethod
    def _check_count(n: int, method: str) -> None:
        if isinstance(n, bool) or not isinstance(n, int) or n <= 0:
            raise ValueError(f"{method}: n must be a positive int, got {n!r}")
