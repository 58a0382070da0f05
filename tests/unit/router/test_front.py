"""``kvtier route``'s HTTP front over stand-in engines: tenants, limits,
salts, streaming, failover and bad input."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from kvtier.router.app import RouterService
from kvtier.router.config import RouterConfig
from tests.unit.router.standin import StandIn, tokenize

OPERATOR = "operator-token"
TENANTS = (
    {"name": "acme", "api_keys": ["key-acme"], "salt": "acme-salt"},
    # rates slow enough that nothing refills while a test runs on a busy machine
    {"name": "beta", "api_keys": ["key-beta"], "requests_per_s": 0.01, "request_burst": 2},
    {
        "name": "tiny",
        "api_keys": ["key-tiny"],
        "prompt_tokens_per_s": 0.1,
        "prompt_token_burst": 20,
    },
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
        operator_token=options.pop("operator_token", OPERATOR),
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


async def get(url: str, token: str | None = OPERATOR) -> tuple[int, bytes]:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    async with aiohttp.ClientSession() as session, session.get(url, headers=headers) as response:
        return response.status, await response.read()


async def until(condition: Callable[[], bool], timeout_s: float = 30.0) -> None:
    """Wait for ``condition`` (a generous deadline: the machine may be busy)."""
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not condition():
        assert asyncio.get_running_loop().time() < deadline, "condition not met in time"
        await asyncio.sleep(0.02)


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
            queue = service.router.nodes[0].queue
            assert (queue.tokens, queue.requests) == (0, 0)
            assert queue.wait_s(time.monotonic()) == 0.0

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
            status, text = await get(url + "/metrics")
            assert status == 200
            assert (
                b'kvtier_route_engine_failures_total{engine="broken",reason="http_503"} 1.0' in text
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
                headers = {"Authorization": f"Bearer {OPERATOR}"}
                async with session.get(url + "/status", headers=headers) as response:
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


def test_a_client_that_leaves_a_stream_costs_the_engine_nothing() -> None:
    """Issue 41 #1: the failed write to the client ends that request only;
    the engine's stream is closed and the engine stays in."""

    async def test() -> None:
        engine = StandIn("only", stream_chunks=3000)  # 30 s of stream if nobody stops it
        async with front([engine]) as (url, service):
            headers = {"Authorization": "Bearer key-acme"}
            body = {"prompt": "x", "stream": True}
            async with (
                aiohttp.ClientSession() as session,
                session.post(url + "/v1/completions", json=body, headers=headers) as response,
            ):
                assert response.status == 200
                assert (await response.content.readany()).startswith(b"data: ")
                response.close()  # the client goes away mid-stream
            node = service.router.nodes[0]
            await until(lambda: engine.streams_cut == 1 and node.inflight_requests == 0)
            assert node.failures == {} and node.live(0.0)
            assert service.router.status()["nodes"][0]["live"]  # type: ignore[index]
            status, _, _ = await post(url + "/v1/completions", {"prompt": "y"})
            assert status == 200  # every other tenant is still served
            assert service.gateway.tenants["acme"].counts == {"client_gone": 1, "ok": 1}

    run(test)


def test_text_and_chat_are_tokenized_by_any_live_engine() -> None:
    """Issue 41 #2: with engine 0 down, tokenizing fails over to engine 1."""

    async def test() -> None:
        down, up = StandIn("down"), StandIn("up")
        async with front([down, up]) as (url, service):
            await down.stop()
            status, _, data = await post(url + "/v1/completions", {"prompt": "hello"})
            assert status == 200, data
            assert answer(data) == {
                "engine": "up",
                "cache_salt": "acme-salt",
                "prompt": tokenize("hello"),
            }
            chat = {"messages": [{"role": "user", "content": "hi"}]}
            status, _, data = await post(url + "/v1/chat/completions", chat)
            assert status == 200, data
            assert up.tokenized == 2 and down.tokenized == 0
            assert service.router.nodes[0].failures == {"unreachable": 1}  # taken out once
            # A prompt every engine's /tokenize chokes on (the stand-in answers 500)
            # is the prompt's fault: a 400, and the engine stays in.
            status, _, data = await post(url + "/v1/chat/completions", {"messages": [{}]})
            assert status == 400 and b"could not tokenize" in data
            assert service.router.nodes[1].failures == {}
            await up.stop()  # nobody left: a clear 503, and the request is not charged
            status, _, data = await post(url + "/v1/completions", {"prompt": "x"}, key="key-beta")
            assert status == 503 and b"tokenize" in data

    run(test)


