"""One request's trip to one engine and back to the client.

``Relay.forward`` posts the body to the chosen engine and relays its answer,
streamed as it comes. Failures are charged to whoever failed:

- the engine refuses the connection, answers 5xx, is silent (below), says
  nothing on a stream within the first-byte timeout or breaks its stream:
  ``EngineFailed`` before the client got anything (the caller takes the
  engine out and tries another); after, the engine is taken out and the
  stream ends with an error event and ``[DONE]``, never a hang;
- while a request waits for its first byte, the engine is asked ``GET
  /health`` every ``health_probe_interval_s`` (``watched``): one that does
  not answer within ``health_probe_timeout_s`` is silent,
  ``EngineFailed("silent")`` at once, streamed or not. A request sent to an
  engine already silent finds it after interval + timeout (10 s by
  default; 2 x interval + timeout at most, when the engine answered a probe
  just before it fell silent), not after ``first_byte_timeout_s`` (120 s).
  Probing while waiting, rather than once when the timeout has passed, is
  what makes that bound; the requests waiting on one engine share its
  probes (``HealthProbe``), so it costs the engine one ``/health`` per
  interval however many wait;
- a non-streamed request whose answer takes longer than the first-byte
  timeout from an engine that still answers ``/health``: a 504 for that
  request only. Its first byte is its last, so the wait measures the
  generation the client asked for, not the engine's health (else one
  tenant's long answers would take every engine out in turn);
- the client goes away mid-stream (a failed write to it): that request ends,
  the engine's stream is closed (so it stops generating) and the engine is
  not blamed. Only errors reading the engine count against the engine.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import aiohttp
from aiohttp import web

from kvtier.router.core import Node, Routed, Router
from kvtier.router.health import HealthProbe
from kvtier.router.metrics import Metrics

# What became of a request the engine took: the tenant's outcome label.
ANSWERED, CLIENT_GONE, ENGINE_BROKE = "ok", "client_gone", "engine_failed_mid_stream"
TIMED_OUT = "timed_out"  # a non-streamed answer that took longer than first_byte_timeout_s
T = TypeVar("T")


class EngineFailed(Exception):
    """An engine did not answer as an engine must; ``reason`` is the counted label."""

    def __init__(self, reason: str, detail: str = "") -> None:
        super().__init__(detail or reason)
        self.reason = reason


def failure_reason(exc: BaseException) -> str:
    """The counted label of an error talking to an engine."""
    if isinstance(exc, asyncio.TimeoutError):
        return "timeout"
    if isinstance(exc, aiohttp.ClientConnectorError):
        return "unreachable"
    return "broken"


def error_body(message: str, kind: str, code: int) -> dict[str, Any]:
    """OpenAI's error shape."""
    return {"error": {"message": message, "type": kind, "code": code}}


def stream_error(message: str) -> bytes:
    """The end of a stream an engine broke: an error event in OpenAI's shape,
    then ``[DONE]``, so a client never waits on a stream that will not end."""
    event = json.dumps(error_body(message, "engine_error", 502)).encode()
    return b"data: " + event + b"\n\ndata: [DONE]\n\n"


def error(status: int, message: str, kind: str, **headers: str) -> web.Response:
    return web.json_response(error_body(message, kind, status), status=status, headers=headers)


async def watched(probe: HealthProbe, node: Node, waiting: Awaitable[T]) -> T:
    """What ``waiting`` (a wait for the engine's first byte) gives, or
    raises; meanwhile the engine is asked ``/health`` every ``probe.interval_s``
    and ``EngineFailed`` is raised (``waiting`` cancelled) as soon as it does
    not answer. An answer that comes while the probe is out wins."""
    task = asyncio.ensure_future(waiting)
    try:
        while True:
            await asyncio.wait((task,), timeout=probe.interval_s)
            reason = None if task.done() else await probe.check(node)
            if task.done():
                return task.result()
            if reason is not None:
                raise EngineFailed(reason, _silence(node, probe))
    finally:
        task.cancel()  # a no-op once done; else the engine's request is dropped


def _silence(node: Node, probe: HealthProbe) -> str:
    return (
        f"engine {node.name} sent nothing and did not answer GET /health within "
        f"{probe.timeout_s} s (health_probe_timeout_s)"
    )


class _Progress:
    """How far one engine got with a request (for the queue's bookkeeping)."""

    __slots__ = ("prefilled",)

    def __init__(self) -> None:
        self.prefilled = False


