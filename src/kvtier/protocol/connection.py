"""``Connection``: a ``CacheClient``'s socket to the cache server, the
requests on it and the registration that keeps it usable.

Requests and replies are matched by ``seq``, so any number of calls can be on
the wire at once. Whoever holds the socket (``_io``) sends what callers have
queued and hands each reply to its caller. A caller that finds the socket
free takes it and does its own I/O, as a plain request/reply client would (no
thread hop on the way out or back); a caller that finds it taken never waits
for it: it queues its request, wakes the holder and waits on its own reply,
so a slow call (a long WAIT, a large store) holds up nobody else's. A caller
holds the socket only until its own reply is in, then hands whatever is still
in flight to the connection's I/O thread, which also sends the heartbeat
(PING: keeps the registration alive, spots a restarted server by its boot id)
and reconnects.

A server that goes away is noticed without waiting for a call to time out:
ZeroMQ's own heartbeat pings the server's I/O thread every ``LINK_PING_S``
and drops a link silent for ``LINK_TIMEOUT_S`` (libzmq answers the ping, so a
busy Python loop does not delay it; the timeout is generous all the same: a
false drop costs misses), and a monitor on the socket reports the dropped
link, or a killed server's closed one, to the socket's holder, which says
HELLO again: a server restarted is joined without waiting for a call, and a
server that stays away degrades the client when that HELLO times out. The
monitor also reports each completed link: a degraded client whose server was
not there (no link when its HELLO timed out) keeps a fresh socket connecting
(ZeroMQ retries by itself, off the Python thread) and says HELLO the moment
the link is made, so a server that takes long to come back is joined as soon
as it listens, with no back-off to wait out; the back-off is for a server
that is linked but does not answer (frozen, overloaded).

Every timer the holder sleeps towards is one that can fire in its current
state: the heartbeat counts only while registered, so an outage never
leaves a past-due timer behind (which would turn the wait into a busy loop).

Registration, a small state machine::

    connecting --WELCOME--> registered --no answer in time / HELLO refused--> degraded
    degraded --after retry_s (doubling up to max_retry_s)--> connecting
    degraded with no link --the link is made--> connecting
    registered --PONG with another boot id, or a no_hello reply--> connecting
    registered --the link dropped--> rejoining --WELCOME--> registered
    rejoining --no answer in time--> degraded

While it is not registered every call is answered at once with no reply
(``Call.reply`` None): the client then misses lookups and skips stores. A
call refused with ``no_hello`` (the server restarted) is held and sent once
more after the new WELCOME, and so is a call made while rejoining (the link
dropped, the socket reconnects by itself, HELLO is out): a server restarted
at once costs no call, and one that stays away costs each call at most its
own timeout, then degraded answers come at once. So is a call posted to be held (``hold_s``: a
hand-off's offer, which nobody waits for and whose loss would cost its
consumer a recompute): while the connection is down, and when it drops with
the call on the wire, the call is kept and sent once registered again, until
its hold ends (then it is answered with nothing). The server may see it
twice: such a request must be idempotent.

Thread safety: any thread may submit. The holder of ``_io`` owns the socket,
the table of requests in flight and the registration state; other threads
reach it through ``_submissions`` and a wake-up pipe.
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

import zmq
from zmq.utils import monitor as zmq_monitor

from kvtier.counters import Counters
from kvtier.failures import FailureLog
from kvtier.l1 import SharedRegion
from kvtier.protocol import messages as p

log = logging.getLogger(__name__)

GRACE_S = 1.0  # a caller waits this much past a request's timeout (the I/O thread ends it)
LINK_PING_S = 1.0  # ZeroMQ's heartbeat on the link to the server
LINK_TIMEOUT_S = 5.0  # a link silent this long is dropped (a frozen server or host)


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
class Call:
    """One request in flight, owned by the socket's holder until ``done`` is set."""

    message: p.Message
    frames: Sequence[object]
    timeout_s: float
    on_reply: Callable[[Call], None] | None = None  # the I/O thread's own requests
    done: threading.Event = field(default_factory=threading.Event)
    reply: p.Reply | None = None  # None: no usable answer (timed out, degraded)
    data: list[zmq.Frame] = field(default_factory=list)
    region: SharedRegion | None = None  # the arena of the registration it went under
    deadline: float = 0.0
    retried: bool = False
    hold_until: float = 0.0  # kept through a dropped connection until then (0: not kept)
    lead: Callable[[Call, float], None] | None = None  # do the I/O for it, if the socket is free
    link: int = 0  # the link it was sent on (Connection._link)

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


