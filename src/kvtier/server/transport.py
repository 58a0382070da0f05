"""The server's ZeroMQ loop: a ROUTER socket feeding ``CacheServer``.

One thread owns the socket, the core and its session table. Every message
gets exactly one reply, carrying the request's ``seq``, or is counted as
dropped:

- malformed frames, undecodable or unknown messages (a message nested past
  msgspec's recursion limit included) get an ``Error`` reply;
- a request the core fails on gets an ``internal`` error (a fault, counted
  apart from the client errors), and a reply that cannot be encoded is
  replaced by one;
- a reply to a peer that went away is dropped (``dropped_replies``), and a
  message over ``max_message_bytes`` makes ZeroMQ close that connection
  (counted as ``disconnects``, from the socket's monitor).

The loop sleeps until something happens: a message, a lookup finishing (the
prefetch controller's callback writes to a wake-up pipe), a bulk copy done
on the pool, a new connection to name (the ZAP handler's socket,
``ConnectionIds``), a watched file descriptor (``watch``: the admin port's
listening socket, stdin), a ``call`` from another thread, ``wake()``, the
next tick or the next parked WAIT's deadline. It never polls. The tick
(every ``TICK_S``) is the server's one clock for upkeep: the core's expiries
and ``core.upkeep``'s jobs. ``stop`` is seen at the next wake-up (``wake()``).

A WAIT is parked until its lookup settles or its timeout passes, so it
never blocks other clients; one WAIT per (peer, request) may be parked, at
most ``MAX_PARKED`` in all. Bytes stores past the core's ``offload_bytes``
(and a hand-off's re-sharding) are copied into L1 on ``COPY_THREADS`` pool
threads, never on the loop. An operation the core answers once a lookup
settles (``Awaiting``: a hand-off found in the tiers) is answered when the
lookup's callback wakes the loop, like a parked WAIT.

Other threads change the server's state only through the loop: ``call(fn,
timeout_s)`` queues ``fn``, wakes the loop, and waits for its result (the
admin API's writes). They may read ``snapshot``, the status at most
``TICK_S`` old, built on the loop for a reader (none while nobody reads).

No exception in decode, dispatch, the tick, a parked WAIT, a copy or send
ends the loop: each is logged (once per defect), counted (``loop_errors``)
and the loop goes on. Registration is bound to the connection a HELLO came
on (``ConnectionIds``), not to the routing id, which a peer can choose.
"""

from __future__ import annotations

import contextlib
import heapq
import logging
import math
import os
import queue
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, TypeVar

import msgspec
import zmq

from kvtier.failures import FailureLog
from kvtier.protocol import messages as p
from kvtier.protocol.status import ServerStatus
from kvtier.server.connections import DOMAIN, ConnectionIds, connection_of
from kvtier.server.core import CacheServer
from kvtier.server.requests import Awaiting, Deferred

log = logging.getLogger(__name__)
T = TypeVar("T")

TICK_S = 0.25
MAX_PARKED = 1 << 16
BATCH_MESSAGES = 1024  # messages handled between two looks at the other events
COPY_THREADS = 2
MAX_DEFERRED = 4 * COPY_THREADS  # copies queued for the pool; past it the loop copies itself
SNAPSHOT_WAIT_S = 1.0  # a reader of ``snapshot`` waits this long for the loop to build one


@dataclass(eq=False)
class _ParkedWait:
    peer: bytes
    connection: str
    request: p.Wait
    deadline: float


@dataclass(frozen=True, slots=True)
class _Done:
    """A deferred operation's work finished on the pool."""

    peer: bytes
    seq: int
    deferred: Deferred
    future: Future[Any]


@dataclass(frozen=True, slots=True)
class _Settled:
    """An awaited lookup settled: its operation can answer now."""

    peer: bytes
    seq: int
    awaiting: Awaiting


class LoopStopped(RuntimeError):
    """``call``: the loop has stopped (or stopped before it ran the call)."""


