"""``kvtier pd-proxy``: prefill on one engine, decode on another, the KV handed
over through the cache server (``kvtier.engine.vllm.handoff``).

Each ``POST /v1/completions`` or ``/v1/chat/completions`` (vLLM's
disaggregated-serving proxy API; the two bodies' shapes:
``kvtier.router.pd_api``):

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

from kvtier.engine.vllm.handoff import CAUSE, HANDOFF_ID, ON_FAILURE, OUTCOME, POLICIES
from kvtier.router.app import error
from kvtier.router.pd_api import API_PATHS, Api, streamed_usage, usage
from kvtier.router.serving import serve_app

log = logging.getLogger(__name__)
FATES = {  # an ended hand-off's outcome, as the error says it
    "expired": "expired: its lease ended before the decode engine loaded it",
    "consumed": "was already consumed",
    "incomplete": "was incomplete: the prefill engine's stores did not all land",
}


@dataclass(eq=False)
class Instance:
    url: str
    in_flight: int = 0


class PrefillFailed(Exception):
    """The prefill engine did not answer the request."""


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
            body = await request.json()
        except ValueError:
            return error(400, "the body is not JSON", "invalid_request_error")
        if not isinstance(body, dict):
            return error(400, "the body must be a JSON object", "invalid_request_error")
        problem = api.check(body)
        if problem:
            return error(400, problem, "invalid_request_error")
        policy = body.pop(ON_FAILURE, self.on_failure)
        if policy not in POLICIES:
            return error(400, f"{ON_FAILURE} must be one of {POLICIES}", "invalid_request_error")
        max_tokens = api.max_tokens(body)
        try:
            first = await self._prefill(api, body)
        except PrefillFailed as exc:
            self._count("prefill_failed")
            return error(502, str(exc), "engine_error")
        return_ids = bool(body.get("return_token_ids"))
        if max_tokens == 1 or first["choices"][0].get("finish_reason") == "stop":
            self._count("prefill_only")
            return await self._answer_alone(request, body, api.alone(first, return_ids))
        params = first.get("kv_transfer_params") or {}
        if HANDOFF_ID not in params:  # the producer could not publish its KV
            if policy == "error":
                self._count("error.not_offered")
                message = "the hand-off failed: the prefill engine could not publish its KV"
                return error(502, f"{message} (cache server away or stores failed)", "engine_error")
            params = {}
        handoff = {**params, ON_FAILURE: policy} if params else {}
        decode_body = api.decode_body(body, first, handoff, max_tokens)
        if body.get("stream"):
            return await self._stream(api, request, first, decode_body, params)
        return await self._joined(api, first, decode_body, params)

    async def _prefill(self, api: Api, body: dict[str, Any]) -> dict[str, Any]:
        status, data = await self._post(self.prefill, api.path, api.prefill_body(body))
        if status != 200:
            raise PrefillFailed(f"the prefill engine answered {status}: {data[:500]!r}")
        answer: dict[str, Any] = json.loads(data)
        return answer

    async def _post(
        self, pool: list[Instance], path: str, body: dict[str, Any]
    ) -> tuple[int, bytes]:
        assert self.session is not None
        instance = min(pool, key=lambda i: i.in_flight)
        instance.in_flight += 1
        try:
            async with self.session.post(instance.url + path, json=body) as resp:
                return resp.status, await resp.read()
        except (TimeoutError, aiohttp.ClientError) as exc:
            return 503, f"{instance.url} unreachable: {exc}".encode()
        finally:
            instance.in_flight -= 1

    async def _joined(
        self, api: Api, first: dict[str, Any], decode_body: dict[str, Any], params: dict[str, Any]
    ) -> web.Response:
        status, data = await self._post(self.decode, api.path, decode_body)
        if status != 200:
            self._count(f"decode_failed.{status}")
            return error(502, await self._decode_failure(status, data, params), "engine_error")
        rest = json.loads(data)
        answer = api.joined(first, rest, decode_body["return_token_ids"])
        answer["usage"] = usage(first, rest, rest.get("kv_transfer_params") if params else None)
        answer.pop("kv_transfer_params", None)
        self._count(_outcome(rest.get("kv_transfer_params"), params))
        return web.json_response(answer)

    async def _stream(
        self,
        api: Api,
        request: web.Request,
        first: dict[str, Any],
        decode_body: dict[str, Any],
        params: dict[str, Any],
    ) -> web.StreamResponse:
        assert self.session is not None
        instance = min(self.decode, key=lambda i: i.in_flight)
        instance.in_flight += 1
        try:
            async with self.session.post(instance.url + api.path, json=decode_body) as upstream:
                if upstream.status != 200:
                    data = await upstream.read()
                    self._count(f"decode_failed.{upstream.status}")
                    message = await self._decode_failure(upstream.status, data, params)
                    return error(502, message, "engine_error")
                response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
                await response.prepare(request)
                head = api.first_chunk(first, decode_body["return_token_ids"])
                await response.write(_event(head))
                async for line in upstream.content:
                    await response.write(_patched(line, first))
                await response.write_eof()
                self._count("streamed")
                return response
        except (TimeoutError, aiohttp.ClientError) as exc:
            return error(502, f"the decode engine failed: {exc}", "engine_error")
        finally:
            instance.in_flight -= 1

    async def _decode_failure(self, status: int, data: bytes, params: dict[str, Any]) -> str:
        """The error for a decode engine that failed the request: under the
        error policy, a hand-off that did not come. The cause is the cache
        server's word (``--cache-admin``), when it can be asked."""
        handoff = str(params.get(HANDOFF_ID, ""))
        head = f"the decode engine answered {status} for hand-off {handoff or '(none)'}"
        cause = await self._fate(handoff) if handoff else ""
        return f"{head}: {cause or 'see the decode engine log'}; engine said {data[:300]!r}"

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
                fate = await resp.json()
        except (TimeoutError, aiohttp.ClientError, ValueError) as exc:
            return f"the cache server is away ({exc})"
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
        await response.prepare(request)
        await response.write(_event(answer))
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
        return response


def _outcome(decoded: dict[str, Any] | None, params: dict[str, Any]) -> str:
    if not params:
        return "recomputed.not_offered"
    if not decoded:
        return "unknown"
    outcome = str(decoded.get(OUTCOME, "unknown"))
    return outcome if outcome == "loaded" else f"{outcome}.{decoded.get(CAUSE, '')}"


def _patched(line: bytes, first: dict[str, Any]) -> bytes:
    """A decode stream's line, its usage (if any) counting the prompt as the
    client sent it and the prefill's token."""
    if not line.startswith(b"data: {") or b'"usage"' not in line:
        return line
    event = json.loads(line[len(b"data: ") :])
    if event.get("usage"):
        event["usage"] = streamed_usage(event["usage"], first)
    return _event(event)


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
