"""``CacheClient``: an engine's connection to the node's cache server.

Never raises into the engine's request path for anything the server or the
network does: a server that does not answer within ``request_timeout_s``
puts the client in degraded mode, where lookups answer 0 at once and stores
are skipped, until a reconnect succeeds: tried after ``retry_s``, then at
doubling intervals up to ``max_retry_s`` while the server stays away (each try
can cost up to ``request_timeout_s`` of the caller's time). A
server restart is seen through its boot id (or a ``no_hello`` error) and the
client registers again. Local clients copy KV through the shared-memory
arena (one copy each way); others, or ``shm=False``, send bytes in frames.

Thread safety: one lock serialises use of the socket (requests and the
heartbeat thread).
"""

from __future__ import annotations

import itertools
import logging
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

Outgoing = tuple[p.Message, Sequence[object]]  # a message and its data frames
ObjectBytes = npt.NDArray[np.uint8]
Consume = Callable[[int, ObjectBytes], None]  # read object i (a view valid during the call)
Fill = Callable[[int, ObjectBytes], None]  # write object i into the given bytes
Answer = tuple[p.Reply | None, list[zmq.Frame]]  # None: no usable reply
PIPELINE_BYTES = 32 << 20  # bytes-path stores are sent in messages of about this size


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
    token: str = ""
    shm: bool = True
    shm_dir: str = "/dev/shm"
    client_id: str = "engine"
    request_timeout_s: float = 2.0
    retry_s: float = 1.0
    max_retry_s: float = 30.0
    heartbeat_s: float = 10.0  # ping this often (keeps the client alive, spots restarts); 0: off
    max_polls: int = 1000  # a lookup still pending after this many polls is a miss


@dataclass(slots=True)
class LookupState:
    """One request's lookup: submitted -> acked -> pending -> done(n).
    ``hit`` is None until done; 0 is a miss. Once done it never changes, so
    polling again never counts a hit twice. ``tiers``: hit chunks per tier."""

    request_id: str
    acked: bool = False
    hit: int | None = None
    polls: int = 0
    tiers: dict[str, int] = field(default_factory=dict)

    def settle(self, reply: p.Reply | None) -> None:
        """Take a QUERY/WAIT answer; anything but a result is a miss."""
        if isinstance(reply, p.QueryResult):
            self.hit, self.tiers = reply.hit_chunks, reply.tiers
        else:
            self.hit = 0  # an error or no server: a miss, never wait forever

    @property
    def done(self) -> bool:
        return self.hit is not None


@dataclass(slots=True)
class ClientStats:
    degraded_requests: int = 0
    reconnects: int = 0
    server_restarts: int = 0
    errors: dict[str, int] = field(default_factory=dict)