def test_an_engines_5xx_to_tokenize_is_asked_of_another_and_charges_nobody() -> None:
    """Found by the robustness harness: a /tokenize an engine answered 503
    (it had held it while silent, then came back) was the client's 400. A
    5xx may be the engine's trouble: the next engine is asked; no engine is
    charged, so a prompt that makes every template fail still cannot take
    engines out (test_text_and_chat_are_tokenized_by_any_live_engine)."""

    async def test() -> None:
        troubled, fine = StandIn("troubled", tokenize_status=503), StandIn("fine")
        async with front([troubled, fine]) as (url, service):
            for _ in range(3):
                status, _, data = await post(url + "/v1/completions", {"prompt": "hello"})
                assert status == 200, data
            assert troubled.tokenized == 0 and fine.tokenized >= 1
            assert [n.failures for n in service.router.nodes] == [{}, {}]

    run(test)


def test_a_request_over_its_rate_is_refused_before_it_is_tokenized() -> None:
    """Issue 41 #3: the request bucket is asked first: no /tokenize call for a 429."""

    async def test() -> None:
        engine = StandIn("e0")
        async with front([engine]) as (url, _):
            completions = url + "/v1/completions"
            codes = [
                (await post(completions, {"prompt": "x"}, key="key-beta"))[0] for _ in range(4)
            ]
            assert codes == [200, 200, 429, 429]
            assert engine.tokenized == 2

    run(test)


def test_engine_internal_fields_are_refused_naming_the_field() -> None:
    """Issue 41 #5: a tenant cannot set what only kvtier and the engine may."""

    async def test() -> None:
        engine = StandIn("e0")
        async with front([engine]) as (url, service):
            for name, value in (
                ("kv_transfer_params", {"do_remote_prefill": True, "remote_handoff": "x"}),
                ("priority", -100),
                ("request_id", "someone-elses"),
                ("vllm_xargs", {"a": 1}),
                ("prompt_embeds", "AAAA"),
            ):
                status, _, data = await post(url + "/v1/completions", {"prompt": "x", name: value})
                assert status == 400 and f"'{name}' may not be set".encode() in data, data
            chat = {
                "messages": [{"role": "user", "content": "hi"}],
                "kv_transfer_params": {"prompt_token_ids": list(range(5000))},
            }
            status, _, data = await post(url + "/v1/chat/completions", chat)
            assert status == 400 and b"kv_transfer_params" in data
            status, _, data = await post(
                url + "/v1/chat/completions", {**chat, "chat_template": "x"}
            )
            assert status == 400
            assert engine.seen == [] and engine.tokenized == 0  # nothing reached the engine
            assert service.bad_requests == {"engine_field": 7}

    run(test)


def test_status_and_metrics_need_the_operator_token() -> None:
    """Issue 41 #11: tenants' names and counts and the engines' URLs are the
    operator's to read; /health stays open."""

    async def test() -> None:
        async with front([StandIn("e0")]) as (url, _):
            assert (await post(url + "/v1/completions", {"prompt": "x"}))[0] == 200
            for path in ("/status", "/metrics"):
                assert (await get(url + path, token=None))[0] == 401
                assert (await get(url + path, token="key-acme"))[0] == 401  # a tenant's key
                status, data = await get(url + path)
                assert status == 200 and b"acme" in data
            assert (await get(url + "/health", token=None))[0] == 200
        async with front([StandIn("e0")], operator_token="") as (url, _):
            status, data = await get(url + "/status", token="key-acme")
            assert status == 401 and b"operator_token" in data  # none set: nobody reads it
        async with front([StandIn("e0")], tenants=(), operator_token="") as (url, _):
            assert (await get(url + "/status", token=None))[0] == 200  # a single-team router

    run(test)


