"""``L1Manager``: the host-memory tier's state machine (ARCHITECTURE §5.1).

::

    reserve_write(keys, sizes, tag, layout)
        │  OUT_OF_MEMORY / NOT_WRITABLE (already resident, or doomed) /
        │  WRONG_LAYOUT (resident under another layout) / WRONG_STATE
        ▼
    STAGING(key, tag) ──abort_write / write-lease expiry──► freed
        │ finish_write: if already resident, this copy is discarded and the
        │ writer still gets SUCCESS (first publisher wins), or WRONG_LAYOUT
        │ if the winner's layout is not this copy's; if doomed, discarded
        │ too (NOT_FOUND)
        ▼
    RESIDENT ◄──reserve_read(n) / finish_read(n)──► READ-LOCKED(count) and/or FENCED
        │ (unlocked, unfenced only)                  │ purge
        ▼                                            ▼
    evicted by policy / delete / clear / purge     DOOMED: no reader finds it
        ─► freed                                     │ last finish_read / unfence /
                                                     │ read-lease expiry
                                                     ▼
                                                   freed

    finish_write_and_reserve_read: STAGING ─► RESIDENT + READ-LOCKED in one step

Rules:

- Every object keeps the layout digest it was written under, and every
  read names the layout it expects per object group (``layouts``; a group
  it does not name expects "", objects written without one). An object of
  another layout is WRONG_LAYOUT to a reader, as if absent: the one rule
  (a chunk whose layout is not proven is a miss) holds in L1 as it does in
  the L2 tiers, whose headers carry the digest. A key is held under one
  layout at a time: the first to publish it keeps it, and a writer of
  another layout gets WRONG_LAYOUT (its copy is not kept). Well-formed
  clients never meet this: their chunk hashes are rooted in a namespace
  that carries the layout digest. The check is for those that do not.
- Staging objects are keyed by (key, writer tag) and invisible to readers; two
  tags may stage one key at once, and the first ``finish_write`` publishes.
- Read locks are counted. Eviction, ``delete`` and ``clear`` skip locked,
  fenced and staging objects. ``purge`` does not: a held object it deletes
  is DOOMED, out of the resident table at once (a lookup misses it, a write
  of its key is NOT_WRITABLE, KV events announce it removed), and its
  memory stays its holders' until the last of them lets go (a purge is
  done while a read is in flight, and that read still finishes). Locking
  is not use: recency changes only on admission and ``touch``. Both apply
  to a batch in reverse, so the first chunk of a prefix ends up most
  recent: evicting a prefix's head would make every later chunk of it
  unreachable.
- Leases: a write reservation expires ``write_lease_s`` after it is made, a
  read lock ``read_lease_s`` after its last ``reserve_read``. Expiry is the
  crash net for holders that vanished. It never frees memory an I/O still
  targets: an I/O path calls ``fence`` before it reads or writes an object's
  bytes and ``unfence`` when the I/O is over; an object whose write lease
  expires while fenced is dropped from the tables but its memory is freed
  only at ``unfence``.
- Eviction keeps used bytes (resident + staging) between the watermarks: it
  starts after an admission pushes usage above ``high_watermark`` and stops
  at ``low_watermark``; ``reserve_write`` also evicts what it needs. The
  objects an admission publishes are never its own victims, and when locked,
  staging and just-published bytes alone exceed the low watermark the round
  is skipped (counted as ``watermark_unreachable``): evicting every other
  object would not reach the mark and would only empty the cache, one store
  evicting the previous one. A policy exception is logged and counted, and
  costs only that eviction round.
- An object larger than the whole arena is OUT_OF_MEMORY (counted as
  ``too_large``), like any batch that cannot fit.
- Owners (``set_owners``: the tenant of each key's salt, ``QuotaBook``): a
  write that would take its owner past a hard limit is OVER_QUOTA (counted
  as ``over_quota``), and so is the part of one batch past its owner's soft
  limit (publishing it would only evict it again). After an admission takes
  an owner past its soft limit, that owner's own least recently used
  objects, the admitted ones included, are evicted down to it
  (``quota_evictions``). An owner's own excess goes first: room for a write
  comes from bytes past owners' soft limits (the writer's own first) before
  anyone else's objects, and neither a write's excess nor bytes held past a
  soft limit ever evict another owner's objects (the watermark round does
  not count them). ``pin`` keeps resident objects from eviction until
  a deadline, within the owner's pin limit and ``max_pinned_fraction`` of
  the arena (OVER_QUOTA past either); a pin protects from eviction only:
  ``delete`` still frees a pinned object.

Every method takes a batch and returns one result per key; caller mistakes
(mismatched lengths, bad sizes, a key twice in one write transition) raise
ValueError. Read-side methods apply a repeated key once per occurrence
(``reserve_read([k, k])`` takes two locks). Thread
safety: one lock guards every field below; nothing under it does I/O (the
arena's bookkeeping is in-memory arithmetic).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence

import numpy as np
import numpy.typing as npt

from kvtier.keys import ObjectKey
from kvtier.l1.objects import (
    IOFence,
    L1Object,
    L1Result,
    ObjectState,
    Placement,
    WriterTag,
)
from kvtier.l1.ownership import L1Ownership

log = logging.getLogger(__name__)
Layouts = Mapping[int, str]  # a reader's expected layout digest per object group
NO_LAYOUTS: Layouts = {}


def expected_layout(layouts: Layouts, key: ObjectKey) -> str:
    """The layout digest a reader giving ``layouts`` expects of ``key``."""
    return layouts.get(key.group, "")


def _distinct(keys: Sequence[ObjectKey], method: str) -> None:
    if len(set(keys)) != len(keys):
        raise ValueError(f"{method}: keys must be distinct within one call")


class L1Manager(L1Ownership):
    """The L1 state machine over one shared-memory arena; see the module
    docstring. Owners, their limits and pins: ``L1Ownership``."""

    # ----------------------------------------------------------------- arena

    @property
    def arena_name(self) -> str:
        """Name of the shared-memory region, for other processes to map."""
        return self._arena.name

    @property
    def capacity(self) -> int:
        return self._arena.capacity

    @property
    def memory(self) -> npt.NDArray[np.uint8]:
        """The whole arena as one array (for adapters that register the memory
        their I/O lands in, for zero-copy transfers)."""
        return self._arena.view(0, self._arena.capacity)

    def wait_mapped(self, timeout: float | None = None) -> bool:
        """Wait until every arena page is mapped (``L1Config.populate``)."""
        return self._arena.wait_mapped(timeout)

    def view(self, placement: Placement) -> npt.NDArray[np.uint8]:
        """The bytes of a successful placement, as a writable view (no copy)."""
        if placement.result is not L1Result.SUCCESS or placement.offset is None:
            raise ValueError(f"view of a placement that did not succeed: {placement.result}")
        return self._arena.view(placement.offset, placement.size)

    # ---------------------------------------------------------------- writes

    def reserve_write(
        self,
        keys: Sequence[ObjectKey],
        sizes: Sequence[int],
        tag: WriterTag,
        costs: Sequence[float] | None = None,
        layout: str = "",
    ) -> list[Placement]:
        """Stage new objects for ``tag``; their memory is all-or-nothing.

        Per key: SUCCESS with an offset; NOT_WRITABLE if already resident
        (or doomed: purged while held, until freed); WRONG_LAYOUT if
        resident under another layout digest than ``layout``;
        WRONG_STATE if this tag already stages it; OUT_OF_MEMORY for every
        key that needed memory if the batch does not fit after eviction (or
        holds an object larger than the arena); OVER_QUOTA for an owner's keys
        from the first that would take it past its hard limit, or the batch
        alone past its soft limit (a chunk after a refused one is unreachable
        anyway). ``costs`` (recompute seconds
        saved) feed cost-aware eviction; ``layout`` (the objects' layout
        digest) stays with them for ``resident_objects``.
        """
        if len(sizes) != len(keys) or (costs is not None and len(costs) != len(keys)):
            raise ValueError("reserve_write: keys, sizes and costs must have the same length")
        _distinct(keys, "reserve_write")
        with self._lock:
            self._reap(self._clock())
            results: list[Placement | None] = [None] * len(keys)
            wanted: list[int] = []
            asked: dict[str, int] = {}  # owner -> bytes this call would add
            cut: set[str] = set()  # owners whose batch stopped at a limit
            for i, key in enumerate(keys):
                resident = self._resident.get(key)
                if resident is not None and resident.layout != layout:
                    self._counters.add("wrong_layout", 1)
                    results[i] = Placement(L1Result.WRONG_LAYOUT)
                elif resident is not None or key in self._doomed:
                    results[i] = Placement(L1Result.NOT_WRITABLE)
                elif (key, tag) in self._staging:
                    results[i] = Placement(L1Result.WRONG_STATE)
                else:
                    owner = self._quotas.owner(key)
                    size = asked.get(owner, 0) + self._arena.reserved_bytes(sizes[i])
                    soft = self._quotas.limit(owner).soft
                    if (
                        owner in cut
                        or self._quotas.would_pass_hard(owner, size)
                        or (soft is not None and size > soft)
                    ):
                        # Past the soft limit, this key and the rest of the
                        # batch would be this write's own victims at publish.
                        # Past either, the rest would follow a missing chunk.
                        cut.add(owner)
                        results[i] = Placement(L1Result.OVER_QUOTA)
                        self._counters.add("over_quota", 1)
                        continue
                    asked[owner] = size
                    wanted.append(i)
            offsets = self._allocate([sizes[i] for i in wanted], asked) if wanted else []
            if offsets is None:
                self._counters.add("out_of_memory", 1)
                if any(sizes[i] > self._arena.capacity for i in wanted):
                    self._counters.add("too_large", 1)
                for i in wanted:
                    results[i] = Placement(L1Result.OUT_OF_MEMORY)
            else:
                expiry = self._clock() + self.config.write_lease_s
                for i, offset in zip(wanted, offsets, strict=True):
                    obj = L1Object(
                        key=keys[i],
                        offset=offset,
                        size=sizes[i],
                        reserved=self._arena.reserved_bytes(sizes[i]),
                        state=ObjectState.STAGING,
                        tag=tag,
                        cost=None if costs is None else costs[i],
                        layout=layout,
                    )
                    self._staging[(keys[i], tag)] = obj
                    self._staging_bytes += obj.reserved
                    self._quotas.stage(self._quotas.owner(obj.key), obj.reserved)
                    self._leases.start(obj, expiry)
                    results[i] = Placement(L1Result.SUCCESS, offset, sizes[i])
            return [r for r in results if r is not None]

    def finish_write(self, keys: Sequence[ObjectKey], tag: WriterTag) -> list[L1Result]:
        """Publish ``tag``'s staged copies. SUCCESS also when another writer won
        (this copy is discarded); WRONG_LAYOUT when the one that won wrote
        another layout (discarded too); NOT_FOUND if there is no such reservation,
        or the key was purged while held and is not freed yet (this copy is
        discarded)."""
        return [p.result for p in self._publish(keys, tag, read_locks=0)]

    def finish_write_and_reserve_read(
        self, keys: Sequence[ObjectKey], tag: WriterTag, n: int = 1
    ) -> list[Placement]:
        """Publish and read-lock in one step, so eviction cannot slip in between.
        The placement is the resident object's (the winner's, if another won
        under the same layout; WRONG_LAYOUT, nothing locked, if under another)."""
        self._check_count(n, "finish_write_and_reserve_read")
        return self._publish(keys, tag, read_locks=n)

    def abort_write(self, keys: Sequence[ObjectKey], tag: WriterTag) -> list[L1Result]:
        """Drop ``tag``'s staged copies; NOT_FOUND if there is no such reservation."""
        _distinct(keys, "abort_write")
        with self._lock:
            self._reap(self._clock())
            results = []
            for key in keys:
                obj = self._staging.pop((key, tag), None)
                if obj is None:
                    results.append(L1Result.NOT_FOUND)
                    continue
                self._unstage(obj)
                self._leases.end(obj)
                self._release_memory(obj)
                results.append(L1Result.SUCCESS)
            return results

    # ----------------------------------------------------------------- reads

    def reserve_read(
        self, keys: Sequence[ObjectKey], n: int = 1, *, layouts: Layouts = NO_LAYOUTS
    ) -> list[Placement]:
        """Read-lock resident objects of the layouts the reader expects
        (``layouts``: a digest per group) ``n`` times each; NOT_FOUND if not
        resident (staging objects are invisible), WRONG_LAYOUT if resident
        under another layout. Does not count as use."""
        self._check_count(n, "reserve_read")
        with self._lock:
            now = self._clock()
            self._reap(now)
            results = []
            for key in keys:
                obj = self._resident.get(key)
                if obj is None:
                    results.append(Placement(L1Result.NOT_FOUND))
                    continue
                if obj.layout != expected_layout(layouts, key):
                    self._counters.add("wrong_layout", 1)
                    results.append(Placement(L1Result.WRONG_LAYOUT))
                    continue
                self._lock_read(obj, n, now)
                results.append(Placement(L1Result.SUCCESS, obj.offset, obj.size))
            return results

    def reserve_read_all(
        self, keys: Sequence[ObjectKey], *, layouts: Layouts = NO_LAYOUTS
    ) -> tuple[list[Placement], int]:
        """Read-lock every one of ``keys`` once, or none of them: their
        placements, and how many are not resident under the layouts the
        reader expects (0: all are locked; else none is, and the placements
        are empty)."""
        with self._lock:
            now = self._clock()
            self._reap(now)
            found = [self._resident.get(key) for key in keys]
            resident = [
                obj
                for key, obj in zip(keys, found, strict=True)
                if obj is not None and obj.layout == expected_layout(layouts, key)
            ]
            if len(resident) < len(found):
                return [], len(found) - len(resident)
            for obj in resident:
                self._lock_read(obj, 1, now)
            return [Placement(L1Result.SUCCESS, obj.offset, obj.size) for obj in resident], 0

    def finish_read(self, keys: Sequence[ObjectKey], n: int = 1) -> list[L1Result]:
        """Drop ``n`` read locks per key (a doomed object's last one frees
        it). WRONG_STATE (and no change) if the key holds fewer than ``n``;
        NOT_FOUND if it is neither resident nor doomed."""
        self._check_count(n, "finish_read")
        with self._lock:
            self._reap(self._clock())
            results = []
            for key in keys:
                # A key is never both: a doomed key cannot be written again.
                obj = self._resident.get(key) or self._doomed.get(key)
                if obj is None:
                    results.append(L1Result.NOT_FOUND)
                elif obj.read_locks < n:
                    log.warning("L1: finish_read(n=%d) on %s holding %d", n, key, obj.read_locks)
                    results.append(L1Result.WRONG_STATE)
                else:
                    obj.read_locks -= n
                    if obj.read_locks == 0:
                        self._locked_objects -= 1
                        self._leases.end(obj)
                        self._locked_bytes -= obj.reserved
                        self._bury(obj)
                    results.append(L1Result.SUCCESS)
            return results

    # ------------------------------------------------------------ I/O fences

    def fence(
        self, keys: Sequence[ObjectKey], tag: WriterTag | None = None
    ) -> tuple[list[Placement], IOFence]:
        """Pin memory for an I/O: ``tag``'s staged copies, or (tag None) resident
        objects; per key where it is (SUCCESS), or NOT_FOUND: not pinned, not
        to be touched by the I/O. The caller must ``unfence`` the returned
        fence exactly once."""
        with self._lock:
            self._reap(self._clock())
            fence = IOFence()
            results = []
            for key in keys:
                obj = self._resident.get(key) if tag is None else self._staging.get((key, tag))
                if obj is None:
                    results.append(Placement(L1Result.NOT_FOUND))
                    continue
                obj.io_fences += 1
                self._fenced_objects += obj.io_fences == 1
                fence.objects.append(obj)
                results.append(Placement(L1Result.SUCCESS, obj.offset, obj.size))
            return results, fence

    def unfence(self, fence: IOFence) -> None:
        """Lift a fence; frees the memory of objects whose lease expired, or
        that were purged, meanwhile."""
        with self._lock:
            if fence.released:
                raise ValueError("unfence: this fence was already lifted")
            fence.released = True
            for obj in fence.objects:
                obj.io_fences -= 1
                self._fenced_objects -= obj.io_fences == 0
                if obj.io_fences == 0 and obj.reclaimed:
                    self._zombies.discard(obj)
                    self._arena.free([obj.offset])
                elif obj.state is ObjectState.DOOMED:
                    self._bury(obj)

    # ------------------------------------------------------------ management

    def touch(self, keys: Sequence[ObjectKey]) -> list[L1Result]:
        """Mark resident objects as used; the first key ends up most recent."""
        with self._lock:
            results = [
                L1Result.SUCCESS if key in self._resident else L1Result.NOT_FOUND for key in keys
            ]
            self._policy.touch(reversed(keys))
            self._quotas.touch(reversed(keys))
            return results

    def delete(self, keys: Sequence[ObjectKey]) -> list[L1Result]:
        """Free resident objects; LOCKED (and kept) if read-locked or fenced."""
        return self._delete(keys, doom=False)

    def purge(self, keys: Sequence[ObjectKey]) -> list[L1Result]:
        """Delete resident objects for good: SUCCESS, freed now; LOCKED, held
        (read-locked or fenced): DOOMED, no longer found by any reader, and
        freed when the last holder lets go; NOT_FOUND if not resident."""
        return self._delete(keys, doom=True)

    def clear(self) -> int:
        """Free every unlocked, unfenced resident object; return how many."""
        with self._lock:
            self._reap(self._clock())
            victims = [key for key in self._resident if self._evictable(key)]
            for key in victims:
                self._policy.remove(key)
                self._drop_resident(self._resident[key])
            return len(victims)

    def reap_expired(self) -> None:
        """Expire leases that are due (every public method also does this)."""
        with self._lock:
            self._reap(self._clock())

    def close(self) -> None:
        """Release the arena. Outstanding views must not be used afterwards."""
        with self._lock:
            self._resident.clear()
            self._staging.clear()
            self._zombies.clear()
            self._doomed.clear()
            self._arena.close()

    # -------------------------------------------------------------- internals
    # All below run with self._lock held.

    def _delete(self, keys: Sequence[ObjectKey], doom: bool) -> list[L1Result]:
        with self._lock:
            self._reap(self._clock())
            results = []
            for key in keys:
                obj = self._resident.get(key)
                if obj is None:
                    results.append(L1Result.NOT_FOUND)
                    continue
                held = bool(obj.read_locks or obj.io_fences)
                if held and not doom:
                    results.append(L1Result.LOCKED)
                    continue
                self._policy.remove(key)
                if held:
                    self._doom(obj)
                else:
                    self._drop_resident(obj)
                results.append(L1Result.LOCKED if held else L1Result.SUCCESS)
            return results

    def _publish(
        self, keys: Sequence[ObjectKey], tag: WriterTag, read_locks: int
    ) -> list[Placement]:
        _distinct(keys, "finish_write")
        with self._lock:
            now = self._clock()
            self._reap(now)
            results = []
            admitted = []
            for key in keys:
                obj = self._staging.pop((key, tag), None)
                if obj is None:
                    results.append(Placement(L1Result.NOT_FOUND))
                    continue
                self._unstage(obj)
                if key in self._doomed:  # purged while held: it stays gone until freed
                    self._leases.end(obj)
                    self._release_memory(obj)
                    results.append(Placement(L1Result.NOT_FOUND))
                    continue
                winner = self._resident.get(key)
                if winner is None:
                    obj.state, obj.tag = ObjectState.RESIDENT, None
                    self._leases.end(obj)
                    self._resident[key] = winner = obj
                    obj.admitted_at = now
                    admitted.append(obj)
                else:
                    self._counters.add("duplicate_writes", 1)
                    self._leases.end(obj)
                    self._release_memory(obj)
                    if winner.layout != obj.layout:
                        self._counters.add("wrong_layout", 1)
                        results.append(Placement(L1Result.WRONG_LAYOUT))
                        continue
                if read_locks:
                    self._lock_read(winner, read_locks, now)
                results.append(Placement(L1Result.SUCCESS, winner.offset, winner.size))
            for obj in reversed(admitted):
                self._quotas.admit(obj.key, obj.reserved)
            if admitted and self.on_residency is not None:
                self.on_residency(True, [obj.key for obj in admitted])
            # Owners' own excess first, this admission's objects included (a
            # batch is admitted in reverse: its tail goes before its head).
            self._evict_excess()
            admitted = [obj for obj in admitted if self._resident.get(obj.key) is obj]
            # The watermark round runs before the policy knows the new objects:
            # they cannot be picked.
            self._evict_to_watermark(sum(o.reserved for o in admitted if not o.read_locks))
            for obj in reversed(admitted):
                self._policy.admit(obj.key, obj.reserved, obj.cost)
            return results
