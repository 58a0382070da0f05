"""``kvtier route``'s HTTP front over stand-in engines: tenants, limits,
salts, streaming, failover and bad input."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any

import aiohttp
from aiohttp import web

from kvtier.router.app import RouterService
from kvtier.router.config import RouterConfig
from tests.unit.router.standin import StandIn, tokenize

TENANTS = (
    {"name": "acme", "api_keys": ["key-acme"], "salt": "acme-salt"},
    {"name": "beta", "api_keys": ["key-beta"], "requests_per_s": 1, "request_burst": 2},
    {"name": "tiny", "api_keys": ["key-tiny"], "prompt_tokens_per_s": 10, "prompt_token_burst": 20},
)


@asynccontextmanager
async def front(engines: list[StandIn], **options: Any) -> AsyncIterator[tuple[str, RouterService]]:
    for engine in engines:
        await engine.start()
    config = RouterConfig(
        port=0,
        engines=tuple({"name": e.name, "url": e.url} for e in engines),
        tenants=options.pop("tenants", TENANTS),
        policy=options.pop("policy", "least_loaded"),
        first_byte_timeout_s=options.pop("first_byte_timeout_s", 5.0),
        **options,
    )
    service = RouterService(config)
    runner = web.AppRunner(service.app())
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    try:
        yield f"http://127.0.0.1:{runner.addresses[0][1]}", service
    finally:
        await runner.cleanup()
        for engine in engines:
            await engine.stop()


def run(test: Callable[[], Awaitable[None]]) -> None:
    asyncio.run(test())


async def post(
    url: str, body: Any, key: str | None = "key-acme", raw: bytes | None = None
) -> tuple[int, dict[str, str], bytes]:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    async with aiohttp.ClientSession() as session:
        data = raw if raw is not None else json.dumps(body).encode()
        headers["Content-Type"] = "application/json"
        async with session.post(url, data=data, headers=headers) as response:
            return response.status, dict(response.headers), await response.read()


def answer(body: bytes) -> dict[str, Any]:
    return json.loads(json.loads(body)["choices"][0]["text"])  # type: ignore[no-any-return]


def test_the_tenant_salt_replaces_the_clients_and_tokens_are_pinned() -> None:
    async def test() -> None:
        engine = StandIn("e0")
        async with front([engine]) as (url, _):
            body = {"prompt": "hello", "max_tokens": 4, "cache_salt": "someone-else"}
            status, _, data = await post(url + "/v1/completions", body)
            assert status == 200
            got = answer(data)
            assert got["cache_salt"] == "acme-salt" and got["prompt"] == tokenize("hello")
            status, _, data = await post(url + "/v1/completions", body, key="key-beta")
            assert answer(data)["cache_salt"] == "beta"  # no salt given: the tenant's name

    run(test)


def test_bad_keys_and_bad_requests_get_clear_errors() -> None:
    async def test() -> None:
        async with front([StandIn("e0", max_model_len=64)]) as (url, service):
            completions = url + "/v1/completions"
            assert (await post(completions, {"prompt": "x"}, key=None))[0] == 401
            assert (await post(completions, {"prompt": "x"}, key="nope"))[0] == 401
            status, _, data = await post(completions, None, raw=b"{not json")
            assert status == 400 and b"not JSON" in data
            status, _, data = await post(completions, {"prompt": ["a", "b"]})
            assert status == 400 and b"separate requests" in data
            status, _, data = await post(completions, {"prompt": "y" * 80, "max_tokens": 10})
            assert status == 400 and b"context is 64 tokens" in data
            status, _, data = await post(url + "/v1/chat/completions", {"messages": []})
            assert status == 400 and b"messages" in data
            status, _, data = await post(completions, {"prompt": "x", "model": "other"})
            assert status == 404 and b"standin-model" in data
            counted = service.bad_requests
            assert counted == {
                "unauthorized": 2,
                "bad_json": 1,
                "bad_prompt": 2,
                "too_long": 1,
                "unknown_model": 1,
            }

    run(test)


def test_rate_limits_answer_429_with_retry_after() -> None:
    async def test() -> None:
        async with front([StandIn("e0")]) as (url, _):
            completions = url + "/v1/completions"
            codes = [
                (await post(completions, {"prompt": "x"}, key="key-beta"))[0] for _ in range(3)
            ]
            assert codes == [200, 200, 429]
            status, headers, data = await post(completions, {"prompt": "x"}, key="key-beta")
            assert status == 429 and int(headers["Retry-After"]) >= 1
            assert b"requests rate" in data
            # prompt tokens: a prompt over the whole burst can never pass
            status, headers, data = await post(completions, {"prompt": "z" * 30}, key="key-tiny")
            assert status == 429 and "Retry-After" not in headers and b"at once" in data
            assert (await post(completions, {"prompt": "z" * 15}, key="key-tiny"))[0] == 200
            status, headers, _ = await post(completions, {"prompt": "z" * 15}, key="key-tiny")
            assert status == 429 and int(headers["Retry-After"]) >= 1
            # another tenant is not held back
            assert (await post(completions, {"prompt": "x"}))[0] == 200

    run(test)


def test_streaming_passes_through_with_the_engine_named() -> None:
    async def test() -> None:
        async with front([StandIn("e0")]) as (url, service):
            body = {"messages": [{"role": "user", "content": "hi"}], "stream": True}
            status, headers, data = await post(url + "/v1/chat/completions", body)
            assert status == 200 and headers["X-Kvtier-Engine"] == "e0"
            events = [e for e in data.decode().split("\n\n") if e]
            assert events[-1] == "data: [DONE]" and len(events) == 5
            first = json.loads(json.loads(events[0][len("data: ") :])["choices"][0]["text"])
            assert first["cache_salt"] == "acme-salt"
            assert service.router.nodes[0].inflight_requests == 0
            assert service.router.nodes[0].inflight_tokens == 0
            assert abs(service.router.nodes[0].inflight_s) < 1e-9

    run(test)


def test_a_failing_engine_is_taken_out_and_the_request_goes_elsewhere() -> None:
    async def test() -> None:
        broken, good = StandIn("broken", fail_status=503), StandIn("good")
        async with front([broken, good], policy="round_robin") as (url, service):
            for _ in range(3):
                status, _, data = await post(url + "/v1/completions", {"prompt": "x"})
                assert status == 200 and answer(data)["engine"] == "good"
            assert len(broken.seen) == 1  # taken out after its failure
            nodes = service.router.status()["nodes"]
            assert nodes[0]["failures"] == {"http_503": 1}  # type: ignore[index]
            async with (
                aiohttp.ClientSession() as session,
                session.get(url + "/metrics") as response,
            ):
                text = await response.text()
            assert (
                'kvtier_route_engine_failures_total{engine="broken",reason="http_503"} 1.0' in text
            )

    run(test)


def test_a_silent_engine_times_out_and_another_answers() -> None:
    async def test() -> None:
        silent, good = StandIn("silent", stall_s=3), StandIn("good")
        async with front([silent, good], policy="round_robin", first_byte_timeout_s=0.5) as (
            url,
            service,
        ):
            status, _, data = await post(url + "/v1/completions", {"prompt": "x", "stream": True})
            assert status == 200 and b'\\"engine\\": \\"good\\"' in data
            assert service.router.nodes[0].failures == {"timeout": 1}

    run(test)


def test_an_engine_that_dies_mid_stream_ends_the_stream_with_an_error() -> None:
    async def test() -> None:
        async with front([StandIn("dying", die_after=2)]) as (url, service):
            body = {"prompt": "x", "stream": True}
            status, _, data = await asyncio.wait_for(post(url + "/v1/completions", body), 10)
            assert status == 200
            events = [e for e in data.decode().split("\n\n") if e]
            assert events[-1] == "data: [DONE]"
            assert "failed mid-stream" in events[-2]
            assert service.router.nodes[0].failures == {"broken": 1}
            # every engine is out: a clear 503, not a hang
            status, _, data = await post(url + "/v1/completions", body)
            assert status == 503 and b"no engine" in data

    run(test)


def test_models_health_and_status() -> None:
    async def test() -> None:
        async with front([StandIn("e0", max_model_len=128)]) as (url, _):
            async with aiohttp.ClientSession() as session:
                async with session.get(url + "/v1/models") as response:
                    models = await response.json()
                async with session.get(url + "/health") as response:
                    assert response.status == 200
                async with session.get(url + "/status") as response:
                    status = await response.json()
            assert models["data"][0] == {
                "id": "standin-model",
                "object": "model",
                "owned_by": "kvtier",
                "max_model_len": 128,
            }
            assert status["router"]["policy"] == "least_loaded"
            assert "key-acme" not in json.dumps(status)  # keys never shown

    run(test)