def test_deep_json_and_out_of_range_token_ids_are_400_and_charge_nothing() -> None:
    """Issue 41 #18: 400 with a message, the tenant's rate tokens untouched."""

    async def test() -> None:
        engine = StandIn("e0")
        async with front([engine]) as (url, service):
            completions = url + "/v1/completions"
            deep = b'{"prompt": "x", "extra": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
            for raw, message in (
                (deep, b"nests"),
                (b'{"prompt": ' + b"[" * 150 + b"1" + b"]" * 150 + b"}", b"nests"),
                (json.dumps({"prompt": [1, 2**32]}).encode(), b"token id"),
                (json.dumps({"prompt": [[5, 2**64]]}).encode(), b"token id"),
                (json.dumps({"prompt": [-1]}).encode(), b"token id"),
                (json.dumps({"prompt": [1] * 5000}).encode(), b"context is 4096"),
                (b'{"prompt": "x", "max_tokens": NaN}', b"not JSON"),
                (json.dumps({"prompt": "x", "max_tokens": "9"}).encode(), b"max_tokens"),
                (json.dumps({"prompt": "x", "stream": "yes"}).encode(), b"stream"),
                (json.dumps({"prompt": "x", "model": ["m"]}).encode(), b"model"),
            ):
                status, _, data = await post(completions, None, key="key-beta", raw=raw)
                assert status == 400 and message in data, (raw[:40], status, data)
                assert json.loads(data)["error"]["code"] == 400
            # beta's burst of 2 requests is whole: nothing was charged
            codes = [
                (await post(completions, {"prompt": [1, 2]}, key="key-beta"))[0] for _ in "abc"
            ]
            assert codes == [200, 200, 429]
            assert engine.tokenized == 0 and len(engine.seen) == 2
            assert service.router.nodes[0].failures == {}

    run(test)


def test_a_long_non_streamed_answer_is_a_504_not_an_engine_failure() -> None:
    """Its first byte is its last: the wait is the generation the client asked
    for. Taking the engine out (and retrying on the next) would let one tenant's
    long answers take every engine out in turn."""

    async def test() -> None:
        slow = [StandIn("a", stall_s=3), StandIn("b", stall_s=3)]
        async with front(slow, first_byte_timeout_s=0.5) as (url, service):
            status, _, data = await post(url + "/v1/completions", {"prompt": "x"})
            assert status == 504 and b"stream" in data
            assert [n.failures for n in service.router.nodes] == [{}, {}]
            assert len(slow[0].seen) + len(slow[1].seen) == 1  # not sent again
            assert service.gateway.tenants["acme"].counts == {"timed_out": 1}

    run(test)


def test_a_body_past_max_body_bytes_is_413_and_never_parsed() -> None:
    """One request may not make the router parse (and hold) tens of MiB: a
    list of token ids costs about ten times its bytes in memory."""

    async def test() -> None:
        engine = StandIn("e0")
        async with front([engine]) as (url, service):
            raw = b'{"prompt": "x", "pad": "' + b"a" * (17 << 20) + b'"}'
            status, _, data = await post(url + "/v1/completions", None, key="key-beta", raw=raw)
            assert status == 413 and b"max_body_bytes" in data
            assert engine.seen == [] and service.bad_requests == {"body_too_large": 1}

    run(test)


# Issue 55 #4: a silent engine (it accepts connections and answers nothing, not
# even /health) is found by the /health probes while a request waits, taken
# out, and the request answered elsewhere; a busy one (it answers /health) is not.
# Frequent probes; a timeout with room, since on a busy machine the good engine
# is probed too and must not be called silent.
QUICK_PROBES = {"health_probe_interval_s": 0.05, "health_probe_timeout_s": 2.0}


@pytest.mark.parametrize("stream", [False, True])
def test_a_silent_engine_is_taken_out_and_the_request_answered_elsewhere(stream: bool) -> None:
    """first_byte_timeout_s is long: only the probes can find the silent
    engine (the old router gave a non-streamed request a 504 after it, kept
    the engine in, and the next request to it waited again: 504, 200, 504...)."""

    async def test() -> None:
        silent, good = StandIn("silent", silent=True), StandIn("good")
        options = {"policy": "round_robin", "first_byte_timeout_s": 60.0, "down_s": 600.0}
        async with front([silent, good], **options, **QUICK_PROBES) as (url, service):
            for _ in range(6):  # token ids: no /tokenize, every request is routed
                body = {"prompt": [1, 2, 3], "stream": stream}
                status, _, data = await post(url + "/v1/completions", body)
                assert status == 200, data
                engine = answer(data) if not stream else json.loads(_first_event(data))
                assert engine["engine"] == "good"
            assert silent.unanswered.count("/v1/completions") == 1  # then it was out
            assert service.router.nodes[0].failures == {"silent": 1}
            assert service.router.nodes[1].failures == {}
            assert service.gateway.tenants["acme"].counts == {"ok": 6}
            _, text = await get(url + "/metrics")
            assert b'engine_failures_total{engine="silent",reason="silent"} 1.0' in text

    run(test)


