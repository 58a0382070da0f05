"""Prefill/decode disaggregation end to end on vLLM's CPU build: a prefill
engine and a decode engine (each bound to its own core), both with the
kvtier connector, behind ``kvtier pd-proxy``, against one real
``kvtier serve``. Outputs equal the colocated engine's (same tokens,
|Δlogprob| <= 1e-4); failed hand-offs end with the request's policy; nothing
stays held on the server.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import threading
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from kvtier.bench.engines import Engine, EngineOptions, kvtier_transfer, vllm_servers
from kvtier.bench.stores import free_port
from tests.integration.harness import (
    Server,
    ServerFactory,
    engine_segments,
    post_json,
    wait_for,
)

pytest.importorskip("vllm")
from kvtier.router.pd.proxy import PDProxy, serve
from tests.integration.test_vllm_connector import TOLERANCE, tokens

pytestmark = [pytest.mark.slow, pytest.mark.engine]

MODEL = "m"
NEW_TOKENS = 8
# A tail after whole chunks, a longer one, an exact number of chunks, shorter than a chunk.
PROMPTS = [tokens(60 + i, n) for i, n in enumerate((700, 1100, 512, 200))]


@pytest.fixture(scope="module")
def logs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("pd")


def kvtier_lines(logs: Path) -> str:
    """The engines' kvtier messages (the last of them), for a failure's message."""
    lines = []
    for log in sorted(logs.glob("*.log")):
        said = [line for line in log.read_text(errors="replace").splitlines() if "kvtier" in line]
        lines += [f"{log.name}: {line}" for line in said[-20:]]
    return "\n".join(lines)


def prefill_config(
    model_dir: Path, kv_server: Server, log: Path
) -> tuple[EngineOptions, dict[str, Any], Path]:
    """A prefill engine on core 0."""
    options = EngineOptions(model_dir, 4096, 1 << 30, prefix_caching=False, cpus="0", name=MODEL)
    return options, kvtier_transfer(kv_server.rpc), log


@pytest.fixture(scope="module")
def engines(model_dir: Path, kv_server: Server, logs: Path) -> Iterator[tuple[Engine, Engine]]:
    """A prefill engine on core 0 and a decode engine on core 1; the decode's
    failed loads fail their request (the error policy's errors)."""
    decode = (EngineOptions(model_dir, 4096, 1 << 30, prefix_caching=False, cpus="1", name=MODEL),)
    configs = [
        prefill_config(model_dir, kv_server, logs / "prefill.log"),
        (
            *decode,
            # A hand-off never offered ends after 5 s (the default is 10 s); the restarted
            # server's find from its disk tier settles well within it.
            kvtier_transfer(kv_server.rpc, load_failure="fail", handoff_wait_s=5.0),
            logs / "decode.log",
        ),
    ]
    with vllm_servers(configs) as (prefill_engine, decode_engine):
        yield prefill_engine, decode_engine


@pytest.fixture(scope="module")
def proxy(engines: tuple[Engine, Engine]) -> Iterator[str]:
    prefill, decode = engines
    with pd_proxy(prefill, decode) as url:
        yield url


@contextmanager
def pd_proxy(prefill: Engine, decode: Engine) -> Iterator[str]:
    """``kvtier pd-proxy`` in front of the two engines, on a thread: its URL."""
    port = free_port()
    pd = PDProxy([prefill.url], [decode.url])
    loop = asyncio.new_event_loop()
    stop = asyncio.Event()
    thread = threading.Thread(
        target=loop.run_until_complete, args=(serve(pd, "127.0.0.1", port, stop),), daemon=True
    )
    thread.start()
    url = f"http://127.0.0.1:{port}"
    assert wait_for(lambda: _health(url), bool)
    yield url
    loop.call_soon_threadsafe(stop.set)
    thread.join(timeout=10)


def _health(url: str) -> bool:
    try:
        with urllib.request.urlopen(url + "/health", timeout=2) as response:
            return bool(response.status == 200)
    except OSError:
        return False


def body(prompt: list[int], **extra: Any) -> dict[str, Any]:
    return {
        "model": MODEL,
        "prompt": prompt,
        "max_tokens": NEW_TOKENS,
        "temperature": 0,
        "logprobs": 1,
        "return_token_ids": True,
        **extra,
    }


def generated(answer: dict[str, Any]) -> tuple[list[int], list[float]]:
    choice = answer["choices"][0]
    return choice["token_ids"], choice["logprobs"]["token_logprobs"]


def assert_same(want: dict[str, Any], got: dict[str, Any], what: str) -> None:
    want_tokens, want_logprobs = generated(want)
    got_tokens, got_logprobs = generated(got)
    assert got_tokens == want_tokens, f"{what}: tokens differ"
    worst = max(abs(a - b) for a, b in zip(want_logprobs, got_logprobs, strict=True))
    assert worst <= TOLERANCE, f"{what}: |Δlogprob| {worst:.2e}"


def on_demand(variable: str, why: str) -> list[pytest.MarkDecorator]:
    """The marks of an engine module CI does not run: ``variable=1`` runs it."""
    skip = pytest.mark.skipif(not os.environ.get(variable), reason=f"{why}: {variable}=1 runs it")
    return [pytest.mark.slow, pytest.mark.engine, skip]


def hand_off_each(
    prefill: Engine, decode: Engine, prompts: list[list[int]], salt: str
) -> list[dict[str, Any]]:
    """Each prompt through ``kvtier pd-proxy``, its output the decoding
    engine's own (asked under ``salt``: nothing reused); the hand-offs' usage."""
    outcomes = []
    with pd_proxy(prefill, decode) as proxy:
        for i, prompt in enumerate(prompts):
            status, colocated = post_json(
                decode.url + "/v1/completions", body(prompt, cache_salt=salt)
            )
            assert status == 200, colocated
            status, pd = post_json(proxy + "/v1/completions", body(prompt))
            assert status == 200, pd
            assert_same(colocated, pd, f"{salt}, prompt {i} ({len(prompt)} tokens)")
            assert pd["usage"]["completion_tokens"] == NEW_TOKENS
            outcomes.append(pd["usage"]["kvtier_handoff"])
    return outcomes


def decode_like(
    engine: Engine, prompt: list[int], produced: dict[str, Any], colocated: dict[str, Any]
) -> None:
    """The rest of a produced answer on ``engine``, as the proxy asks for it:
    its hand-off loaded, and with the producer's token the colocated tokens
    and logprobs."""
    first = produced["choices"][0]["token_ids"]
    rest_body = body(
        prompt + first, max_tokens=NEW_TOKENS - 1, kv_transfer_params=produced["kv_transfer_params"]
    )
    status, rest = post_json(engine.url + "/v1/completions", rest_body)
    assert status == 200, rest
    handoff = rest["kv_transfer_params"]
    assert handoff["kvtier_handoff_outcome"] == "loaded", handoff
    want_tokens, want_logprobs = generated(colocated)
    got_tokens, got_logprobs = generated(rest)
    assert first + got_tokens == want_tokens
    head = produced["choices"][0]["logprobs"]["token_logprobs"]
    worst = max(abs(a - b) for a, b in zip(want_logprobs, head + got_logprobs, strict=True))
    assert worst <= TOLERANCE, f"|Δlogprob| {worst:.2e}"


def handoffs(server: Server) -> dict[str, Any]:
    return dict(server.status()["handoffs"])


def test_pd_outputs_equal_colocated_and_the_first_token_comes_once(
    engines: tuple[Engine, Engine], proxy: str, kv_server: Server, logs: Path
) -> None:
    prefill, _ = engines
    before = consumed(kv_server.fresh_status())  # what the module's other tests consumed
    for i, prompt in enumerate(PROMPTS):
        # Colocated: the whole request on one engine (its own tenant salt, so the
        # P/D run below reuses nothing of it).
        status, colocated = post_json(
            prefill.url + "/v1/completions", body(prompt, cache_salt="ref")
        )
        assert status == 200, colocated
        status, pd = post_json(proxy + "/v1/completions", body(prompt))
        assert status == 200, pd
        assert_same(colocated, pd, f"prompt {i} ({len(prompt)} tokens)")
        usage = pd["usage"]
        assert usage["prompt_tokens"] == len(prompt)
        assert usage["completion_tokens"] == NEW_TOKENS  # the first token once, not twice
        outcome = usage["kvtier_handoff"]["kvtier_handoff_outcome"]
        assert outcome == "loaded", f"{usage}\n{kvtier_lines(logs)}"
        assert pd["choices"][0]["prompt_token_ids"] == prompt
    # Two tokens: the decode's one finishes in the step that loads its prompt.
    status, short = post_json(proxy + "/v1/completions", body(PROMPTS[0], max_tokens=2))
    assert status == 200, short
    assert short["usage"]["kvtier_handoff"]["kvtier_handoff_outcome"] == "loaded"
    # The server's status is a snapshot taken each tick: wait for the last DONE in it.
    seen = wait_for(kv_server.status, lambda s: consumed(s) == before + len(PROMPTS) + 1)
    assert consumed(seen) == before + len(PROMPTS) + 1
    assert seen["handoffs"]["held"] == 0
    assert seen["storage"]["held_lookup_locks"] == 0


def test_a_chat_is_rendered_once_and_equals_colocated(
    engines: tuple[Engine, Engine], proxy: str, kv_server: Server
) -> None:
    """``/v1/chat/completions``: the prefill engine renders the messages; the
    decode engine gets the ids (``kv_transfer_params.prompt_token_ids``)."""
    prefill, _ = engines
    words = " ".join(f"t{t}" for t in tokens(75, 650))
    chat = {
        "model": MODEL,
        "messages": [{"role": "user", "content": words}],
        "max_completion_tokens": NEW_TOKENS,
        "temperature": 0,
        "logprobs": True,
        "return_token_ids": True,
    }
    before = consumed(kv_server.fresh_status())
    status, colocated = post_json(
        prefill.url + "/v1/chat/completions", {**chat, "cache_salt": "ref"}
    )
    assert status == 200, colocated
    status, pd = post_json(proxy + "/v1/chat/completions", chat)
    assert status == 200, pd
    want, got = colocated["choices"][0], pd["choices"][0]
    assert got["token_ids"] == want["token_ids"] and len(got["token_ids"]) == NEW_TOKENS
    assert got["message"]["content"] == want["message"]["content"]
    assert pd["prompt_token_ids"] == colocated["prompt_token_ids"]
    pairs = zip(want["logprobs"]["content"], got["logprobs"]["content"], strict=True)
    worst = max(abs(a["logprob"] - b["logprob"]) for a, b in pairs)
    assert worst <= TOLERANCE, f"|Δlogprob| {worst:.2e}"
    assert pd["usage"]["prompt_tokens"] == colocated["usage"]["prompt_tokens"]
    assert pd["usage"]["kvtier_handoff"]["kvtier_handoff_outcome"] == "loaded", pd["usage"]
    seen = wait_for(kv_server.status, lambda s: consumed(s) == before + 1)
    assert consumed(seen) == before + 1


def consumed(status: dict[str, Any]) -> int:
    return int(status["server"]["handoffs"]["consumed"])


def test_a_stream_gives_the_prefill_token_then_the_decode_tokens(
    engines: tuple[Engine, Engine], proxy: str
) -> None:
    prefill, _ = engines
    prompt = tokens(70, 900)
    status, colocated = post_json(prefill.url + "/v1/completions", body(prompt, cache_salt="ref"))
    assert status == 200
    request = urllib.request.Request(
        proxy + "/v1/completions",
        json.dumps(body(prompt, stream=True, stream_options={"include_usage": True})).encode(),
        {"Content-Type": "application/json"},
    )
    events = []
    with urllib.request.urlopen(request, timeout=300) as response:
        for line in response:
            if line.startswith(b"data: {"):
                events.append(json.loads(line[len(b"data: ") :]))
    streamed = [t for e in events for c in e["choices"] for t in c.get("token_ids") or []]
    assert streamed == colocated["choices"][0]["token_ids"]
    usage = [e["usage"] for e in events if e.get("usage")][-1]
    assert (usage["prompt_tokens"], usage["completion_tokens"]) == (len(prompt), NEW_TOKENS)


def test_a_hand_off_that_never_comes_recomputes_or_fails_as_asked(
    engines: tuple[Engine, Engine], kv_server: Server
) -> None:
    """The producer died before its offer: the decode engine waits
    handoff_wait_s, then recomputes (same output) or fails the request."""
    prefill, decode = engines
    prompt = tokens(80, 700)
    status, colocated = post_json(prefill.url + "/v1/completions", body(prompt, cache_salt="ref"))
    assert status == 200
    forged = {"do_remote_prefill": True, "kvtier_handoff": "gone", "kvtier_prompt_tokens": 700}
    decode_prompt = prompt + colocated["choices"][0]["token_ids"][:1]
    status, recomputed = post_json(
        decode.url + "/v1/completions",
        body(decode_prompt, max_tokens=NEW_TOKENS - 1, kv_transfer_params=forged),
    )
    assert status == 200, recomputed
    assert recomputed["choices"][0]["token_ids"] == colocated["choices"][0]["token_ids"][1:]
    assert recomputed["kv_transfer_params"] == {
        "kvtier_handoff": "gone",
        "kvtier_handoff_outcome": "recomputed",
        "kvtier_handoff_cause": "not_offered",
    }
    status, failed = post_json(
        decode.url + "/v1/completions",
        body(
            decode_prompt,
            max_tokens=NEW_TOKENS - 1,
            kv_transfer_params={**forged, "kvtier_on_failure": "error"},
        ),
    )
    assert status >= 500, failed  # vLLM's error for a failed KV load: the client is told
    assert _health(decode.url)  # and the engine keeps serving
    status, again = post_json(decode.url + "/v1/completions", body(decode_prompt, max_tokens=2))
    assert status == 200, again
    assert handoffs(kv_server)["held"] == 0


def test_the_prefill_engine_killed_after_its_answer_leaves_its_hand_off_loadable(
    engines: tuple[Engine, Engine], kv_server: Server, model_dir: Path, logs: Path
) -> None:
    """A prefill engine of its own is killed (SIGKILL, its whole process
    group) once it has answered. The hand-off is the cache server's by then:
    the decode engine loads it and gives the colocated tokens."""
    _, decode = engines
    with vllm_servers([prefill_config(model_dir, kv_server, logs / "doomed.log")]) as (prefill,):
        killed_after_its_answer(prefill, decode, kv_server)


def killed_after_its_answer(prefill: Engine, decode: Engine, kv_server: Server) -> None:
    prompt = tokens(90, 800)
    status, colocated = post_json(prefill.url + "/v1/completions", body(prompt, cache_salt="ref"))
    assert status == 200, colocated
    produce = body(prompt, max_tokens=1, kv_transfer_params={"do_remote_decode": True})
    status, produced = post_json(prefill.url + "/v1/completions", produce)
    assert status == 200, produced
    segments = engine_segments(prefill.pid)
    os.killpg(prefill.pid, signal.SIGKILL)
    for segment in segments:  # what the engine would have removed as it shut down
        segment.unlink(missing_ok=True)
    assert wait_for(lambda: _health(prefill.url), lambda up: not up) is False
    decode_like(decode, prompt, produced, colocated)
    assert wait_for(lambda: handoffs(kv_server)["held"], lambda n: n == 0) == 0


def written_back(status: dict[str, Any]) -> int:
    store = status["storage"]["store"]
    return sum(int(v) for v in store["stored_objects"].values())


def test_a_hand_off_outlives_its_cache_server_through_its_disk_tier(
    engines: tuple[Engine, Engine], kv_server: Server, module_servers: ServerFactory
) -> None:
    """The decode engine produces and consumes, and the cache server is
    killed (SIGKILL) after the producer's answer and restarted on its ports
    and cache directory (the module's fixture reaches the new one). The
    hand-off's record died with it, but its chunks had been written back to
    the server's disk tier: the consumer sees another boot id than the
    producer's, takes with ``find``, and the new server finds them there.
    Same tokens and logprobs as the engine's own, nothing held."""
    _, engine = engines
    prompt = tokens(120, 700)  # two chunks and a tail: three objects of one rank
    first = written_back(kv_server.fresh_status())
    status, colocated = post_json(engine.url + "/v1/completions", body(prompt, cache_salt="ref-3"))
    assert status == 200, colocated
    # The reference's two chunks reach the disk tier too: count them before the producer's.
    before = wait_for(lambda: written_back(kv_server.status()), lambda n: n >= first + 2)
    assert before >= first + 2
    produce = body(prompt, max_tokens=1, kv_transfer_params={"do_remote_decode": True})
    status, produced = post_json(engine.url + "/v1/completions", produce)
    assert status == 200, produced
    after = wait_for(lambda: written_back(kv_server.status()), lambda n: n >= before + 3)
    assert after >= before + 3
    restarted = module_servers.restart(kv_server)
    # The engine's clients (its scheduler's and its worker's) said hello again.
    assert wait_for(restarted.status, lambda s: s["clients"] >= 2, timeout_s=60)["clients"] >= 2
    decode_like(engine, prompt, produced, colocated)
    # The server's status is a snapshot taken each tick: wait for the take in it.
    seen = wait_for(
        restarted.status,
        lambda s: s["server"]["handoffs"]["consumed"] == 1 and s["handoffs"]["held"] == 0,
    )
    assert seen["server"]["handoffs"]["found"] == seen["server"]["handoffs"]["consumed"] == 1
    assert seen["handoffs"]["held"] == 0
    assert seen["storage"]["held_lookup_locks"] == 0
