"""The admin HTTP endpoint of ``kvtier serve`` (127.0.0.1 by default).

``GET /healthz`` (open, for liveness probes), ``GET /status`` (JSON: a
``kvtier.protocol.status.ServerStatus``), ``GET /metrics`` (Prometheus text:
its counters and gauges, ``kvtier.server.metrics``), ``POST /clear`` (drops every unlocked
object from L1), ``POST /prefetch`` (a router's routing-time prefetch,
``kvtier.server.warmup``), the admin JSON API under ``/admin/``
(``kvtier.operations.admin_api``: tenants, namespaces, pins, purges, drain,
quotas, the savings ledger), and the dashboard at ``/``
(``kvtier.operations.dashboard``). When the server has tokens (an auth token, or a
tenants file), everything but ``/healthz`` needs ``Authorization: Bearer
<token>`` of an admin tenant: 401 without a known token, 403 for a tenant
without the admin role. Status and metrics come from the
snapshot the server loop refreshes every tick, so a request's thread never
touches the loop's tables; writes (``/clear``, ``/prefetch``, the admin API's
POSTs) run on the loop (``ServerTransport.call``), a 503 when it does not
get to them within ``LOOP_CALL_TIMEOUT_S``. The loop accepts connections
(the listening socket is one it watches); each connection is served on a
thread of its own, at most ``MAX_REQUEST_THREADS`` at once: one past them is
answered 503 by the loop at once and closed, so no client can make the
process start threads without bound.
"""

from __future__ import annotations

import contextlib
import json
import socket
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import msgspec
from prometheus_client import generate_latest

from kvtier.keys import NamespaceLabel
from kvtier.operations.admin_api import LOOP_CALL_TIMEOUT_S, AdminAPI
from kvtier.operations.dashboard import History
from kvtier.operations.dashboard import page as dashboard_page
from kvtier.server.metrics import StatusCollector
from kvtier.server.transport import LoopStopped, ServerTransport

MAX_PREFETCH_BODY = 1 << 20
MAX_ADMIN_BODY = 4 << 20
BODY_TIMEOUT_S = 30.0
MAX_NESTING = 32  # the admin API's bodies are flat: two levels suffice
MAX_REQUEST_THREADS = 16  # connections served at once; one more is answered 503
THREAD_NAME = "kvtier-admin"  # the threads that serve them
_BUSY = (
    b"HTTP/1.0 503 Service Unavailable\r\nContent-Type: text/plain\r\n"
    b"Content-Length: 38\r\nConnection: close\r\n\r\n"
    b"busy: too many admin requests at once\n"
)


def json_object(raw: bytes) -> dict[str, Any]:
    """A request body (empty: ``{}``) as a JSON object; ValueError says what
    is wrong. Bodies are flat: nesting past ``MAX_NESTING`` is refused here,
    as is nesting past Python's recursion limit (json raises RecursionError,
    which no caller expects), so no handler recurses through a body. A
    number a field cannot take (``1e400`` reads as inf, ``NaN``) is refused
    by that field's check, which names it."""
    try:
        body = json.loads(raw or b"{}")
    except RecursionError:
        raise ValueError(f"the body is nested more than {MAX_NESTING} levels deep") from None
    if not isinstance(body, dict):
        raise ValueError("the body must be a JSON object")
    if _nesting(body) > MAX_NESTING:
        raise ValueError(f"the body is nested more than {MAX_NESTING} levels deep")
    return body


