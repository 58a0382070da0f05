"""``kvtier pd-proxy``: prefill on one engine, decode on another, the KV handed
over through the cache server (``kvtier.engine.vllm.handoff``; the parameters
and outcomes are named in ``kvtier.protocol.handoff``).

Each ``POST /v1/completions`` or ``/v1/chat/completions`` (vLLM's
disaggregated-serving proxy API; the two bodies' shapes:
``kvtier.router.pd.api``):

1. the least busy prefill engine gets the request with ``max_tokens`` 1,
   ``return_token_ids`` and ``kv_transfer_params: {"do_remote_decode":
   true}``; its one token is the answer's first, and its response's
   ``kv_transfer_params`` name the hand-off;
2. if that token ends the answer (``max_tokens`` 1, or a stop), the answer
   is the prefill's; otherwise the least busy decode engine gets the
   request with the prompt as token ids *followed by that first token* (a
   chat's messages rendered once, by the prefill engine), one token fewer to
   generate, and the hand-off's parameters: it loads the prompt's KV and
   computes only the first token's, so no token is generated twice;
3. the client gets the first token, then the decode's stream (or one body
   joining both), with ``usage`` counting the prompt once and every
   generated token, and ``usage.kvtier_handoff`` saying whether the KV was
   loaded or recomputed, and why.

A hand-off that fails ends with the request's policy (``kvtier_on_failure``
in the body, else ``--on-failure``): ``recompute`` on the decode engine, or
an ``error`` answer (502) naming the cause.

Each failure is answered as the party that caused it: a malformed body gets
400 (413: too large) naming what to change, before any engine is asked; an
engine's 4xx is its word on the client's request and is passed on; an engine
that cannot be reached, fails (5xx, or refuses the proxy's own credentials:
401, 403) or answers 200 with no completion the proxy can read gets the
client a 502 naming the engine. Once a stream has started, a decode engine's
failure ends it with an error event and ``data: [DONE]``; a client that
leaves ends its own request only, and its decode stream is closed.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
from dataclasses import dataclass
from functools import partial
from typing import Any

import aiohttp
from aiohttp import web

from kvtier.protocol.handoff import CAUSE, FAIL, HANDOFF_ID, LOADED, ON_FAILURE, OUTCOME, POLICIES
from kvtier.router.body import BadRequest, read_body
from kvtier.router.pd.api import API_PATHS, Api, streamed_usage, usage
from kvtier.router.relay import error, stream_error
from kvtier.router.serving import serve_app

log = logging.getLogger(__name__)
FATES = {  # an ended hand-off's outcome, as the error says it
    "expired": "expired: its lease ended before the decode engine loaded it",
    "consumed": "was already consumed",
    "incomplete": "was incomplete: the prefill engine's stores did not all land",
}
CREDENTIALS = (401, 403)  # refusals of the proxy's own credentials: the engine's failure
DONE = b"data: [DONE]\n\n"


@dataclass(eq=False)
class Instance:
    url: str
    in_flight: int = 0


class EngineRefused(Exception):
    """An engine refused the request as the client sent it (a 4xx): passed on."""

    def __init__(self, status: int, data: bytes) -> None:
        super().__init__(f"the engine answered {status}")
        self.status = status
        self.data = data

    def response(self) -> web.Response:
        return web.Response(status=self.status, body=self.data, content_type="application/json")


class EngineFailed(Exception):
    """An engine gave no usable answer; ``reason`` is how, for the counts."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


