"""``PrefetchController``: the lookup path from L2 into L1.

For one request (a prompt's chunks, each one or more objects: ranks x groups)::

    1. lock what L1 has under the request's  (caller's thread; a full L1 hit ends here;
       layouts                                an object L1 holds under another layout
                                              ends the hit before its chunk)
    2. one submit_lookup per adapter          for the objects L1 lacks
    3. plan once over the union               each object from the first adapter
                                              (cascade order, fastest first) that has it;
                                              the prefix ends at the first chunk nobody has
    4. reserve staging in L1, fence it, one submit_load per (adapter, group)
    5. as each load completes: admit + lock   (finish_write_and_reserve_read)
    6. fold to the longest prefix of chunks whose every object is locked;
       release everything outside it          → LookupResult

Steps 4 and 5 are ``Loads`` (``kvtier.controllers.loads``).

- Single flight: an object already being loaded for another request is not
  loaded again; the second request waits for the same load and gets its own
  read lock when it lands (if it is loaded under another layout than the
  second request's, that is a miss for the second).
- Deadline: what has not arrived by ``deadline_s`` is a miss for that
  request. The load itself goes on (its buffer stays fenced until the adapter
  is done); when it lands it is admitted unlocked, warming the cache.
- Leases: every object an adapter's lookup found is unlocked on that adapter
  exactly once — after its load, or when the plan does not use that copy.
- Bounds: at most ``max_inflight_requests`` requests are worked on at once;
  up to ``max_backlog_requests`` more wait in order, without holding L1
  locks (they lock L1 again when they start); beyond that a request gets
  what L1 has at once (counted as ``backlog_full``). Loads start while fewer
  than ``max_inflight_bytes`` are in flight (one batch may always run). An
  object larger than L1 is a miss.
- Loaded objects stay in L1 (``retain_loaded``) or are marked temporary in
  the result, for the caller to drop after reading them.
- A caller that stops waiting ``abandon``s its handle; the locks of a
  result that comes later are released here.
- An exception in the worker's body is logged, counted (``worker_errors``)
  and ends only the request it concerned (a miss); the locks, staging
  copies and fences of that step are released on the way out.

Thread safety: ``submit`` runs step 1 on the caller's thread (L1 has its own
lock) and hands the rest to the worker thread through ``_events``, under
``_submit_lock`` so that nothing arrives after ``stop()``. Every field below
except ``_counters`` (thread-safe) is the worker's.
"""

from __future__ import annotations

import functools
import heapq
import itertools
import logging
import queue
import threading
import time
from collections import Counter, deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from kvtier.controllers.loads import Loads
from kvtier.controllers.lookups import (
    L1_TIER,
    LookupResult,
    MissReason,
    PrefetchHandle,
)
from kvtier.controllers.prefetch_request import PrefetchRequest
from kvtier.counters import Counters
from kvtier.failures import FailureLog
from kvtier.keys import ObjectKey
from kvtier.l1 import L1Manager, L1Result
from kvtier.l2.base import L2Adapter, TaskId, TaskKind, TaskResult
from kvtier.layout import KVLayout
from kvtier.read_or_recompute import LinkEstimate, cheapest_prefix

log = logging.getLogger(__name__)

GiB = 1 << 30


@dataclass(frozen=True, slots=True, kw_only=True)
class PrefetchConfig:
    deadline_s: float = 5.0
    max_inflight_requests: int = 64
    max_backlog_requests: int = 1024
    max_inflight_bytes: int = 1 * GiB
    retain_loaded: bool = True

    def __post_init__(self) -> None:
        for name in (
            "deadline_s",
            "max_inflight_requests",
            "max_backlog_requests",
            "max_inflight_bytes",
        ):
            if not getattr(self, name) > 0:
                raise ValueError(f"prefetch option {name!r} must be positive")