@dataclass(slots=True)
class ClientStats:
    degraded_requests: int = 0
    reconnects: int = 0
    dropped_links: int = 0  # links the socket's monitor saw drop (a killed or frozen server)
    server_restarts: int = 0
    peak_in_flight: int = 0  # most requests on the wire at once (concurrent callers)
    errors: dict[str, int] = field(default_factory=dict)


class Connection:
    """One client's connection to one cache server; see the module docstring."""

    def __init__(self, config: ClientConfig, connect_wait_s: float | None = None) -> None:
        """Start the I/O thread and wait up to ``connect_wait_s`` (default: the
        request timeout) for the first HELLO; until it is answered the
        connection is degraded."""
        self.config = config
        self.stats = ClientStats()
        self.chunk_size: int | None = None  # None while unregistered (degraded)
        self.boot_id: str | None = None
        self.region: SharedRegion | None = None  # the server's arena, when mapped here
        self._context: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
        self._socket: zmq.Socket[bytes] | None = None
        self._monitor: zmq.Socket[bytes] | None = None  # the socket's link events
        self._linked = False  # the socket's link to the server is up (the monitor says)
        self._poller = zmq.Poller()  # the socket's holder's
        self._io = threading.Lock()  # held by whoever does the socket's I/O; never waited on
        self._submissions: queue.SimpleQueue[Call] = queue.SimpleQueue()
        self._wake_read, self._wake_write = os.pipe()
        self._wake_lock = threading.Lock()
        self._closed = False
        os.set_blocking(self._wake_read, False)
        os.set_blocking(self._wake_write, False)
        self._seq = itertools.count(1)
        self._in_flight: dict[int, Call] = {}
        self._held: list[Call] = []  # sent once registered: refused with no_hello, or held
        self._hello: Call | None = None
        self._rejoining = False  # the link dropped while registered; HELLO is out again
        self._link = 0  # counts links (a new socket, a dropped link); calls note theirs
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
    def registering(self) -> bool:
        """Whether the first HELLO is still out (neither answered nor given up on)."""
        return not self._tried.is_set()

    def submit(
        self,
        message: p.Message,
        frames: Sequence[object] = (),
        timeout_s: float | None = None,
        hold_s: float = 0.0,
    ) -> Call:
        """Queue a request; its ``wait`` sends it (or wakes the socket's holder).
        ``hold_s``: keep it through a dropped connection that long (see the
        module docstring)."""
        timeout = self.config.request_timeout_s if timeout_s is None else timeout_s
        call = Call(message, frames, timeout, lead=self._lead)
        if hold_s > 0:
            call.hold_until = time.monotonic() + hold_s
        if self._stop.is_set():
            call.done.set()  # closed: no answer
            return call
        self._submissions.put(call)
        return call

    def post(
        self,
        message: p.Message,
        frames: Sequence[object] = (),
        timeout_s: float | None = None,
        hold_s: float = 0.0,
    ) -> Call:
        """Queue a request that may not be waited for, and have it sent."""
        call = self.submit(message, frames, timeout_s, hold_s)
        self._wake()
        return call

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

    # ------------------------------------------------------ the socket's holder

    def _lead(self, call: Call, limit_s: float) -> None:
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
        """The next heartbeat (only while registered: it is sent only then) or
        reconnect (only while there is no socket: a socket waiting for its
        link says HELLO when the link is made); inf if neither can fire."""
        beating = self._registered.is_set() and self.config.heartbeat_s > 0
        beat = self._next_beat if beating else math.inf
        return min(beat, self._next_try if self._socket is None else math.inf)

    def _turn(self, max_wait_s: float) -> None:
        """One round of the socket's I/O (the caller holds ``_io``): timers,
        queued calls, then replies for up to ``max_wait_s``."""
        now = time.monotonic()
        if self._socket is None and now >= self._next_try:
            self._connect()
        if self._registered.is_set() and self.config.heartbeat_s > 0 and now >= self._next_beat:
            self._next_beat = now + self.config.heartbeat_s
            self._send_call(Call(p.Ping(), (), self.config.request_timeout_s, self._on_pong))
        self._dispatch_submissions()
        wake_at = min(
            [now + max_wait_s, self._next_timer()]
            + [c.deadline for c in self._in_flight.values()]
            + [c.hold_until for c in self._held if c.hold_until]
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
        if self._monitor is not None and self._monitor in ready:
            self._link_events()
        self._expire(time.monotonic())

    def _dispatch_submissions(self) -> None:
        while True:
            try:
                call = self._submissions.get_nowait()
            except queue.Empty:
                return
            if not self._registered.is_set():
                now = time.monotonic()
                if self._rejoining:  # wait for the HELLO, no longer than the call's own timeout
                    call.hold_until = max(call.hold_until, now + call.timeout_s)
                else:
                    self.stats.degraded_requests += 1
                if call.hold_until > now:
                    self._held.append(call)  # sent after the next WELCOME
                else:
                    self._finish(call, None)
            else:
                self._send_call(call)

    def _send_call(self, call: Call) -> None:
        assert self._socket is not None
        seq = next(self._seq)
        call.message.seq = seq
        call.deadline = time.monotonic() + call.timeout_s
        call.region = self.region
        call.link = self._link
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

    def _link_events(self) -> None:
        """Read the monitor's events. A dropped link means the server is away
        (killed, restarted, frozen past the link's heartbeat, or cut off):
        rejoin now rather than at the next call's timeout. A link made while
        no HELLO is out (a degraded client waiting for its server) is the
        server back: say HELLO now."""
        assert self._monitor is not None
        dropped = False
        while self._monitor is not None and self._monitor.poll(0):
            event = zmq_monitor.recv_monitor_message(self._monitor)["event"]
            dropped |= event == zmq.EVENT_DISCONNECTED
            self._linked = event == zmq.EVENT_HANDSHAKE_SUCCEEDED
        if dropped and self._registered.is_set():
            log.warning("client: the link to %s dropped; registering again", self.config.address)
            self.stats.dropped_links += 1
            self._rejoin()
        elif self._linked and self._hello is None:
            log.info("client: %s is listening again; registering", self.config.address)
            self._send_hello()

    def _finish(self, call: Call, reply: p.Reply | None) -> None:
        call.reply = reply
        call.done.set()
        if call.on_reply is not None:
            call.on_reply(call)

    def _expire(self, now: float) -> None:
        ended = [call for call in self._held if 0 < call.hold_until <= now]
        if ended:
            self._held = [call for call in self._held if call not in ended]
            for call in ended:
                self._finish(call, None)
        late = [(seq, c) for seq, c in self._in_flight.items() if c.deadline <= now]
        lost = [(seq, call) for seq, call in late if call.link != self._link]
        for seq, call in lost:  # sent on a link that dropped: its reply went with it
            del self._in_flight[seq]
            self._finish(call, None)
        late = [(seq, call) for seq, call in late if call.link == self._link]
        if late:
            log.warning(
                "client: no answer from %s to %s within %.1f s; degraded",
                self.config.address,
                ", ".join(sorted({type(call.message).__name__ for _, call in late})),
                late[0][1].timeout_s,
            )
            self._degrade()

    # ------------------------------------------------------- registration

    def _connect(self, hello: bool = True) -> None:
        """A fresh socket; HELLO on it now, or (``hello`` False) once its
        link is made."""
        self._disconnect()
        self._link += 1
        self._socket = self._context.socket(zmq.DEALER)
        self._socket.setsockopt(zmq.LINGER, 0)
        self._socket.setsockopt(zmq.HEARTBEAT_IVL, round(LINK_PING_S * 1000))
        self._socket.setsockopt(zmq.HEARTBEAT_TIMEOUT, round(LINK_TIMEOUT_S * 1000))
        self._monitor = self._socket.get_monitor_socket(
            zmq.EVENT_DISCONNECTED | zmq.EVENT_HANDSHAKE_SUCCEEDED
        )
        self._socket.connect(self.config.address)
        self._poller.register(self._socket, zmq.POLLIN)
        self._poller.register(self._monitor, zmq.POLLIN)
        self.stats.reconnects += 1
        if hello:
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
        self._hello = Call(hello, (), c.request_timeout_s, self._on_welcome)
        self._send_call(self._hello)

    def _on_welcome(self, call: Call) -> None:
        reply = call.reply
        if isinstance(reply, p.Error):
            log.error("client: the server refused hello: %s", reply.message)
            self._degrade()
        if not isinstance(reply, p.Welcome):
            self._tried.set()
            return  # no answer: _degrade runs (or ran) for the timeout
        self.chunk_size, self.boot_id = reply.chunk_size, reply.boot_id
        self._retry_s = self.config.retry_s
        self._next_beat = time.monotonic() + self.config.heartbeat_s
        if self.region is not None and self.region.name != reply.arena:
            self.region.close()  # a new arena (the server restarted): calls of the old one fail
            self.region = None
        if reply.arena is not None and self.region is None:
            try:
                self.region = SharedRegion.attach(reply.arena, shm_dir=self.config.shm_dir)
            except OSError:  # another host, or another /dev/shm: use the bytes path
                log.info("client: arena %s is not mapped here; sending bytes", reply.arena)
        self._registered.set()
        self._rejoining = False
        self._tried.set()
        held, self._held = self._held, []
        for held_call in held:
            self._send_call(held_call)

    def _on_pong(self, call: Call) -> None:
        if isinstance(call.reply, p.Pong) and call.reply.boot_id != self.boot_id:
            self.stats.server_restarts += 1
            self._send_hello()

    def _restarted(self, call: Call) -> None:
        """The server does not know us (it restarted): register, then send
        ``call`` once more."""
        call.retried = True
        self._held.append(call)
        if self._hello is None or self._hello.done.is_set():
            self.stats.server_restarts += 1
            self._send_hello()

    def _rejoin(self) -> None:
        """The link dropped: say HELLO again on the same socket (ZeroMQ
        reconnects it; the HELLO goes when it does). The calls in flight are
        left to their timeouts, without degrading the connection when they
        pass (their link is gone: ``_expire``): the event comes with no time,
        and one read late (the holder was idle) may follow a reconnection
        whose calls the new server is answering. The chunk size stays: engines go on using
        the cache, their calls held until the WELCOME or their timeout."""
        self._registered.clear()
        self._rejoining = True
        self._link += 1
        self._send_hello()

    def _degrade(self) -> None:
        """The server is away (or refused us): drop the socket (and any late
        reply with it), answer every call in flight with nothing (but those
        still to be held: sent again once registered), and try again: when
        a fresh socket's link is made if the server was not there (no link),
        else after the back-off."""
        self.chunk_size = None
        self._registered.clear()
        self._rejoining = False
        self._tried.set()
        away = not self._linked
        self._disconnect()
        self._fail_all(keep_held=True)
        self._hello = None
        if away:
            self._connect(hello=False)
            return
        self._next_try = time.monotonic() + self._retry_s
        self._retry_s = min(2 * self._retry_s, self.config.max_retry_s)

    def _fail_all(self, keep_held: bool = False) -> None:
        calls = [*self._in_flight.values(), *self._held]
        now = time.monotonic()
        self._in_flight.clear()
        self._held = [c for c in calls if keep_held and c.hold_until > now]
        for call in calls:
            if call not in self._held:
                self._finish(call, None)

    def _disconnect(self) -> None:
        self._linked = False
        if self._socket is not None:
            with contextlib.suppress(KeyError):
                self._poller.unregister(self._socket)
            if self._monitor is not None:
                with contextlib.suppress(KeyError):
                    self._poller.unregister(self._monitor)
                with contextlib.suppress(zmq.ZMQError):
                    self._socket.disable_monitor()
                self._monitor.close(linger=0)
                self._monitor = None
            self._socket.close(linger=0)
            self._socket = None


__all__ = ["GRACE_S", "LINK_TIMEOUT_S", "Call", "ClientConfig", "ClientStats", "Connection"]