@dataclass(frozen=True, slots=True)
class _Call:
    """Another thread's ``call``: run ``fn`` on the loop, settle ``future``."""

    fn: Callable[[], Any]
    future: Future[Any]

    def run(self) -> None:
        if not self.future.set_running_or_notify_cancel():
            return  # its caller gave up waiting before the loop got to it
        try:
            self.future.set_result(self.fn())
        except BaseException as exc:  # the caller's to handle, not the loop's
            self.future.set_exception(exc)


Event = tuple[bytes, str] | _Done | _Settled | _Call


class ServerTransport:
    """Bind, then ``serve(stop_event)`` until the event is set.

    ``context``: a ZeroMQ context to share (the KV event publisher's sockets,
    so the process runs one pair of libzmq threads); its owner terminates it
    after ``serve`` returns. None: one of the transport's own. Either way it
    must hold no other ZAP handler (one per context)."""

    def __init__(
        self,
        core: CacheServer,
        address: str,
        max_message_bytes: int = 2 << 30,
        context: zmq.Context[zmq.Socket[bytes]] | None = None,
    ) -> None:
        self.core = core
        self.counters = core.transport_counters
        self._failures = FailureLog(log, self.counters, "loop_errors")
        self._own_context = context is None
        self._context: zmq.Context[zmq.Socket[bytes]] = context or zmq.Context()
        self._connections = ConnectionIds(self._context, self.counters)
        self._socket = self._context.socket(zmq.ROUTER)
        self._socket.setsockopt(zmq.LINGER, 0)
        self._socket.setsockopt(zmq.MAXMSGSIZE, max_message_bytes)
        self._socket.setsockopt(zmq.ZAP_DOMAIN, DOMAIN)
        # Refuse (and count) a reply to a peer gone or not reading, never block on it.
        self._socket.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self._socket.bind(address)
        self.address = self._socket.getsockopt_string(zmq.LAST_ENDPOINT)
        self._monitor = self._socket.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        # Other threads' events, each with a byte on the pipe to wake the loop
        # (the loop's own need none: it takes them after every batch).
        self._loop_thread: int | None = None
        self._events: queue.SimpleQueue[Event] = queue.SimpleQueue()
        self._wake_read, self._wake_write = os.pipe()
        os.set_blocking(self._wake_read, False)
        os.set_blocking(self._wake_write, False)
        self._poller = zmq.Poller()
        for source in (self._socket, self._monitor, self._connections.socket, self._wake_read):
            self._poller.register(source, zmq.POLLIN)
        self._watched: dict[int, Callable[[], None]] = {}  # fd -> what to do when readable
        self._pool = ThreadPoolExecutor(COPY_THREADS, thread_name_prefix="kvtier-copy")
        self._deferred = 0  # copies on or queued for the pool (the loop's count)
        self._wake_lock = threading.Lock()  # no byte for a closed (or reused) pipe
        self._closed = False
        self._parked: dict[tuple[bytes, str], _ParkedWait] = {}
        self._deadlines: list[tuple[float, int, tuple[bytes, str]]] = []  # may be stale
        self._seq = 0
        core.on_lookup_done = self._lookup_done
        # (built at, status): what ``snapshot`` serves; replaced on the loop only.
        self._snapshot: tuple[float, ServerStatus] = (time.monotonic(), core.status())

    def serve(self, stop: threading.Event) -> None:
        next_tick = time.monotonic() + TICK_S
        self._loop_thread = threading.get_ident()
        try:
            while not stop.is_set():
                now = time.monotonic()
                wake_at = min(next_tick, self._deadlines[0][0] if self._deadlines else next_tick)
                timeout_ms = max(0, math.ceil((wake_at - now) * 1000))
                try:
                    ready = dict(self._poller.poll(timeout_ms))
                    if self._connections.socket in ready:
                        self._connections.answer_pending()
                    if self._monitor in ready:
                        self._count_disconnects()
                    if self._wake_read in ready:
                        with contextlib.suppress(BlockingIOError):
                            while os.read(self._wake_read, 4096):
                                pass
                    if self._socket in ready:
                        self._receive()
                    self._take_watched(ready)
                    self._take_events()
                except Exception:
                    self._failures.record("server: receiving")
                self._expire_parked()
                if time.monotonic() >= next_tick:
                    self._tick()
                    next_tick = time.monotonic() + TICK_S
        finally:
            self.core.on_lookup_done = None
            with self._wake_lock:
                self._closed = True  # no call is queued from now on
            self._refuse_calls()
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._socket.disable_monitor()
            self._monitor.close(linger=0)
            self._socket.close(linger=0)
            self._connections.close()
            if self._own_context:
                self._context.term()
            with self._wake_lock:
                os.close(self._wake_read)
                os.close(self._wake_write)

    def watch(self, fd: int, on_ready: Callable[[], None]) -> None:
        """Call ``on_ready()`` on the loop whenever ``fd`` is readable (until
        ``unwatch``); it must not block. Before ``serve``, or on the loop."""
        self._watched[fd] = on_ready
        self._poller.register(fd, zmq.POLLIN)

    def unwatch(self, fd: int) -> None:
        """Stop watching ``fd``. Before ``serve``, or on the loop."""
        if self._watched.pop(fd, None) is not None:
            self._poller.unregister(fd)

    # ------------------------------------------------------ other threads

    def call(self, fn: Callable[[], T], timeout_s: float) -> T:
        """Run ``fn`` on the loop's thread, between two requests, and return
        what it returns (or raise what it raises); from the loop's own thread
        it runs at once. ``TimeoutError`` when the loop has not finished it
        within ``timeout_s`` (its message says whether it will still run);
        ``LoopStopped`` when the loop has stopped, or stops before running
        it. Queued before ``serve`` starts, it runs when the loop starts."""
        if not timeout_s > 0:  # NaN too
            raise ValueError(f"call: timeout_s must be > 0 seconds, got {timeout_s}")
        if threading.get_ident() == self._loop_thread:
            return fn()
        future: Future[T] = Future()
        with self._wake_lock:
            if self._closed:
                raise LoopStopped("the server loop has stopped; nothing more runs on it")
            self._events.put(_Call(fn, future))
            with contextlib.suppress(BlockingIOError):  # full: the loop is awake
                os.write(self._wake_write, b"\0")
        with contextlib.suppress(TimeoutError):
            future.exception(timeout_s)  # waits; what ``fn`` raises stays in the future
        if future.cancel():
            raise TimeoutError(
                f"the server loop did not get to this call within {timeout_s} s; it was not run"
            )
        if not future.done():  # started, not finished (finished late: its result counts)
            raise TimeoutError(
                f"the server loop did not finish this call within {timeout_s} s; "
                "it still runs and may take effect"
            )
        return future.result()

    @property
    def snapshot(self) -> ServerStatus:
        """The status, at most ``TICK_S`` old, from any thread (the last one
        built if the loop does not build one within ``SNAPSHOT_WAIT_S``)."""
        try:
            return self._fresh_snapshot() or self.call(self._build_snapshot, SNAPSHOT_WAIT_S)
        except (TimeoutError, LoopStopped):
            return self._snapshot[1]

    def _fresh_snapshot(self) -> ServerStatus | None:
        built_at, status = self._snapshot
        return status if time.monotonic() - built_at < TICK_S else None

    def _build_snapshot(self) -> ServerStatus:
        """On the loop: a new snapshot unless another reader just built one
        (a failed build is counted, and the last one kept for a tick)."""
        if (status := self._fresh_snapshot()) is None:
            status = self._snapshot[1]
            try:
                status = self.core.status()
            except Exception:
                self._failures.record("server: the status snapshot")
            self._snapshot = (time.monotonic(), status)
        return status

    def wake(self) -> None:
        """Make the loop look around now (at ``stop``, for one), from any thread."""
        with self._wake_lock, contextlib.suppress(BlockingIOError):  # full: the loop is awake
            if not self._closed:
                os.write(self._wake_write, b"\0")

    def _lookup_done(self, peer: bytes, request_id: str) -> None:
        """The prefetch controller's callback: a lookup settled."""
        self._post((peer, request_id))

    def _post(self, event: Event) -> None:
        self._events.put(event)
        if threading.get_ident() == self._loop_thread:
            return  # a lookup that settled while the loop handled it
        self.wake()

    # ------------------------------------------------------------- events

    def _take_events(self) -> None:
        while not self._events.empty():  # the loop is the only consumer
            event = self._events.get_nowait()
            try:
                if isinstance(event, _Call):
                    event.run()
                elif isinstance(event, _Done):
                    self._finish(event)
                elif isinstance(event, _Settled):
                    self._answer_settled(event)
                else:
                    self._settled(event)
            except Exception:
                self._failures.record("server: a finished lookup or copy")

    def _take_watched(self, ready: dict[Any, int]) -> None:
        for fd, on_ready in list(self._watched.items()):
            if fd in ready:
                try:
                    on_ready()
                except Exception:
                    self._failures.record(f"server: a watched descriptor ({fd})")

    def _refuse_calls(self) -> None:
        """The loop stopped: every call still queued fails (other events are dropped)."""
        while not self._events.empty():
            event = self._events.get_nowait()
            if isinstance(event, _Call) and event.future.set_running_or_notify_cancel():
                event.future.set_exception(
                    LoopStopped("the server loop stopped before it ran this call")
                )

    def _settled(self, slot: tuple[bytes, str], expired: bool = False) -> None:
        """Answer the WAIT parked for ``slot``: its lookup settled (an event for
        an older lookup of the same id is ignored), or its time is up."""
        wait = self._parked.get(slot)
        if wait is None or not (
            expired or self.core.lookup_settled(wait.peer, wait.request.request_id, wait.connection)
        ):
            return
        del self._parked[slot]
        self._answer(wait.peer, wait.connection, wait.request, [])

    def _finish(self, done: _Done) -> None:
        self._deferred -= 1
        try:
            reply, out = done.deferred.finish(done.future.result())
        except Exception:
            self._failures.record("server: a bulk copy")
            reply, out = self.core.fault("copy"), []
        self._send(done.peer, reply, out, done.seq)

    def _answer_settled(self, settled: _Settled) -> None:
        try:
            reply, out = settled.awaiting.finish()
        except Exception:
            self._failures.record("server: an awaited lookup")
            reply, out = self.core.fault("awaited"), []
        self._send(settled.peer, reply, out, settled.seq)

    def _count_disconnects(self) -> None:
        while self._monitor.poll(0):
            self._monitor.recv_multipart()  # one event: a connection closed
            self.counters.add("disconnects")

    def _tick(self) -> None:
        try:
            self.core.tick()
        except Exception:
            self._failures.record("server: the tick")
        try:  # each job's failure is counted apart
            self.core.upkeep.run_due()
        except Exception:
            self._failures.record("server: upkeep")

    # ------------------------------------------------------------ requests

    def _receive(self) -> None:
        for _ in range(BATCH_MESSAGES):
            if not int(self._socket.getsockopt(zmq.EVENTS)) & zmq.POLLIN:
                return
            frames = self._socket.recv_multipart(copy=False)
            try:
                self._handle(frames)
            except Exception:
                self._failures.record("server: a request")

    def _handle(self, frames: list[zmq.Frame]) -> None:
        peer = frames[0].bytes
        if len(frames) < 2:
            self._send(peer, self.core.error("bad_request", "a request needs a body frame"), [])
            return
        connection = connection_of(frames[1])
        try:
            request = p.decode_request(frames[1].buffer)
        except msgspec.ValidationError as exc:
            code = "unknown_op" if "$.op" in str(exc) else "bad_request"
            self._send(peer, self.core.error(code, f"invalid message: {exc}"), [])
            return
        except (msgspec.DecodeError, RecursionError, MemoryError, ValueError) as exc:
            # RecursionError: a message nested past msgspec's limit.
            self._send(peer, self.core.error("bad_request", f"undecodable message: {exc}"), [])
            return
        if isinstance(request, p.Wait) and self._park(peer, connection, request):
            return
        data = [f.buffer for f in frames[2:]]
        self._answer(peer, connection, request, data)

    def _park(self, peer: bytes, connection: str, wait: p.Wait) -> bool:
        """Park a WAIT whose lookup is still pending; False: answer it now."""
        timeout = wait.timeout_s
        if not math.isfinite(timeout):
            timeout = self.core.limits.max_wait_s if timeout > 0 else 0.0
        timeout = min(max(timeout, 0.0), self.core.limits.max_wait_s)
        if timeout == 0 or self.core.lookup_settled(peer, wait.request_id, connection):
            return False
        slot = (peer, wait.request_id)
        if slot in self._parked or len(self._parked) >= MAX_PARKED:
            message = (
                "a WAIT for this request is already pending"
                if slot in self._parked
                else f"{MAX_PARKED} WAITs are pending, the server's limit; poll with QUERY"
            )
            self._send(peer, self.core.error("busy", message), [], wait.seq)
            return True
        deadline = time.monotonic() + timeout
        self._parked[slot] = _ParkedWait(peer, connection, wait, deadline)
        self._seq += 1
        heapq.heappush(self._deadlines, (deadline, self._seq, slot))
        return True  # a lookup settling from now on queues an event the loop takes

    def _expire_parked(self) -> None:
        now = time.monotonic()
        while self._deadlines and self._deadlines[0][0] <= now:
            deadline, _, slot = heapq.heappop(self._deadlines)
            wait = self._parked.get(slot)
            if wait is not None and wait.deadline == deadline:
                try:
                    self._settled(slot, expired=True)
                except Exception:
                    self._parked.pop(slot, None)
                    self._failures.record("server: a parked WAIT")

    def _answer(
        self, peer: bytes, connection: str, request: p.Request, data: Sequence[memoryview]
    ) -> None:
        try:
            outcome = self.core.handle(peer, request, data, connection)
        except Exception:  # a fault, not a client's error: answer, log, keep serving
            self._failures.record(f"server: {type(request).__name__}")
            outcome = self.core.fault(type(request).__name__), []
        if isinstance(outcome, Deferred) and self._deferred >= MAX_DEFERRED:
            try:  # the pool is behind: copy here, so the socket pushes back on senders
                outcome = outcome.finish(outcome.work())
            except Exception:
                self._failures.record("server: a bulk copy")
                outcome = self.core.fault("copy"), []
        if isinstance(outcome, Awaiting):
            settled = _Settled(peer, request.seq, outcome)
            outcome.lookup.add_done_callback(lambda: self._post(settled))
            return
        if isinstance(outcome, Deferred):
            self._deferred += 1
            future = self._pool.submit(outcome.work)
            done = _Done(peer, request.seq, outcome, future)
            future.add_done_callback(lambda _: self._post(done))
            return
        reply, out = outcome
        self._send(peer, reply, out, request.seq)

    def _send(self, peer: bytes, reply: p.Message, data: Sequence[object], seq: int = 0) -> None:
        reply.seq = seq
        try:
            body = p.encode(reply)
        except Exception:  # e.g. an integer past 64 bits: never leave the peer waiting
            self._failures.record(f"server: encoding a {type(reply).__name__} reply")
            fallback = self.core.fault("encode")
            fallback.seq = seq
            body, data = p.encode(fallback), []
        try:
            self._socket.send_multipart(
                [peer, body, *data],  # type: ignore[list-item]
                flags=zmq.NOBLOCK,
                copy=False,
            )
        except zmq.ZMQError as exc:  # the peer went away, or is not reading
            self.counters.add("dropped_replies")
            log.debug("server: reply to a vanished peer dropped: %s", exc)
