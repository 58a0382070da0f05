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

from kvtier.router.body import MAX_DEPTH
from kvtier.router.pd.proxy import PDProxy
from tests.unit.router.standin import tokenize

PROMPT = [5, 6, 7, 8]
HANDOFF = {"do_remote_prefill": True, "kvtier_handoff": "h-1", "kvtier_prompt_tokens": 4}
MAX_TOKENS = 1024  # the stand-in's context: more is refused as vLLM refuses it
VOCABULARY = 50_000


@dataclass(eq=False)
class Engine:
    """Answers completions like vLLM: token ``100 + i`` for the i-th token it
    generates, text ``" w<token>"``; the prefill side names a hand-off. It
    refuses (400) what vLLM would refuse of the fields it reads, and can be
    made to fail: answer ``status``, answer 200 with ``answer`` (bytes that
    are not a completion), die after ``die_after`` streamed tokens, or
    stream a token every ``pace_s`` (``cut`` says whether its reader left)."""

    prefill: bool
    status: int = 200
    handoff: dict[str, Any] | None = field(default_factory=lambda: dict(HANDOFF))
    outcome: dict[str, Any] = field(
        default_factory=lambda: {"kvtier_handoff": "h-1", "kvtier_handoff_outcome": "loaded"}
    )
    answer: bytes | None = None
    die_after: int = -1
    pace_s: float = 0.0
    cut: bool = False
    seen: list[dict[str, Any]] = field(default_factory=list)

    def refusal(self, body: dict[str, Any], prompt: Any) -> web.Response | None:
        """vLLM's answer to a request it cannot serve, or the failure it was told to give."""
        if self.status != 200:
            message = {"message": f"the stand-in answers {self.status}", "code": self.status}
            return web.json_response({"error": message}, status=self.status)
        limit = body.get("max_completion_tokens") or body.get("max_tokens")
        valid_prompt = isinstance(prompt, list) and all(
            type(t) is int and 0 <= t < VOCABULARY for t in prompt
        )
        messages = body.get("messages", [{"role": "user", "content": ""}])
        valid_messages = isinstance(messages, list) and all(
            isinstance(m, dict) and isinstance(m.get("content"), str) for m in messages
        )
        valid_limit = isinstance(limit, int) and 1 <= limit <= MAX_TOKENS
        if not (valid_prompt and valid_messages and valid_limit):
            message = {"message": "bad max_tokens or prompt", "type": "BadRequestError"}
            return web.json_response({"error": {**message, "code": 400}}, status=400)
        return None

    async def stream(
        self, request: web.Request, events: list[dict[str, Any]], last: dict[str, Any]
    ) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        try:
            for i, event in enumerate(events):
                if i == self.die_after:
                    assert request.transport is not None
                    request.transport.close()  # the engine process died
                    return response
                await response.write(f"data: {json.dumps(event)}\n\n".encode())
                if self.pace_s:
                    await asyncio.sleep(self.pace_s)
            await response.write(f"data: {json.dumps(last)}\n\ndata: [DONE]\n\n".encode())
        except ConnectionError:
            self.cut = True
        return response

    async def complete(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.seen.append(body)
        prompt = body.get("prompt")
        prompt = tokenize(prompt) if isinstance(prompt, str) else prompt
        refused = self.refusal(body, prompt)
        if refused is not None:
            return refused
        if self.answer is not None:
            return web.Response(body=self.answer, content_type="application/json")
        start = 100 if self.prefill else 101
        ids = list(range(start, start + body["max_tokens"]))
        choice = {"index": 0, "text": "".join(f" w{t}" for t in ids), "finish_reason": "length"}
        choice |= {"token_ids": ids, "prompt_token_ids": prompt}
        usage = {"prompt_tokens": len(prompt), "completion_tokens": len(ids)}
        head = {"id": "cmpl-1", "object": "text_completion", "created": 1, "model": "m"}
        if not body.get("stream"):
            params = self.handoff if self.prefill else self.outcome
            return web.json_response(
                {**head, "choices": [choice], "usage": usage, "kv_transfer_params": params}
            )
        events = [
            {**head, "choices": [{"index": 0, "text": f" w{token}", "token_ids": [token]}]}
            for token in ids
        ]
        return await self.stream(request, events, {**head, "choices": [], "usage": usage})

    async def chat(self, request: web.Request) -> web.StreamResponse:
        """Chat completions like vLLM: the messages render as ``PROMPT``
        unless ``kv_transfer_params.prompt_token_ids`` forwards the ids."""
        body = await request.json()
        self.seen.append(body)
        forwarded = (body.get("kv_transfer_params") or {}).get("prompt_token_ids")
        prompt = forwarded or PROMPT
        refused = self.refusal(body, prompt)
        if refused is not None:
            return refused
        if self.answer is not None:
            return web.Response(body=self.answer, content_type="application/json")
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
        chunk = {**head, "object": "chat.completion.chunk"}
        events = [
            {**chunk, "choices": [{"index": 0, "delta": {"content": f" w{t}"}, "token_ids": [t]}]}
            for t in ids
        ]
        return await self.stream(request, events, {**chunk, "choices": [], "usage": usage})


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
        admin_status = options.pop("fate_status", 200)
        if admin is not None:
            app = web.Application()

            async def fate(request: web.Request) -> web.Response:
                if admin_status != 200:  # as kvtier serve's admin port refuses
                    return web.Response(status=admin_status, text="unauthorized\n")
                return web.json_response({"id": (await request.json())["id"], **admin})

            app.router.add_post("/admin/handoff", fate)
            a_runner, a_url = await serve(app)
            runners.append(a_runner)
            options["cache_admin"] = a_url
        proxy_runner, url = await serve(PDProxy([p_url], [d_url], **options).app())
        runners.append(proxy_runner)
        # A deadline for a stream that would never end (the proxy answers in milliseconds).
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as session:
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
        (request(max_tokens=True), "max_tokens"),
        (request(prompt=[1, True, 3]), "token ids"),
        (request(prompt=[1, -2]), "token ids"),
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


# ------------------------------------------- hostile clients, failing engines


FORGED = {"do_remote_prefill": True, "kvtier_handoff": "someone-elses", "kvtier_prompt_tokens": 3}


@pytest.mark.parametrize(
    "params",
    [FORGED, {"prompt_token_ids": list(range(5000))}, {"do_remote_decode": True}, "h-1", [1]],
)
@pytest.mark.parametrize("make", [request, chat])
@synchronous
async def test_a_clients_own_hand_off_parameters_are_refused(
    make: Callable[..., dict[str, Any]], params: Any
) -> None:
    """Engine-internal fields are the proxy's to set: a client's would take
    another request's hand-off, or prefill ids that no check has seen."""
    prefill, decode = Engine(prefill=True, handoff={}), Engine(prefill=False)
    status, answer = await ask(prefill, decode, make(kv_transfer_params=params))
    assert status == 400 and "kv_transfer_params" in answer["error"]["message"], answer
    assert not prefill.seen and not decode.seen


@pytest.mark.parametrize("empty", [None, {}])
@synchronous
async def test_only_what_the_prefill_engine_returned_goes_to_the_decode_engine(empty: Any) -> None:
    """An empty ``kv_transfer_params`` asks for nothing: served, and not passed on."""
    prefill, decode = Engine(prefill=True, handoff={}), Engine(prefill=False)
    status, _ = await ask(prefill, decode, request(kv_transfer_params=empty))
    assert status == 200
    assert prefill.seen[0]["kv_transfer_params"] == {"do_remote_decode": True}
    assert "kv_transfer_params" not in decode.seen[0]  # the prefill offered nothing
    prefill, decode = Engine(prefill=True), Engine(prefill=False)
    status, _ = await ask(prefill, decode, request(kv_transfer_params=empty))
    assert status == 200
    assert decode.seen[0]["kv_transfer_params"] == {**HANDOFF, "kvtier_on_failure": "recompute"}


async def engine_urls(session: aiohttp.ClientSession, url: str) -> tuple[str, str]:
    async with session.get(url + "/status") as resp:
        status = await resp.json()
    return status["prefill"][0]["url"], status["decode"][0]["url"]


async def counts(session: aiohttp.ClientSession, url: str) -> dict[str, int]:
    async with session.get(url + "/status") as resp:
        answer: dict[str, int] = (await resp.json())["requests"]
    return answer


def events_of(body: bytes) -> list[bytes]:
    """A stream's events, each ``data: ...``; it must be nothing else."""
    events = [e for e in body.split(b"\n\n") if e]
    assert all(e.startswith(b"data: ") and b"\n" not in e for e in events), body
    return [e[len(b"data: ") :] for e in events]


@pytest.mark.parametrize("make", [request, chat])
@synchronous
async def test_a_decode_engine_dying_mid_stream_ends_the_stream_with_an_error_event(
    make: Callable[..., dict[str, Any]],
) -> None:
    prefill, decode = Engine(prefill=True), Engine(prefill=False, die_after=1)
    body = make(stream=True)
    path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
    async with proxied(prefill, decode) as (session, url):
        async with session.post(url + path, json=body) as resp:
            status, streamed = resp.status, await resp.read()
        _, decode_url = await engine_urls(session, url)
        decode.die_after = -1
        async with session.post(url + path, json=body) as resp:
            again = events_of(await resp.read())
        requests = await counts(session, url)
    assert status == 200
    *tokens, failure, done = events_of(streamed)
    assert len(tokens) == 2 and done == b"[DONE]"  # the prefill's token, the decode's first
    message = json.loads(failure)["error"]["message"]
    assert json.loads(failure)["error"]["code"] == 502
    assert f"decode engine {decode_url} failed mid-stream" in message
    assert again[-1] == b"[DONE]" and len(again) == 6  # 4 tokens, usage, [DONE]
    assert requests == {"decode_failed.mid_stream": 1, "streamed": 1}


NOT_COMPLETIONS = [
    b"not json",
    b"[1, 2]",
    b'{"id": "x"}',
    json.dumps({"id": "c", "created": 1, "model": "m", "choices": []}).encode(),
    json.dumps(
        {
            "id": "c",
            "created": 1,
            "model": "m",
            "choices": [{"text": 5}],
            "usage": {"prompt_tokens": 4, "completion_tokens": 1},
        }
    ).encode(),
    b"[" * 100_000,
]
NOT_COMPLETION_IDS = ["text", "array", "no-choices", "empty-choices", "wrong-type", "deep"]


@pytest.mark.parametrize("answer", NOT_COMPLETIONS, ids=NOT_COMPLETION_IDS)
@synchronous
async def test_a_prefill_answer_that_is_not_a_completion_is_a_502_naming_the_engine(
    answer: bytes,
) -> None:
    prefill, decode = Engine(prefill=True, answer=answer), Engine(prefill=False)
    async with proxied(prefill, decode) as (session, url):
        async with session.post(url + "/v1/completions", json=request()) as resp:
            status, failed = resp.status, await resp.json()
        prefill_url, _ = await engine_urls(session, url)
    assert status == 502, failed
    assert f"the prefill engine {prefill_url} answered 200" in failed["error"]["message"]
    assert not decode.seen


@synchronous
async def test_a_prefill_answer_without_the_token_ids_is_a_502() -> None:
    """The decode engine's prompt is made of them: without, it would answer another prompt."""
    completion = {"id": "c", "created": 1, "model": "m", "choices": [{"text": " w100"}]}
    completion["usage"] = {"prompt_tokens": 4, "completion_tokens": 1}
    prefill = Engine(prefill=True, answer=json.dumps(completion).encode())
    decode = Engine(prefill=False)
    status, failed = await ask(prefill, decode, request())
    assert status == 502 and "prompt_token_ids" in failed["error"]["message"], failed
    assert not decode.seen


@pytest.mark.parametrize("answer", NOT_COMPLETIONS, ids=NOT_COMPLETION_IDS)
@synchronous
async def test_a_decode_answer_that_is_not_a_completion_is_a_502_naming_the_engine(
    answer: bytes,
) -> None:
    prefill, decode = Engine(prefill=True), Engine(prefill=False, answer=answer)
    async with proxied(prefill, decode) as (session, url):
        async with session.post(url + "/v1/completions", json=request()) as resp:
            status, failed = resp.status, await resp.json()
        _, decode_url = await engine_urls(session, url)
    assert status == 502, failed
    assert f"the decode engine {decode_url} answered 200" in failed["error"]["message"]


@synchronous
async def test_an_engines_refusal_of_the_clients_request_is_the_clients_answer() -> None:
    """A 4xx is the engine's word on what the client sent: passed on, not a 502.
    A refusal of the proxy's own credentials is the engine's failure."""
    prefill, decode = Engine(prefill=True, status=400), Engine(prefill=False)
    status, answer = await ask(prefill, decode, request())
    assert status == 400 and answer["error"]["message"] == "the stand-in answers 400"
    assert not decode.seen
    prefill, decode = Engine(prefill=True), Engine(prefill=False)
    status, answer = await ask(prefill, decode, request(max_tokens=MAX_TOKENS + 2))
    assert status == 400 and answer["error"]["type"] == "BadRequestError", answer
    assert decode.seen[0]["max_tokens"] == MAX_TOKENS + 1  # what the decode engine refused
    prefill, decode = Engine(prefill=True), Engine(prefill=False, status=400)
    async with proxied(prefill, decode) as (session, url):
        body = request(stream=True)
        async with session.post(url + "/v1/completions", json=body) as resp:
            assert resp.status == 400
    prefill, decode = Engine(prefill=True, status=401), Engine(prefill=False)
    status, answer = await ask(prefill, decode, request())
    assert status == 502 and "answered 401" in answer["error"]["message"]


def nested(depth: int) -> Any:
    value: Any = 1
    for _ in range(depth):
        value = [value]
    return value


@pytest.mark.parametrize(
    ("raw", "status", "words"),
    [
        pytest.param(b"[" * 100_000, 400, "deep", id="deep"),
        pytest.param(
            b'{"prompt": [1], "user": ' + b"[" * 50_000 + b"]" * 50_000 + b"}",
            400,
            "deep",
            id="deep-field",
        ),
        pytest.param(
            json.dumps(request(user=nested(MAX_DEPTH + 1))).encode(),
            400,
            "deep",
            id="past-the-limit",
        ),
        pytest.param(json.dumps(request(stream="yes")).encode(), 400, "stream", id="stream"),
        pytest.param(
            json.dumps(request(return_token_ids=1)).encode(), 400, "return_token_ids", id="ids"
        ),
        pytest.param(b"x" * (2 << 20), 413, "bytes", id="2MiB"),
        # Passed on, the engines would get what JSON has no word for.
        pytest.param(b'{"prompt": [1], "temperature": NaN}', 400, "NaN", id="nan"),
        pytest.param(b'{"prompt": [1], "temperature": 1e400}', 400, "too large", id="inf"),
    ],
)
@synchronous
async def test_malformed_bodies_are_refused_naming_what_to_change(
    raw: bytes, status: int, words: str
) -> None:
    prefill, decode = Engine(prefill=True), Engine(prefill=False)
    async with (
        proxied(prefill, decode) as (session, url),
        session.post(url + "/v1/completions", data=raw) as resp,
    ):
        answer = await resp.json()
    assert resp.status == status and words in answer["error"]["message"], answer
    assert not prefill.seen


async def eventually(probe: Callable[[], Awaitable[Any]], deadline_s: float = 60.0) -> Any:
    """``probe()``'s first true answer, asked until ``deadline_s``."""
    loop = asyncio.get_running_loop()
    end = loop.time() + deadline_s
    while True:
        answer = await probe()
        if answer or loop.time() > end:
            return answer
        await asyncio.sleep(0.02)


@synchronous
async def test_a_stream_client_that_leaves_ends_its_request_only() -> None:
    """Its decode stream is closed (the engine stops generating for nobody),
    the proxy counts it as the client's, and serves the next request."""
    prefill, decode = Engine(prefill=True), Engine(prefill=False, pace_s=0.01)
    async with proxied(prefill, decode) as (session, url):
        body = request(max_tokens=MAX_TOKENS, stream=True)
        async with session.post(url + "/v1/completions", json=body) as resp:
            assert (await resp.content.readline()).startswith(b"data: {")
            resp.close()  # the client leaves

        async def left() -> bool:
            return decode.cut and (await counts(session, url)).get("client_gone") == 1

        assert await eventually(left), (decode.cut, await counts(session, url))
        decode.pace_s = 0.0
        async with session.post(url + "/v1/completions", json=request()) as resp:
            assert resp.status == 200
        async with session.get(url + "/status") as resp:
            engines = await resp.json()
    assert engines["decode"][0]["in_flight"] == 0
    assert set(engines["requests"]) == {"client_gone", "loaded"}


@synchronous
async def test_a_cache_admin_refusing_the_proxy_is_not_a_hand_off_never_offered() -> None:
    prefill, decode = Engine(prefill=True), Engine(prefill=False, status=500)
    status, failed = await ask(
        prefill,
        decode,
        request(),
        on_failure="error",
        fate={},
        fate_status=401,
    )
    message = failed["error"]["message"]
    assert status == 502 and "never had" not in message
    assert "admin API answered 401" in message, message
