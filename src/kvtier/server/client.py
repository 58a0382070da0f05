"""``CacheClient``: an engine's connection to the node's cache server.

Requests and replies are matched by ``seq``, so any number of calls can be on
the wire at once. Whoever holds the socket (``_io``) sends what callers have
queued and hands each reply to its caller. A caller that finds the socket
free takes it and does its own I/O, as a plain request/reply client would (no
thread hop on the way out or back); a caller that finds it taken never waits
for it: it queues its request, wakes the holder and waits on its own reply,
so a slow call (a long WAIT, a large store) holds up nobody else's. A caller
holds the socket only until its own reply is in, then hands whatever is still
in flight to the client's I/O thread, which also sends the heartbeat (PING:
keeps the registration alive, spots a restarted server by its boot id) and
reconnects.

Never raises into the engine's request path for anything the server or the
network does. A request not answered within its timeout makes the client
degraded: every call then answers at once (lookups miss, stores are
skipped) while the I/O thread tries HELLO again after ``retry_s``, doubling
up to ``max_retry_s`` (1 s by default: a server that comes back is in use
again within about a second). A restart is seen through the boot id or a
``no_hello`` reply; the client registers again and sends the refused request
once more. Local clients copy KV through the shared-memory arena (one copy
each way); others, or ``shm=False``, send bytes in frames.

Thread safety: any thread may call any method. The holder of ``_io`` owns
the socket, the table of requests in flight and the registration state;
other threads reach it through ``_submissions`` and a wake-up pipe.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import math
import os
import queue
import select
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np
import numpy.typing as npt
import zmq

from kvtier.counters import Counters
from kvtier.failures import FailureLog
from kvtier.l1 import SharedRegion
from kvtier.server import protocol as p

log = logging.getLogger(__name__)

ObjectBytes = npt.NDArray[np.uint8]
Consume = Callable[[int, ObjectBytes], None]  # read object i (a view valid during the call)
Fill = Callable[[int, ObjectBytes], None]  # write object i into the given bytes
PIPELINE_BYTES = 32 << 20  # bytes-path stores are sent in messages of about this size
GRACE_S = 1.0  # a caller waits this much past a request's timeout (the I/O thread ends it)


@dataclass(frozen=True, slots=True, kw_only=True)
class ClientConfig:
    address: str  # e.g. "tcp://127.0.0.1:5555"
    model: str
    layouts: tuple[p.LayoutSpec, ...]
    num_ranks: int = 1
    rank: int = -1  # -1: this client stores and loads every rank's objects; r: rank r's only
    block_alignment: int = 1
    revision: str = ""
    lora: str = ""
    salt: str = ""
    hash_model: str = ""  # Namespace.model of the client's hashes, when model is its label
    auth_token: str = ""
    shm: bool = True
    shm_dir: str = "/dev/shm"
    client_id: str = "engine"
    request_timeout_s: float = 2.0
    retry_s: float = 0.25
    max_retry_s: float = 1.0
    heartbeat_s: float = 10.0  # ping this often (keeps the client alive, spots restarts); 0: off
    max_polls: int = 1000  # a lookup still pending after this many polls is a miss


@dataclass(eq=False)
class _Call:
    """One request in flight, owned by the socket's holder until ``done`` is set."""

    message: p.Message
    frames: Sequence[object]
    timeout_s: float
    on_reply: Callable[[_Call], None] | None = None  # the I/O thread's own requests
    done: threading.Event = field(default_factory=threading.Event)
    reply: p.Reply | None = None  # None: no usable answer (timed out, degraded)
    data: list[zmq.Frame] = field(default_factory=list)
    region: SharedRegion | None = None  # the arena of the registration it went under
    deadline: float = 0.0
    retried: bool = False
    lead: Callable[[_Call, float], None] | None = None  # do the I/O for it, if the socket is free

    @property
    def ready(self) -> bool:
        """Answered, or given up on (``reply`` None): reading it never blocks."""
        return self.done.is_set()

    def wait(self, timeout_s: float | None = None) -> p.Reply | None:
        """The reply; None if there is none within ``timeout_s`` (default: the
        request's own timeout, which the socket's holder enforces)."""
        limit = self.timeout_s + GRACE_S if timeout_s is None else timeout_s
        end = time.monotonic() + limit
        if self.lead is not None and not self.done.is_set():
            self.lead(self, limit)
        self.done.wait(max(0.0, end - time.monotonic()))
        return self.reply if self.done.is_set() else None


