"""A TCP proxy between the cache server and Redis that can slow or cut the
link: ``latency_s`` delays every piece of data each way, ``drop()`` closes
every connection open now, and ``refusing`` closes new ones at once.

Threads: one accepting, two per connection (one each way); they end with
their sockets. ``close()`` stops everything.
"""

from __future__ import annotations

import contextlib
import socket
import threading
import time


class TcpProxy:
    def __init__(self, upstream_port: int) -> None:
        self.upstream_port = upstream_port
        self.latency_s = 0.0
        self.refusing = False
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port: int = self._listener.getsockname()[1]
        self._open: set[socket.socket] = set()
        self._lock = threading.Lock()  # guards _open
        self._closed = False
        threading.Thread(target=self._accept, name="proxy-accept", daemon=True).start()

    def drop(self) -> int:
        """Close every connection open now; how many there were."""
        with self._lock:
            sockets, self._open = list(self._open), set()
        for sock in sockets:
            _close(sock)
        return len(sockets) // 2

    def close(self) -> None:
        self._closed = True
        _close(self._listener)
        self.drop()

    def _accept(self) -> None:
        while not self._closed:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            if self.refusing:
                _close(client)
                continue
            try:
                upstream = socket.create_connection(("127.0.0.1", self.upstream_port), timeout=2)
                upstream.settimeout(None)
            except OSError:
                _close(client)
                continue
            with self._lock:
                self._open |= {client, upstream}
            for src, dst in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pump, args=(src, dst), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket) -> None:
        with contextlib.suppress(OSError):
            while data := src.recv(1 << 16):
                if self.latency_s:
                    time.sleep(self.latency_s)
                dst.sendall(data)
        for sock in (src, dst):
            with self._lock:
                self._open.discard(sock)
            _close(sock)


def _close(sock: socket.socket) -> None:
    with contextlib.suppress(OSError):
        sock.shutdown(socket.SHUT_RDWR)
    sock.close()
