"""``BlockingAdapter``: the L2 adapter contract (``kvtier.l2.base``) kept over
three blocking batch methods, run on thread pools.

An adapter type writes ``_store``, ``_lookup`` and ``_load`` against its
backend's blocking client; this class does the rest of the contract: split
batches into parts that run in parallel, deliver each task's result once,
turn every failure into a counted miss, back off and reconnect after a
connection failure, skip re-writing what the backend still holds, and apply
the payload codec.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from abc import abstractmethod
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import ClassVar

from kvtier.counters import Counters
from kvtier.keys import ObjectKey
from kvtier.l2.base import (
    AdapterConfig,
    Buffer,
    CompletionCallback,
    L2Adapter,
    TaskId,
    TaskKind,
    TaskResult,
)
from kvtier.l2.format import CorruptObject
from kvtier.l2.payload_codec import PayloadCodec
from kvtier.l2.seal import Sealer
from kvtier.layout import KVLayout

log = logging.getLogger(__name__)

DECODE_PIPELINE = 4  # parts per I/O thread of a coded load
UNNUMBERED = TaskId(0)  # a task's id until submit numbers it


@dataclass(eq=False)
class _Task:
    """One submitted task while its parts run (fields under the adapter's lock)."""

    kind: TaskKind
    keys: tuple[ObjectKey, ...]
    buffers: Sequence[Buffer]
    layout: str
    id: TaskId = UNNUMBERED
    ok: list[bool] = field(default_factory=list)
    nbytes: int = 0
    remaining: int = 0
    failure: str = ""
    corrupt: dict[ObjectKey, str] = field(default_factory=dict)
    started: float = 0.0  # perf_counter at submit
    decoded: int = 0  # of nbytes, what came coded (loads)


class BackendUnavailable(Exception):
    """Raised by a backend method when it cannot reach its server (starts back-off)."""


class _Reconnecting(Exception):
    """Another thread is reconnecting the backend: this part is a miss."""


class BlockingAdapter(L2Adapter):
    """Runs blocking batch I/O on thread pools and turns failures into misses.

    Subclasses implement ``_store``, ``_lookup`` and ``_load`` (and may
    override ``_unlock``, ``_reconnect``, ``_close_backend``). They may raise:
    ``BackendUnavailable``, ``TimeoutError`` or ``ConnectionError`` for the
    whole batch (a miss for every key, and back-off), any other exception
    (a miss for every key, reason "error"), or return per-key results and
    call ``_count_failure`` for the keys that failed. ``_load`` checks each
    copy with ``kvtier.l2.format`` and calls ``_corrupt`` for bad ones.

    Stores run on their own pool, so write-back never queues ahead of
    lookups and loads. A store or load batch is split into up to
    ``io_threads`` parts that run in parallel (``max_parts``); the task's
    result is delivered once, by the part that finishes last. Adapters whose
    lookup is an in-memory check set ``inline_lookup`` and answer at once.

    Thread safety: ``_lock`` guards counters and the back-off and reconnect
    state. ``clock`` (monotonic seconds) times the back-off; tests replace it.
    """

    inline_lookup: ClassVar[bool] = False
    # Whether payloads may be stored with a codec (adapters that move payloads
    # straight between L1 and the backend, without a copy, say False).
    takes_codecs: ClassVar[bool] = True

    def __init__(self, config: AdapterConfig, on_complete: CompletionCallback) -> None:
        if config.codec != "none" and not self.takes_codecs:
            raise ValueError(
                f"option 'codec': {self.type_name} adapters store payloads as they are "
                "(codec 'none'); codecs are for the redis, valkey, s3 and mock adapters"
            )
        self.config = config
        self.name = config.name or self.type_name
        self.writable = config.write
        self.shared = self.shared_by_default if config.shared is None else config.shared
        self.codec = PayloadCodec(config.codec, {}, where=self.name)
        self.seal: Sealer | None = None
        self.clock: Callable[[], float] = time.monotonic
        self._on_complete = on_complete
        self._tasks = itertools.count(1)
        self._lock = threading.Lock()
        threads = config.io_threads
        self._read_pool = ThreadPoolExecutor(threads, thread_name_prefix=f"l2-{self.name}-r")
        self._write_pool = ThreadPoolExecutor(threads, thread_name_prefix=f"l2-{self.name}-w")
        self._closed = False
        self._down = False  # the last backend call failed as unreachable or timed out
        self._down_until = 0.0
        self._backoff = config.backoff_initial_s
        self._needs_reconnect = False
        self._reconnecting = False
        self._recoveries = 0
        self._stored: OrderedDict[ObjectKey, None] = OrderedDict()  # stored lately, oldest first
        self._failures = Counters()  # misses by reason
        self._counters = Counters()
        self._part = threading.local()  # the running part's refused copies (_corrupt)

    # ------------------------------------------------------------ contract

    def share_layouts(self, layouts: Mapping[str, KVLayout]) -> None:
        self.codec.layouts = layouts

    def seal_with(self, seal: Sealer | None) -> None:
        self.seal = seal

    def submit_store(
        self, keys: Sequence[ObjectKey], buffers: Sequence[Buffer], layout: str = ""
    ) -> TaskId:
        self._check_batch(keys, buffers)
        return self._submit(_Task(TaskKind.STORE, tuple(keys), buffers, layout))

    def submit_lookup(self, keys: Sequence[ObjectKey]) -> TaskId:
        return self._submit(_Task(TaskKind.LOOKUP, tuple(keys), (), ""))

    def submit_load(
        self, keys: Sequence[ObjectKey], buffers: Sequence[Buffer], layout: str = ""
    ) -> TaskId:
        self._check_batch(keys, buffers)
        return self._submit(_Task(TaskKind.LOAD, tuple(keys), buffers, layout))

    @property
    def recoveries(self) -> int:
        with self._lock:
            return self._recoveries

    def unlock(self, keys: Sequence[ObjectKey]) -> None:
        try:
            self._unlock(keys)
        except Exception:
            log.exception("L2 %s: unlock failed; leases expire on their own", self.name)

    def close(self) -> None:
        """Refuse new tasks, wait for in-flight ones, then release the backend."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._read_pool.shutdown(wait=True)
        self._write_pool.shutdown(wait=True)
        try:
            self._close_backend()
        except Exception:
            log.exception("L2 %s: closing the backend failed", self.name)

    def status(self) -> dict[str, object]:
        with self._lock:
            return {
                "type": self.type_name,
                "name": self.name,
                "codec": self.codec.writer.name,
                "sealed_with": self.seal.key_id.hex() if self.seal else "",
                "healthy": self.clock() >= self._down_until,
                "closed": self._closed,
                "recoveries": self._recoveries,
                "failures": self._failures.snapshot(),
                **self._counters.snapshot(),
                **self.codec.status(),
                **self._backend_status(),
            }

    # ---------------------------------------------------- for subclasses

    @abstractmethod
    def _store(
        self, keys: Sequence[ObjectKey], buffers: Sequence[Buffer], layout: str
    ) -> list[int | None]:
        """Store each buffer; per key the bytes written, or None if it failed."""

    @abstractmethod
    def _lookup(self, keys: Sequence[ObjectKey]) -> list[bool]:
        """Per key whether a copy exists (it may still fail to load)."""

    @abstractmethod
    def _load(
        self, keys: Sequence[ObjectKey], buffers: Sequence[Buffer], layout: str
    ) -> list[bool]:
        """Read each payload into its buffer; per key whether it is there and valid."""

    def _unlock(self, keys: Sequence[ObjectKey]) -> None:
        return None

    def _refresh(self, keys: Sequence[ObjectKey]) -> None:
        """Keys a store found present already: renew whatever ages them out
        (a TTL), as rewriting them would have."""
        return None

    def _reconnect(self) -> None:
        """Re-establish the backend connection after a failure (may raise)."""

    def _close_backend(self) -> None:
        return None

    def _backend_status(self) -> dict[str, object]:
        return {}

    def _count_failure(self, reason: str, n: int = 1) -> None:
        self._failures.add(reason, n)

    def _corrupt(self, key: ObjectKey, error: CorruptObject) -> None:
        """Count a refused copy; the subclass deletes or quarantines it."""
        log.warning("L2 %s: corrupt copy of %s (%s); treated as a miss", self.name, key, error)
        self._counters.add("corrupt_objects")
        self._failures.add(f"corrupt_{error.reason.value}")
        self._part.corrupt[key] = error.reason.value

    # ------------------------------------------------------------ internals

    @staticmethod
    def _check_batch(keys: Sequence[ObjectKey], buffers: Sequence[Buffer]) -> None:
        if len(keys) != len(buffers):
            raise ValueError("keys and buffers must have the same length")

    def max_parts(self, kind: TaskKind, n: int) -> int:
        """How many parts a batch of ``n`` keys is split into (``io_threads``
        run at once). A load of coded payloads is cut finer, so that each
        part's decode overlaps the next part's transfer."""
        if kind is TaskKind.LOOKUP:
            return 1
        parts = min(self.config.io_threads, n)
        if kind is TaskKind.LOAD and self.codec.writer.ident:
            parts = min(n, parts * DECODE_PIPELINE)
        return max(1, parts)

    def _submit(self, task: _Task) -> TaskId:
        task.id = TaskId(next(self._tasks))
        task.started = time.perf_counter()
        n = len(task.keys)
        task.ok = [False] * n
        inline = task.kind is TaskKind.LOOKUP and self.inline_lookup
        parts = 1 if inline else self.max_parts(task.kind, n)
        task.remaining = parts
        with self._lock:  # close() sets _closed under it, so the pools are still up here
            refused = "closed" if self._closed else None
            if refused is None and self.clock() < self._down_until:
                refused = "backoff"
            if refused is None and not inline:
                pool = self._write_pool if task.kind is TaskKind.STORE else self._read_pool
                bounds = [n * i // parts for i in range(parts + 1)]
                for lo, hi in itertools.pairwise(bounds):
                    pool.submit(self._run_part, task, lo, hi)
        if refused is not None:
            self._count_failure(refused, n)
            no = (False,) * n
            self._deliver(TaskResult(self.name, task.id, task.kind, task.keys, no, failure=refused))
        elif inline:
            self._run_part(task, 0, n)
        return task.id

    def _run_part(self, task: _Task, lo: int, hi: int) -> None:
        keys = task.keys[lo:hi]
        buffers = task.buffers[lo:hi]
        ok: Sequence[bool]
        nbytes = decoded = 0
        failure = ""
        self._part.corrupt = {}  # filled by _corrupt, on this thread
        try:
            self._connected()
            if task.kind is TaskKind.STORE:
                ok, nbytes = self._store_missing(keys, buffers, task.layout)
            elif task.kind is TaskKind.LOAD:
                started = time.perf_counter()
                self.codec.start_part()
                ok = self._load(keys, buffers, task.layout)
                nbytes = sum(b.nbytes for b, hit in zip(buffers, ok, strict=True) if hit)
                decoded = self.codec.end_part(time.perf_counter() - started, nbytes)
            else:
                ok = self._lookup(keys)
            self._backend_ok()
        except _Reconnecting:
            failure = "reconnecting"
        except (BackendUnavailable, TimeoutError, ConnectionError) as exc:
            failure = "timeout" if isinstance(exc, TimeoutError) else "unreachable"
            self._backend_down(failure, exc)
        except Exception:
            log.exception("L2 %s: %s of %d keys failed", self.name, task.kind.value, len(keys))
            failure = "error"
        if failure:
            self._count_failure(failure, len(keys))
            ok = [False] * len(keys)
        with self._lock:
            task.ok[lo:hi] = ok
            task.nbytes += nbytes
            task.decoded += decoded
            task.failure = failure or task.failure
            task.corrupt.update(self._part.corrupt)
            task.remaining -= 1
            if task.remaining:
                return
            kind = task.kind.value
            self._counters.add(f"{kind}_keys", len(task.keys))
            self._counters.add(f"{kind}_ok", sum(task.ok))
            self._counters.add(f"{kind}_bytes", task.nbytes)
        if task.kind is TaskKind.LOAD and not task.failure and all(task.ok):
            self.codec.load_done(time.perf_counter() - task.started, task.nbytes, task.decoded)
        result = TaskResult(
            self.name,
            task.id,
            task.kind,
            task.keys,
            tuple(task.ok),
            task.nbytes,
            task.failure,
            task.corrupt,
        )
        self._deliver(result)

    def _store_missing(
        self, keys: Sequence[ObjectKey], buffers: Sequence[Buffer], layout: str
    ) -> tuple[list[bool], int]:
        """Store what the backend lacks; per key whether it holds it now, and
        the bytes written. Only keys stored before are asked about: a new
        object costs no lookup, a re-admitted one a lookup instead of a write."""
        present = [False] * len(keys)
        if self.config.skip_present:
            with self._lock:
                known = [i for i, key in enumerate(keys) if key in self._stored]
            if known:
                found = self._lookup([keys[i] for i in known])
                for i, hit in zip(known, found, strict=True):
                    present[i] = hit
        kept = [k for k, hit in zip(keys, present, strict=True) if hit]
        if kept:
            self._unlock(kept)  # the lookup's leases: nothing will be read
            self._refresh(kept)
        todo = [i for i, hit in enumerate(present) if not hit]
        written = self._store([keys[i] for i in todo], [buffers[i] for i in todo], layout)
        ok = list(present)
        for i, w in zip(todo, written, strict=True):
            ok[i] = w is not None
        with self._lock:
            self._counters.add("store_present", len(kept))
            for key, stored in zip(keys, ok, strict=True):
                if stored:
                    self._stored[key] = None
                    self._stored.move_to_end(key)
            while len(self._stored) > self.config.remembered_keys:
                self._stored.popitem(last=False)
        return ok, sum(w or 0 for w in written)

    def _connected(self) -> None:
        """Reconnect first if a failure asked for it; only one thread does."""
        with self._lock:
            if not self._needs_reconnect:
                return
            if self._reconnecting:
                raise _Reconnecting
            self._reconnecting = True
        try:
            self._reconnect()
        finally:
            with self._lock:
                self._reconnecting = False
        with self._lock:
            self._needs_reconnect = False

    def _deliver(self, result: TaskResult) -> None:
        """Hand a result over. The callbacks of kvtier's controllers only queue
        it; one that raises anyway loses this result (its caller's fences and
        locks wait for their leases), so it is logged and counted."""
        try:
            self._on_complete(result)
        except Exception:
            log.exception("L2 %s: completion callback failed for task %d", self.name, result.task)
            self._counters.add("callback_failures")

    def _backend_ok(self) -> None:
        with self._lock:
            self._backoff = self.config.backoff_initial_s
            if self._down:
                self._down = False
                self._recoveries += 1
                log.warning("L2 %s: backend answers again", self.name)

    def _backend_down(self, reason: str, exc: BaseException) -> None:
        with self._lock:
            self._down = True
            self._down_until = self.clock() + self._backoff
            log.warning(
                "L2 %s: backend %s (%s); misses for %.1f s", self.name, reason, exc, self._backoff
            )
            self._backoff = min(2 * self._backoff, self.config.backoff_max_s)
            self._needs_reconnect = True