PendingReply = _Call  # a request sent without waiting, answered once ``ready``


@dataclass(slots=True)
class LookupState:
    """One request's lookup: submitted -> acked -> pending -> done(n).
    ``hit_chunks`` is None until done; 0 is a miss. Once done it never
    changes, so polling again never counts a hit twice. ``miss_reason`` says
    why the hit ends where it does: the server's ``MissReason`` value, or
    ``refused`` (the server answered with an error), ``no_server`` (no
    answer) or ``over_budget`` (still pending when the caller stopped asking);
    "" for a full hit or while pending."""

    request_id: str
    acked: bool = False
    hit_chunks: int | None = None
    polls: int = 0
    chunks_by_tier: dict[str, int] = field(default_factory=dict)
    miss_reason: str = ""
    _ack: _Call | None = None
    _answer: _Call | None = None  # the WAIT or QUERY whose reply is awaited

    def settle(self, reply: p.Reply | None) -> None:
        """Take a QUERY/WAIT answer; anything but a result is a miss."""
        if isinstance(reply, p.QueryResult):
            self.hit_chunks, self.chunks_by_tier = reply.hit_chunks, reply.chunks_by_tier
            self.miss_reason = reply.miss_reason
        else:  # an error or no server: a miss, never wait forever
            self.give_up("refused" if isinstance(reply, p.Error) else "no_server")

    def give_up(self, reason: str) -> None:
        """End the lookup as a miss, for ``reason``."""
        self.hit_chunks, self.miss_reason = 0, reason

    @property
    def done(self) -> bool:
        return self.hit_chunks is not None


@dataclass(slots=True)
class ClientStats:
    degraded_requests: int = 0
    reconnects: int = 0
    server_restarts: int = 0
    peak_in_flight: int = 0  # most requests on the wire at once (concurrent callers)
    errors: dict[str, int] = field(default_factory=dict)