class PrefetchController:
    """Brings a request's missing chunks from L2 into L1; see the module docstring."""

    def __init__(
        self, config: PrefetchConfig, l1: L1Manager, adapters: Sequence[L2Adapter]
    ) -> None:
        self.config = config
        self._l1 = l1
        self._adapters = {adapter.name: adapter for adapter in adapters}  # cascade order
        self._links = {name: LinkEstimate() for name in self._adapters}
        self._lookup_started: dict[tuple[str, TaskId], float] = {}
        self._events: queue.SimpleQueue[object] = queue.SimpleQueue()
        self._active: set[PrefetchRequest] = set()
        self._backlog: deque[PrefetchRequest] = deque()
        self._deadlines: list[tuple[float, int, PrefetchRequest]] = []
        self._seq = itertools.count()
        self._lookups: dict[tuple[str, TaskId], PrefetchRequest] = {}
        self._counters = Counters()
        self._loads = Loads(l1, self._adapters, self._counters)  # steps 4 and 5
        self._budget_wait: deque[tuple[PrefetchRequest, str, int, list[ObjectKey]]] = deque()
        self._draining = False  # _finish is starting backlog requests
        self._stopping = False  # the worker's view
        self._submit_lock = threading.Lock()
        self._closed = False  # under _submit_lock: set by stop(), read by submit()
        self._failures = FailureLog(log, self._counters)
        self._thread = threading.Thread(target=self._run, name="kvtier-prefetch", daemon=True)
        self._thread.start()

    # -------------------------------------------------------------- callers

    def submit(
        self,
        chunks: Sequence[Sequence[ObjectKey]],
        layouts: Mapping[int, KVLayout] | None = None,
        deadline_s: float | None = None,
        recompute_s_per_chunk: float | None = None,
    ) -> PrefetchHandle:
        """Start a lookup. ``layouts`` maps each object group to its layout;
        objects of groups without one can only hit in L1.
        ``recompute_s_per_chunk``: the engine's prefill seconds for one chunk;
        given, chunks are loaded from L2 only as far as that beats
        recomputing them (``kvtier.read_or_recompute``)."""
        frozen = tuple(tuple(chunk) for chunk in chunks)
        flat = [key for chunk in frozen for key in chunk]
        if len(set(flat)) != len(flat):
            raise ValueError("lookup: an object key appears twice in one request")
        handle = PrefetchHandle()
        deadline = time.monotonic() + (deadline_s or self.config.deadline_s)
        request = PrefetchRequest(
            frozen, layouts or {}, deadline, handle, len(frozen), recompute_s_per_chunk
        )
        self._lock_l1(request)
        self._counters.add("lookups")
        if len(request.locked) == len(flat):  # a full L1 hit: the common, hot case
            self._answer(request)
            return handle
        if self._adapters and not request.all_locked():
            with self._submit_lock:
                if not self._closed:
                    self._events.put(request)
                    return handle
            request.ended = MissReason.STOPPED
        self._answer(request)  # the worker never sees this request
        return handle

    def on_result(self, result: TaskResult) -> None:
        """An adapter's lookup or load completion (the adapter's callback)."""
        self._events.put(result)

    def stop(self) -> None:
        """Finish every request as it stands, wait for loads in flight, then stop."""
        with self._submit_lock:
            self._closed = True
            self._events.put("stop")
        self._thread.join()

    def status(self) -> dict[str, object]:
        out: dict[str, object] = dict(self._counters.snapshot())
        for name, link in self._links.items():  # what read-or-recompute goes by
            cost = link.cost()
            if cost is not None:
                out[f"link_latency_s.{name}"] = cost.latency_s
                out[f"link_bytes_per_s.{name}"] = cost.bytes_per_s
        return out

    # --------------------------------------------------------------- worker

    def _run(self) -> None:
        while True:
            timeout = None
            if self._deadlines:
                timeout = max(0.0, self._deadlines[0][0] - time.monotonic())
            try:
                event = self._events.get(timeout=timeout)
            except queue.Empty:
                event = None
            for step in (self._dispatch, self._upkeep):
                try:
                    step(event)
                except Exception:
                    self._failures.record(f"prefetch: the worker, on {_describe(event)},")
            if self._stopping and not self._loads.batches and not self._lookups:
                break
        # Nothing arrives after stop(); answer what came before it as misses.
        while True:
            try:
                event = self._events.get_nowait()
            except queue.Empty:
                return
            if isinstance(event, PrefetchRequest):
                self._answer(event, give_up=True)

    def _dispatch(self, event: object) -> None:
        if event == "stop":
            self._stopping = True
            waiting, self._backlog = list(self._backlog), deque()
            for request in [*waiting, *self._active]:
                self._finish(request, give_up=True)
        elif isinstance(event, PrefetchRequest):
            self._guarded(event, self._admit)
        elif isinstance(event, TaskResult) and event.kind is TaskKind.LOOKUP:
            self._on_lookup(event)
        elif isinstance(event, TaskResult):
            self._on_load(event)

    def _upkeep(self, event: object) -> None:
        self._expire(time.monotonic())
        self._launch_waiting()
        self._set_gauges()

    def _guarded(self, request: PrefetchRequest, step: Callable[[PrefetchRequest], None]) -> None:
        """Run a step of one request; if it fails, that request ends as a miss
        (its locks and leases released) and the exception goes on."""
        try:
            step(request)
        except BaseException:
            self._finish(request, give_up=True)
            raise

    def _admit(self, request: PrefetchRequest) -> None:
        if self._stopping:
            self._finish(request, give_up=True)
        elif len(self._active) < self.config.max_inflight_requests:
            self._start(request)
        elif len(self._backlog) >= self.config.max_backlog_requests:
            self._counters.add("backlog_full")
            request.ended = MissReason.OVERLOADED
            self._answer(request)  # what L1 had: no L2 this time
        else:
            # Waiting must not pin L1: give the locks back, take them again at _start.
            self._l1.finish_read(list(request.locked))
            request.locked.clear()
            request.tier.clear()
            request.parked = True
            self._backlog.append(request)
            heapq.heappush(self._deadlines, (request.deadline, next(self._seq), request))

    def _start(self, request: PrefetchRequest) -> None:
        self._active.add(request)
        if request.parked:
            request.parked = False
            self._lock_l1(request)
            if request.all_locked():
                self._finish(request)
                return
        else:
            heapq.heappush(self._deadlines, (request.deadline, next(self._seq), request))
        missing = [k for c in request.chunks[: request.limit] for k in c if k not in request.locked]
        for name, adapter in self._adapters.items():
            request.waiting_lookups.add(name)
            request.found[name] = set()
            task = adapter.submit_lookup(missing)
            self._lookups[(name, task)] = request
            self._lookup_started[(name, task)] = time.monotonic()

    def _on_lookup(self, result: TaskResult) -> None:
        started = self._lookup_started.pop((result.adapter, result.task), None)
        if started is not None and not result.failure:
            self._links[result.adapter].round_trip(time.monotonic() - started)
        request = self._lookups.pop((result.adapter, result.task), None)
        found = {k for k, ok in zip(result.keys, result.ok, strict=True) if ok}
        if request is None or request.done:
            self._unlock(result.adapter, found)  # nobody will load these
            return
        request.found[result.adapter] = found
        if result.failure:
            request.down.add(result.adapter)
        request.waiting_lookups.discard(result.adapter)
        if not request.waiting_lookups:
            self._guarded(request, self._plan)

    def _plan(self, request: PrefetchRequest) -> None:
        """Pick a source for every object of the loadable prefix (as far as
        loading beats recomputing), then load."""
        planned = request.sources(self._loads.layout_in_flight)
        limit = self._worth_loading(request, planned)
        request.limit = limit
        assigned: dict[tuple[str, int], list[ObjectKey]] = {}
        for sources in planned[:limit]:
            for key, source in sources.items():
                if source is None:
                    self._loads.inflight[key].subscribers[key].append(request)
                    request.pending_loads.add(key)
                else:
                    assigned.setdefault((source, key.group), []).append(key)
        loading = {name: set[ObjectKey]() for name in self._adapters}
        for (name, _group), keys in assigned.items():
            loading[name].update(keys)
        for name, found in request.found.items():
            self._unlock(name, found - loading[name])
        for (name, group), keys in assigned.items():
            self._budget_wait.append((request, name, group, keys))
        self._launch_waiting()
        if not request.pending_loads and not self._budget_waiting(request):
            self._finish(request)

    def _worth_loading(
        self, request: PrefetchRequest, planned: list[dict[ObjectKey, str | None]]
    ) -> int:
        """How many of the planned chunks to load: all of them, unless the
        engine's recompute time says loading some costs more than it saves."""
        per_chunk = request.recompute_s_per_chunk
        if per_chunk is None:
            return len(planned)
        chunk_bytes = request.bytes_by_source(planned)
        costs = {name: link.cost() for name, link in self._links.items()}
        worth = cheapest_prefix(chunk_bytes, costs, per_chunk)
        if worth < len(planned):
            self._counters.add("recompute_cheaper_chunks", len(planned) - worth)
            for tier in {t for nbytes in chunk_bytes[worth:] for t in nbytes}:
                chunks = sum(tier in nbytes for nbytes in chunk_bytes[worth:])
                self._counters.add(f"recompute_cheaper_chunks.{tier}", chunks)
            first = next(k for k, source in planned[worth].items() if source is not None)
            request.missed[first] = MissReason.RECOMPUTE_CHEAPER
        return worth

    def _launch_waiting(self) -> None:
        while self._budget_wait:
            request, name, group, keys = self._budget_wait[0]
            size = request.layouts[group].object_bytes()
            nbytes = size * len(keys)
            loads = self._loads
            if loads.batches and loads.inflight_bytes + nbytes > self.config.max_inflight_bytes:
                return
            self._budget_wait.popleft()
            if request.done:
                self._unlock(name, set(keys))
                continue
            layout = request.layouts[group]
            load = functools.partial(self._loads.start, name=name, layout=layout, keys=keys)
            self._guarded(request, load)
            if not request.pending_loads and not self._budget_waiting(request):
                self._finish(request)

    def _on_load(self, result: TaskResult) -> None:
        batch = self._loads.finish(result)
        if batch is None:
            log.error("prefetch: result for unknown load %s/%d", result.adapter, result.task)
            return
        if all(result.ok):
            self._links[result.adapter].load(time.monotonic() - batch.started, batch.nbytes)
        try:
            touched = self._loads.land(batch, result)
        except BaseException:  # what was still staged is dropped; its requests end as misses
            for requests in batch.subscribers.values():
                for request in requests:
                    self._finish(request, give_up=True)
            raise
        for request in touched:
            if not request.pending_loads and not self._budget_waiting(request):
                self._finish(request)

    def _expire(self, now: float) -> None:
        while self._deadlines and self._deadlines[0][0] <= now:
            _, _, request = heapq.heappop(self._deadlines)
            if not request.done:
                self._counters.add("deadline_misses")
                request.ended = MissReason.DEADLINE
                if request.parked:  # still in the backlog: what L1 has now
                    self._backlog.remove(request)
                    request.parked = False
                    self._lock_l1(request)
                self._finish(request)

    def _finish(self, request: PrefetchRequest, give_up: bool = False) -> None:
        """Answer a request the worker was handling and start the next ones."""
        self._active.discard(request)
        self._answer(request, give_up)
        if self._draining:
            return  # the loop below, further up the stack, goes on
        self._draining = True
        try:
            while (
                not self._stopping
                and self._backlog
                and len(self._active) < self.config.max_inflight_requests
            ):
                self._guarded(self._backlog.popleft(), self._start)
        finally:
            self._draining = False

    def _answer(self, request: PrefetchRequest, give_up: bool = False) -> None:
        """Fold to the longest fully locked prefix, release the rest, set the result."""
        if request.done:
            return
        request.done = True
        if request.waiting_lookups:  # answered before the plan: return what was found
            for name, found in request.found.items():
                if name not in request.waiting_lookups:
                    self._unlock(name, found)
        whole = not give_up and len(request.locked) == request.objects
        if whole:  # every object locked: nothing to fold or release
            hit = len(request.chunks)
            placements = {k: request.locked[k] for c in request.chunks for k in c}  # prompt order
            tiers = Counter(request.tier.values())
        else:
            hit = 0 if give_up else request.hit_chunks()
            kept = [k for chunk in request.chunks[:hit] for k in chunk]  # in prompt order
            kept_set = set(kept)
            extra = [k for k in request.locked if k not in kept_set]
            if extra:
                self._l1.finish_read(extra)
            placements = {k: request.locked[k] for k in kept}
            tiers = Counter(request.tier[k] for k in kept)
        temporary: frozenset[ObjectKey] = frozenset()
        if not self.config.retain_loaded:
            temporary = frozenset(k for k in placements if request.tier[k] != L1_TIER)
        if give_up and hit < len(request.chunks):
            reason: MissReason | None = MissReason.STOPPED if self._stopping else MissReason.ERROR
        else:
            reason = request.miss_reason(hit)
        result = LookupResult(hit, placements, dict(tiers), temporary, reason)
        if not request.handle.deliver(result):
            self._counters.add("abandoned")  # the caller stopped waiting: nobody reads these
            self._l1.finish_read(list(placements))
            return
        self._counters.add("hit_chunks", hit)
        for tier, n in tiers.items():
            self._counters.add(f"hit_objects.{tier}", n)
        if reason is not None:
            self._counters.add(f"miss_reasons.{reason.value}")

    # ------------------------------------------------------------- helpers

    def _lock_l1(self, request: PrefetchRequest) -> None:
        """Step 1: read-lock what L1 has of the request; set how far a hit can reach."""
        wanted = [k for c in request.chunks for k in c if k not in request.locked]
        placements = self._l1.reserve_read(wanted, layouts=request.digests)
        for key, placement in zip(wanted, placements, strict=True):
            if placement.result is L1Result.SUCCESS:
                request.locked[key] = placement
                request.tier[key] = L1_TIER
            elif placement.result is L1Result.WRONG_LAYOUT:
                request.wrong_layout(key)
        if len(request.locked) < request.objects:
            request.limit = request.loadable_prefix()

    def _budget_waiting(self, request: PrefetchRequest) -> bool:
        return any(r is request for r, *_ in self._budget_wait)

    def _unlock(self, name: str, keys: set[ObjectKey]) -> None:
        self._loads.unlock(name, keys)

    def _set_gauges(self) -> None:
        self._counters.set(
            active_requests=len(self._active),
            backlog_requests=len(self._backlog),
            inflight_bytes=self._loads.inflight_bytes,
            inflight_objects=len(self._loads.inflight),
        )


def _describe(event: object) -> str:
    if isinstance(event, TaskResult):
        return f"the {event.kind.value} result of {event.adapter} task {event.task}"
    if isinstance(event, PrefetchRequest):
        return f"a lookup of {len(event.chunks)} chunks"
    return repr(event)
