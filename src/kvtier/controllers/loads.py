"""``Loads``: the prefetch worker's loads from L2 into L1 (steps 4 and 5 of
``kvtier.controllers.prefetch``), single-flight::

    start(request, adapter, layout, keys)
        reserve staging in L1 ─► fence it ─► submit_load      (a LoadBatch)
        │ a key published meanwhile: read-locked from L1 instead
        │ no room: that key is a miss (NO_ROOM)
        ▼
    finish(result)  the batch leaves the books (its bytes stop counting)
        ▼
    land(batch, result)
        unfence ─► return the adapter's leases ─► publish each loaded copy,
        read-locked once per request still waiting for it (none: published
        unlocked, warming the cache); a failed copy is dropped, a miss for
        its requests

``inflight`` maps every object being loaded to its batch: a second request
for it subscribes to that batch instead of loading it again. Every field is
the worker thread's (no lock).
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Mapping
from dataclasses import dataclass, field

from kvtier.controllers.lookups import L1_TIER, MissReason, load_miss
from kvtier.controllers.prefetch_request import PrefetchRequest
from kvtier.counters import Counters
from kvtier.keys import ObjectKey
from kvtier.l1 import IOFence, L1Manager, L1Result, WriterTag
from kvtier.l2.base import L2Adapter, TaskId, TaskResult
from kvtier.layout import KVLayout


@dataclass(eq=False)
class LoadBatch:
    """One ``submit_load``: its staged objects and the requests waiting for each."""

    adapter: str
    tag: WriterTag
    fence: IOFence
    nbytes: int
    digest: str  # the layout its objects are loaded under
    subscribers: dict[ObjectKey, list[PrefetchRequest]]
    started: float = field(default_factory=time.monotonic)  # its load's cost is learned


class Loads:
    """The loads in flight; see the module docstring."""

    def __init__(
        self, l1: L1Manager, adapters: Mapping[str, L2Adapter], counters: Counters
    ) -> None:
        self._l1 = l1
        self._adapters = adapters
        self._counters = counters
        self._tags = itertools.count()
        self.batches: dict[tuple[str, TaskId], LoadBatch] = {}
        self.inflight: dict[ObjectKey, LoadBatch] = {}  # single flight
        self.inflight_bytes = 0

    def start(
        self, request: PrefetchRequest, name: str, layout: KVLayout, keys: list[ObjectKey]
    ) -> None:
        """Stage ``keys`` in L1 and load them from adapter ``name`` for
        ``request``. The adapter's leases on ``keys`` are returned here for
        what is not loaded, or when the load lands; on an exception, here,
        for all (and nothing stays staged or fenced)."""
        tag = WriterTag(f"prefetch-{next(self._tags)}")
        size = layout.object_bytes()
        digest = layout.digest()
        staged: list[ObjectKey] = []
        fence: IOFence | None = None
        try:
            placements = self._l1.reserve_write(keys, [size] * len(keys), tag, layout=digest)
            for key, placement in zip(keys, placements, strict=True):
                if placement.result is L1Result.SUCCESS:
                    staged.append(key)
                elif placement.result is L1Result.NOT_WRITABLE:
                    self._take_resident(request, key)  # published meanwhile: read it from L1
                elif placement.result is L1Result.WRONG_LAYOUT:
                    request.wrong_layout(key)  # published meanwhile, under another layout
                else:
                    self._counters.add("staging_out_of_memory")  # too large for L1, or no room
                    request.missed[key] = MissReason.NO_ROOM
            if not staged:
                self.unlock(name, set(keys))
                return
            _, fence = self._l1.fence(staged, tag)
            views = [self._l1.view(p) for p in placements if p.result is L1Result.SUCCESS]
            subscribers = {k: [request] for k in staged}
            batch = LoadBatch(name, tag, fence, size * len(staged), digest, subscribers)
            task = self._adapters[name].submit_load(staged, views, digest)
        except BaseException:
            if fence is not None:
                self._l1.unfence(fence)
            if staged:
                self._l1.abort_write(staged, tag)
            self.unlock(name, set(keys))
            raise
        self.unlock(name, set(keys) - set(staged))
        for key in staged:
            self.inflight[key] = batch
            request.pending_loads.add(key)
        self.inflight_bytes += batch.nbytes
        self.batches[(name, task)] = batch

    def finish(self, result: TaskResult) -> LoadBatch | None:
        """Take the batch of a completed load off the books (None: unknown);
        ``land`` it next."""
        batch = self.batches.pop((result.adapter, result.task), None)
        if batch is None:
            return None
        self.inflight_bytes -= batch.nbytes
        for key in result.keys:
            del self.inflight[key]
        return batch

    def land(self, batch: LoadBatch, result: TaskResult) -> set[PrefetchRequest]:
        """Publish what ``batch`` loaded; return the requests it concerned.
        On an exception what is still staged is dropped, and it goes on (the
        worker ends the batch's requests as misses)."""
        try:
            self._l1.unfence(batch.fence)
            self.unlock(result.adapter, set(result.keys))
            return self._admit(batch, result)
        except BaseException:
            self._l1.abort_write(list(result.keys), batch.tag)
            raise

    def unlock(self, name: str, keys: set[ObjectKey]) -> None:
        """Return adapter ``name``'s leases on ``keys``."""
        if keys:
            self._adapters[name].unlock(list(keys))

    def layout_in_flight(self, key: ObjectKey) -> str | None:
        """The layout digest ``key`` is being loaded under; None if it is not."""
        batch = self.inflight.get(key)
        return None if batch is None else batch.digest

    def _take_resident(self, request: PrefetchRequest, key: ObjectKey) -> None:
        (placement,) = self._l1.reserve_read([key], layouts=request.digests)
        if placement.result is L1Result.SUCCESS:
            request.locked[key] = placement
            request.tier[key] = L1_TIER
        elif placement.result is L1Result.WRONG_LAYOUT:
            request.wrong_layout(key)

    def _admit(self, batch: LoadBatch, result: TaskResult) -> set[PrefetchRequest]:
        """Publish the loaded copies, locked once per live subscriber; return
        the requests this load concerned."""
        waiting: dict[int, list[ObjectKey]] = {}  # number of live subscribers -> keys
        touched: set[PrefetchRequest] = set()
        for key, ok in zip(result.keys, result.ok, strict=True):
            live = [r for r in batch.subscribers[key] if not r.done]
            touched.update(live)
            for request in live:
                request.pending_loads.discard(key)
            if ok:
                waiting.setdefault(len(live), []).append(key)
            else:
                self._l1.abort_write([key], batch.tag)
                reason = load_miss(result, key)
                for request in live:
                    request.missed[key] = reason
        self._counters.add(f"loaded_objects.{result.adapter}", result.count)
        self._counters.add(f"loaded_bytes.{result.adapter}", result.nbytes)
        self._counters.add(f"failed_loads.{result.adapter}", len(result.ok) - result.count)
        for n, keys in waiting.items():
            if n == 0:
                self._l1.finish_write(keys, batch.tag)  # late: warm the cache, lock nothing
                continue
            placements = self._l1.finish_write_and_reserve_read(keys, batch.tag, n)
            for key, placement in zip(keys, placements, strict=True):
                if placement.result is not L1Result.SUCCESS:
                    # The staging lease expired, or another layout's copy won.
                    reason = (
                        MissReason.LAYOUT_MISMATCH
                        if placement.result is L1Result.WRONG_LAYOUT
                        else MissReason.LOAD_FAILED
                    )
                    for request in batch.subscribers[key]:
                        request.missed[key] = reason
                    continue
                for request in batch.subscribers[key]:
                    if not request.done:
                        request.locked[key] = placement
                        request.tier[key] = result.adapter
        return touched


__all__ = ["LoadBatch", "Loads"]
