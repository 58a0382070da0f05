"""``kvtier route``'s HTTP front: an OpenAI-compatible server over N engines.

Each ``POST /v1/completions`` or ``/v1/chat/completions``:

1. the gateway names the tenant from the API key (401 without a good one)
   and sets ``cache_salt`` to the tenant's;
2. the prompt is tokenized as the engine will (``tokens``) and checked
   against the engines' context length (400, naming both numbers);
3. the tenant's rate limits admit it or answer 429 with ``Retry-After``;
4. the ``Router`` picks an engine; if the plan loads from an L2, that node's
   cache server is told to start bringing those chunks to L1 now;
5. the request goes to the engine, streamed through as it comes. An engine
   that refuses the connection, answers 5xx or says nothing within
   ``first_byte_timeout_s`` is taken out for ``down_s`` and the request
   goes to the next best one (the reason counted); once bytes have reached
   the client a failure ends the stream with an error event, never a hang.

``GET /v1/models``, ``/health``, ``/metrics`` (Prometheus) and ``/status``
(JSON: engines, indexes, cost model, tenants, event streams) go with it.
``RouterService`` owns the event subscribers and the status poller that keep
the indexes current.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Callable
from typing import Any

import aiohttp
import numpy as np
from aiohttp import web
from prometheus_client import generate_latest

from kvtier.events.subscriber import EventSubscriber
from kvtier.keys import model_label, salt_label
from kvtier.router.config import EngineSpec, RouterConfig
from kvtier.router.core import Node, NoEngine, Routed, Router
from kvtier.router.cost import ENGINE, CostModel
from kvtier.router.gateway import Gateway, Tenant, retry_after
from kvtier.router.metrics import Metrics
from kvtier.router.tokens import BadPrompt, EngineTokenizer, HFTokenizer, Tokenizer

log = logging.getLogger(__name__)
ROUTES = {"/v1/completions": "completion", "/v1/chat/completions": "chat"}
STARTUP_SYNC_S = 3.0  # how long start-up waits for the event streams to catch up


class EngineFailed(Exception):
    def __init__(self, reason: str, detail: str = "") -> None:
        super().__init__(detail or reason)
        self.reason = reason


def error_body(message: str, kind: str, code: int) -> dict[str, Any]:
    """OpenAI's error shape."""
    return {"error": {"message": message, "type": kind, "code": code}}


def error(status: int, message: str, kind: str, **headers: str) -> web.Response:
    return web.json_response(error_body(message, kind, status), status=status, headers=headers)