def test_a_silent_engine_asked_to_tokenize_is_taken_out_and_another_tokenizes() -> None:
    async def test() -> None:
        silent, good = StandIn("silent", silent=True), StandIn("good")
        async with front([silent, good], first_byte_timeout_s=60.0, **QUICK_PROBES) as (
            url,
            service,
        ):
            status, _, data = await post(url + "/v1/completions", {"prompt": "hello"})
            assert status == 200, data
            assert answer(data)["engine"] == "good"
            assert silent.unanswered.count("/tokenize") == 1 and good.tokenized == 1
            assert service.router.nodes[0].failures == {"silent": 1}

    run(test)


def test_a_slow_engine_that_answers_health_gives_a_504_and_stays_in() -> None:
    """Probed many times while the answer is slow (a generous probe timeout:
    the probe answers at once however busy the machine is)."""

    async def test() -> None:
        slow = StandIn("slow", stall_s=3)
        probes = {"health_probe_interval_s": 0.05, "health_probe_timeout_s": 30.0}
        async with front([slow], first_byte_timeout_s=0.5, **probes) as (url, service):
            status, _, data = await post(url + "/v1/completions", {"prompt": [1, 2]})
            assert status == 504 and b"first_byte_timeout_s" in data
            assert slow.health_checks >= 1 and len(slow.seen) == 1
            node = service.router.nodes[0]
            assert node.failures == {} and node.live(time.monotonic())
            assert service.gateway.tenants["acme"].counts == {"timed_out": 1}

    run(test)


def _first_event(data: bytes) -> str:
    """The text of a stream's first event (the stand-in's answer)."""
    first = data.decode().split("\n\n")[0][len("data: ") :]
    return str(json.loads(first)["choices"][0]["text"])


# Issue 55 #6: a chat's count is everything its template renders.
def chat(content: str = "hi", **fields: Any) -> dict[str, Any]:
    return {"messages": [{"role": "user", "content": content}], **fields}


def test_documents_and_tools_are_counted_against_the_budget_and_the_context() -> None:
    """tiny's budget is 20 prompt tokens at once; "hi" is 20 as the stand-in
    counts. The old router counted only the messages: 240 KB of documents
    passed the budget and the context check, and the engine prefilled them."""

    async def test() -> None:
        engine = StandIn("e0")
        async with front([engine]) as (url, service):
            chats = url + "/v1/chat/completions"
            documents = [{"title": "a", "text": "x" * 400}]
            tools = [{"type": "function", "function": {"name": "f", "description": "y" * 400}}]
            for fields in ({"documents": documents}, {"tools": tools}):
                status, headers, data = await post(chats, chat(**fields), key="key-tiny")
                assert status == 429 and b"at once" in data, (fields.keys(), data)
                assert "Retry-After" not in headers  # more than the budget ever holds
            huge = [{"title": "t", "text": "z" * 240_000}]
            for fields in (
                {"documents": huge},
                {"chat_template_kwargs": {"documents": huge}},
            ):
                status, _, data = await post(chats, chat(**fields))
                assert status == 400 and b"context is 4096 tokens" in data, data
            assert engine.seen == []  # nothing was prefilled
            status, _, data = await post(chats, chat(), key="key-tiny")
            assert status == 200, data
            status, _, data = await post(chats, chat(documents=[{"text": "short"}]))
            assert status == 200, data
            assert engine.seen[-1]["documents"] == [{"text": "short"}]  # sent on as given
            assert service.bad_requests == {"too_long": 2}

    run(test)


def test_chat_fields_the_router_cannot_count_are_refused_by_name() -> None:
    async def test() -> None:
        engine = StandIn("e0")
        async with front([engine]) as (url, service):
            chats = url + "/v1/chat/completions"
            image = {"type": "image_url", "image_url": {"url": "http://x/y.png"}}
            parts = [{"type": "text", "text": "what is this?"}, image]
            for body, named in (
                ({"messages": [{"role": "user", "content": parts}]}, b"messages[0].content[1]"),
                (
                    {"messages": [{"role": "user", "content": [{"input_audio": {"data": ""}}]}]},
                    b"'input_audio' part",
                ),
                (chat(chat_template_kwargs={"chat_template": "{{ '' }}"}), b"chat_template"),
                (chat(chat_template_kwargs=[1]), b"chat_template_kwargs"),
                (chat(documents="a" * 1000), b"documents"),
            ):
                status, _, data = await post(chats, body)
                assert status == 400 and named in data, (body, data)
            assert engine.seen == [] and engine.tokenized == 0
            assert service.bad_requests == {"uncounted_field": 3, "bad_prompt": 2}
            text_parts = {"messages": [{"role": "user", "content": parts[:1]}]}
            assert (await post(chats, text_parts))[0] == 200  # text parts are counted

    run(test)
