"""One request's trip to one engine and back to the client.

``Relay.forward`` posts the body to the chosen engine and relays its answer,
streamed as it comes. Failures are charged to whoever failed:

- the engine refuses the connection, answers 5xx, says nothing within the
  first-byte timeout or breaks its stream: ``EngineFailed`` before the
  client got anything (the caller takes the engine out and tries another);
  after, the engine is taken out and the stream ends with an error event and
  ``[DONE]``, never a hang;
- a non-streamed request whose answer takes longer than the first-byte
  timeout: a 504 for that request only. Its first byte is its last, so the
  wait measures the generation the client asked for, not the engine's health
  (else one tenant's long answers would take every engine out in turn);
- the client goes away mid-stream (a failed write to it): that request ends,
  the engine's stream is closed (so it stops generating) and the engine is
  not blamed. Only errors reading the engine count against the engine.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable
from typing import Any

import aiohttp
from aiohttp import web

from kvtier.router.core import Node, Routed, Router
from kvtier.router.metrics import Metrics

# What became of a request the engine took: the tenant's outcome label.
ANSWERED, CLIENT_GONE, ENGINE_BROKE = "ok", "client_gone", "engine_failed_mid_stream"
TIMED_OUT = "timed_out"  # a non-streamed answer that took longer than first_byte_timeout_s


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
    ) -> None:
        self.session = session
        self.router = router
        self.metrics = metrics
        self.failed = failed

    async def forward(
        self, request: web.Request, node: Node, routed: Routed, body: dict[str, Any]
    ) -> tuple[web.StreamResponse, str]:
        """Send to one engine: the client's response and the outcome label.
        ``EngineFailed`` if the engine failed before the client got anything."""
        self.router.dispatched(routed)
        progress = _Progress()
        try:
            try:
                upstream = await self.session.post(node.url + request.path, json=body)
            except aiohttp.SocketTimeoutError as exc:
                if body.get("stream"):
                    raise EngineFailed("timeout", str(exc)) from None
                return self._too_slow(node), TIMED_OUT
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

    def _too_slow(self, node: Node) -> web.Response:
        """A non-streamed answer comes whole, so the wait for its first byte is
        the whole generation: a long one is the request's doing, not a sign
        that the engine is stuck (a streamed first token is). The engine stays
        in and the request is not sent again elsewhere."""
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
            first = await upstream.content.readany()
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
]