class Relay:
    """See the module docstring. ``failed(node, exc)`` takes an engine out."""

    def __init__(
        self,
        session: aiohttp.ClientSession,
        router: Router,
        metrics: Metrics,
        failed: Callable[[Node, EngineFailed], None],
        probe: HealthProbe,
    ) -> None:
        self.session = session
        self.router = router
        self.metrics = metrics
        self.failed = failed
        self.probe = probe

    async def forward(
        self, request: web.Request, node: Node, routed: Routed, body: dict[str, Any]
    ) -> tuple[web.StreamResponse, str]:
        """Send to one engine: the client's response and the outcome label.
        ``EngineFailed`` if the engine failed before the client got anything."""
        self.router.dispatched(routed)
        progress = _Progress()
        try:
            try:
                upstream = await watched(self.probe, node, self._post(node, request.path, body))
            except aiohttp.SocketTimeoutError as exc:
                if body.get("stream"):
                    raise EngineFailed("timeout", str(exc)) from None
                return await self._too_slow(node), TIMED_OUT
            except (TimeoutError, aiohttp.ClientError) as exc:
                raise EngineFailed(failure_reason(exc), str(exc)) from None
            async with upstream:
                if upstream.status >= 500:
                    raise EngineFailed(f"http_{upstream.status}", await _text(upstream))
                if upstream.status == 200 and body.get("stream"):
                    return await self._stream(request, node, routed, upstream, progress)
                try:
                    data = await upstream.read()
                except (TimeoutError, aiohttp.ClientError) as exc:
                    raise EngineFailed(failure_reason(exc), str(exc)) from None
                # A 4xx is the engine's answer to a bad request: the client's, relayed.
                response = web.Response(
                    status=upstream.status, body=data, content_type="application/json"
                )
                return response, ANSWERED
        finally:
            self.router.finished(routed, prefilled=progress.prefilled)

    async def _post(self, node: Node, path: str, body: dict[str, Any]) -> aiohttp.ClientResponse:
        return await self.session.post(node.url + path, json=body)

    async def _too_slow(self, node: Node) -> web.Response:
        """A non-streamed answer comes whole, so the wait for its first byte is
        the whole generation: a long one is the request's doing, not a sign
        that the engine is stuck (a streamed first token is). If the engine
        still answers ``/health`` it stays in and the request is not sent
        again elsewhere (a 504); if it does not, it is silent:
        ``EngineFailed``, and the request goes to another engine."""
        reason = await self.probe.check(node)
        if reason is not None:
            raise EngineFailed(reason, _silence(node, self.probe))
        limit = self.session.timeout.sock_read
        message = (
            f"engine {node.name} did not answer within {limit} s (first_byte_timeout_s); "
            "a long answer comes sooner streamed (stream: true) or with fewer max_tokens"
        )
        return error(504, message, "timeout")

    async def _stream(
        self,
        request: web.Request,
        node: Node,
        routed: Routed,
        upstream: aiohttp.ClientResponse,
        progress: _Progress,
    ) -> tuple[web.StreamResponse, str]:
        try:
            first = await watched(self.probe, node, upstream.content.readany())
        except (TimeoutError, aiohttp.ClientError) as exc:
            raise EngineFailed(failure_reason(exc), str(exc)) from None
        if not first:
            raise EngineFailed("empty", "the engine closed the stream before the first token")
        ttft = time.perf_counter() - routed.started
        progress.prefilled = True
        self.router.first_token(routed, ttft)
        self.metrics.ttft.labels(node.name).observe(ttft)
        response = web.StreamResponse(
            headers={
                "Content-Type": "text/event-stream",
                "Cache-Control": "no-cache",
                "X-Kvtier-Engine": node.name,
            }
        )
        data, outcome = first, ANSWERED
        try:
            await response.prepare(request)
            while data:
                await response.write(data)
                try:
                    data = await upstream.content.readany()
                except (TimeoutError, aiohttp.ClientError) as exc:
                    failure = EngineFailed(failure_reason(exc), str(exc))
                    self.failed(node, failure)
                    message = (
                        f"engine {node.name} failed mid-stream ({failure.reason}); "
                        "retry the request"
                    )
                    data, outcome = stream_error(message), ENGINE_BROKE
                    await response.write(data)
                    break
            await response.write_eof()
        except ConnectionError:  # a write to the client failed: it went away
            upstream.close()  # the engine sees the disconnect and stops generating
            return response, CLIENT_GONE
        return response, outcome


async def _text(upstream: aiohttp.ClientResponse) -> str:
    """An engine's error body, for the log (what it sent until it broke)."""
    try:
        return (await upstream.read()).decode(errors="replace")[:500]
    except (TimeoutError, aiohttp.ClientError) as exc:
        return f"(unreadable: {exc})"


__all__ = [
    "ANSWERED",
    "CLIENT_GONE",
    "ENGINE_BROKE",
    "TIMED_OUT",
    "EngineFailed",
    "Relay",
    "error",
    "error_body",
    "failure_reason",
    "stream_error",
    "watched",
]
