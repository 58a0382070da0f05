"""The server's ZeroMQ loop: a ROUTER socket feeding ``CacheServer``.

One thread owns the socket and the core. Malformed frames, undecodable or
unknown messages get an ``Error`` reply and the loop goes on; a message over
``max_message_bytes`` makes ZeroMQ drop that connection. WAIT requests are
parked until their lookup settles or their timeout passes, so a WAIT never
blocks other clients.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass

import msgspec
import zmq

from kvtier.server import protocol as p
from kvtier.server.core import CacheServer

log = logging.getLogger(__name__)

TICK_S = 0.25


@dataclass(eq=False)
class _ParkedWait:
    peer: bytes
    request: p.Wait
    deadline: float


class ServerTransport:
    """Bind, then ``serve(stop_event)`` until the event is set."""

    def __init__(self, core: CacheServer, address: str, max_message_bytes: int = 2 << 30) -> None:
        self.core = core
        self._context: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
        self._socket = self._context.socket(zmq.ROUTER)
        self._socket.setsockopt(zmq.LINGER, 0)
        self._socket.setsockopt(zmq.MAXMSGSIZE, max_message_bytes)
        self._socket.setsockopt(zmq.ROUTER_HANDOVER, 1)  # a reconnecting client keeps its id
        self._socket.bind(address)
        self.address = self._socket.getsockopt_string(zmq.LAST_ENDPOINT)
        self._parked: list[_ParkedWait] = []
        # What other threads (admin HTTP) may read: refreshed by the loop each tick.
        self.snapshot: dict[str, object] = core.status()

    def serve(self, stop: threading.Event) -> None:
        poller = zmq.Poller()
        poller.register(self._socket, zmq.POLLIN)
        next_tick = time.monotonic() + TICK_S
        try:
            while not stop.is_set():
                timeout_ms = 2 if self._parked else 100
                if poller.poll(timeout_ms):
                    while int(self._socket.getsockopt(zmq.EVENTS)) & zmq.POLLIN:
                        self._handle(self._socket.recv_multipart(copy=False))
                self._flush_parked()
                if time.monotonic() >= next_tick:
                    self.core.tick()
                    self.snapshot = self.core.status()
                    next_tick = time.monotonic() + TICK_S
        finally:
            self._socket.close(linger=0)

    def _handle(self, frames: list[zmq.Frame]) -> None:
        peer = frames[0].bytes
        if len(frames) < 2:
            self._send(peer, self.core.error("bad_request", "a request needs a body frame"), [])
            return
        try:
            request = p.decode_request(frames[1].buffer)
        except msgspec.ValidationError as exc:
            code = "unknown_op" if "$.op" in str(exc) else "bad_request"
            self._send(peer, self.core.error(code, f"invalid message: {exc}"), [])
            return
        except msgspec.DecodeError as exc:
            self._send(peer, self.core.error("bad_request", f"undecodable message: {exc}"), [])
            return
        if isinstance(request, p.Wait) and not self.core.lookup_settled(peer, request.request_id):
            wait = min(max(request.timeout_s, 0.0), self.core.limits.max_wait_s)
            self._parked.append(_ParkedWait(peer, request, time.monotonic() + wait))
            return
        data = [f.buffer for f in frames[2:]]
        try:
            reply, out = self.core.handle(peer, request, data)
        except Exception:  # a bug, not a client error: answer, log, keep serving
            log.exception("server: %s failed", type(request).__name__)
            reply, out = self.core.error("internal", "the server failed on this request"), []
        self._send(peer, reply, out)

    def _flush_parked(self) -> None:
        if not self._parked:
            return
        now = time.monotonic()
        keep = []
        for wait in self._parked:
            if now >= wait.deadline or self.core.lookup_settled(wait.peer, wait.request.request_id):
                reply, out = self.core.handle(wait.peer, wait.request, [])
                self._send(wait.peer, reply, out)
            else:
                keep.append(wait)
        self._parked = keep

    def _send(self, peer: bytes, reply: p.Message, data: Sequence[object]) -> None:
        try:
            self._socket.send_multipart([peer, p.encode(reply), *data], copy=False)  # type: ignore[list-item]
        except zmq.ZMQError as exc:  # the peer went away
            log.debug("server: reply to a vanished peer dropped: %s", exc)
