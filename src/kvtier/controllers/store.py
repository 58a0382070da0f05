"""``StoreController``: write-back from L1 to the L2 adapters.

After L1 admits objects, ``on_admitted`` queues them for L2 under a store
policy:

=================  ===========================================================
``all``            every admitted object is written to every writable adapter
``hit_count>=N``   an object is written once lookups have hit it N times in L1
``none``           nothing is written (L1 only)
=================  ===========================================================

Under ``all`` an object is admitted with a read lock that this controller
owns (``pinned``) until its L2 stores are over: L1 never evicts an object
before it was written back. Pinned bytes are bounded (``pinned_fraction`` of
L1); beyond that objects are queued unpinned and may be evicted before their
turn (skipped, counted). A failed store is not retried: the object becomes
evictable like any other. The queue is bounded too (``max_queued_objects``).

A worker thread takes queued objects in order, read-locks (unpinned ones)
and fences their memory only while their L2 stores run, and bounds the bytes
in flight. A ``gate`` (the server's per-tenant L2 quotas) may keep an object
from an adapter (counted ``over_quota.<adapter>``).

Re-seeding: an adapter whose backend answers again after failing
(``L2Adapter.recoveries``) may have come back empty (a restarted Redis).
The controller then writes what L1 holds to that adapter, newest first, at
most ``reseed_bytes_per_s``, after the regular queue; the adapter skips what
it still has (``skip_present``). Only under ``all``: the other policies never
promised that L2 holds what L1 does.

``stop()`` drops what is queued, waits for the stores in flight (adapters
always complete their tasks) and releases every lock it took or owns. An
exception in the worker's body is logged, counted (``worker_errors``) and
costs only what that step was doing; the locks and fences of that step are
released on the way out.

Thread safety: callers put events on ``_events`` under ``_submit_lock`` (so
nothing arrives after ``stop()``); every other field is owned by the worker
thread, except the counters (thread-safe).
"""

from __future__ import annotations

import logging
import queue
import re
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from kvtier.counters import Counters
from kvtier.failures import FailureLog
from kvtier.keys import ObjectKey
from kvtier.l1 import IOFence, L1Manager, L1Result, Placement
from kvtier.l2.base import L2Adapter, TaskId, TaskResult

log = logging.getLogger(__name__)

MiB = 1 << 20
SUCCESS = L1Result.SUCCESS
StoreGate = Callable[[str, ObjectKey, int], bool]  # (adapter name, key, bytes) -> may it go
_HIT_POLICY = re.compile(r"hit_count>=(\d+)")
TICK_S = 0.5  # how often an idle worker looks for adapters that came back (re-seeding)


@dataclass(frozen=True, slots=True, kw_only=True)
class StoreConfig:
    policy: str = "all"  # "all", "none" or "hit_count>=N"
    max_inflight_bytes: int = 512 * MiB
    # Admitted objects held in L1 until written back, as a share of L1: the
    # rest of L1 stays evictable for new stores while an L2 is slow.
    pinned_fraction: float = 0.5
    batch_objects: int = 64
    max_queued_objects: int = 100_000  # beyond this, new objects are not written (counted)
    hit_table_objects: int = 1_000_000  # candidates remembered by the hit-count policy
    reseed_bytes_per_s: int = 256 * MiB  # 0: never re-seed an adapter that came back

    def __post_init__(self) -> None:
        if self.policy not in ("all", "none") and _HIT_POLICY.fullmatch(self.policy) is None:
            raise ValueError(
                f"store policy {self.policy!r} must be 'all', 'none' or 'hit_count>=N'"
            )
        for name in ("max_inflight_bytes", "batch_objects", "max_queued_objects"):
            if getattr(self, name) <= 0:
                raise ValueError(f"store option {name!r} must be positive")
        if not 0.0 <= self.pinned_fraction <= 1.0:
            raise ValueError(
                f"store option 'pinned_fraction' must be in [0, 1], got {self.pinned_fraction}"
            )
        if self.reseed_bytes_per_s < 0:
            raise ValueError("store option 'reseed_bytes_per_s' must be >= 0")

    @property
    def hit_threshold(self) -> int | None:
        match = _HIT_POLICY.fullmatch(self.policy)
        return int(match[1]) if match else None


@dataclass(frozen=True, slots=True)
class _Queued:
    key: ObjectKey
    layout: str  # digest
    nbytes: int
    pinned: bool  # the controller owns a read lock on it since admission


@dataclass(slots=True)
class _Batch:
    keys: list[ObjectKey]
    fence: IOFence
    nbytes: int
    waiting: int  # adapters that have not answered yet


@dataclass(slots=True)
class _Candidate:
    layout: str
    nbytes: int
    hits: int = 0


