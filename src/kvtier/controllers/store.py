"""``StoreController``: write-back from L1 to the L2 adapters.

After L1 admits objects, ``on_admitted`` queues them for L2 under a store
policy:

=================  ===========================================================
``all``            every admitted object is written to every writable adapter
``hit_count>=N``   an object is written once lookups have hit it N times in L1
``none``           nothing is written (L1 only)
=================  ===========================================================

A worker thread takes queued objects in order, read-locks them in L1 and
fences their memory only while their L2 stores run, and bounds the bytes in
flight. Objects evicted from L1 before their turn are skipped (counted).
``stop()`` drops what is queued, waits for the stores in flight (adapters
always complete their tasks) and releases every lock it took.

Thread safety: callers only put events on ``_events``; every other field is
owned by the worker thread, except the counters (thread-safe).
"""

from __future__ import annotations

import logging
import queue
import re
import threading
from collections import OrderedDict, deque
from collections.abc import Sequence
from dataclasses import dataclass, field

from kvtier.counters import Counters
from kvtier.keys import ObjectKey
from kvtier.l1 import IOFence, L1Manager, L1Result
from kvtier.l2.base import L2Adapter, TaskId, TaskResult

log = logging.getLogger(__name__)

MiB = 1 << 20
_HIT_POLICY = re.compile(r"hit_count>=(\d+)")


@dataclass(frozen=True, slots=True, kw_only=True)
class StoreConfig:
    policy: str = "all"  # "all", "none" or "hit_count>=N"
    max_inflight_bytes: int = 512 * MiB
    batch_objects: int = 64
    max_queued_objects: int = 100_000  # beyond this, new objects are not written (counted)
    hit_table_objects: int = 1_000_000  # candidates remembered by the hit-count policy

    def __post_init__(self) -> None:
        if self.policy not in ("all", "none") and _HIT_POLICY.fullmatch(self.policy) is None:
            raise ValueError(
                f"store policy {self.policy!r} must be 'all', 'none' or 'hit_count>=N'"
            )
        for name in ("max_inflight_bytes", "batch_objects", "max_queued_objects"):
            if getattr(self, name) <= 0:
                raise ValueError(f"store option {name!r} must be positive")

    @property
    def hit_threshold(self) -> int | None:
        match = _HIT_POLICY.fullmatch(self.policy)
        return int(match[1]) if match else None


@dataclass(slots=True)
class _Batch:
    keys: list[ObjectKey]
    fence: IOFence
    nbytes: int
    waiting: int  # adapters that have not answered yet


@dataclass(slots=True)
class _Candidate:
    layout: str
    hits: int = 0


@dataclass(slots=True)
class _Flush:
    done: threading.Event = field(default_factory=threading.Event)


