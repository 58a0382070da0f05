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

The handler runs on its own thread over one context; the transport creates
a context of its own for it (one ZAP handler per context).
"""

from __future__ import annotations

import itertools
import logging
import threading

import zmq

from kvtier.counters import Counters
from kvtier.failures import FailureLog

log = logging.getLogger(__name__)

ZAP_ENDPOINT = "inproc://zeromq.zap.01"
DOMAIN = b"kvtier"
POLL_MS = 100


def connection_of(frame: zmq.Frame) -> str:
    """The id ``ConnectionIds`` gave the connection a message came on ("" if none)."""
    try:
        user = frame.get("User-Id")
    except zmq.ZMQError:
        return ""
    return user if isinstance(user, str) else ""


class ConnectionIds:
    """Answers ZAP requests on a daemon thread until ``close()``."""

    def __init__(self, context: zmq.Context[zmq.Socket[bytes]], counters: Counters) -> None:
        self._socket = context.socket(zmq.REP)
        self._socket.setsockopt(zmq.LINGER, 0)
        self._socket.bind(ZAP_ENDPOINT)
        self._ids = itertools.count(1)
        self._counters = counters
        self._failures = FailureLog(log, counters, "zap_errors")
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kvtier-zap", daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._stop.set()
        self._thread.join()
        self._socket.close(linger=0)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                if self._socket.poll(POLL_MS):
                    self._answer(self._socket.recv_multipart())
            except Exception:
                self._failures.record("server: the connection-id (ZAP) handler")

    def _answer(self, request: list[bytes]) -> None:
        # ZAP 1.0 request: version, request id, domain, address, identity,
        # mechanism, credentials...; reply: version, request id, status code,
        # status text, user id, metadata.
        version, request_id = request[0], request[1]
        user = f"c{next(self._ids)}".encode()
        self._socket.send_multipart([version, request_id, b"200", b"OK", user, b""])
        self._counters.add("connections")