class PDProxy:
    def __init__(
        self,
        prefill: list[str],
        decode: list[str],
        on_failure: str = "recompute",
        timeout_s: float = 600.0,
        cache_admin: str = "",
        admin_token: str = "",
    ) -> None:
        if not prefill or not decode:
            raise ValueError("pd-proxy needs at least one --prefill and one --decode engine")
        if on_failure not in POLICIES:
            raise ValueError(f"--on-failure must be one of {POLICIES}")
        self.prefill = [Instance(url.rstrip("/")) for url in prefill]
        self.decode = [Instance(url.rstrip("/")) for url in decode]
        self.on_failure = on_failure
        self.cache_admin = cache_admin.rstrip("/")  # where to ask what became of a hand-off
        self.admin_token = admin_token
        self.timeout = aiohttp.ClientTimeout(total=timeout_s)
        self.session: aiohttp.ClientSession | None = None
        self.counts: dict[str, int] = {}

    def app(self) -> web.Application:
        app = web.Application()
        for path, api in API_PATHS.items():
            app.router.add_post(path, partial(self._completions, api))
        app.router.add_get("/health", self._health)
        app.router.add_get("/status", self._status)
        app.on_startup.append(self._start)
        app.on_cleanup.append(self._stop)
        return app

    async def _start(self, app: web.Application) -> None:
        self.session = aiohttp.ClientSession(timeout=self.timeout)

    async def _stop(self, app: web.Application) -> None:
        if self.session is not None:
            await self.session.close()

    async def _health(self, request: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    async def _status(self, request: web.Request) -> web.Response:
        engines = {
            "prefill": [vars(i) for i in self.prefill],
            "decode": [vars(i) for i in self.decode],
        }
        return web.json_response({**engines, "requests": self.counts})

    def _count(self, outcome: str) -> None:
        self.counts[outcome] = self.counts.get(outcome, 0) + 1

    # ----------------------------------------------------------- requests

    async def _completions(self, api: Api, request: web.Request) -> web.StreamResponse:
        try:
            body = await _client_body(request)
        except BadRequest as exc:
            return error(exc.status, str(exc), exc.kind)
        problem = api.check(body)
        if problem:
            return error(400, problem, "invalid_request_error")
        policy = body.pop(ON_FAILURE, self.on_failure)
        if policy not in POLICIES:
            return error(400, f"{ON_FAILURE} must be one of {POLICIES}", "invalid_request_error")
        max_tokens = api.max_tokens(body)
        try:
            first = await self._ask(self.prefill, "prefill", api, api.prefill_body(body))
        except EngineRefused as exc:
            self._count("refused_by_prefill")
            return exc.response()
        except EngineFailed as exc:
            self._count(f"prefill_failed.{exc.reason}")
            return error(502, str(exc), "engine_error")
        return_ids = bool(body.get("return_token_ids"))
        if max_tokens == 1 or first["choices"][0].get("finish_reason") == "stop":
            self._count("prefill_only")
            return await self._answer_alone(request, body, api.alone(first, return_ids))
        params = first.get("kv_transfer_params") or {}
        if HANDOFF_ID not in params:  # the producer could not publish its KV
            if policy == FAIL:
                self._count("error.not_offered")
                message = "the hand-off failed: the prefill engine could not publish its KV"
                return error(502, f"{message} (cache server away or stores failed)", "engine_error")
            params = {}
        handoff = {**params, ON_FAILURE: policy} if params else {}
        decode_body = api.decode_body(body, first, handoff, max_tokens)
        try:
            if body.get("stream"):
                return await self._stream(api, request, first, decode_body)
            rest = await self._ask(self.decode, "decode", api, decode_body)
        except EngineRefused as exc:
            self._count("refused_by_decode")
            return exc.response()
        except EngineFailed as exc:
            self._count(f"decode_failed.{exc.reason}")
            return error(502, await self._decode_failure(exc, params), "engine_error")
        answer = api.joined(first, rest, decode_body["return_token_ids"])
        answer["usage"] = usage(first, rest, rest.get("kv_transfer_params") if params else None)
        answer.pop("kv_transfer_params", None)
        self._count(_outcome(rest.get("kv_transfer_params"), params))
        return web.json_response(answer)

    async def _ask(
        self, pool: list[Instance], kind: str, api: Api, body: dict[str, Any]
    ) -> dict[str, Any]:
        """The least busy engine of ``pool``'s completion for ``body``.
        ``EngineRefused``: it refused the client's request; ``EngineFailed``:
        no completion came."""
        assert self.session is not None
        instance = min(pool, key=lambda i: i.in_flight)
        instance.in_flight += 1
        try:
            async with self.session.post(instance.url + api.path, json=body) as resp:
                status, data = resp.status, await resp.read()
        except (TimeoutError, aiohttp.ClientError) as exc:
            message = f"the {kind} engine {instance.url} failed: {exc!r}"
            raise EngineFailed("no_answer", message) from None
        finally:
            instance.in_flight -= 1
        _judge(kind, instance.url, status, data)
        try:
            answer: dict[str, Any] = json.loads(data)
        except (ValueError, RecursionError) as exc:
            problem = f"not JSON ({exc.__class__.__name__})"
        else:
            problem = api.unreadable(answer, prefill=kind == "prefill")
        if problem:
            message = f"the {kind} engine {instance.url} answered 200 with no completion: {problem}"
            raise EngineFailed("not_a_completion", message)
        return answer

    async def _stream(
        self, api: Api, request: web.Request, first: dict[str, Any], decode_body: dict[str, Any]
    ) -> web.StreamResponse:
        """The prefill's token, then the decode engine's events. Before the
        first byte, the decode engine's failure raises as ``_ask``'s does."""
        assert self.session is not None
        instance = min(self.decode, key=lambda i: i.in_flight)
        instance.in_flight += 1
        try:
            async with self.session.post(instance.url + api.path, json=decode_body) as upstream:
                if upstream.status != 200:
                    _judge("decode", instance.url, upstream.status, await upstream.read())
                response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
                try:
                    await response.prepare(request)
                    head = api.first_chunk(first, decode_body["return_token_ids"])
                    await response.write(_event(head))
                    failure = await _relay(upstream, response, first, instance.url)
                    if failure:
                        self._count("decode_failed.mid_stream")
                        await response.write(stream_error(failure))
                    else:
                        self._count("streamed")
                    await response.write_eof()
                except ConnectionError:  # a write to the client failed: it left
                    upstream.close()  # the decode engine sees it and stops generating
                    self._count("client_gone")
                return response
        except (TimeoutError, aiohttp.ClientError) as exc:
            message = f"the decode engine {instance.url} failed: {exc!r}"
            raise EngineFailed("no_answer", message) from None
        finally:
            instance.in_flight -= 1

    async def _decode_failure(self, failed: EngineFailed, params: dict[str, Any]) -> str:
        """The error for a decode engine that failed the request: under the
        error policy, a hand-off that did not come. The cause is the cache
        server's word (``--cache-admin``), when it can be asked."""
        handoff = str(params.get(HANDOFF_ID, ""))
        cause = await self._fate(handoff) if handoff else ""
        return f"{failed} (hand-off {handoff or '(none)'}: {cause or 'see the decode engine log'})"

    async def _fate(self, handoff: str) -> str:
        """What the cache server says became of ``handoff``, in words."""
        if not self.cache_admin:
            return ""
        assert self.session is not None
        headers = {"Authorization": f"Bearer {self.admin_token}"} if self.admin_token else {}
        try:
            async with self.session.post(
                self.cache_admin + "/admin/handoff", json={"id": handoff}, headers=headers
            ) as resp:
                status, text = resp.status, await resp.text()
        except (TimeoutError, aiohttp.ClientError, ValueError) as exc:
            return f"the cache server is away ({exc})"
        try:
            fate = json.loads(text) if status == 200 else None
        except ValueError:
            fate = None
        if not isinstance(fate, dict):  # e.g. 401: the proxy has no KVTIER_AUTH_TOKEN
            return f"the cache server's admin API answered {status}: {text[:200]!r}"
        if fate.get("state") == "ended":
            return f"the hand-off {FATES.get(fate.get('outcome', ''), fate.get('outcome'))}"
        if fate.get("state") == "held":
            refused = fate.get("refused") or "nothing"
            return f"the hand-off is still held (taken: {fate.get('taken')}; refused: {refused})"
        return "the cache server never had this hand-off (the producer died before its offer?)"

    async def _answer_alone(
        self, request: web.Request, body: dict[str, Any], answer: dict[str, Any]
    ) -> web.StreamResponse:
        """The first token was the whole answer."""
        if not body.get("stream"):
            return web.json_response(answer)
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        try:
            await response.prepare(request)
            await response.write(_event(answer) + DONE)
            await response.write_eof()
        except ConnectionError:
            self._count("client_gone")
        return response


async def _client_body(request: web.Request) -> dict[str, Any]:
    """The client's JSON object (strict, and nested no deeper than the
    engines' encoder can follow: ``kvtier.router.body``), or ``BadRequest``
    saying what is wrong with it."""
    try:
        raw = await request.read()
    except web.HTTPRequestEntityTooLarge:
        message = f"the body is over {request.client_max_size} bytes"
        raise BadRequest(message, "body_too_large", 413) from None
    return read_body(raw)


def _judge(kind: str, url: str, status: int, data: bytes) -> None:
    """Raise for an engine's answer other than 200: the client's refusal
    (``EngineRefused``) or the engine's failure (``EngineFailed``)."""
    if status == 200:
        return
    if 400 <= status < 500 and status not in CREDENTIALS:
        raise EngineRefused(status, data)
    message = f"the {kind} engine {url} answered {status}: {data[:300]!r}"
    raise EngineFailed(f"http_{status}", message)


async def _relay(
    upstream: aiohttp.ClientResponse, response: web.StreamResponse, first: dict[str, Any], url: str
) -> str:
    """Forward the decode engine's events to the client until the stream
    ends: "" when it ended, else how the engine failed. A failed write to
    the client raises (``ConnectionError``)."""
    while True:
        try:
            line = await upstream.content.readline()
            patched = _patched(line, first)
        # ValueError: a line past aiohttp's limit, or a usage the proxy cannot read.
        except (TimeoutError, aiohttp.ClientError, ValueError, RecursionError) as exc:
            return f"the decode engine {url} failed mid-stream ({exc!r}); retry the request"
        if not line:
            return ""
        await response.write(patched)


def _outcome(decoded: dict[str, Any] | None, params: dict[str, Any]) -> str:
    if not params:
        return "recomputed.not_offered"
    if not decoded:
        return "unknown"
    outcome = str(decoded.get(OUTCOME, "unknown"))
    return outcome if outcome == LOADED else f"{outcome}.{decoded.get(CAUSE, '')}"


def _patched(line: bytes, first: dict[str, Any]) -> bytes:
    """A decode stream's line, its usage (if any) counting the prompt as the
    client sent it and the prefill's token. ``ValueError`` if that usage
    cannot be read."""
    if not line.startswith(b"data: {") or b'"usage"' not in line:
        return line
    event = json.loads(line[len(b"data: ") :])
    if event.get("usage"):
        event["usage"] = streamed_usage(event["usage"], first)
    return b"data: " + json.dumps(event).encode() + b"\n"  # the blank line follows as it came


def _event(data: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(data).encode() + b"\n\n"


# ------------------------------------------------------------ the command


async def serve(proxy: PDProxy, host: str, port: int, stop: asyncio.Event | None = None) -> None:
    def ready(bound: int) -> str:
        return (
            f"kvtier pd-proxy: http://{host}:{bound} prefill {len(proxy.prefill)} "
            f"decode {len(proxy.decode)} on failure {proxy.on_failure}"
        )

    await serve_app(proxy.app(), host, port, ready, stop)


def run(args: argparse.Namespace) -> int:
    proxy = PDProxy(
        args.prefill or [],
        args.decode or [],
        args.on_failure,
        args.timeout_s,
        args.cache_admin or "",
        os.environ.get("KVTIER_AUTH_TOKEN", ""),
    )
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    asyncio.run(serve(proxy, args.host, args.port))
    return 0
