"""The router reads a cache server's ``/status`` as a typed ``ServerStatus``:
a good one is read by attribute; one that does not fit is a counted
``bad_answer`` whose detail names the field, and the router keeps routing."""

from __future__ import annotations

import asyncio
import logging

import aiohttp
import msgspec
import pytest
from aiohttp import web

from kvtier.protocol import messages as p
from kvtier.protocol import status as s
from kvtier.router.cache_servers import CacheServers
from kvtier.router.core import Node
from kvtier.router.metrics import Metrics


def good_status() -> dict[str, object]:
    document = s.ServerStatus(
        boot_id="boot-1",
        protocol=p.PROTOCOL_VERSION,
        hash_algorithm=p.HASH_ALGORITHM,
        chunk_size=256,
        chunk_size_frozen=True,
        uptime_s=3.0,
        hash_namespaces=[
            s.HashNamespace(model="org/m", kv_dtype="bfloat16", layout="ab12", chunk_size=256)
        ],
        server=s.ServerCounts(lookups=2),
        storage=s.StorageStatus(
            l1=s.L1Status(), l2={}, store=s.StoreStatus(), prefetch=s.PrefetchStatus()
        ),
    )
    out: dict[str, object] = msgspec.to_builtins(document)
    return out


async def read(
    body: bytes, streamed: bool = False
) -> tuple[s.ServerStatus | None, CacheServers, Metrics]:
    """``read_status`` against a server whose ``/status`` answers ``body``
    (``streamed``: in chunks, its length not announced)."""

    async def answer(request: web.Request) -> web.StreamResponse:
        if not streamed:
            return web.Response(body=body, content_type="application/json")
        response = web.StreamResponse(headers={"Content-Type": "application/json"})
        response.enable_chunked_encoding()
        await response.prepare(request)
        for start in range(0, len(body), 1 << 14):
            await response.write(body[start : start + (1 << 14)])
        await response.write_eof()
        return response

    app = web.Application()
    app.router.add_get("/status", answer)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    url = f"http://127.0.0.1:{runner.addresses[0][1]}"
    node = Node(0, "e0", "http://127.0.0.1:1", cache_url=url)
    metrics = Metrics()
    servers = CacheServers([node], "", metrics)
    try:
        async with aiohttp.ClientSession() as session:
            return await servers.read_status(session, node), servers, metrics
    finally:
        await runner.cleanup()


def test_a_status_is_read_by_attribute() -> None:
    status, servers, _ = asyncio.run(read(msgspec.json.encode(good_status())))
    assert status is not None
    assert status.boot_id == "boot-1" and status.server.lookups == 2
    assert status.hash_namespaces[0].model == "org/m"
    assert servers.states[0].error == "" and servers.states[0].polls == 1


@pytest.mark.parametrize(
    ("change", "named"),
    [
        (lambda d: d.pop("boot_id"), "missing required field `boot_id`"),
        (lambda d: d["server"].update(lookups="two"), "`$.server.lookups`"),
        (lambda d: d.update(hash_namespaces=[{"model": 1}]), "`$.hash_namespaces[0].model`"),
        (lambda d: d["storage"].update(l1=[]), "`$.storage.l1`"),
    ],
)
def test_a_status_that_does_not_fit_is_refused_naming_the_field(
    change: object, named: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="kvtier.router.cache_servers")
    document = good_status()
    change(document)  # type: ignore[operator]
    status, servers, metrics = asyncio.run(read(msgspec.json.encode(document)))
    assert status is None
    state = servers.states[0]
    assert state.error == "bad_answer" and named in state.detail
    assert servers.status()["e0"]["detail"] == state.detail  # type: ignore[index]
    counted = metrics.registry.get_sample_value(
        "kvtier_route_cache_server_errors_total", {"engine": "e0", "reason": "bad_answer"}
    )
    assert counted == 1
    [warning] = [r for r in caplog.records if "cannot read cache server" in r.getMessage()]
    assert named in warning.getMessage()


def test_an_answer_that_is_not_json_is_a_bad_answer() -> None:
    status, servers, _ = asyncio.run(read(b"<html>proxy error</html>"))
    assert status is None
    assert servers.states[0].error == "bad_answer"
    assert "not JSON" in servers.states[0].detail


@pytest.mark.parametrize("streamed", [False, True])
def test_a_status_over_the_bound_is_a_bad_answer_naming_it(
    streamed: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    limit = 1 << 16
    monkeypatch.setattr("kvtier.router.cache_servers.MAX_STATUS_BYTES", limit)
    document = good_status()
    fits = msgspec.json.encode(document)
    assert len(fits) < limit
    status, _, _ = asyncio.run(read(fits, streamed))
    assert status is not None and status.boot_id == "boot-1"

    document["padding"] = "x" * (4 * limit)  # a field the reader does not know
    status, servers, metrics = asyncio.run(read(msgspec.json.encode(document), streamed))
    assert status is None
    state = servers.states[0]
    assert state.error == "bad_answer" and state.detail == f"/status is over {limit} bytes"
    counted = metrics.registry.get_sample_value(
        "kvtier_route_cache_server_errors_total", {"engine": "e0", "reason": "bad_answer"}
    )
    assert counted == 1


def test_a_status_nested_past_the_decoders_depth_is_a_bad_answer() -> None:
    """An unknown field is skipped, but its nesting still recurses: the
    RecursionError that raised out of the poll is a bad answer now."""
    body = msgspec.json.encode(good_status())
    deep = b'{"deep":' + b"[" * 100_000 + b"]" * 100_000 + b","
    status, servers, _ = asyncio.run(read(deep + body[1:]))
    assert status is None
    state = servers.states[0]
    assert state.error == "bad_answer" and "nests deeper" in state.detail
