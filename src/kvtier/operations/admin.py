"""The admin HTTP endpoint of ``kvtier serve`` (127.0.0.1 by default).

``GET /healthz`` (open, for liveness probes), ``GET /status`` (JSON),
``GET /metrics`` (Prometheus text), ``POST /clear`` (drops every unlocked
object from L1), ``POST /prefetch`` (a router's routing-time prefetch,
``kvtier.server.warmup``), the admin JSON API under ``/admin/``
(``kvtier.operations.admin_api``: tenants, namespaces, pins, purges, drain,
quotas, the savings ledger), and the dashboard at ``/``
(``kvtier.operations.dashboard``). When the server has tokens (an auth token, or a
tenants file), everything but ``/healthz`` needs ``Authorization: Bearer
<token>`` of an admin tenant: 401 without a known token, 403 for a tenant
without the admin role. Status and metrics come from the
snapshot the server loop refreshes every tick, so this thread never touches
the loop's tables.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from prometheus_client import generate_latest
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from kvtier.operations.admin_api import AdminAPI
from kvtier.operations.dashboard import History
from kvtier.operations.dashboard import page as dashboard_page
from kvtier.server.transport import ServerTransport

MAX_PREFETCH_BODY = 1 << 20
MAX_ADMIN_BODY = 4 << 20
BODY_TIMEOUT_S = 30.0
MAX_NESTING = 32  # the admin API's bodies are flat: two levels suffice


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


class SnapshotCollector(Collector):
    """Every number in the status snapshot, as a gauge.

    ``{"storage": {"prefetch": {"hit_objects.L1": 3}}}`` becomes
    ``kvtier_storage_prefetch_hit_objects{key="L1"} 3``: a dotted counter name
    splits into a metric and a ``key`` label (tier, adapter, reason).
    """

    def __init__(self, transport: ServerTransport) -> None:
        self._transport = transport

    def collect(self) -> Iterator[GaugeMetricFamily]:
        families: dict[str, GaugeMetricFamily] = {}
        for path, value in _numbers(self._transport.snapshot, ["kvtier"]):
            name, _, key = path.partition(".")
            family = families.get(name)
            if family is None:
                family = GaugeMetricFamily(name, name.replace("_", " "), labels=["key"])
                families[name] = family
            family.add_metric([key], float(value))
        yield from families.values()


def _numbers(data: dict[str, Any], prefix: list[str]) -> Iterator[tuple[str, float]]:
    for name, value in data.items():
        if isinstance(value, dict):
            yield from _numbers(value, [*prefix, _clean(name)])
        elif isinstance(value, int | float) and not isinstance(value, bool):
            base, dot, key = name.partition(".")
            yield "_".join([*prefix, _clean(base)]) + (dot + key if dot else ""), value


def _clean(name: str) -> str:
    return "".join(c if c.isalnum() else "_" for c in name)


class AdminHTTP:
    """Serves the admin endpoints on a daemon thread until ``close()``."""

    def __init__(self, transport: ServerTransport, host: str, port: int) -> None:
        registry = transport.core.metrics.registry
        tenants = transport.core.tenants
        registry.register(SnapshotCollector(transport))
        storage = transport.core.storage
        warmup = transport.core.warmup
        self.history = History(lambda: transport.snapshot)
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
                    body = json.dumps(transport.snapshot, default=str, indent=1).encode()
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
                    cleared = storage.l1.clear()
                    self._send(200, json.dumps({"cleared": cleared}).encode(), "application/json")
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

            def _prefetch(self) -> None:
                """``{"model": label, "salt": label, "hashes": [hex, ...]}``."""
                body = self._json_body(MAX_PREFETCH_BODY)
                if body is None:
                    return
                try:
                    hashes = [bytes.fromhex(h) for h in body["hashes"]]
                    asked = warmup.start(str(body["model"]), str(body["salt"]), hashes)
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

        self._server = ThreadingHTTPServer((host, port), Handler)
        self.port = self._server.server_address[1]
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self.history.close()
