"""The nodes' cache servers, as the router reads them.

``read_status(node)`` fetches a cache server's ``/status`` and decodes it
as a ``ServerStatus`` (its hash namespaces and boot id are what the router
uses) and ``prefetch(node, payload)`` posts a routing-time
``/prefetch``, both with the configured token (``cache_token``: an admin
tenant's, when the servers have tokens). A server the router was told to use
and cannot read (unreachable, silent, 401/403, a document that is not a
``ServerStatus``: ``bad_answer``, the field named in the log; one over
``MAX_STATUS_BYTES`` is not read past that) leaves the
router routing without its chunk hashes, so it is never silent:

- every failed poll is counted (``kvtier_route_cache_server_errors_total``,
  by engine and reason);
- each change of state is logged once: a warning when a server becomes
  unreadable or fails another way, naming what to change; a line when it is
  read again;
- ``status()`` (in the router's ``/status``) shows each server's state.

Owned by the event loop's thread (no lock).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import msgspec

from kvtier.protocol.status import MAX_STATUS_BYTES, ServerStatus, decode
from kvtier.router.core import Node
from kvtier.router.metrics import Metrics
from kvtier.router.relay import failure_reason

log = logging.getLogger(__name__)
HINTS = {
    "http_401": "set cache_token (KVTIER_ROUTE_CACHE_TOKEN) to an admin tenant's token",
    "http_403": "cache_token's tenant has no admin role on that server",
}


@dataclass
class CacheServerState:
    """What the last poll of one cache server found ("" error: read)."""

    engine: str
    url: str
    error: str = ""
    detail: str = ""  # what the last failed poll said (a bad answer names its field)
    polls: int = 0
    errors: dict[str, int] = field(default_factory=dict)


class CacheServers:
    """See the module docstring."""

    def __init__(self, nodes: Sequence[Node], token: str, metrics: Metrics) -> None:
        self._headers = {"Authorization": f"Bearer {token}"} if token else {}
        self._metrics = metrics
        self.states = {n.index: CacheServerState(n.name, n.cache_url) for n in nodes if n.cache_url}

    async def read_status(self, session: aiohttp.ClientSession, node: Node) -> ServerStatus | None:
        """The server's ``/status``; None (counted, logged on a change) if unreadable."""
        error, detail, body = await self._fetch_status(session, node)
        self._note(node, error, detail)
        return None if error else body

    async def _fetch_status(
        self, session: aiohttp.ClientSession, node: Node
    ) -> tuple[str, str, ServerStatus | None]:
        """(error, detail, the status); error "" when read."""
        try:
            async with session.get(node.cache_url + "/status", headers=self._headers) as response:
                status, data = response.status, await _read_at_most(response, MAX_STATUS_BYTES)
        except (TimeoutError, aiohttp.ClientError) as exc:
            return failure_reason(exc), str(exc), None
        if data is None:
            return "bad_answer", f"/status is over {MAX_STATUS_BYTES} bytes", None
        if status != 200:
            return f"http_{status}", data.decode(errors="replace")[:200], None
        try:
            return "", "", decode(data)
        except msgspec.ValidationError as exc:  # names the field
            return "bad_answer", f"/status is not a kvtier status: {exc}", None
        except msgspec.DecodeError as exc:
            return "bad_answer", f"/status is not JSON: {exc}", None

    async def prefetch(
        self, session: aiohttp.ClientSession, node: Node, payload: dict[str, Any]
    ) -> None:
        """Ask the server to start its L2 -> L1 loads (the outcome counted)."""
        try:
            async with session.post(
                node.cache_url + "/prefetch", json=payload, headers=self._headers
            ) as response:
                outcome = "started" if response.status == 200 else f"http_{response.status}"
        except (TimeoutError, aiohttp.ClientError):
            outcome = "unreachable"
        self._metrics.prefetches.labels(outcome).inc()

    def status(self) -> dict[str, object]:
        return {
            s.engine: {
                "url": s.url,
                "readable": s.polls > 0 and not s.error,
                "error": s.error,
                "detail": s.detail,
                "polls": s.polls,
                "errors": dict(s.errors),
            }
            for s in self.states.values()
        }

    def _note(self, node: Node, error: str, detail: str) -> None:
        state = self.states[node.index]
        state.polls += 1
        state.detail = detail
        if error:
            state.errors[error] = state.errors.get(error, 0) + 1
            self._metrics.cache_server_errors.labels(node.name, error).inc()
        if error == state.error and state.polls > 1:
            return
        if error:
            hint = HINTS.get(error, "the router routes without its chunk hashes until it answers")
            log.warning(
                "route: cannot read cache server %s of engine %s (%s: %s); %s",
                state.url,
                node.name,
                error,
                detail,
                hint,
            )
        elif state.error:
            log.warning("route: cache server %s of engine %s is read again", state.url, node.name)
        state.error = error


async def _read_at_most(response: aiohttp.ClientResponse, limit: int) -> bytes | None:
    """The body, or None once it is longer than ``limit`` bytes (announced or
    sent: what is read past that is not kept)."""
    if (response.content_length or 0) > limit:
        return None
    body = bytearray()
    async for chunk in response.content.iter_chunked(1 << 16):
        body += chunk
        if len(body) > limit:
            return None
    return bytes(body)