@dataclass(slots=True)
class _Flush:
    done: threading.Event = field(default_factory=threading.Event)


class StoreController:
    """Writes admitted L1 objects to L2; see the module docstring."""

    def __init__(
        self,
        config: StoreConfig,
        l1: L1Manager,
        adapters: Sequence[L2Adapter],
        gate: StoreGate | None = None,
    ) -> None:
        """``gate``: whether an object may go to an adapter (adapter name,
        key, bytes), asked on this controller's thread; None lets all go."""
        self.config = config
        self._l1 = l1
        self._adapters = list(adapters)
        self._events: queue.SimpleQueue[object] = queue.SimpleQueue()
        self._submit_lock = threading.Lock()
        self._closed = False  # under _submit_lock
        self._queued: deque[_Queued] = deque()
        self._pinned_bytes = 0  # bytes of pinned objects queued or in flight
        self._max_pinned = int(config.pinned_fraction * l1.capacity)
        self._candidates: OrderedDict[ObjectKey, _Candidate] = OrderedDict()
        self._batches: dict[tuple[str, TaskId], _Batch] = {}
        self._inflight_bytes = 0
        self._flushes: list[_Flush] = []
        self._recoveries = {a.name: a.recoveries for a in self._adapters}
        self._reseeds: dict[str, deque[_Queued]] = {}  # adapter -> L1's objects when it came back
        self._reseed_budget = 0.0
        self._reseed_clock = time.monotonic()
        self._counters = Counters()
        self._failures = FailureLog(log, self._counters)
        self._stopping = False
        self._gate = gate
        self._thread = threading.Thread(target=self._run, name="kvtier-store", daemon=True)
        self._thread.start()

    # -------------------------------------------------------------- callers

    @property
    def pins_admissions(self) -> bool:
        """Whether admitted objects should come with a read lock for this
        controller (``on_admitted(..., pinned=True)``)."""
        return bool(self._adapters) and self.config.policy == "all"

    def on_admitted(
        self, keys: Sequence[ObjectKey], layout: str = "", nbytes: int = 0, pinned: bool = False
    ) -> None:
        """Objects that L1 just admitted (from any thread), each ``nbytes``
        long. ``pinned``: the caller took one read lock per key for this
        controller, which releases it exactly once."""
        if not keys:
            return
        wanted = self._adapters and self.config.policy != "none"
        with self._submit_lock:
            if wanted and not self._closed:
                self._events.put(("admitted", list(keys), layout, nbytes, pinned))
                return
        if pinned:
            self._l1.finish_read(keys)

    def on_hits(self, keys: Sequence[ObjectKey]) -> None:
        """Objects that a lookup found in L1 (feeds the hit-count policy)."""
        if self.config.hit_threshold is not None and keys:
            self._put(("hits", list(keys)))

    def on_result(self, result: TaskResult) -> None:
        """An adapter's store completion (the adapter's callback)."""
        self._events.put(result)  # always: a store in flight must be finished

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until nothing is queued or in flight (re-seeding included);
        False on timeout."""
        waiter = _Flush()
        if not self._put(waiter):
            return True  # stopped: nothing is queued or in flight
        return waiter.done.wait(timeout)

    def stop(self) -> None:
        """Drop queued objects, wait for stores in flight, release every lock."""
        with self._submit_lock:
            self._closed = True
            self._events.put("stop")
        self._thread.join()

    def status(self) -> dict[str, object]:
        return {"policy": self.config.policy, **self._counters.snapshot()}

    def _put(self, event: object) -> bool:
        with self._submit_lock:
            if self._closed:
                return False
            self._events.put(event)
            return True

    # --------------------------------------------------------------- worker

    def _run(self) -> None:
        # An adapter that comes back says so to nobody (its ``recoveries``
        # grows in whatever task found it answering, a load or a lookup
        # included), and a re-seed waits for its rate: an idle worker looks
        # every TICK_S, where there is re-seeding to do, and sleeps otherwise.
        reseeding = self.config.policy == "all" and self.config.reseed_bytes_per_s > 0
        tick = TICK_S if reseeding and self._adapters else None
        while True:
            timeout = tick if not self._stopping else None
            try:
                event = self._events.get(timeout=timeout)
            except queue.Empty:
                event = None
            try:
                self._step(event)
            except Exception:
                self._failures.record(f"store: the worker, on {_describe(event)},")
            if self._stopping and not self._batches:
                break
        self._release_queue()
        while True:  # flush waiters that raced with stop()
            try:
                event = self._events.get_nowait()
            except queue.Empty:
                return
            if isinstance(event, _Flush):
                event.done.set()

    def _step(self, event: object) -> None:
        if event == "stop":
            self._stopping = True
            self._counters.add("dropped_at_stop", len(self._queued))
            self._release_queue()
            self._reseeds.clear()
        elif isinstance(event, TaskResult):
            self._complete(event)
        elif isinstance(event, _Flush):
            self._flushes.append(event)
        elif isinstance(event, tuple) and event[0] == "admitted":
            self._admit(*event[1:])
        elif isinstance(event, tuple) and event[0] == "hits":
            self._hit(event[1])
        if not self._stopping:
            self._check_recoveries()
            self._launch()
        idle = not self._queued and not self._batches and not self._reseeds
        if idle or self._stopping:
            for waiter in self._flushes:
                waiter.done.set()
            self._flushes.clear()
        self._set_gauges()

    def _admit(self, keys: list[ObjectKey], layout: str, nbytes: int, pinned: bool) -> None:
        threshold = self.config.hit_threshold
        if threshold is None:
            items = [_Queued(key, layout, nbytes, pinned) for key in keys]
            if pinned:
                room = max(0, self._max_pinned - self._pinned_bytes)
                keep = min(len(items), room // nbytes if nbytes else len(items))
                if keep < len(items):  # over the bound: queued, but evictable
                    self._counters.add("unpinned_over_bound", len(items) - keep)
                    self._l1.finish_read([item.key for item in items[keep:]])
                    items[keep:] = [_Queued(i.key, layout, nbytes, False) for i in items[keep:]]
            self._enqueue(items)
            return
        for key in keys:
            self._candidates[key] = _Candidate(layout, nbytes)
            self._candidates.move_to_end(key)
        while len(self._candidates) > self.config.hit_table_objects:
            self._candidates.popitem(last=False)
        if pinned:  # pins are for the 'all' policy; never held for candidates
            self._l1.finish_read(keys)

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
                ready.append(_Queued(key, entry.layout, entry.nbytes, False))
        self._enqueue(ready)

    def _enqueue(self, items: list[_Queued]) -> None:
        room = max(0, self.config.max_queued_objects - len(self._queued))
        dropped = items[room:]
        if dropped:
            self._counters.add("dropped_queue_full", len(dropped))
            self._l1.finish_read([item.key for item in dropped if item.pinned])
        kept = items[:room]
        self._pinned_bytes += sum(item.nbytes for item in kept if item.pinned)
        self._queued.extend(kept)

    def _launch(self) -> None:
        """Start batches in queue order while each one fits the in-flight bound
        (one batch may always run, so an oversized one cannot stall the queue);
        re-seed batches once the queue is empty, within their rate."""
        while self._queued:
            items = _take_batch(self._queued, self.config.batch_objects)
            if self._start_batch(items, self._adapters) is None:
                self._queued.extendleft(reversed(items))
                return
        self._launch_reseeds()

    def _start_batch(self, items: list[_Queued], targets: Sequence[L2Adapter]) -> int | None:
        """Lock, fence and submit one batch; the bytes submitted, or None (and
        nothing taken) if it does not fit the in-flight bound. Pinned items
        come locked already; the batch's locks are released at ``_complete``."""
        unpinned = [item.key for item in items if not item.pinned]
        pinned = [item.key for item in items if item.pinned]
        locked: list[ObjectKey] = []
        fence: IOFence | None = None
        try:
            # Under the layout it was admitted with: the key may since have
            # been evicted and written again under another, whose bytes must
            # not go to L2 under this one's header.
            layouts = {key.group: items[0].layout for key in unpinned}
            locks = self._l1.reserve_read(unpinned, layouts=layouts)
            locked = [k for k, p in zip(unpinned, locks, strict=True) if p.result is SUCCESS]
            held = set(locked).union(pinned)
            wanted = [item.key for item in items if item.key in held]
            placements, fence = self._l1.fence(wanted)
            fenced = [
                (k, p) for k, p in zip(wanted, placements, strict=True) if p.result is SUCCESS
            ]
            nbytes = sum(p.size for _, p in fenced)
            if self._batches and self._inflight_bytes + nbytes > self.config.max_inflight_bytes:
                self._l1.unfence(fence)
                self._l1.finish_read(locked)
                return None
        except BaseException:  # give back what this batch took, and the items' pins
            if fence is not None:
                self._l1.unfence(fence)
            self._l1.finish_read(locked + pinned)
            self._pinned_bytes -= sum(item.nbytes for item in items if item.pinned)
            raise
        self._pinned_bytes -= sum(item.nbytes for item in items if item.pinned)
        # Not fenced: evicted before its turn (unpinned), or pinned with a read
        # lease that ran out (a crash net that should never fire here).
        self._counters.add("skipped_evicted", len(items) - len(fenced))
        keys = [k for k, _ in fenced]
        lost = held.difference(keys)
        if lost:
            self._l1.finish_read(list(lost))
        if not keys:
            self._l1.unfence(fence)
            return 0
        views = [self._l1.view(p) for _, p in fenced]
        plans = [(adapter, self._gated(adapter, fenced)) for adapter in targets]
        plans = [(adapter, chosen) for adapter, chosen in plans if chosen]
        if not plans:
            self._l1.unfence(fence)
            self._l1.finish_read(keys)
            return 0
        batch = _Batch(keys, fence, nbytes, len(plans))
        self._inflight_bytes += nbytes
        for adapter, chosen in plans:
            # Adapters answer every task, a refused one included, through
            # _complete: the batch's fence and locks are released there.
            task = adapter.submit_store(
                [keys[i] for i in chosen], [views[i] for i in chosen], items[0].layout
            )
            self._batches[(adapter.name, task)] = batch
        return nbytes

    def _gated(self, adapter: L2Adapter, fenced: list[tuple[ObjectKey, Placement]]) -> list[int]:
        """The batch's objects ``gate`` lets go to ``adapter`` (indices)."""
        if self._gate is None:
            return list(range(len(fenced)))
        chosen = [i for i, (k, p) in enumerate(fenced) if self._gate(adapter.name, k, p.size)]
        self._counters.add(f"over_quota.{adapter.name}", len(fenced) - len(chosen))
        return chosen

    def _complete(self, result: TaskResult) -> None:
        batch = self._batches.pop((result.adapter, result.task), None)
        if batch is None:
            log.error("store: result for unknown task %s/%d", result.adapter, result.task)
            return
        batch.waiting -= 1
        if batch.waiting == 0:
            try:
                self._l1.unfence(batch.fence)
            finally:
                self._l1.finish_read(batch.keys)
                self._inflight_bytes -= batch.nbytes
        # Counted after the locks go, so that once a status shows an object
        # written to every adapter, the store controller holds nothing of it.
        self._counters.add(f"stored_objects.{result.adapter}", result.count)
        self._counters.add(f"failed_objects.{result.adapter}", len(result.ok) - result.count)
        self._counters.add(f"stored_bytes.{result.adapter}", result.nbytes)

    # ------------------------------------------------------------ re-seeding

    def _check_recoveries(self) -> None:
        if self.config.policy != "all" or not self.config.reseed_bytes_per_s:
            return
        for adapter in self._adapters:
            seen = adapter.recoveries
            if seen == self._recoveries[adapter.name]:
                continue
            self._recoveries[adapter.name] = seen
            resident = self._l1.resident_objects()
            items = deque(_Queued(key, layout, 0, False) for key, layout in resident)
            self._reseeds[adapter.name] = items
            self._counters.add(f"reseeds.{adapter.name}")
            log.warning(
                "store: L2 %s answers again; re-seeding it with L1's %d objects",
                adapter.name,
                len(items),
            )

    def _launch_reseeds(self) -> None:
        """Re-seed batches, one adapter after another, while the rate allows."""
        if not self._reseeds:
            return
        now = time.monotonic()
        rate = self.config.reseed_bytes_per_s
        self._reseed_budget = min(rate, self._reseed_budget + (now - self._reseed_clock) * rate)
        self._reseed_clock = now
        for adapter in self._adapters:
            items = self._reseeds.get(adapter.name)
            while items and self._reseed_budget > 0:
                batch = _take_batch(items, self.config.batch_objects)
                sent = self._start_batch(batch, [adapter])
                if sent is None:
                    items.extendleft(reversed(batch))
                    return
                self._reseed_budget -= sent
                self._counters.add(f"reseeded_objects.{adapter.name}", len(batch))
            if items is not None and not items:
                del self._reseeds[adapter.name]

    # ------------------------------------------------------------ internals

    def _release_queue(self) -> None:
        """Give back the pins of everything still queued (at stop)."""
        pinned = [item.key for item in self._queued if item.pinned]
        self._queued.clear()
        self._pinned_bytes = 0
        if pinned:
            self._l1.finish_read(pinned)

    def _set_gauges(self) -> None:
        self._counters.set(
            queued_objects=len(self._queued),
            inflight_bytes=self._inflight_bytes,
            pinned_bytes=self._pinned_bytes,
            candidates=len(self._candidates),
            reseed_objects=sum(len(items) for items in self._reseeds.values()),
        )


def _take_batch(source: deque[_Queued], limit: int) -> list[_Queued]:
    """Up to ``limit`` items from the head of ``source`` that share a layout."""
    layout = source[0].layout
    items: list[_Queued] = []
    while source and source[0].layout == layout and len(items) < limit:
        items.append(source.popleft())
    return items


def _describe(event: object) -> str:
    if isinstance(event, TaskResult):
        return f"the result of {event.adapter} task {event.task}"
    if isinstance(event, tuple):
        return f"a {event[0]} event of {len(event[1])} objects"
    return repr(event)
