"""``kvtier pd-proxy`` over stand-in prefill and decode engines that answer as
vLLM does (the real engines run in ``tests/integration/test_vllm_pd.py``):
what each engine is sent, how the answer is joined, and every failure's
answer."""

from __future__ import annotations

import asyncio
import inspect
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from kvtier.router.pd import PDProxy

PROMPT = [5, 6, 7, 8]
HANDOFF = {"do_remote_prefill": True, "kvtier_handoff": "h-1", "kvtier_prompt_tokens": 4}


@dataclass(eq=False)
class Engine:
    """Answers completions like vLLM: token ``100 + i`` for the i-th token it
    generates, text ``" w<token>"``; the prefill side names a hand-off."""

    prefill: bool
    status: int = 200
    handoff: dict[str, Any] | None = field(default_factory=lambda: dict(HANDOFF))
    outcome: dict[str, Any] = field(
        default_factory=lambda: {"kvtier_handoff": "h-1", "kvtier_handoff_outcome": "loaded"}
    )
    seen: list[dict[str, Any]] = field(default_factory=list)

    async def complete(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.seen.append(body)
        if self.status != 200:
            return web.json_response({"error": {"message": "Internal server error"}}, status=500)
        start = 100 if self.prefill else 101
        ids = list(range(start, start + body["max_tokens"]))
        choice = {"index": 0, "text": "".join(f" w{t}" for t in ids), "finish_reason": "length"}
        choice |= {"token_ids": ids, "prompt_token_ids": body["prompt"]}
        usage = {"prompt_tokens": len(body["prompt"]), "completion_tokens": len(ids)}
        head = {"id": "cmpl-1", "object": "text_completion", "created": 1, "model": "m"}
        if not body.get("stream"):
            params = self.handoff if self.prefill else self.outcome
            return web.json_response(
                {**head, "choices": [choice], "usage": usage, "kv_transfer_params": params}
            )
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        for token in ids:
            event = {**head, "choices": [{"index": 0, "text": f" w{token}", "token_ids": [token]}]}
            await response.write(f"data: {json.dumps(event)}\n\n".encode())
        await response.write(
            f"data: {json.dumps({**head, 'choices': [], 'usage': usage})}\n\n".encode()
        )
        await response.write(b"data: [DONE]\n\n")
        return response

    async def chat(self, request: web.Request) -> web.StreamResponse:
        """Chat completions like vLLM: the messages render as ``PROMPT``
        unless ``kv_transfer_params.prompt_token_ids`` forwards the ids."""
        body = await request.json()
        self.seen.append(body)
        forwarded = (body.get("kv_transfer_params") or {}).get("prompt_token_ids")
        prompt = forwarded or PROMPT
        start = 100 if self.prefill else 101
        limit = body.get("max_completion_tokens") or body["max_tokens"]
        ids = list(range(start, start + limit))
        text = "".join(f" w{t}" for t in ids)
        head = {"id": "chatcmpl-1", "object": "chat.completion", "created": 1, "model": "m"}
        usage = {"prompt_tokens": len(prompt), "completion_tokens": len(ids)}
        if not body.get("stream"):
            message = {"role": "assistant", "content": text}
            choice = {"index": 0, "message": message, "finish_reason": "length", "token_ids": ids}
            params = self.handoff if self.prefill else self.outcome
            answer = {**head, "choices": [choice], "usage": usage, "prompt_token_ids": prompt}
            return web.json_response({**answer, "kv_transfer_params": params})
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        chunk = {**head, "object": "chat.completion.chunk"}
        for token in ids:
            delta = {"index": 0, "delta": {"content": f" w{token}"}, "token_ids": [token]}
            await response.write(f"data: {json.dumps({**chunk, 'choices': [delta]})}\n\n".encode())
        last = {**chunk, "choices": [], "usage": usage}
        await response.write(f"data: {json.dumps(last)}\n\ndata: [DONE]\n\n".encode())
        return response


async def serve(app: web.Application) -> tuple[web.AppRunner, str]:
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    return runner, f"http://127.0.0.1:{runner.addresses[0][1]}"


def engine_app(engine: Engine) -> web.Application:
    app = web.Application()
    app.router.add_post("/v1/completions", engine.complete)
    app.router.add_post("/v1/chat/completions", engine.chat)
    return app


@asynccontextmanager
async def proxied(
    prefill: Engine, decode: Engine, **options: Any
) -> AsyncIterator[tuple[aiohttp.ClientSession, str]]:
    runners = []
    try:
        p_runner, p_url = await serve(engine_app(prefill))
        d_runner, d_url = await serve(engine_app(decode))
        runners += [p_runner, d_runner]
        admin = options.pop("fate", None)
        if admin is not None:
            app = web.Application()

            async def fate(request: web.Request) -> web.Response:
                return web.json_response({"id": (await request.json())["id"], **admin})

            app.router.add_post("/admin/handoff", fate)
            a_runner, a_url = await serve(app)
            runners.append(a_runner)
            options["cache_admin"] = a_url
        proxy_runner, url = await serve(PDProxy([p_url], [d_url], **options).app())
        runners.append(proxy_runner)
        async with aiohttp.ClientSession() as session:
            yield session, url
    finally:
        for runner in reversed(runners):
            await runner.cleanup()


async def ask(
    prefill: Engine, decode: Engine, body: dict[str, Any], **options: Any
) -> tuple[int, Any]:
    """One completion through the proxy: its status and JSON answer."""
    path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
    async with (
        proxied(prefill, decode, **options) as (session, url),
        session.post(url + path, json=body) as resp,
    ):
        return resp.status, await resp.json()


def synchronous(test: Callable[..., Awaitable[None]]) -> Callable[..., None]:
    """An async test as pytest runs it (no async plugin here)."""

    def run(*args: Any, **kwargs: Any) -> None:
        asyncio.run(test(*args, **kwargs))

    run.__name__, run.__doc__ = test.__name__, test.__doc__
    run.__signature__ = inspect.signature(test)  # type: ignore[attr-defined]
    return run


def request(**extra: Any) -> dict[str, Any]:
    return {"model": "m", "prompt": PROMPT, "max_tokens": 4, "temperature": 0, **extra}


@synchronous
async def test_prefill_gives_the_first_token_decode_the_rest() -> None:
    prefill, decode = Engine(prefill=True), Engine(prefill=False)
    status, answer = await ask(prefill, decode, request(return_token_ids=True))
    assert status == 200, answer
    (sent_prefill,), (sent_decode,) = prefill.seen, decode.seen
    assert sent_prefill["max_tokens"] == 1 and sent_prefill["return_token_ids"]
    assert sent_prefill["kv_transfer_params"] == {"do_remote_decode": True}
    assert sent_decode["prompt"] == [*PROMPT, 100]  # the prompt, then prefill's token
    assert sent_decode["max_tokens"] == 3
    assert sent_decode["kv_transfer_params"] == {**HANDOFF, "kvtier_on_failure": "recompute"}
    choice = answer["choices"][0]
    assert choice["token_ids"] == [100, 101, 102, 103] and choice["prompt_token_ids"] == PROMPT
    assert choice["text"] == " w100 w101 w102 w103"
    assert answer["usage"]["prompt_tokens"] == 4
    assert answer["usage"]["completion_tokens"] == 4  # one from prefill, three from decode
    assert answer["usage"]["kvtier_handoff"]["kvtier_handoff_outcome"] == "loaded"
    assert "kv_transfer_params" not in answer


@synchronous
async def test_a_stream_starts_with_the_prefill_token() -> None:
    prefill, decode = Engine(prefill=True), Engine(prefill=False)
    async with proxied(prefill, decode) as (session, url):
        body = request(stream=True, return_token_ids=True)
        async with session.post(url + "/v1/completions", json=body) as resp:
            lines = [line async for line in resp.content if line.startswith(b"data: {")]
    events = [json.loads(line[len(b"data: ") :]) for line in lines]
    tokens = [t for e in events for c in e["choices"] for t in c.get("token_ids") or []]
    assert tokens == [100, 101, 102, 103]
    assert events[-1]["usage"] == {"prompt_tokens": 4, "completion_tokens": 4, "total_tokens": 8}


@synchronous
async def test_one_token_or_a_stop_is_the_prefill_answer_alone() -> None:
    prefill, decode = Engine(prefill=True), Engine(prefill=False)
    _, answer = await ask(prefill, decode, request(max_tokens=1))
    assert answer["choices"][0]["text"] == " w100" and not decode.seen
    assert "token_ids" not in answer["choices"][0]  # not asked for


@synchronous
async def test_no_hand_off_is_recomputed_or_an_error_as_the_request_asks() -> None:
    prefill, decode = Engine(prefill=True, handoff={}), Engine(prefill=False)
    async with proxied(prefill, decode) as (session, url):
        async with session.post(url + "/v1/completions", json=request()) as resp:
            recomputed = await resp.json()
        async with session.post(
            url + "/v1/completions", json=request(kvtier_on_failure="error")
        ) as resp:
            failed = await resp.json()
            status = resp.status
    assert "kv_transfer_params" not in decode.seen[0]  # a plain request: decode prefills it
    assert recomputed["usage"]["kvtier_handoff"]["kvtier_handoff_cause"] == "not_offered"
    assert status == 502 and "could not publish" in failed["error"]["message"]
    assert len(decode.seen) == 1


@synchronous
async def test_a_decode_failure_names_the_cache_servers_word_for_it() -> None:
    prefill, decode = Engine(prefill=True), Engine(prefill=False, status=500)
    fate = {"state": "ended", "outcome": "expired"}
    status, failed = await ask(prefill, decode, request(), on_failure="error", fate=fate)
    assert status == 502
    message = failed["error"]["message"]
    assert "h-1" in message and "expired: its lease ended" in message
    assert decode.seen[0]["kv_transfer_params"]["kvtier_on_failure"] == "error"


@pytest.mark.parametrize(
    ("body", "words"),
    [
        (request(n=2), "n = 1"),
        (request(prompt=[[1, 2], [3]]), "one prompt"),
        (request(max_tokens=0), "max_tokens"),
        (request(kvtier_on_failure="maybe"), "kvtier_on_failure"),
        (request(echo=True), "echo"),
    ],
)
@synchronous
async def test_bad_requests_are_refused_naming_what_to_change(
    body: dict[str, Any], words: str
) -> None:
    prefill, decode = Engine(prefill=True), Engine(prefill=False)
    async with (
        proxied(prefill, decode) as (session, url),
        session.post(url + "/v1/completions", json=body) as resp,
    ):
        answer = await resp.json()
    assert resp.status == 400 and words in answer["error"]["message"]
    assert not prefill.seen


def test_a_proxy_needs_both_kinds_of_engine() -> None:
    with pytest.raises(ValueError, match="--prefill"):
        PDProxy([], ["http://d"])
    with pytest.raises(ValueError, match="--on-failure"):
        PDProxy(["http://p"], ["http://d"], on_failure="maybe")


def chat(**extra: Any) -> dict[str, Any]:
    messages = [{"role": "user", "content": "hello"}]
    return {"model": "m", "messages": messages, "max_completion_tokens": 4, **extra}


@synchronous
async def test_a_chat_is_rendered_once_and_its_ids_forwarded_to_decode() -> None:
    prefill, decode = Engine(prefill=True), Engine(prefill=False)
    status, answer = await ask(prefill, decode, chat(return_token_ids=True))
    assert status == 200, answer
    (sent_prefill,), (sent_decode,) = prefill.seen, decode.seen
    assert sent_prefill["max_completion_tokens"] == 1 and sent_prefill["return_token_ids"]
    assert sent_prefill["kv_transfer_params"] == {"do_remote_decode": True}
    assert sent_decode["messages"] == chat()["messages"]
    assert sent_decode["max_completion_tokens"] == 3 and "max_tokens" not in sent_decode
    forwarded = {**HANDOFF, "kvtier_on_failure": "recompute", "prompt_token_ids": [*PROMPT, 100]}
    assert sent_decode["kv_transfer_params"] == forwarded
    choice = answer["choices"][0]
    assert choice["message"] == {"role": "assistant", "content": " w100 w101 w102 w103"}
    assert choice["token_ids"] == [100, 101, 102, 103]
    assert answer["prompt_token_ids"] == PROMPT
    assert answer["usage"]["completion_tokens"] == 4 and answer["usage"]["prompt_tokens"] == 4
    assert answer["usage"]["kvtier_handoff"]["kvtier_handoff_outcome"] == "loaded"
    # Without a hand-off the decode engine still gets the ids, rendered once.
    prefill, decode = Engine(prefill=True, handoff={}), Engine(prefill=False)
    status, answer = await ask(prefill, decode, chat(max_tokens=2, max_completion_tokens=None))
    assert status == 200 and decode.seen[0]["kv_transfer_params"] == {
        "prompt_token_ids": [*PROMPT, 100]
    }
    assert decode.seen[0]["max_completion_tokens"] == 1
    assert "prompt_token_ids" not in answer and "token_ids" not in answer["choices"][0]


@synchronous
async def test_a_chat_stream_starts_with_the_prefill_token_as_a_delta() -> None:
    prefill, decode = Engine(prefill=True), Engine(prefill=False)
    async with proxied(prefill, decode) as (session, url):
        body = chat(stream=True, stream_options={"include_usage": True})
        async with session.post(url + "/v1/chat/completions", json=body) as resp:
            lines = [line async for line in resp.content if line.startswith(b"data: {")]
    events = [json.loads(line[len(b"data: ") :]) for line in lines]
    assert events[0]["object"] == "chat.completion.chunk"
    assert events[0]["choices"][0]["delta"] == {"role": "assistant", "content": " w100"}
    text = "".join(c["delta"].get("content", "") for e in events for c in e["choices"])
    assert text == " w100 w101 w102 w103"
    assert events[-1]["usage"] == {"prompt_tokens": 4, "completion_tokens": 4, "total_tokens": 8}


@pytest.mark.parametrize(
    ("body", "words"),
    [
        (chat(messages=[]), "messages"),
        (chat(max_completion_tokens=0), "max_completion_tokens"),
        (chat(tools=[{"type": "function"}]), "tools"),
        (chat(n=3), "n = 1"),
    ],
)
@synchronous
async def test_bad_chats_are_refused_naming_what_to_change(
    body: dict[str, Any], words: str
) -> None:
    prefill, decode = Engine(prefill=True), Engine(prefill=False)
    status, answer = await ask(prefill, decode, body)
    assert status == 400 and words in answer["error"]["message"]
    assert not prefill.seen