def _nesting(value: Any) -> int:
    """How deep lists and objects nest in ``value`` (a loop, not recursion)."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        item, depth = stack.pop()
        items = item.values() if isinstance(item, dict) else item
        if isinstance(item, dict | list):
            deepest = max(deepest, depth)
            stack.extend((child, depth + 1) for child in items)
    return deepest


class AdminHTTP:
    """Serves the admin endpoints on a daemon thread until ``close()``."""

    def __init__(self, transport: ServerTransport, host: str, port: int) -> None:
        registry = transport.core.metrics.registry
        tenants = transport.core.tenants
        registry.register(StatusCollector(lambda: transport.snapshot))
        storage = transport.core.storage
        warmup = transport.core.warmup
        self.history = History(lambda: transport.snapshot)
        transport.core.upkeep.every("dashboard", self.history.interval_s, self.history.record)
        api = AdminAPI(transport, self.history)

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                if self.path == "/healthz":
                    self._send(200, b"ok\n", "text/plain")
                elif self.path == "/":  # the page holds no data: /admin/dashboard does
                    self._send(200, dashboard_page(), "text/html; charset=utf-8")
                elif not self._authorized():
                    return
                elif self.path == "/status":
                    body = msgspec.json.format(msgspec.json.encode(transport.snapshot), indent=1)
                    self._send(200, body, "application/json")
                elif self.path == "/metrics":
                    self._send(200, generate_latest(registry), "text/plain; version=0.0.4")
                elif self.path.startswith("/admin/"):
                    self._api("GET", {})
                else:
                    self._send(404, b"not found\n", "text/plain")

            def do_POST(self) -> None:
                if not self._authorized():
                    return
                elif self.path == "/clear":
                    self._clear()
                elif self.path == "/prefetch":
                    self._prefetch()
                elif self.path.startswith("/admin/"):
                    body = self._json_body()
                    if body is not None:
                        self._api("POST", body)
                else:
                    self._send(404, b"not found\n", "text/plain")

            def _json_body(self, limit: int = MAX_ADMIN_BODY) -> dict[str, Any] | None:
                """The request's JSON object (None: a 400 was sent, or the
                client stopped sending and its connection is dropped)."""
                try:
                    length = int(self.headers.get("Content-Length") or 0)
                    if not 0 <= length <= limit:
                        raise ValueError(f"a body of at most {limit} bytes, please")
                    return json_object(self.rfile.read(length))
                except ValueError as exc:
                    self._send(400, json.dumps({"error": str(exc)}).encode(), "application/json")
                except TimeoutError:
                    self.close_connection = True  # a body announced, never sent: not a fault
                return None

            def _api(self, method: str, body: dict[str, Any]) -> None:
                code, answer = api.handle(method, self.path, body)
                self._send(code, json.dumps(answer, default=str).encode(), "application/json")

            def _clear(self) -> None:
                """Drop every unlocked object from L1 (on the loop, which owns L1's writes)."""
                try:
                    cleared = transport.call(storage.clear_l1, LOOP_CALL_TIMEOUT_S)
                except (TimeoutError, LoopStopped) as exc:
                    self._send(503, json.dumps({"error": str(exc)}).encode(), "application/json")
                else:
                    self._send(200, json.dumps({"cleared": cleared}).encode(), "application/json")

            def _prefetch(self) -> None:
                """``{"model": label, "salt": label, "hashes": [hex, ...]}``."""
                body = self._json_body(MAX_PREFETCH_BODY)
                if body is None:
                    return
                try:
                    hashes = [bytes.fromhex(h) for h in body["hashes"]]
                    namespace = NamespaceLabel(str(body["model"]), str(body["salt"]))
                    asked = transport.call(
                        lambda: warmup.start(namespace, hashes), LOOP_CALL_TIMEOUT_S
                    )
                except (TimeoutError, LoopStopped) as exc:
                    self._send(503, f"{exc}\n".encode(), "text/plain")
                except KeyError as exc:
                    self._send(400, f"bad prefetch request: no {exc}\n".encode(), "text/plain")
                except LookupError as exc:
                    self._send(404, f"{exc}\n".encode(), "text/plain")
                except OverflowError as exc:
                    self._send(429, f"{exc}\n".encode(), "text/plain")
                except (ValueError, TypeError, AttributeError) as exc:
                    self._send(400, f"bad prefetch request: {exc}\n".encode(), "text/plain")
                else:
                    self._send(200, json.dumps({"chunks": asked}).encode(), "application/json")

            def _authorized(self) -> bool:
                """Whether an admin tenant asks; if not, the refusal is sent."""
                if tenants.open:
                    return True
                given = self.headers.get("Authorization", "")
                scheme, _, token = given.partition(" ")
                tenant = tenants.authenticate(token) if scheme == "Bearer" else None
                if tenant is None:
                    self._send(401, b"unauthorized\n", "text/plain")
                elif not tenant.admin:
                    self._send(403, b"forbidden: this tenant has no admin role\n", "text/plain")
                return tenant is not None and tenant.admin

            def _send(self, code: int, body: bytes, kind: str) -> None:
                try:
                    self.send_response(code)
                    self.send_header("Content-Type", kind)
                    self.send_header("Content-Length", str(len(body)))
                    self.end_headers()
                    self.wfile.write(body)
                except (BrokenPipeError, ConnectionResetError, TimeoutError):
                    self.close_connection = True  # the client gave up waiting: not a fault

            def log_message(self, format: str, *args: Any) -> None:
                return None  # no request lines in the server log

            # A client that announces a body and stops sending holds a thread
            # until this (seconds); then its connection is dropped.
            timeout = BODY_TIMEOUT_S

        self._server = _BoundedHTTPServer((host, port), Handler, MAX_REQUEST_THREADS)
        self.port = self._server.server_address[1]
        # No thread waits on the listening socket: the server loop accepts when
        # it is readable (timeout 0: never wait there) and each connection gets
        # a thread of its own, which ends with it (at most MAX_REQUEST_THREADS).
        self._server.timeout = 0
        transport.watch(self._server.fileno(), self._server.handle_request)

    def close(self) -> None:
        """After the server loop has stopped: wait for requests in progress."""
        self._server.server_close()


class _BoundedHTTPServer(ThreadingHTTPServer):
    """Serves each connection on a thread of its own, at most ``max_threads``
    at once. A connection past them is answered 503 on the accepting thread
    (the server loop) without waiting for it: the reply is small enough for
    the fresh socket's buffer, and what the client has sent so far is read
    first, so that closing does not reset the connection under the reply
    (a request still on its way may: that client sees a reset instead).

    A slot is held until its thread ends: a client that stops sending keeps
    one for ``BODY_TIMEOUT_S`` per read."""

    # Connections the kernel holds until the loop accepts them: socketserver's
    # 5 makes a burst of clients wait a second (a SYN retry) for the loop.
    request_queue_size = 128

    def __init__(self, address: tuple[str, int], handler: type, max_threads: int) -> None:
        super().__init__(address, handler)
        self._slots = threading.BoundedSemaphore(max_threads)

    def process_request(self, request: Any, client_address: Any) -> None:
        if not self._slots.acquire(blocking=False):
            _refuse(request)
            self.shutdown_request(request)
            return
        try:
            super().process_request(request, client_address)
        except BaseException:  # no thread started: it will not give the slot back
            self._slots.release()
            raise

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        threading.current_thread().name = THREAD_NAME
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._slots.release()


def _refuse(request: socket.socket) -> None:
    """Answer ``_BUSY`` without blocking: whatever fails, the connection closes."""
    request.setblocking(False)
    with contextlib.suppress(OSError):
        request.recv(1 << 16)
    with contextlib.suppress(OSError):
        request.send(_BUSY)