class StoreController:
    """Writes admitted L1 objects to L2; see the module docstring."""

    def __init__(self, config: StoreConfig, l1: L1Manager, adapters: Sequence[L2Adapter]) -> None:
        self.config = config
        self._l1 = l1
        self._adapters = list(adapters)
        self._events: queue.SimpleQueue[object] = queue.SimpleQueue()
        self._queued: deque[tuple[ObjectKey, str]] = deque()  # (key, layout digest)
        self._candidates: OrderedDict[ObjectKey, _Candidate] = OrderedDict()
        self._batches: dict[tuple[str, TaskId], _Batch] = {}
        self._inflight_bytes = 0
        self._flushes: list[_Flush] = []
        self._counters = Counters()
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="kvtier-store", daemon=True)
        self._thread.start()

    # -------------------------------------------------------------- callers

    def on_admitted(self, keys: Sequence[ObjectKey], layout: str = "") -> None:
        """Objects that L1 just admitted (from any thread)."""
        if self._adapters and self.config.policy != "none" and keys:
            self._events.put(("admitted", list(keys), layout))

    def on_hits(self, keys: Sequence[ObjectKey]) -> None:
        """Objects that a lookup found in L1 (feeds the hit-count policy)."""
        if self.config.hit_threshold is not None and keys:
            self._events.put(("hits", list(keys)))

    def on_result(self, result: TaskResult) -> None:
        """An adapter's store completion (the adapter's callback)."""
        self._events.put(result)

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until nothing is queued or in flight; False on timeout."""
        if not self._thread.is_alive():
            return True  # stopped: nothing is queued or in flight
        waiter = _Flush()
        self._events.put(waiter)
        return waiter.done.wait(timeout)

    def stop(self) -> None:
        """Drop queued objects, wait for stores in flight, release every lock."""
        self._events.put("stop")
        self._thread.join()

    def status(self) -> dict[str, object]:
        return {"policy": self.config.policy, **self._counters.snapshot()}

    # --------------------------------------------------------------- worker

    def _run(self) -> None:
        while True:
            event = self._events.get()
            if event == "stop":
                self._stopping = True
                self._counters.add("dropped_at_stop", len(self._queued))
                self._queued.clear()
            elif isinstance(event, TaskResult):
                self._complete(event)
            elif isinstance(event, _Flush):
                self._flushes.append(event)
            elif isinstance(event, tuple) and event[0] == "admitted":
                self._admit(event[1], event[2])
            elif isinstance(event, tuple) and event[0] == "hits":
                self._hit(event[1])
            if not self._stopping:
                self._launch()
            idle = not self._queued and not self._batches
            if idle:
                for waiter in self._flushes:
                    waiter.done.set()
                self._flushes.clear()
                if self._stopping:
                    break
            self._set_gauges()
        while True:  # events that raced with stop(): release flush waiters
            try:
                event = self._events.get_nowait()
            except queue.Empty:
                return
            if isinstance(event, _Flush):
                event.done.set()

    def _admit(self, keys: list[ObjectKey], layout: str) -> None:
        threshold = self.config.hit_threshold
        if threshold is None:
            self._enqueue([(key, layout) for key in keys])
            return
        for key in keys:
            self._candidates[key] = _Candidate(layout)
            self._candidates.move_to_end(key)
        while len(self._candidates) > self.config.hit_table_objects:
            self._candidates.popitem(last=False)

    def _hit(self, keys: list[ObjectKey]) -> None:
        threshold = self.config.hit_threshold
        assert threshold is not None
        ready = []
        for key in keys:
            entry = self._candidates.get(key)
            if entry is None:
                continue
            entry.hits += 1
            if entry.hits >= threshold:
                del self._candidates[key]
                ready.append((key, entry.layout))
        self._enqueue(ready)

    def _enqueue(self, items: list[tuple[ObjectKey, str]]) -> None:
        room = self.config.max_queued_objects - len(self._queued)
        if len(items) > room:
            self._counters.add("dropped_queue_full", len(items) - max(room, 0))
            items = items[: max(room, 0)]
        self._queued.extend(items)

    def _launch(self) -> None:
        """Start batches in queue order while each one fits the in-flight bound
        (one batch may always run, so an oversized one cannot stall the queue)."""
        while self._queued:
            layout = self._queued[0][1]
            keys: list[ObjectKey] = []
            while (
                self._queued
                and self._queued[0][1] == layout
                and len(keys) < self.config.batch_objects
            ):
                keys.append(self._queued.popleft()[0])
            if not self._start_batch(keys, layout):
                self._queued.extendleft((key, layout) for key in reversed(keys))
                return

    def _start_batch(self, keys: list[ObjectKey], layout: str) -> bool:
        """Lock, fence and submit one batch; False (nothing held) if it does not fit."""
        placements = self._l1.reserve_read(keys)
        locked = [k for k, p in zip(keys, placements, strict=True) if p.result is L1Result.SUCCESS]
        views = [self._l1.view(p) for p in placements if p.result is L1Result.SUCCESS]
        nbytes = sum(v.nbytes for v in views)
        if self._batches and self._inflight_bytes + nbytes > self.config.max_inflight_bytes:
            self._l1.finish_read(locked)
            return False
        self._counters.add("skipped_evicted", len(keys) - len(locked))
        if not locked:
            return True
        codes, fence = self._l1.fence(locked)
        assert all(c is L1Result.SUCCESS for c in codes)  # read-locked objects cannot vanish
        batch = _Batch(locked, fence, nbytes, len(self._adapters))
        self._inflight_bytes += nbytes
        for adapter in self._adapters:
            task = adapter.submit_store(locked, views, layout)
            self._batches[(adapter.name, task)] = batch
        return True

    def _complete(self, result: TaskResult) -> None:
        batch = self._batches.pop((result.adapter, result.task), None)
        if batch is None:
            log.error("store: result for unknown task %s/%d", result.adapter, result.task)
            return
        batch.waiting -= 1
        if batch.waiting == 0:
            self._l1.unfence(batch.fence)
            self._l1.finish_read(batch.keys)
            self._inflight_bytes -= batch.nbytes
        # Counted after the locks go, so that once a status shows an object
        # written to every adapter, the store controller holds nothing of it.
        self._counters.add(f"stored_objects.{result.adapter}", result.count)
        self._counters.add(f"failed_objects.{result.adapter}", len(result.ok) - result.count)
        self._counters.add(f"stored_bytes.{result.adapter}", result.nbytes)

    def _set_gauges(self) -> None:
        self._counters.set(
            queued_objects=len(self._queued),
            inflight_bytes=self._inflight_bytes,
            candidates=len(self._candidates),
        )