class RouterService:
    """The router, its indexes' feeds and the HTTP application."""

    def __init__(self, config: RouterConfig, tokenizer: Tokenizer | None = None) -> None:
        self.config = config
        specs: list[EngineSpec] = list(config.engine_specs())
        self.specs = specs
        nodes = [
            Node(i, s.name, s.url.rstrip("/"), s.cache_url.rstrip("/")) for i, s in enumerate(specs)
        ]
        self.router = Router(nodes, config.policy, CostModel(config.cost), down_s=config.down_s)
        self.router.chunks.approx_ttl_s = config.approx_ttl_s
        self.gateway = Gateway(config.tenant_specs())
        self.metrics = Metrics()
        self.tokenizer = tokenizer
        self.session: aiohttp.ClientSession | None = None
        self.subscribers: list[tuple[int, str, EventSubscriber]] = []
        self.boot_ids: dict[int, str] = {}
        self.model = config.model
        self._tasks: list[asyncio.Task[None]] = []
        self.bad_requests: dict[str, int] = {}

    # ---------------------------------------------------------------- life

    def app(self) -> web.Application:
        app = web.Application(client_max_size=64 << 20)
        app.router.add_post("/v1/completions", self._generate)
        app.router.add_post("/v1/chat/completions", self._generate)
        app.router.add_get("/v1/models", self._models)
        app.router.add_get("/health", self._health)
        app.router.add_get("/metrics", self._metrics)
        app.router.add_get("/status", self._status)
        app.on_startup.append(self._start)
        app.on_cleanup.append(self._stop)
        return app

    async def _start(self, app: web.Application) -> None:
        timeout = aiohttp.ClientTimeout(
            total=None,
            connect=self.config.connect_timeout_s,
            sock_read=self.config.first_byte_timeout_s,
        )
        self.session = aiohttp.ClientSession(timeout=timeout)
        if self.tokenizer is None:
            if self.config.tokenizer:
                self.tokenizer = HFTokenizer(self.config.tokenizer)
            else:
                self.tokenizer = EngineTokenizer(self.session, self.specs[0].url, self.model)
        for node, spec in enumerate(self.specs):
            if spec.events:
                self._subscribe(
                    node, "cache", spec.events, spec.events_replay, self.router.chunks.apply
                )
            if spec.engine_events:
                self._subscribe(
                    node,
                    "engine",
                    spec.engine_events,
                    spec.engine_events_replay,
                    self.router.blocks.apply,
                    bind=spec.engine_events_bind,
                )
        deadline = time.monotonic() + STARTUP_SYNC_S  # caught up before the first request
        while time.monotonic() < deadline and not all(s.synced for _, _, s in self.subscribers):
            await asyncio.sleep(0.02)
        await self._poll_once()
        self._tasks.append(asyncio.create_task(self._poll_forever()))

    def _subscribe(
        self,
        node: int,
        kind: str,
        endpoint: str,
        replay: str,
        apply: Callable[[int, Any], None],
        bind: bool = False,
    ) -> None:
        sub = EventSubscriber(
            endpoint,
            replay,
            lambda batch: apply(node, batch),
            name=f"{self.specs[node].name}-{kind}",
            bind=bind,
        )
        sub.start()
        self.subscribers.append((node, kind, sub))

    async def _stop(self, app: web.Application) -> None:
        for task in self._tasks:
            task.cancel()
        for _, _, sub in self.subscribers:
            await asyncio.to_thread(sub.close)
        if self.session is not None:
            await self.session.close()

    # ------------------------------------------------------------- polling

    async def _poll_forever(self) -> None:
        while True:
            await asyncio.sleep(self.config.status_poll_s)
            try:
                await self._poll_once()
            except Exception:
                log.exception("route: polling the cache servers failed")

    async def _poll_once(self) -> None:
        """Each cache server's namespace and boot id; each event stream's age."""
        assert self.session is not None
        for node, spec in enumerate(self.specs):
            if not spec.cache_url:
                continue
            try:
                async with self.session.get(spec.cache_url.rstrip("/") + "/status") as response:
                    status = await response.json(content_type=None)
            except (TimeoutError, aiohttp.ClientError, ValueError):
                continue
            boot = status.get("boot_id", "")
            if self.boot_ids.get(node, boot) != boot:
                for n, kind, sub in self.subscribers:
                    if n == node and kind == "cache":
                        sub.resync()  # a restart the sequence numbers may not show
            self.boot_ids[node] = boot
            entries = status.get("hash_namespaces") or []
            # The engines' connectors name the model as vLLM was given it, which is
            # also the name vLLM serves it under; else the latest registration.
            chosen = [e for e in entries if e.get("model") == self.model] or entries[-1:]
            if chosen:
                self.router.set_namespace(chosen[-1])
        now = time.monotonic()
        for node, kind, sub in self.subscribers:
            if kind != "cache":
                continue
            silent = not sub.last_message or now - sub.last_message > self.config.events_stale_s
            if silent:
                self.router.chunks.approximate.add(node)
            else:
                self.router.chunks.approximate.discard(node)
        self.router.chunks.expire()
        if not self.model or not all(n.max_model_len for n in self.router.nodes):
            await self._learn_model()

    async def _learn_model(self) -> None:
        """Each engine's context length, and the model name from the first that answers."""
        assert self.session is not None
        for node in self.router.nodes:
            try:
                async with self.session.get(node.url + "/v1/models") as response:
                    data = await response.json(content_type=None)
                entry = data["data"][0]
            except (aiohttp.ClientError, TimeoutError, ValueError, KeyError, IndexError, TypeError):
                continue
            node.max_model_len = int(entry.get("max_model_len") or 0)
            if not self.model:
                self.model = str(entry.get("id", ""))
                if isinstance(self.tokenizer, EngineTokenizer):
                    self.tokenizer.model = self.model

    # ------------------------------------------------------------ handlers

    async def _health(self, request: web.Request) -> web.Response:
        now = time.monotonic()
        live = sum(n.live(now) for n in self.router.nodes)
        body = {"status": "ok" if live else "no_engine", "engines_live": live}
        return web.json_response(body, status=200 if live else 503)

    async def _models(self, request: web.Request) -> web.Response:
        if not self.model:
            await self._learn_model()
        lengths = [n.max_model_len for n in self.router.nodes if n.max_model_len]
        entry: dict[str, Any] = {"id": self.model, "object": "model", "owned_by": "kvtier"}
        if lengths:
            entry["max_model_len"] = max(lengths)
        return web.json_response({"object": "list", "data": [entry]})

    async def _metrics(self, request: web.Request) -> web.Response:
        for node in self.router.nodes:
            self.metrics.inflight.labels(node.name).set(node.inflight_tokens)
        return web.Response(body=generate_latest(self.metrics.registry), content_type="text/plain")

    async def _status(self, request: web.Request) -> web.Response:
        body = {
            "router": self.router.status(),
            "gateway": self.gateway.status(),
            "events": {
                f"{self.specs[n].name}/{kind}": sub.status() for n, kind, sub in self.subscribers
            },
            "bad_requests": dict(self.bad_requests),
        }
        return web.json_response(body, dumps=lambda o: json.dumps(o, default=str))

    def _bad(
        self,
        tenant: str,
        reason: str,
        message: str,
        status: int = 400,
        kind: str = "invalid_request_error",
    ) -> web.Response:
        """A refused request, counted by reason (``/status``, ``/metrics``)."""
        self.bad_requests[reason] = self.bad_requests.get(reason, 0) + 1
        self.metrics.requests.labels(tenant, reason).inc()
        return error(status, message, kind)

    async def _generate(self, request: web.Request) -> web.StreamResponse:
        tenant = self.gateway.authenticate(request.headers.get("Authorization"))
        if tenant is None:
            return self._bad(
                "-", "unauthorized", "missing or unknown API key", 401, "authentication_error"
            )
        try:
            body = await request.json()
        except (ValueError, UnicodeDecodeError):
            return self._bad(tenant.name, "bad_json", "the body is not JSON")
        if not isinstance(body, dict):
            return self._bad(tenant.name, "bad_json", "the body must be a JSON object")
        asked = body.get("model")
        if asked and self.model and asked != self.model:
            message = f"model {asked!r} is not served here; /v1/models lists {self.model!r}"
            return self._bad(tenant.name, "unknown_model", message, 404, "model_not_found")
        kind = ROUTES[request.path]
        assert self.tokenizer is not None
        try:
            if kind == "completion":
                tokens = await self.tokenizer.completion(body.get("prompt"))
            else:
                tokens = await self.tokenizer.chat(body)
        except BadPrompt as exc:
            return self._bad(tenant.name, "bad_prompt", str(exc))
        except (TimeoutError, aiohttp.ClientError) as exc:
            return error(503, f"no engine could tokenize the prompt: {exc}", "engine_unavailable")
        too_long = self._too_long(len(tokens), body.get("max_tokens"))
        if too_long:
            return self._bad(tenant.name, "too_long", too_long)
        admission = self.gateway.admit(tenant, len(tokens))
        if not admission.admitted:
            self.metrics.requests.labels(tenant.name, f"rate_limited_{admission.refusal}").inc()
            self.gateway.count(tenant, "rate_limited")
            if admission.retry_after_s is None:
                return error(
                    429,
                    f"a {len(tokens)}-token prompt is more than tenant {tenant.name!r} "
                    "may send at once",
                    "rate_limit_exceeded",
                )
            return error(
                429,
                f"tenant {tenant.name!r} is over its {admission.refusal.replace('_', ' ')} rate",
                "rate_limit_exceeded",
                **{"Retry-After": retry_after(admission.retry_after_s)},
            )
        body["cache_salt"] = tenant.spec.cache_salt
        if kind == "completion":
            body["prompt"] = tokens  # the engine sees exactly what was hashed
        if not body.get("model"):
            body["model"] = self.model
        return await self._dispatch(request, tenant, body, np.asarray(tokens, dtype=np.uint32))

    def _too_long(self, prompt: int, max_tokens: Any) -> str:
        lengths = [n.max_model_len for n in self.router.nodes if n.max_model_len]
        if not lengths:
            return ""
        limit = max(lengths)
        wanted = prompt + (max_tokens if isinstance(max_tokens, int) and max_tokens > 0 else 1)
        if wanted > limit:
            return (
                f"the prompt is {prompt} tokens and asks for up to {wanted - prompt} more; "
                f"the engines' context is {limit} tokens: shorten the prompt or max_tokens"
            )
        return ""

    async def _dispatch(
        self, request: web.Request, tenant: Tenant, body: dict[str, Any], tokens: np.ndarray
    ) -> web.StreamResponse:
        tried: list[int] = []
        salt = tenant.spec.cache_salt
        while True:
            started = time.perf_counter()
            try:
                routed = self.router.route(tokens, salt, exclude=tried)
            except NoEngine as exc:
                self.metrics.requests.labels(tenant.name, "no_engine").inc()
                self.gateway.count(tenant, "no_engine")
                return error(503, str(exc), "engine_unavailable")
            self.metrics.scoring.observe(time.perf_counter() - started)
            if tried:
                self.metrics.retries.inc()
            node = self.router.nodes[routed.decision.node]
            tried.append(node.index)
            self._count_plan(routed)
            if self.config.prefetch:
                self._prefetch(node, routed, salt)
            try:
                response = await self._forward(request, node, routed, body)
            except EngineFailed as exc:
                self.router.failed(node.index, exc.reason)
                self.metrics.engine_failures.labels(node.name, exc.reason).inc()
                log.warning(
                    "route: engine %s failed (%s: %s); trying another", node.name, exc.reason, exc
                )
                continue
            self.metrics.requests.labels(tenant.name, "ok").inc()
            self.gateway.count(tenant, "ok")
            return response

    def _count_plan(self, routed: Routed) -> None:
        decision = routed.decision
        self.metrics.routed.labels(self.router.nodes[decision.node].name).inc()
        self.metrics.planned.labels("prefill").inc(decision.prefill_tokens)
        for tier, tokens in decision.loaded.items():
            self.metrics.planned.labels(tier).inc(tokens)

    def _prefetch(self, node: Node, routed: Routed, salt: str) -> None:
        """Start the L2 -> L1 loads the plan counts on (fire and forget)."""
        decision = routed.decision
        if not node.cache_url or not any(t not in ("L1", ENGINE) for t in decision.loaded):
            return
        namespace = self.router.namespace or {}
        payload = {
            "model": model_label(str(namespace.get("model", ""))),
            "salt": salt_label(salt),
            "hashes": [h.hex() for h in routed.hashes[: decision.load_chunks]],
        }
        task = asyncio.create_task(self._send_prefetch(node, payload))
        self._tasks.append(task)
        task.add_done_callback(self._tasks.remove)

    async def _send_prefetch(self, node: Node, payload: dict[str, Any]) -> None:
        assert self.session is not None
        try:
            async with self.session.post(node.cache_url + "/prefetch", json=payload) as response:
                outcome = "started" if response.status == 200 else f"http_{response.status}"
        except (TimeoutError, aiohttp.ClientError):
            outcome = "unreachable"
        self.metrics.prefetches.labels(outcome).inc()

    async def _forward(
        self, request: web.Request, node: Node, routed: Routed, body: dict[str, Any]
    ) -> web.StreamResponse:
        """Send to one engine. ``EngineFailed`` if it fails before the client
        got anything (the caller tries another); after that, the stream ends
        with an error event."""
        assert self.session is not None
        self.router.dispatched(routed)
        progress = _Progress()
        try:
            try:
                upstream = await self.session.post(node.url + request.path, json=body)
            except (TimeoutError, aiohttp.ClientError) as exc:
                raise EngineFailed(_reason(exc), str(exc)) from None
            async with upstream:
                if upstream.status >= 500:
                    raise EngineFailed(f"http_{upstream.status}", await upstream.text())
                if upstream.status != 200:  # the engine's answer to a bad request: the client's
                    data = await upstream.read()
                    return web.Response(
                        status=upstream.status, body=data, content_type="application/json"
                    )
                if body.get("stream"):
                    return await self._stream(request, node, routed, upstream, progress)
                try:
                    data = await upstream.read()
                except (TimeoutError, aiohttp.ClientError) as exc:
                    raise EngineFailed(_reason(exc), str(exc)) from None
                return web.Response(body=data, content_type="application/json")
        finally:
            self.router.finished(routed, prefilled=progress.prefilled)

    async def _stream(
        self,
        request: web.Request,
        node: Node,
        routed: Routed,
        upstream: aiohttp.ClientResponse,
        progress: _Progress,
    ) -> web.StreamResponse:
        try:
            first = await upstream.content.readany()
        except (TimeoutError, aiohttp.ClientError) as exc:
            raise EngineFailed(_reason(exc), str(exc)) from None
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
        await response.prepare(request)
        await response.write(first)
        try:
            async for data in upstream.content.iter_any():
                await response.write(data)
        except (TimeoutError, aiohttp.ClientError) as exc:
            reason = _reason(exc)
            self.router.failed(node.index, reason)
            self.metrics.engine_failures.labels(node.name, reason).inc()
            message = f"engine {node.name} failed mid-stream ({reason}); retry the request"
            event = json.dumps(error_body(message, "engine_error", 502)).encode()
            await response.write(b"data: " + event + b"\n\ndata: [DONE]\n\n")
        await response.write_eof()
        return response


class _Progress:
    """How far one engine got with a request (for the queue's bookkeeping)."""

    __slots__ = ("prefilled",)

    def __init__(self) -> None:
        self.prefilled = False


def _reason(exc: BaseException) -> str:
    if isinstance(exc, asyncio.TimeoutError):
        return "timeout"
    if isinstance(exc, aiohttp.ClientConnectorError):
        return "unreachable"
    return "broken"


__all__ = ["RouterService"]
