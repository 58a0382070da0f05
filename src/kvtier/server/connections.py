"""``ConnectionIds``: a ZeroMQ authentication (ZAP) handler that names every
connection, so that registration is bound to a connection and not to a
routing id.

A ROUTER socket knows its peers by routing id, and a DEALER may choose its
own: a peer that presents another client's id (after that client went away,
or with ``ROUTER_HANDOVER``) would be taken for it. libzmq asks the ZAP
handler about each new connection of a socket with a ZAP domain and stamps
every message from that connection with the ``User-Id`` the handler
returned; a peer cannot set it. This handler accepts every connection (the
token in HELLO is the authentication) and answers a fresh id ``c<n>``.

The handler has no thread: its socket is one more in the transport loop's
poller, which calls ``answer_pending()`` when it is readable (a connection's
handshake waits for the loop's next turn, well under a tick). One ZAP
handler per context: the transport's context has this one.
"""

from __future__ import annotations

import contextlib
import itertools
import logging

import zmq

from kvtier.counters import Counters
from kvtier.failures import FailureLog

log = logging.getLogger(__name__)

ZAP_ENDPOINT = "inproc://zeromq.zap.01"
DOMAIN = b"kvtier"
REFUSAL = [b"1.0", b"", b"500", b"the connection-id handler failed", b"", b""]


def connection_of(frame: zmq.Frame) -> str:
    """The id ``ConnectionIds`` gave the connection a message came on ("" if none)."""
    try:
        user = frame.get("User-Id")
    except zmq.ZMQError:
        return ""
    return user if isinstance(user, str) else ""


class ConnectionIds:
    """Answers ZAP requests when its owner's loop finds ``socket`` readable,
    until ``close()``; every method on that loop's thread."""

    def __init__(self, context: zmq.Context[zmq.Socket[bytes]], counters: Counters) -> None:
        self.socket = context.socket(zmq.REP)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.bind(ZAP_ENDPOINT)
        self._ids = itertools.count(1)
        self._counters = counters
        self._failures = FailureLog(log, counters, "zap_errors")

    def answer_pending(self) -> None:
        """Answer every ZAP request waiting now; never blocks, never raises."""
        while True:
            try:
                request = self.socket.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            except Exception:
                self._failures.record("server: the connection-id (ZAP) handler")
                return
            try:
                self._answer(request)
            except Exception:
                self._failures.record("server: the connection-id (ZAP) handler")
                # A REP socket takes no request before it replies: refuse this one.
                with contextlib.suppress(zmq.ZMQError):
                    self.socket.send_multipart(REFUSAL, zmq.NOBLOCK)

    def close(self) -> None:
        self.socket.close(linger=0)

    def _answer(self, request: list[bytes]) -> None:
        # ZAP 1.0 request: version, request id, domain, address, identity,
        # mechanism, credentials...; reply: version, request id, status code,
        # status text, user id, metadata.
        version, request_id = request[0], request[1]
        user = f"c{next(self._ids)}".encode()
        self.socket.send_multipart([version, request_id, b"200", b"OK", user, b""])
        self._counters.add("connections")
