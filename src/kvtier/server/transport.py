"""The server's ZeroMQ loop: a ROUTER socket feeding ``CacheServer``.

One thread owns the socket and the core. Every message gets exactly one
reply or is counted as dropped:

- malformed frames, undecodable or unknown messages (a message nested past
  msgspec's recursion limit included) get an ``Error`` reply;
- a request the core fails on gets an ``internal`` error, and a reply that
  cannot be encoded is replaced by one;
- a reply to a peer that went away is dropped (``dropped_replies``), and a
  message over ``max_message_bytes`` makes ZeroMQ close that connection
  before the loop sees it (counted with the other closed connections as
  ``disconnects``, from the socket's monitor).

No exception in decode, dispatch, the tick, the parked-WAIT flush or send
ends the loop: each is logged (once per defect), counted (``loop_errors``)
and the loop goes on. WAIT requests are parked until their lookup settles or
their timeout passes, so a WAIT never blocks other clients; one WAIT per
(peer, request) may be parked, at most ``MAX_PARKED`` in all.

Registration is bound to the connection a HELLO came on (``ConnectionIds``),
not to the routing id, which a peer can choose.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass

import msgspec
import zmq

from kvtier.failures import FailureLog
from kvtier.server import protocol as p
from kvtier.server.connections import DOMAIN, ConnectionIds, connection_of
from kvtier.server.core import CacheServer

log = logging.getLogger(__name__)

TICK_S = 0.25
MAX_PARKED = 1 << 16
BATCH_MESSAGES = 1024  # messages handled between two looks at the tick and parked WAITs


@dataclass(eq=False)
class _ParkedWait:
    peer: bytes
    connection: str
    request: p.Wait
    deadline: float


class ServerTransport:
    """Bind, then ``serve(stop_event)`` until the event is set."""

    def __init__(self, core: CacheServer, address: str, max_message_bytes: int = 2 << 30) -> None:
        self.core = core
        self.counters = core.transport_counters
        self._failures = FailureLog(log, self.counters, "loop_errors")
        # A context of its own: the ZAP handler is per context.
        self._context: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        self._connections = ConnectionIds(self._context, self.counters)
        self._socket = self._context.socket(zmq.ROUTER)
        self._socket.setsockopt(zmq.LINGER, 0)
        self._socket.setsockopt(zmq.MAXMSGSIZE, max_message_bytes)
        self._socket.setsockopt(zmq.ZAP_DOMAIN, DOMAIN)
        # Refuse (and count) a reply to a peer that is gone or not reading,
        # instead of dropping it silently or blocking the loop on it.
        self._socket.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self._socket.bind(address)
        self.address = self._socket.getsockopt_string(zmq.LAST_ENDPOINT)
        self._monitor = self._socket.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        self._parked: dict[tuple[bytes, str], _ParkedWait] = {}
        # What other threads (admin HTTP) may read: refreshed by the loop each tick.
        self.snapshot: dict[str, object] = core.status()

    def serve(self, stop: threading.Event) -> None:
        poller = zmq.Poller()
        poller.register(self._socket, zmq.POLLIN)
        poller.register(self._monitor, zmq.POLLIN)
        next_tick = time.monotonic() + TICK_S
        try:
            while not stop.is_set():
                timeout_ms = 2 if self._parked else 100
                try:
                    ready = dict(poller.poll(timeout_ms))
                    if self._monitor in ready:
                        self._count_disconnects()
                    if self._socket in ready:
                        self._receive()
                except Exception:
                    self._failures.record("server: receiving")
                self._flush_parked()
                if time.monotonic() >= next_tick:
                    self._tick()
                    next_tick = time.monotonic() + TICK_S
        finally:
            self._socket.disable_monitor()
            self._monitor.close(linger=0)
            self._socket.close(linger=0)
            self._connections.close()
            self._context.term()

    def _count_disconnects(self) -> None:
        while self._monitor.poll(0):
            self._monitor.recv_multipart()  # one event: a connection closed
            self.counters.add("disconnects")

    def _receive(self) -> None:
        for _ in range(BATCH_MESSAGES):
            if not int(self._socket.getsockopt(zmq.EVENTS)) & zmq.POLLIN:
                return
            frames = self._socket.recv_multipart(copy=False)
            try:
                self._handle(frames)
            except Exception:
                self._failures.record("server: a request")

    def _tick(self) -> None:
        try:
            self.core.tick()
        except Exception:
            self._failures.record("server: the tick")
        try:
            self.snapshot = self.core.status()
        except Exception:
            self._failures.record("server: the status snapshot")

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
        if self.core.lookup_settled(peer, wait.request_id, connection):
            return False
        slot = (peer, wait.request_id)
        if slot in self._parked or len(self._parked) >= MAX_PARKED:
            message = (
                "a WAIT for this request is already pending"
                if slot in self._parked
                else f"{MAX_PARKED} WAITs are pending, the server's limit; poll with QUERY"
            )
            self._send(peer, self.core.error("busy", message), [])
            return True
        timeout = wait.timeout_s
        if not math.isfinite(timeout):
            timeout = self.core.limits.max_wait_s if timeout > 0 else 0.0
        timeout = min(max(timeout, 0.0), self.core.limits.max_wait_s)
        self._parked[slot] = _ParkedWait(peer, connection, wait, time.monotonic() + timeout)
        return True

    def _answer(
        self, peer: bytes, connection: str, request: p.Request, data: Sequence[memoryview]
    ) -> None:
        try:
            reply, out = self.core.handle(peer, request, data, connection)
        except Exception:  # a bug, not a client error: answer, log, keep serving
            self._failures.record(f"server: {type(request).__name__}")
            reply, out = self.core.error("internal", "the server failed on this request"), []
        self._send(peer, reply, out)

    def _flush_parked(self) -> None:
        if not self._parked:
            return
        now = time.monotonic()
        for slot, wait in list(self._parked.items()):
            try:
                due = now >= wait.deadline or self.core.lookup_settled(
                    wait.peer, wait.request.request_id, wait.connection
                )
                if due:
                    del self._parked[slot]
                    self._answer(wait.peer, wait.connection, wait.request, [])
            except Exception:
                self._parked.pop(slot, None)
                self._failures.record("server: a parked WAIT")

    def _send(self, peer: bytes, reply: p.Message, data: Sequence[object]) -> None:
        try:
            body = p.encode(reply)
        except Exception:  # e.g. an integer past 64 bits: never leave the peer waiting
            self._failures.record(f"server: encoding a {type(reply).__name__} reply")
            body, data = p.encode(self.core.error("internal", "the reply could not be encoded")), []
        try:
            self._socket.send_multipart(
                [peer, body, *data],  # type: ignore[list-item]
                flags=zmq.NOBLOCK,
                copy=False,
            )
        except zmq.ZMQError as exc:  # the peer went away
            self.counters.add("dropped_replies")
            log.debug("server: reply to a vanished peer dropped: %s", exc)