class CacheClient:
    """Talks to one cache server; see the module docstring."""

    def __init__(self, config: ClientConfig) -> None:
        self.config = config
        self.stats = ClientStats()
        self._failures = FailureLog(log, Counters(), "heartbeat_errors")
        self.chunk_size: int | None = None
        self.boot_id: str | None = None
        self._lock = threading.Lock()
        self._context: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
        self._socket: zmq.Socket[bytes] | None = None
        self._region: SharedRegion | None = None
        self._degraded_until = 0.0
        self._retry_s = config.retry_s  # doubles while reconnecting fails
        self._ids = itertools.count()
        self._stop = threading.Event()
        self._heartbeat: threading.Thread | None = None
        with self._lock:
            self._connect()
        if config.heartbeat_s > 0:
            self._heartbeat = threading.Thread(target=self._beat, daemon=True)
            self._heartbeat.start()

    @property
    def degraded(self) -> bool:
        return self.chunk_size is None

    # ---------------------------------------------------------------- lookup

    def lookup(
        self, request_id: str, hashes: Sequence[bytes], group: int = 0, wait_s: float = 0.0
    ) -> LookupState:
        """Start a lookup; an unreachable server makes it a finished miss.
        With ``wait_s`` the WAIT goes out right behind the LOOKUP (one round
        trip instead of two) and the state comes back done unless still
        pending after ``wait_s``."""
        state = LookupState(request_id)
        requests: list[Outgoing] = [(p.Lookup(request_id, list(hashes), group), ())]
        timeouts = [self.config.request_timeout_s]  # the ack: a dead server is seen this soon
        if wait_s > 0:
            requests.append((p.Wait(request_id, wait_s), ()))
            timeouts.append(wait_s + self.config.request_timeout_s)
        answers = self._pipeline(requests, timeouts)
        if not isinstance(answers[0][0], p.Ack):
            state.hit = 0
            return state
        state.acked = True
        if wait_s > 0:
            state.polls = 1
            state.settle(answers[1][0])
        return state

    def query(self, state: LookupState, timeout_s: float = 0.0) -> int | None:
        """None while pending; the hit chunk count once done (asked once only)."""
        if state.done:
            return state.hit
        state.polls += 1
        if state.polls > self.config.max_polls:
            log.warning(
                "client: lookup %s still pending after %d polls; a miss",
                state.request_id,
                state.polls - 1,
            )
            state.hit = 0
            return 0
        message: p.Message = (
            p.Wait(state.request_id, timeout_s) if timeout_s > 0 else p.Query(state.request_id)
        )
        state.settle(self._call(message, timeout_s + self.config.request_timeout_s))
        return state.hit

    def retrieve_with(self, request_id: str, start: int, end: int, consume: Consume) -> bool:
        """Hand each object of hit chunks [start, end) (chunk-major, rank-minor)
        to ``consume(i, view)``, then release their locks. The view is only
        valid during the call: copy out of it. False if anything failed (the
        server refused, or an object has an unexpected size): the engine then
        recomputes those chunks."""
        reply, frames = self._call_frames(p.Retrieve(request_id, start, end))
        ok = False
        views: list[ObjectBytes] = []
        if isinstance(reply, p.Objects):
            if self._region is not None:
                arena = self._region.array
                views = [arena[o : o + s] for o, s in zip(reply.offsets, reply.sizes, strict=True)]
            else:
                views = [np.frombuffer(f.buffer, np.uint8) for f in frames]
            ok = len(views) == len(reply.sizes)
        try:
            for i, view in enumerate(views if ok else ()):
                consume(i, view)
        finally:
            self._call(p.Release(request_id, start, end))
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

    def release(self, request_id: str, start: int, end: int) -> None:
        """Drop locks on hit chunks [start, end) the engine will compute itself."""
        self._call(p.Release(request_id, start, end))

    def end_session(self, request_id: str) -> None:
        self._call(p.EndSession(request_id))

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
        reply = self._call(p.StoreReserve(request_id, list(hashes), group))
        if not isinstance(reply, p.Reserved):
            return 0
        if list(reply.sizes) != list(sizes):
            log.warning("client: the server's object sizes differ from ours; store skipped")
            self._call(p.StoreAbort(reply.reservation))
            return 0
        arena = self._region.array
        try:
            for i, (offset, size) in enumerate(zip(reply.offsets, reply.sizes, strict=True)):
                if offset >= 0:
                    fill(i, arena[offset : offset + size])
        except BaseException:
            self._call(p.StoreAbort(reply.reservation))
            raise
        done = self._call(p.StoreCommit(reply.reservation))
        return done.stored if isinstance(done, p.Committed) else 0

    def _send(
        self, request_id: str, hashes: Sequence[bytes], buffers: Sequence[ObjectBytes], group: int
    ) -> int:
        # Bytes path: several messages in flight, so the server copies one into
        # L1 while the next is still on the wire.
        ranks = max(1, len(buffers) // max(1, len(hashes)))
        per_chunk = sum(b.nbytes for b in buffers[:ranks]) or 1
        step = max(1, PIPELINE_BYTES // per_chunk)
        requests: list[Outgoing] = [
            (
                p.Store(request_id, list(hashes[i : i + step]), group),
                buffers[i * ranks : (i + step) * ranks],
            )
            for i in range(0, len(hashes), step)
        ]
        answers = self._pipeline(requests)
        return sum(r.stored for r, _ in answers if isinstance(r, p.Committed))

    # ------------------------------------------------------------ management

    def ping(self) -> bool:
        """True if the server answered; re-registers after a restart."""
        reply = self._call(p.Ping())
        if isinstance(reply, p.Pong) and reply.boot_id != self.boot_id:
            with self._lock:
                self.stats.server_restarts += 1
                self._hello()
        return isinstance(reply, p.Pong)

    def status(self) -> dict[str, object] | None:
        reply = self._call(p.Status())
        return reply.status if isinstance(reply, p.StatusReply) else None

    def close(self) -> None:
        self._stop.set()
        if self._heartbeat is not None:
            self._heartbeat.join()
        with self._lock:
            self._disconnect()

    # ------------------------------------------------------------- internals

    def _call(
        self, message: p.Message, timeout_s: float | None = None, frames: Sequence[object] = ()
    ) -> p.Reply | None:
        return self._call_frames(message, timeout_s, frames)[0]

    def _call_frames(
        self, message: p.Message, timeout_s: float | None = None, frames: Sequence[object] = ()
    ) -> Answer:
        timeouts = None if timeout_s is None else [timeout_s]
        return self._pipeline([(message, frames)], timeouts)[0]

    def _pipeline(
        self, requests: list[Outgoing], timeouts: Sequence[float] | None = None
    ) -> list[Answer]:
        """Send every request, then read their replies in order, each within
        its own timeout from the send (``request_timeout_s`` by default). The
        server answers one peer's messages in the order they were sent, so a
        pipeline saves round trips without reordering anything (seed Q17's
        race needs a server that handles one client's messages concurrently;
        ours does not)."""
        none: list[Answer] = [(None, [])] * len(requests)
        with self._lock:
            disconnected = self._socket is None or self.chunk_size is None
            if disconnected and (time.monotonic() < self._degraded_until or not self._connect()):
                self.stats.degraded_requests += 1
                return none
            answers = self._exchange(requests, timeouts) or none
            if isinstance(answers[0][0], p.Error) and answers[0][0].code == "no_hello":
                self.stats.server_restarts += 1  # the server restarted: register, then again
                answers = (self._exchange(requests, timeouts) or none) if self._hello() else none
            for (message, _), (reply, _) in zip(requests, answers, strict=True):
                if isinstance(reply, p.Error):
                    self.stats.errors[reply.code] = self.stats.errors.get(reply.code, 0) + 1
                    log.debug("client: %s refused: %s", type(message).__name__, reply.message)
            return answers

    def _exchange(
        self, requests: list[Outgoing], timeouts: Sequence[float] | None
    ) -> list[Answer] | None:
        assert self._socket is not None
        if timeouts is None:
            timeouts = [self.config.request_timeout_s] * len(requests)
        try:
            sent = time.monotonic()
            for message, frames in requests:
                self._socket.send_multipart([p.encode(message), *frames], copy=False)  # type: ignore[list-item]
            answers: list[Answer] = []
            for timeout in timeouts:
                left = sent + timeout - time.monotonic()
                if not self._socket.poll(max(0, int(left * 1000))):
                    raise TimeoutError
                parts = self._socket.recv_multipart(copy=False)
                answers.append((p.decode_reply(parts[0].buffer), parts[1:]))
            return answers
        except (TimeoutError, zmq.ZMQError, ValueError) as exc:
            log.warning("client: no usable answer from %s (%r); degraded", self.config.address, exc)
            self._go_degraded()
            return None

    def _connect(self) -> bool:
        self._disconnect()
        self._socket = self._context.socket(zmq.DEALER)
        self._socket.setsockopt(zmq.LINGER, 0)
        self._socket.connect(self.config.address)
        self.stats.reconnects += 1
        return self._hello()

    def _hello(self) -> bool:
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
            token=c.token,
            shm=c.shm,
            rank=c.rank,
        )
        answers = self._exchange([(hello, ())], None)
        reply = answers[0][0] if answers else None
        if not isinstance(reply, p.Welcome):
            if isinstance(reply, p.Error):
                log.error("client: the server refused hello: %s", reply.message)
            self._go_degraded()
            return False
        self.chunk_size, self.boot_id = reply.chunk_size, reply.boot_id
        self._retry_s = self.config.retry_s
        if self._region is not None:
            self._region.close()
            self._region = None
        if reply.arena is not None:
            try:
                self._region = SharedRegion.attach(reply.arena, shm_dir=c.shm_dir)
            except OSError:  # another host, or another /dev/shm: use the bytes path
                log.info("client: arena %s is not mapped here; sending bytes", reply.arena)
        return True

    def _go_degraded(self) -> None:
        self.chunk_size = None
        self._degraded_until = time.monotonic() + self._retry_s
        self._retry_s = min(2 * self._retry_s, self.config.max_retry_s)
        if self._socket is not None:  # drop late replies with the socket
            self._socket.close(linger=0)
            self._socket = None

    def _disconnect(self) -> None:
        if self._socket is not None:
            self._socket.close(linger=0)
            self._socket = None
        if self._region is not None:
            self._region.close()
            self._region = None

    def _beat(self) -> None:
        while not self._stop.wait(self.config.heartbeat_s):
            try:
                self.ping()
            except Exception:  # a heartbeat that dies would let the server drop us
                self._failures.record("client: the heartbeat")
