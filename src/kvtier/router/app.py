"""``kvtier route``'s HTTP front: an OpenAI-compatible server over N engines.

Each ``POST /v1/completions`` or ``/v1/chat/completions``:

1. the gateway names the tenant from the API key (401 without a good one);
2. the body is read and checked (``body``: strict JSON, bounded nesting,
   the fields the router reads, no engine-internal field) and the prompt's
   shape too (``tokens.check_prompt``): 400 naming the field, nothing
   charged;
3. the tenant's request bucket admits it or answers 429 with
   ``Retry-After``, before any work is done for it;
4. the prompt is tokenized as the engine will (``tokens``; with any live
   engine, failing over): for a chat, everything its template renders (the
   messages, ``documents``, ``tools``, ``chat_template_kwargs``...), a part
   the router cannot count (an image, audio or video) refused by name (400).
   The count is checked against the engines' context length (400, naming
   both numbers) and the tenant's prompt-token bucket (429);
5. the gateway sets ``cache_salt`` to the tenant's, the ``Router`` picks an
   engine; if the plan loads from an L2, that node's cache server is told to
   start bringing those chunks to L1 now;
6. the request goes to the engine, streamed through as it comes
   (``relay``). An engine that refuses the connection, answers 5xx, is
   silent (sends nothing and does not answer ``GET /health`` within
   ``health_probe_timeout_s``; asked every ``health_probe_interval_s`` while
   a request waits, so found in seconds) or sends no first streamed byte
   within ``first_byte_timeout_s`` is taken out for ``down_s`` and the
   request goes to the next best one (the reason counted). A non-streamed
   answer slower than ``first_byte_timeout_s`` from an engine that answers
   ``/health`` is a 504 for that request only: its wait is the generation it
   asked for. Once bytes have reached the client a failure ends the stream
   with an error event, never a hang. A client that goes away costs the
   engine nothing.

``GET /v1/models``, ``/health``, ``/metrics`` (Prometheus) and ``/status``
(JSON: engines, indexes, cost model, tenants, event streams, cache servers)
go with it; the last two need the operator's token (``gateway``).
``RouterService`` owns the event subscribers and the status poller that keep
the indexes current (``cache_servers``).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Callable
from typing import Any

import aiohttp
import msgspec
import numpy as np
from aiohttp import web
from prometheus_client import generate_latest

from kvtier.events.subscriber import EventSubscriber
from kvtier.keys import NamespaceLabel
from kvtier.router.body import BadRequest, check_body, output_tokens, read_body
from kvtier.router.cache_servers import CacheServers
from kvtier.router.config import EngineSpec, RouterConfig
from kvtier.router.core import Node, NoEngine, Routed, Router
from kvtier.router.cost import ENGINE, CostModel
from kvtier.router.gateway import Admission, Gateway, Tenant, retry_after
from kvtier.router.health import HealthProbe
from kvtier.router.metrics import Metrics
from kvtier.router.relay import EngineFailed, Relay, error
from kvtier.router.tokens import (
    EnginesUnavailable,
    EngineTokenizer,
    HFTokenizer,
    Tokenizer,
    check_chat,
    check_prompt,
)

log = logging.getLogger(__name__)
ROUTES = {"/v1/completions": "completion", "/v1/chat/completions": "chat"}
STARTUP_SYNC_S = 3.0  # how long start-up waits for the event streams to catch up


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
        self.router.chunks.pending_ttl_s = config.pending_ttl_s
        self.gateway = Gateway(config.tenant_specs(), operator_token=config.operator_token)
        self.metrics = Metrics()
        self.cache_servers = CacheServers(nodes, config.cache_token, self.metrics)
        self.tokenizer = tokenizer
        self.session: aiohttp.ClientSession | None = None
        self.probe: HealthProbe | None = None
        self.relay: Relay | None = None
        self.subscribers: list[tuple[int, str, EventSubscriber]] = []
        self.boot_ids: dict[int, str] = {}
        self.model = config.model
        self._tasks: list[asyncio.Task[None]] = []
        self.bad_requests: dict[str, int] = {}

    # ---------------------------------------------------------------- life

    def app(self) -> web.Application:
        app = web.Application(client_max_size=self.config.max_body_bytes)
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
        self.probe = HealthProbe(
            aiohttp.ClientSession(),  # its own pool: see HealthProbe
            self.config.health_probe_timeout_s,
            self.config.health_probe_interval_s,
        )
        self.relay = Relay(self.session, self.router, self.metrics, self._engine_failed, self.probe)
        if self.tokenizer is None:
            if self.config.tokenizer:
                self.tokenizer = HFTokenizer(self.config.tokenizer)
            else:
                self.tokenizer = EngineTokenizer(
                    self.session,
                    self.router.live_nodes,
                    self._engine_failed,
                    self.model,
                    self.probe,
                )
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
        if self.probe is not None:
            self.probe.close()
            await self.probe.session.close()
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
        for node in self.router.nodes:
            if not node.cache_url:
                continue
            status = await self.cache_servers.read_status(self.session, node)
            if status is None:
                continue  # counted and logged by cache_servers
            boot = status.boot_id
            if self.boot_ids.get(node.index, boot) != boot:
                for n, kind, sub in self.subscribers:
                    if n == node.index and kind == "cache":
                        sub.resync()  # a restart the sequence numbers may not show
            self.boot_ids[node.index] = boot
            entries = status.hash_namespaces
            # The engines' connectors name the model as vLLM was given it, which is
            # also the name vLLM serves it under; else the latest registration.
            chosen = [e for e in entries if e.model == self.model] or entries[-1:]
            if chosen:
                self.router.set_namespace(msgspec.structs.asdict(chosen[-1]))
        now = time.monotonic()
        for node_index, kind, sub in self.subscribers:
            if kind != "cache":
                continue
            silent = not sub.last_message or now - sub.last_message > self.config.events_stale_s
            if silent:
                self.router.chunks.approximate.add(node_index)
            else:
                self.router.chunks.approximate.discard(node_index)
        self.router.chunks.expire()
        if not self.model or not all(n.max_model_len for n in self.router.nodes):
            await self._learn_model()

    async def _learn_model(self) -> None:
        """Each engine's context length, and the model name from the first that
        answers. An engine gets ``health_probe_timeout_s`` to answer: a silent
        one must not hold up start-up and every later poll for
        ``first_byte_timeout_s``."""
        assert self.session is not None
        timeout = aiohttp.ClientTimeout(total=self.config.health_probe_timeout_s)
        for node in self.router.nodes:
            try:
                async with self.session.get(node.url + "/v1/models", timeout=timeout) as response:
                    data = await response.json(content_type=None)
                entry = data["data"][0]
                max_model_len = int(entry.get("max_model_len") or 0)
            except (
                aiohttp.ClientError,
                TimeoutError,
                ValueError,
                LookupError,
                TypeError,
                AttributeError,  # an entry that is not an object
            ):
                continue  # not up, or not answering as an OpenAI server: ask again next poll
            node.max_model_len = max_model_len
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

    def _not_operator(self, request: web.Request) -> web.Response | None:
        """The refusal of a ``/status`` or ``/metrics`` request without the
        operator's token; None: let it through."""
        if self.gateway.operator(request.headers.get("Authorization")) is False:
            self.bad_requests["not_operator"] = self.bad_requests.get("not_operator", 0) + 1
            return error(
                401,
                f"{request.path} needs the operator's token (operator_token in kvtier route's "
                "config), not a tenant's key",
                "authentication_error",
            )
        return None

    async def _metrics(self, request: web.Request) -> web.Response:
        refusal = self._not_operator(request)
        if refusal is not None:
            return refusal
        for node in self.router.nodes:
            self.metrics.inflight.labels(node.name).set(node.queue.tokens)
        return web.Response(body=generate_latest(self.metrics.registry), content_type="text/plain")

    async def _status(self, request: web.Request) -> web.Response:
        refusal = self._not_operator(request)
        if refusal is not None:
            return refusal
        body = {
            "router": self.router.status(),
            "gateway": self.gateway.status(),
            "events": {
                f"{self.specs[n].name}/{kind}": sub.status() for n, kind, sub in self.subscribers
            },
            "cache_servers": self.cache_servers.status(),
            "bad_requests": dict(self.bad_requests),
        }
        return web.json_response(body, dumps=lambda o: json.dumps(o, default=str))

    def _bad(self, tenant: str, exc: BadRequest) -> web.Response:
        """A refused request, counted by reason (``/status``, ``/metrics``)."""
        self.bad_requests[exc.reason] = self.bad_requests.get(exc.reason, 0) + 1
        self.metrics.requests.labels(tenant, exc.reason).inc()
        return error(exc.status, str(exc), exc.kind)

    def _rate_limited(self, tenant: Tenant, admission: Admission, prompt: int) -> web.Response:
        self.metrics.requests.labels(tenant.name, f"rate_limited_{admission.refusal}").inc()
        self.gateway.count(tenant, "rate_limited")
        if admission.retry_after_s is None:
            return error(
                429,
                f"a {prompt}-token prompt is more than tenant {tenant.name!r} may send at once",
                "rate_limit_exceeded",
            )
        return error(
            429,
            f"tenant {tenant.name!r} is over its {admission.refusal.replace('_', ' ')} rate",
            "rate_limit_exceeded",
            **{"Retry-After": retry_after(admission.retry_after_s)},
        )

    async def _generate(self, request: web.Request) -> web.StreamResponse:
        tenant = self.gateway.authenticate(request.headers.get("Authorization"))
        if tenant is None:
            unknown = BadRequest(
                "missing or unknown API key", "unauthorized", 401, "authentication_error"
            )
            return self._bad("-", unknown)
        chat = ROUTES[request.path] == "chat"
        try:  # everything that needs no engine, before anything is charged
            body = read_body(await self._read(request))
            check_body(body, self.model)
            if chat:
                check_chat(body)
            prompt = None if chat else check_prompt(body.get("prompt"))
            if isinstance(prompt, list):  # token ids: the length is known now
                self._check_length(len(prompt), body)
        except BadRequest as exc:
            return self._bad(tenant.name, exc)
        admission = self.gateway.admit_request(tenant)
        if not admission.admitted:
            return self._rate_limited(tenant, admission, 0)
        assert self.tokenizer is not None
        try:
            if prompt is None:
                tokens = await self.tokenizer.chat(body)
            elif isinstance(prompt, str):
                tokens = await self.tokenizer.completion(prompt)
            else:
                tokens = prompt  # token ids: the engine's own
            self._check_length(len(tokens), body)
        except BadRequest as exc:  # the request token stays taken: it paid for the tokenizing
            return self._bad(tenant.name, exc)
        except EnginesUnavailable as exc:
            self.gateway.give_back_request(tenant)  # not the tenant's doing
            return error(503, str(exc), "engine_unavailable")
        admission = self.gateway.admit_prompt(tenant, len(tokens))
        if not admission.admitted:
            return self._rate_limited(tenant, admission, len(tokens))
        body["cache_salt"] = tenant.spec.cache_salt
        if not chat:
            body["prompt"] = tokens  # the engine sees exactly what was hashed
        if not body.get("model"):
            body["model"] = self.model
        return await self._dispatch(request, tenant, body, np.asarray(tokens, dtype=np.uint32))

    async def _read(self, request: web.Request) -> bytes:
        try:
            return await request.read()
        except web.HTTPRequestEntityTooLarge:
            limit = self.config.max_body_bytes
            raise BadRequest(
                f"the body is over {limit} bytes (max_body_bytes)", "body_too_large", 413
            ) from None

    def _check_length(self, prompt: int, body: dict[str, Any]) -> None:
        """``BadRequest`` if the prompt and the tokens asked for pass every engine's context."""
        lengths = [n.max_model_len for n in self.router.nodes if n.max_model_len]
        output = output_tokens(body)
        if lengths and prompt + output > max(lengths):
            raise BadRequest(
                f"the prompt is {prompt} tokens and asks for up to {output} more; "
                f"the engines' context is {max(lengths)} tokens: shorten the prompt or max_tokens",
                "too_long",
            )

    async def _dispatch(
        self, request: web.Request, tenant: Tenant, body: dict[str, Any], tokens: np.ndarray
    ) -> web.StreamResponse:
        assert self.relay is not None
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
                response, outcome = await self.relay.forward(request, node, routed, body)
            except EngineFailed as exc:
                self._engine_failed(node, exc)
                continue
            self.metrics.requests.labels(tenant.name, outcome).inc()
            self.gateway.count(tenant, outcome)
            return response

    def _engine_failed(self, node: Node, exc: EngineFailed) -> None:
        """Take an engine out for ``down_s``: it failed a request (or a tokenizing)."""
        self.router.failed(node.index, exc.reason)
        self.metrics.engine_failures.labels(node.name, exc.reason).inc()
        log.warning("route: engine %s failed (%s: %s); out for down_s", node.name, exc.reason, exc)

    def _count_plan(self, routed: Routed) -> None:
        decision = routed.decision
        self.metrics.routed.labels(self.router.nodes[decision.node].name).inc()
        self.metrics.planned.labels("prefill").inc(decision.prefill_tokens)
        for tier, tokens in decision.loaded.items():
            self.metrics.planned.labels(tier).inc(tokens)

    def _prefetch(self, node: Node, routed: Routed, salt: str) -> None:
        """Start the L2 -> L1 loads the plan counts on (fire and forget)."""
        assert self.session is not None
        decision = routed.decision
        if not node.cache_url or not any(t not in ("L1", ENGINE) for t in decision.loaded):
            return
        reported = self.router.namespace or {}
        label = NamespaceLabel.named(str(reported.get("model", "")), salt)
        payload = {
            "model": label.model,
            "salt": label.salt,
            "hashes": [h.hex() for h in routed.hashes[: decision.load_chunks]],
        }
        task = asyncio.create_task(self.cache_servers.prefetch(self.session, node, payload))
        self._tasks.append(task)
        task.add_done_callback(self._tasks.remove)


# pd-proxy answers errors in the same shape.
__all__ = ["RouterService"]