class CacheClient:
    """Talks to one cache server; see the module docstring."""

    def __init__(self, config: ClientConfig, connect_wait_s: float | None = None) -> None:
        """Start the I/O thread and wait up to ``connect_wait_s`` (default: the
        request timeout) for the first HELLO; until it is answered the client
        is degraded."""
        self.config = config
        self.stats = ClientStats()
        self.chunk_size: int | None = None  # None while unregistered (degraded)
        self.boot_id: str | None = None
        self._context: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
        self._socket: zmq.Socket[bytes] | None = None
        self._poller = zmq.Poller()  # the socket's holder's
        self._io = threading.Lock()  # held by whoever does the socket's I/O; never waited on
        self._region: SharedRegion | None = None
        self._submissions: queue.SimpleQueue[_Call] = queue.SimpleQueue()
        self._wake_read, self._wake_write = os.pipe()
        self._wake_lock = threading.Lock()
        self._closed = False
        os.set_blocking(self._wake_read, False)
        os.set_blocking(self._wake_write, False)
        self._seq = itertools.count(1)
        self._in_flight: dict[int, _Call] = {}
        self._held: list[_Call] = []  # refused with no_hello: sent again once registered
        self._hello: _Call | None = None
        self._retry_s = config.retry_s  # doubles while reconnecting fails
        self._next_try = 0.0  # when to send HELLO again while unregistered
        self._next_beat = time.monotonic() + config.heartbeat_s
        self._registered = threading.Event()
        self._tried = threading.Event()  # the first HELLO has an outcome
        self._stop = threading.Event()
        self._failures = FailureLog(log, Counters(), "io_errors")
        self._thread = threading.Thread(target=self._run, name="kvtier-client", daemon=True)
        self._thread.start()
        self._tried.wait(
            config.request_timeout_s + GRACE_S if connect_wait_s is None else connect_wait_s
        )

    @property
    def degraded(self) -> bool:
        return self.chunk_size is None

    @property
    def shared_memory(self) -> bool:
        """Whether KV goes through the server's mapped arena (else bytes in frames)."""
        return self._region is not None

    # ---------------------------------------------------------------- lookup

    def lookup(
        self,
        request_id: str,
        hashes: Sequence[bytes],
        group: int = 0,
        wait_s: float = 0.0,
        block_s: float | None = None,
    ) -> LookupState:
        """Start a lookup. With ``wait_s`` a WAIT goes out right behind the
        LOOKUP (one round trip instead of two). Blocks up to ``block_s``
        (default: until the answer, or the ack when there is no WAIT); a
        state not done by then is finished later by ``poll``/``query``. An
        unreachable server makes it a finished miss."""
        state = LookupState(request_id)
        state._ack = self._submit(p.Lookup(request_id, list(hashes), group))
        if wait_s > 0:
            state.polls = 1
            state._answer = self._submit(
                p.Wait(request_id, wait_s), timeout_s=wait_s + self.config.request_timeout_s
            )
        awaited = state._answer or state._ack
        awaited.wait(block_s)
        self._take(state)
        return state

    def poll(self, state: LookupState, wait_s: float = 0.0) -> int | None:
        """The lookup's answer if it has come; never blocks. While pending, a
        WAIT of ``wait_s`` (or a QUERY) is kept in flight so that a later
        poll finds the answer. None while pending; 0 is a miss."""
        self._ask(state, wait_s, self._post)
        return state.hit_chunks

    def query(self, state: LookupState, timeout_s: float = 0.0) -> int | None:
        """The lookup's answer, waiting up to ``timeout_s`` for it (plus one
        round trip); None if still pending then, 0 is a miss."""
        answer = self._ask(state, timeout_s, self._submit)
        if answer is not None:
            answer.wait()
            self._take(state)
        return state.hit_chunks

    def retrieve_with(self, request_id: str, start: int, end: int, consume: Consume) -> bool:
        """Hand each object of hit chunks [start, end) (chunk-major, rank-minor)
        to ``consume(i, view)``, then release their locks. The view is only
        valid during the call: copy out of it. False if anything failed (the
        server refused, or an object has an unexpected size): the engine then
        recomputes those chunks."""
        call = self._submit(p.Retrieve(request_id, start, end))
        reply = call.wait()
        ok = False
        views: list[ObjectBytes] = []
        if isinstance(reply, p.Objects):
            if call.region is not None:
                arena = call.region.array
                views = [arena[o : o + s] for o, s in zip(reply.offsets, reply.sizes, strict=True)]
            else:
                views = [np.frombuffer(f.buffer, np.uint8) for f in call.data]
            ok = len(views) == len(reply.sizes)
        try:
            for i, view in enumerate(views if ok else ()):
                consume(i, view)
        finally:
            self._post(p.Release(request_id, start, end))  # nothing waits for its ack
        return ok

    def retrieve_into(
        self, request_id: str, start: int, end: int, out: Sequence[ObjectBytes]
    ) -> bool:
        """``retrieve_with`` into caller buffers, one per object; False also
        when the objects do not match ``out`` in number or size."""
        targets = [b.reshape(-1).view(np.uint8) for b in out]
        copied = 0

        def copy(i: int, view: ObjectBytes) -> None:
            nonlocal copied
            if i == copied < len(targets) and targets[i].nbytes == view.nbytes:
                np.copyto(targets[i], view)
                copied += 1

        ok = self.retrieve_with(request_id, start, end, copy)
        return ok and copied == len(targets)

    def release(self, request_id: str, start: int, end: int, wait: bool = True) -> None:
        """Drop locks on hit chunks [start, end) the engine will compute itself
        (``wait=False``: send it and go on)."""
        message = p.Release(request_id, start, end)
        if wait:
            self._submit(message).wait()
        else:
            self._post(message)

    def end_session(self, request_id: str, wait: bool = True) -> None:
        message = p.EndSession(request_id)
        if wait:
            self._submit(message).wait()
        else:
            self._post(message)

    def report_usage(self, prefill_s_per_token: float, load_s: float, loaded_tokens: int) -> None:
        """Tell the server's savings ledger what prefill and loads cost here;
        sent without waiting for the ack."""
        self._post(p.UsageReport(prefill_s_per_token, load_s, loaded_tokens))

    def report_shadow(self, checked: int, mismatched: int, unavailable: int = 0) -> None:
        """Tell the server about shadow checks (``kvtier.engine.shadow``);
        sent without waiting for the ack."""
        self._post(p.ShadowReport(checked, mismatched, unavailable))

    # ----------------------------------------------------------------- store

    def store(
        self,
        request_id: str,
        hashes: Sequence[bytes],
        buffers: Sequence[ObjectBytes],
        group: int = 0,
    ) -> int:
        """Store one buffer per (chunk, rank), chunk-major; return objects stored
        (0 when degraded: the store is skipped)."""
        if self._region is None:
            return self._send(request_id, hashes, buffers, group)
        sources = [b.reshape(-1).view(np.uint8) for b in buffers]
        return self.store_with(
            request_id,
            hashes,
            [s.nbytes for s in sources],
            lambda i, dst: np.copyto(dst, sources[i]),
            group,
        )

    def store_with(
        self,
        request_id: str,
        hashes: Sequence[bytes],
        sizes: Sequence[int],
        fill: Fill,
        group: int = 0,
    ) -> int:
        """Store one object per (chunk, rank), chunk-major, each written by
        ``fill(i, dst)`` straight into its arena slot (into a buffer on the
        bytes path); objects the server has already are never filled. Returns
        objects stored; 0 when degraded, when the server's object sizes differ
        from ``sizes``, or when ``fill`` raises (the reservation is aborted and
        the exception goes on)."""
        if self._region is None:
            buffers = [np.empty(size, np.uint8) for size in sizes]
            for i, buffer in enumerate(buffers):
                fill(i, buffer)
            return self._send(request_id, hashes, buffers, group)
        call = self._submit(p.StoreReserve(request_id, list(hashes), group))
        reply = call.wait()
        if not isinstance(reply, p.Reserved) or call.region is None:
            return 0
        if list(reply.sizes) != list(sizes):
            log.warning("client: the server's object sizes differ from ours; store skipped")
            self._post(p.StoreAbort(reply.reservation))
            return 0
        arena = call.region.array
        try:
            for i, (offset, size) in enumerate(zip(reply.offsets, reply.sizes, strict=True)):
                if offset >= 0:
                    fill(i, arena[offset : offset + size])
        except BaseException:
            self._post(p.StoreAbort(reply.reservation))
            raise
        done = self._submit(p.StoreCommit(reply.reservation)).wait()
        return done.stored if isinstance(done, p.Committed) else 0

    def _send(
        self, request_id: str, hashes: Sequence[bytes], buffers: Sequence[ObjectBytes], group: int
    ) -> int:
        # Bytes path: several messages in flight, so the server copies one into
        # L1 while the next is still on the wire.
        ranks = max(1, len(buffers) // max(1, len(hashes)))
        per_chunk = sum(b.nbytes for b in buffers[:ranks]) or 1
        step = max(1, PIPELINE_BYTES // per_chunk)
        calls = [
            self._submit(
                p.Store(request_id, list(hashes[i : i + step]), group),
                buffers[i * ranks : (i + step) * ranks],
            )
            for i in range(0, len(hashes), step)
        ]
        replies = [call.wait() for call in calls]
        return sum(r.stored for r in replies if isinstance(r, p.Committed))

    # ------------------------------------------------------------ management

    def ping(self) -> bool:
        """True if the server answered (a restart is noticed and handled by the
        I/O thread)."""
        return isinstance(self._submit(p.Ping()).wait(), p.Pong)

    def status(self) -> dict[str, object] | None:
        reply = self._submit(p.Status()).wait()
        return reply.status if isinstance(reply, p.StatusReply) else None

    def pin(
        self, hashes: Sequence[bytes], ttl_s: float, group: int = 0, wait: bool = True
    ) -> p.Pinned | None:
        """Keep these chunks in L1 for ``ttl_s`` (0: unpin them); None when the
        server did not answer or refused (``stats.errors`` says why), or
        without waiting (``wait`` False: the answer is not read)."""
        message = p.Pin(list(hashes), ttl_s, group)
        if not wait:
            self._post(message)
            return None
        reply = self._submit(message).wait()
        return reply if isinstance(reply, p.Pinned) else None

    def handoff(self, message: p.HandoffOffer | p.HandoffTake | p.HandoffDone) -> PendingReply:
        """Send a hand-off operation without waiting (``kvtier.server.handoffs``);
        the answer is the returned call's ``reply`` once it is ``ready``: a
        ``HandoffState``, an ``Error``, or None (no server)."""
        return self._post(message)

    def close(self) -> None:
        """Stop the client's thread and free its descriptors; a second close does nothing."""
        self._stop.set()
        self._wake()
        self._thread.join()
        with self._wake_lock:  # a late release or report after close is dropped, never raised
            if self._closed:
                return
            self._closed = True
            os.close(self._wake_read)
            os.close(self._wake_write)

    # ------------------------------------------------------ caller helpers

    def _submit(
        self,
        message: p.Message,
        frames: Sequence[object] = (),
        timeout_s: float | None = None,
    ) -> _Call:
        """Queue a request; its ``wait`` sends it (or wakes the socket's holder)."""
        timeout = self.config.request_timeout_s if timeout_s is None else timeout_s
        call = _Call(message, frames, timeout, lead=self._lead)
        if self._stop.is_set():
            call.done.set()  # closed: no answer
            return call
        self._submissions.put(call)
        return call

    def _post(
        self, message: p.Message, frames: Sequence[object] = (), timeout_s: float | None = None
    ) -> _Call:
        """Queue a request that may not be waited for, and have it sent."""
        call = self._submit(message, frames, timeout_s)
        self._wake()
        return call

    def _lead(self, call: _Call, limit_s: float) -> None:
        """Do the socket's I/O on this thread until ``call`` is answered or
        ``limit_s`` has passed, if the socket is free; else wake its holder,
        which sends ``call`` with the rest of the queue."""
        if not self._io.acquire(blocking=False):
            self._wake()
            return
        end = time.monotonic() + limit_s
        try:
            while not call.done.is_set() and not self._stop.is_set():
                self._turn(end - time.monotonic())
                if time.monotonic() >= end:
                    break
        except Exception:
            self._failures.record("client: a caller's I/O")
        finally:
            pending = self._pending()
            self._io.release()
        if pending:
            self._wake()  # the I/O thread takes over what is still in flight

    def _pending(self) -> bool:
        """Whether the socket's holder has work: calls queued, in flight or held."""
        return bool(self._in_flight or self._held) or not self._submissions.empty()

    def _wake(self) -> None:
        with self._wake_lock, contextlib.suppress(BlockingIOError):  # full: the thread is awake
            if not self._closed:
                os.write(self._wake_write, b"\0")

    def _ask(self, state: LookupState, wait_s: float, send: Callable[..., _Call]) -> _Call | None:
        """Take the replies that came in; while the lookup is pending, have a
        WAIT of ``wait_s`` (or a QUERY) out for it (``send``: queue it, or
        queue it and wake the socket's holder). The call awaited, if any."""
        self._take(state)
        if state.done:
            return None
        if state._answer is None:
            if state.polls >= self.config.max_polls:
                log.warning(
                    "client: lookup %s still pending after %d polls; a miss",
                    state.request_id,
                    state.polls,
                )
                state.give_up("over_budget")
                return None
            state.polls += 1
            asking = p.Wait(state.request_id, wait_s) if wait_s > 0 else p.Query(state.request_id)
            state._answer = send(asking, timeout_s=wait_s + self.config.request_timeout_s)
        return state._answer

    @staticmethod
    def _take(state: LookupState) -> None:
        """Fold the replies that came in into the state (never blocks)."""
        if state._ack is not None and state._ack.done.is_set():
            if isinstance(state._ack.reply, p.Ack):
                state.acked = True
            else:
                state.settle(state._ack.reply)  # refused, or no server: a miss
            state._ack = None
        answer = state._answer
        if state.done or answer is None or not answer.done.is_set():
            return
        state._answer = None
        if not isinstance(answer.reply, p.QueryResult) or answer.reply.hit_chunks is not None:
            state.settle(answer.reply)

    # ------------------------------------------------------------ I/O thread

    def _run(self) -> None:
        """Idle without the socket until woken (a queued call, a caller handing
        over) or a timer is due (heartbeat, reconnect); then hold the socket
        while anything is queued or in flight."""
        self._poller.register(self._wake_read, zmq.POLLIN)
        idle = select.poll()  # not select(): a process may hold over FD_SETSIZE (1024) files
        idle.register(self._wake_read, select.POLLIN)
        while not self._stop.is_set():
            idle_s = 0.0 if self._pending() else self._next_timer() - time.monotonic()
            idle.poll(math.ceil(min(1.0, max(0.0, idle_s)) * 1000))
            with self._io:  # a caller doing its own I/O hands over when answered
                try:
                    self._turn(0.0)
                    while self._pending() and not self._stop.is_set():
                        self._turn(1.0)
                except Exception:
                    self._failures.record("client: the I/O thread")
        with self._io:
            self._fail_all()
            while True:  # calls submitted while closing: no answer
                try:
                    self._submissions.get_nowait().done.set()
                except queue.Empty:
                    break
            self._disconnect()

    def _next_timer(self) -> float:
        beat = self._next_beat if self.config.heartbeat_s > 0 else math.inf
        return min(beat, self._next_try if self._socket is None else math.inf)

    def _turn(self, max_wait_s: float) -> None:
        """One round of the socket's I/O (the caller holds ``_io``): timers,
        queued calls, then replies for up to ``max_wait_s``."""
        now = time.monotonic()
        if self._socket is None and now >= self._next_try:
            self._connect()
        if self._registered.is_set() and self.config.heartbeat_s > 0 and now >= self._next_beat:
            self._next_beat = now + self.config.heartbeat_s
            self._send_call(_Call(p.Ping(), (), self.config.request_timeout_s, self._on_pong))
        self._dispatch_submissions()
        wake_at = min(
            [now + max_wait_s, self._next_timer()] + [c.deadline for c in self._in_flight.values()]
        )
        timeout_ms = max(0, min(1000, math.ceil((wake_at - time.monotonic()) * 1000)))
        ready = dict(self._poller.poll(timeout_ms))
        if self._wake_read in ready:
            with contextlib.suppress(BlockingIOError):
                while os.read(self._wake_read, 4096):
                    pass
            self._dispatch_submissions()
        if self._socket is not None and self._socket in ready:
            self._receive()
        self._expire(time.monotonic())

    def _dispatch_submissions(self) -> None:
        while True:
            try:
                call = self._submissions.get_nowait()
            except queue.Empty:
                return
            if not self._registered.is_set():
                self.stats.degraded_requests += 1
                self._finish(call, None)
            else:
                self._send_call(call)

    def _send_call(self, call: _Call) -> None:
        assert self._socket is not None
        seq = next(self._seq)
        call.message.seq = seq
        call.deadline = time.monotonic() + call.timeout_s
        call.region = self._region
        try:
            self._socket.send_multipart(
                [p.encode(call.message), *call.frames],  # type: ignore[list-item]
                copy=False,
            )
        except (zmq.ZMQError, ValueError, OverflowError) as exc:
            log.warning("client: could not send %s: %r", type(call.message).__name__, exc)
            self._finish(call, None)
            return
        self._in_flight[seq] = call
        self.stats.peak_in_flight = max(self.stats.peak_in_flight, len(self._in_flight))

    def _receive(self) -> None:
        assert self._socket is not None
        while self._socket is not None and self._socket.poll(0):
            parts = self._socket.recv_multipart(copy=False)
            try:
                reply = p.decode_reply(parts[0].buffer)
            except ValueError as exc:
                log.warning("client: an undecodable reply from %s: %s", self.config.address, exc)
                continue
            call = self._in_flight.pop(reply.seq, None)
            if call is None:
                continue  # a late reply to a call that timed out
            if isinstance(reply, p.Error):
                self.stats.errors[reply.code] = self.stats.errors.get(reply.code, 0) + 1
                log.debug("client: %s refused: %s", type(call.message).__name__, reply.message)
                if reply.code == "no_hello" and not call.retried and call.on_reply is None:
                    self._restarted(call)
                    continue
            call.data = list(parts[1:])
            self._finish(call, reply)

    def _finish(self, call: _Call, reply: p.Reply | None) -> None:
        call.reply = reply
        call.done.set()
        if call.on_reply is not None:
            call.on_reply(call)

    def _expire(self, now: float) -> None:
        late = [call for call in self._in_flight.values() if call.deadline <= now]
        if late:
            log.warning(
                "client: no answer from %s to %s within %.1f s; degraded",
                self.config.address,
                ", ".join(sorted({type(call.message).__name__ for call in late})),
                late[0].timeout_s,
            )
            self._degrade()

    # ------------------------------------------------------- registration

    def _connect(self) -> None:
        self._disconnect()
        self._socket = self._context.socket(zmq.DEALER)
        self._socket.setsockopt(zmq.LINGER, 0)
        self._socket.connect(self.config.address)
        self._poller.register(self._socket, zmq.POLLIN)
        self.stats.reconnects += 1
        self._send_hello()

    def _send_hello(self) -> None:
        c = self.config
        hello = p.Hello(
            version=p.PROTOCOL_VERSION,
            client_id=c.client_id,
            model=c.model,
            layouts=list(c.layouts),
            num_ranks=c.num_ranks,
            block_alignment=c.block_alignment,
            revision=c.revision,
            lora=c.lora,
            salt=c.salt,
            token=c.auth_token,
            shm=c.shm,
            rank=c.rank,
            hash_model=c.hash_model,
        )
        self._registered.clear()
        self._hello = _Call(hello, (), c.request_timeout_s, self._on_welcome)
        self._send_call(self._hello)

    def _on_welcome(self, call: _Call) -> None:
        reply = call.reply
        if isinstance(reply, p.Error):
            log.error("client: the server refused hello: %s", reply.message)
            self._degrade()
        if not isinstance(reply, p.Welcome):
            self._tried.set()
            return  # no answer: _degrade runs (or ran) for the timeout
        self.chunk_size, self.boot_id = reply.chunk_size, reply.boot_id
        self._retry_s = self.config.retry_s
        if self._region is not None:
            self._region.close()
            self._region = None
        if reply.arena is not None:
            try:
                self._region = SharedRegion.attach(reply.arena, shm_dir=self.config.shm_dir)
            except OSError:  # another host, or another /dev/shm: use the bytes path
                log.info("client: arena %s is not mapped here; sending bytes", reply.arena)
        self._registered.set()
        self._tried.set()
        held, self._held = self._held, []
        for held_call in held:
            self._send_call(held_call)

    def _on_pong(self, call: _Call) -> None:
        if isinstance(call.reply, p.Pong) and call.reply.boot_id != self.boot_id:
            self.stats.server_restarts += 1
            self._send_hello()

    def _restarted(self, call: _Call) -> None:
        """The server does not know us (it restarted): register, then send
        ``call`` once more."""
        call.retried = True
        self._held.append(call)
        if self._hello is None or self._hello.done.is_set():
            self.stats.server_restarts += 1
            self._send_hello()

    def _degrade(self) -> None:
        """The server is away (or refused us): drop the socket (and any late
        reply with it), answer every call in flight with nothing, and try
        again after the back-off."""
        self.chunk_size = None
        self._registered.clear()
        self._tried.set()
        self._disconnect()
        self._fail_all()
        self._next_try = time.monotonic() + self._retry_s
        self._retry_s = min(2 * self._retry_s, self.config.max_retry_s)

    def _fail_all(self) -> None:
        calls = [*self._in_flight.values(), *self._held]
        self._in_flight.clear()
        self._held.clear()
        for call in calls:
            self._finish(call, None)

    def _disconnect(self) -> None:
        if self._socket is not None:
            with contextlib.suppress(KeyError):
                self._poller.unregister(self._socket)
            self._socket.close(linger=0)
            self._socket = None
