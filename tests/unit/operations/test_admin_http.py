"""The admin HTTP server over real sockets: at most ``MAX_REQUEST_THREADS``
connections are served at once; past them a connection is answered 503 at
once, no thread is started for it, and the cache server's loop goes on."""

from __future__ import annotations

import socket
import threading
from collections.abc import Iterator
from dataclasses import dataclass

import pytest

from kvtier.l1 import L1Config
from kvtier.operations.admin import MAX_REQUEST_THREADS, THREAD_NAME, AdminHTTP
from kvtier.server.core import CacheServer
from kvtier.server.transport import ServerTransport
from kvtier.storage import StorageConfig, StorageManager
from tests.integration.harness import wait_for

GET_HEALTHZ = b"GET /healthz HTTP/1.0\r\n\r\n"
# Headers never ended: its thread waits in the read.
STALLED = b"GET /healthz HTTP/1.0\r\nHost: x\r\n"


@dataclass
class Admin:
    transport: ServerTransport
    http: AdminHTTP

    def connect(self) -> socket.socket:
        return socket.create_connection(("127.0.0.1", self.http.port), timeout=10)

    def ask(self, request: bytes = GET_HEALTHZ) -> bytes:
        """The whole answer to one request on a connection of its own."""
        with self.connect() as conn:
            conn.sendall(request)
            return _read_all(conn)


def _read_all(conn: socket.socket) -> bytes:
    chunks = []
    while chunk := conn.recv(1 << 16):
        chunks.append(chunk)
    return b"".join(chunks)


@pytest.fixture
def admin() -> Iterator[Admin]:
    storage = StorageManager(StorageConfig(l1=L1Config(size_bytes=1 << 20, populate=False)))
    core = CacheServer(storage, chunk_size=256)
    transport = ServerTransport(core, "tcp://127.0.0.1:0")
    http = AdminHTTP(transport, "127.0.0.1", 0)
    stop = threading.Event()
    loop = threading.Thread(target=transport.serve, args=(stop,), daemon=True)
    loop.start()
    yield Admin(transport, http)
    stop.set()
    transport.wake()
    loop.join(10)
    http.close()
    core.close()
    storage.close()


def _handler_threads() -> int:
    return sum(1 for t in threading.enumerate() if t.name == THREAD_NAME)


def test_connections_past_the_bound_are_answered_503_without_a_thread(admin: Admin) -> None:
    assert admin.ask().startswith(b"HTTP/1.0 200")
    assert wait_for(_handler_threads, lambda n: n == 0) == 0  # that request's thread ended
    held = [admin.connect() for _ in range(MAX_REQUEST_THREADS)]
    try:
        for conn in held:
            conn.sendall(STALLED)
        # The loop accepts in arrival order: these hold every slot now, so
        # every connection opened after them is refused, however many at once.
        crowd = [admin.connect() for _ in range(200)]
        for conn in crowd:
            conn.sendall(GET_HEALTHZ)
        answers = []
        for conn in crowd:
            with conn:
                answers.append(_read_all(conn))
        assert all(a.startswith(b"HTTP/1.0 503 ") for a in answers), answers[:3]
        assert all(a.endswith(b"busy: too many admin requests at once\n") for a in answers)
        assert _handler_threads() == MAX_REQUEST_THREADS
        # The cache server's loop was never held up by them.
        assert admin.transport.call(lambda: "loop", 10) == "loop"
    finally:
        for conn in held:
            conn.close()
    # The stalled requests end (their clients went away) and give their slots back.
    assert wait_for(_handler_threads, lambda n: n == 0) == 0
    assert admin.ask().startswith(b"HTTP/1.0 200")
