"""The replay client against a small streaming server that speaks vLLM's
``/v1/completions`` stream (token ids per chunk, a final usage chunk): TTFT,
ITL, token ids, cached tokens, arrival times, and failures as results."""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

from aiohttp import web

from kvtier.bench.replay import replay
from kvtier.traces import TraceRequest


async def completions(request: web.Request) -> web.StreamResponse:
    body: dict[str, Any] = await request.json()
    if body["prompt"][0] == 0:
        return web.json_response({"error": "bad prompt"}, status=400)
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await response.prepare(request)
    await asyncio.sleep(0.05)  # "prefill"
    tokens = [t + 1 for t in body["prompt"][: body["max_tokens"]]]  # a fake model
    if body["prompt"][0] == 9:
        tokens = tokens[:-1]  # one token short
    for token in tokens:
        chunk = {"choices": [{"text": "x", "token_ids": [token]}]}
        await response.write(f"data: {json.dumps(chunk)}\n\n".encode())
        await asyncio.sleep(0.01)
    usage = {"prompt_tokens": len(body["prompt"]), "prompt_tokens_details": {"cached_tokens": 2}}
    await response.write(f"data: {json.dumps({'choices': [], 'usage': usage})}\n\n".encode())
    await response.write(b"data: [DONE]\n\n")
    return response


async def serve_and_replay(trace: list[TraceRequest]) -> tuple[list[Any], float]:
    app = web.Application()
    app.router.add_post("/v1/completions", completions)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    try:
        started = time.perf_counter()
        results = await replay(f"http://127.0.0.1:{port}", "m", trace, started=started)
        return results, time.perf_counter() - started
    finally:
        await runner.cleanup()


def test_replay_measures_each_request() -> None:
    trace = [
        TraceRequest("a", 0.0, (5, 6, 7, 8), 3),
        TraceRequest("b", 0.3, (1, 2), 2),
        TraceRequest("bad", 0.0, (0, 1), 1),
        TraceRequest("short", 0.0, (9, 9, 9), 3),
    ]
    results, elapsed = asyncio.run(serve_and_replay(trace))
    a, b, bad, short = results
    assert a.tokens == [6, 7, 8] and b.tokens == [2, 3]
    assert a.ok and b.ok and a.cached_tokens == 2 and a.prompt_tokens == 4
    # lower bounds only: the server's own sleeps and the trace's arrival times
    assert a.ttft_s is not None and a.ttft_s >= 0.05
    assert len(a.itls()) == 2 and all(gap >= 0.005 for gap in a.itls())
    assert b.sent_s >= b.arrival_s == 0.3 and a.sent_s < b.sent_s  # sent at their arrival
    assert elapsed >= 0.35
    assert not bad.ok and bad.error is not None and bad.error.startswith("HTTP 400")
    assert not short.ok and short.error == "2 tokens came back, not 3"


def test_unreachable_server_is_a_failed_result() -> None:
    results = asyncio.run(replay("http://127.0.0.1:9", "m", [TraceRequest("a", 0.0, (1,), 1)]))
    assert not results[0].ok and results[0].error is not None
    assert results[0].error.startswith("ClientConnectorError")
