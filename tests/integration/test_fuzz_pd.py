"""``kvtier pd-proxy``'s HTTP front under random and hostile bodies, over the
stand-in engines of ``tests/unit/router/test_pd.py`` (healthy, refusing with
400 what vLLM refuses of the fields they read).

``HostileBodies(seed)`` draws requests as a hostile client and an unlucky
one would send them: random bytes, truncated JSON, bodies that are not
objects, nesting past any parser's recursion, integers and floats past every
limit (``1e400``, 5,000 digits, NaN), fields of the wrong type, the client's
own ``kv_transfer_params`` (a forged hand-off, prompt ids), bodies past the
size limit, well-formed requests, and stream clients that leave after the
first event. Draws are a pure function of the seed.

Every request gets exactly one well-formed answer (requests share keep-alive
connections, so a second answer to one would be read as the next's): 200
with a completion, or a stream of ``data:`` events ending ``data: [DONE]``;
or a 4xx with an OpenAI error message. Never a 5xx: the engines are healthy,
so one would be the proxy's own failure, or an input error charged to an
engine. No engine ever sees a client's ``kv_transfer_params``. Afterwards the
proxy still serves a well-formed request right, with nothing in flight.
"""

from __future__ import annotations

import asyncio
import json
import random
import signal
import subprocess
import sys
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from kvtier.process import clean_env, read_line, stop_process
from kvtier.router.body import MAX_DEPTH
from tests.integration.harness import ROOT
from tests.integration.test_fuzz import rss_anon_bytes
from tests.unit.router.test_pd import (
    FORGED,
    HANDOFF,
    MAX_TOKENS,
    PROMPT,
    Engine,
    engine_app,
    events_of,
    eventually,
    proxied,
    serve,
    synchronous,
)

COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"
HOSTILE_REQUESTS = 10_000
EDGE_NUMBERS = [
    "0",
    "-1",
    "2147483648",
    "9223372036854775808",
    "18446744073709551616",
    "1" + "0" * 30,
    "9" * 5000,  # past Python's integer digit limit
    "3.5",
    "1e308",
    "1e400",  # a float that parses as infinity
    "-1e400",
    "NaN",
    "Infinity",
    "true",
]
JUNK: list[Any] = [None, True, "x", "é" * 1000, [], {}, [[1]], {"a": 1}, -5, 3.5, [None]]
FIELDS = [
    "prompt",
    "messages",
    "max_tokens",
    "max_completion_tokens",
    "min_tokens",
    "stream",
    "stream_options",
    "return_token_ids",
    "n",
    "best_of",
    "echo",
    "kvtier_on_failure",
    "logprobs",
    "temperature",
    "model",
    "tools",
]
CLIENT_PARAMS: list[Any] = [
    FORGED,
    {"prompt_token_ids": list(range(5000))},
    {"do_remote_decode": True},
    {"kvtier_blend": {"spans": [[0, 4]]}},
    {"kvtier_on_failure": "error"},
    "h-1",
    [1],
    7,
    True,
]


@dataclass(frozen=True, slots=True)
class Probe:
    kind: str
    path: str
    data: bytes
    expect: frozenset[int]  # the statuses that may answer it
    leave: bool = False  # a stream client that leaves after the first event
    stream: bool = False  # a 200 answer is a stream


class HostileBodies:
    """Draws hostile requests; see the module docstring."""

    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)
        self.families: list[tuple[str, Callable[[], Probe], int]] = [
            ("random_bytes", self.random_bytes, 8),
            ("truncated", self.truncated, 6),
            ("not_object", self.not_object, 3),
            ("deep_nesting", self.deep_nesting, 4),
            ("edge_numbers", self.edge_numbers, 10),
            ("wrong_types", self.wrong_types, 12),
            ("client_params", self.client_params, 8),
            ("valid", self.valid, 10),
            ("too_large", self.too_large, 1),
            ("leaving", self.leaving, 4),
        ]

    def draw(self) -> Probe:
        _, family, _ = self.rng.choices(self.families, [w for _, _, w in self.families])[0]
        return family()

    # ------------------------------------------------------------ families

    def body(self, **extra: Any) -> tuple[str, dict[str, Any]]:
        """A well-formed request, completion or chat, streamed or not."""
        limit = self.rng.choice([1, 2, 4, 8])
        common: dict[str, Any] = {"model": "m", "stream": self.rng.random() < 0.4}
        if self.rng.random() < 0.3:
            common["return_token_ids"] = True
        if self.rng.random() < 0.5:
            prompt = self.rng.choice([PROMPT, "hello there", list(range(1, 40))])
            return COMPLETIONS, {**common, "prompt": prompt, "max_tokens": limit, **extra}
        messages = [{"role": "user", "content": "hello"}]
        return CHAT, {**common, "messages": messages, "max_completion_tokens": limit, **extra}

    def probe(self, kind: str, expect: set[int], **extra: Any) -> Probe:
        path, body = self.body(**extra)
        stream = body.get("stream") is True
        return Probe(kind, path, json.dumps(body).encode(), frozenset(expect), stream=stream)

    def random_bytes(self) -> Probe:
        data = self.rng.randbytes(self.rng.randint(0, 300))
        return Probe("random_bytes", self.rng.choice([COMPLETIONS, CHAT]), data, frozenset({400}))

    def truncated(self) -> Probe:
        whole = self.probe("truncated", {400})
        cut = whole.data[: self.rng.randrange(len(whole.data))]
        return Probe("truncated", whole.path, cut, frozenset({400}))

    def not_object(self) -> Probe:
        value = self.rng.choice([[], [1, 2], "prompt", 5, None, True, [{"prompt": [1]}]])
        path = self.rng.choice([COMPLETIONS, CHAT])
        return Probe("not_object", path, json.dumps(value).encode(), frozenset({400}))

    def deep_nesting(self) -> Probe:
        """Past the proxy's limit, as a whole body or one field; else within it."""
        depth = self.rng.choice([MAX_DEPTH + 1, 1_000, 5_000, 100_000])
        opener, closer = self.rng.choice([(b"[", b"]"), (b'{"k":', b"}")])
        nested = opener * depth + b"1" + closer * depth
        if self.rng.random() < 0.3:
            return Probe("deep_nesting", COMPLETIONS, opener * depth, frozenset({400}))
        if self.rng.random() < 0.3:  # an ignored field, within the limit: served
            within = opener * (MAX_DEPTH - 2) + b"1" + closer * (MAX_DEPTH - 2)
            probe = self.probe("deep_nesting", {200}, user="@@")
            data = probe.data.replace(b'"@@"', within)
            return Probe("deep_nesting", probe.path, data, probe.expect, stream=probe.stream)
        probe = self.probe("deep_nesting", {400}, user="@@")
        return Probe("deep_nesting", probe.path, probe.data.replace(b'"@@"', nested), probe.expect)

    def edge_numbers(self) -> Probe:
        """A field, or a prompt's token, as a number at or past some limit."""
        name = self.rng.choice(["max_tokens", "n", "min_tokens", "temperature", "seed", "token"])
        number = self.rng.choice(EDGE_NUMBERS).encode()
        if name == "token":
            probe = self.probe("edge_numbers", {200, 400}, prompt=[1, "@@", 3])
        else:
            probe = self.probe("edge_numbers", {200, 400}, **{name: "@@"})
        data = probe.data.replace(b'"@@"', number)
        return Probe("edge_numbers", probe.path, data, probe.expect, stream=probe.stream)

    def wrong_types(self) -> Probe:
        junk = {name: self.rng.choice(JUNK) for name in self.rng.sample(FIELDS, 2)}
        probe = self.probe("wrong_types", {200, 400}, **junk)
        stream = junk.get("stream", probe.stream) is True
        return Probe("wrong_types", probe.path, probe.data, probe.expect, stream=stream)

    def client_params(self) -> Probe:
        params = self.rng.choice(CLIENT_PARAMS)
        return self.probe("client_params", {400}, kv_transfer_params=params)

    def valid(self) -> Probe:
        return self.probe("valid", {200})

    def too_large(self) -> Probe:
        probe = self.probe("too_large", {413}, user="x" * (1 << 20))
        return Probe("too_large", probe.path, probe.data, probe.expect)

    def leaving(self) -> Probe:
        """A long stream: the client is gone while the proxy still relays it."""
        path, body = self.body(stream=True)
        limit = "max_tokens" if path == COMPLETIONS else "max_completion_tokens"
        data = json.dumps({**body, limit: MAX_TOKENS}).encode()
        return Probe("leaving", path, data, frozenset({200}), leave=True, stream=True)


async def answer(session: aiohttp.ClientSession, url: str, probe: Probe) -> int:
    """Send one probe; check its one answer is well formed; its status."""
    headers = {"Content-Type": "application/json"}
    async with session.post(url + probe.path, data=probe.data, headers=headers) as resp:
        assert resp.status in probe.expect, (probe.kind, resp.status, await resp.text())
        if probe.leave:
            assert (await resp.content.readline()).startswith(b"data: {")
            resp.close()  # the client leaves
            return resp.status
        body = await resp.read()
    if resp.status != 200:
        assert resp.content_type == "application/json", (probe.kind, resp.status, body[:200])
        error = json.loads(body)["error"]
        assert isinstance(error["message"], str) and error["message"], (probe.kind, body)
    elif probe.stream:
        events = events_of(body)
        assert events[-1] == b"[DONE]", (probe.kind, body)
        assert all(b'"error"' not in e for e in events), (probe.kind, body)
    else:
        assert json.loads(body)["choices"], (probe.kind, body)
    return resp.status


def check_engines_saw_only_the_proxys_params(prefill: Engine, decode: Engine) -> None:
    """What the engines were sent: the proxy's hand-off parameters, never a
    client's (then forgets it, so that 10,000 bodies are not kept)."""
    for body in prefill.seen:
        assert body["kv_transfer_params"] == {"do_remote_decode": True}, body
    allowed = {**HANDOFF, "kvtier_on_failure": "recompute"}
    for body in decode.seen:
        params = dict(body.get("kv_transfer_params") or {})
        params.pop("prompt_token_ids", None)  # a chat's, from the prefill's answer
        assert params.items() <= allowed.items(), body
    prefill.seen.clear()
    decode.seen.clear()


async def blast(
    url: str, bodies: HostileBodies, count: int, prefill: Engine, decode: Engine
) -> Counter[str]:
    """``count`` probes over 8 keep-alive clients; the statuses by kind."""
    statuses: Counter[str] = Counter()

    async def client(share: int) -> None:
        async with aiohttp.ClientSession() as session:
            for _ in range(share):
                probe = bodies.draw()
                statuses[f"{probe.kind}:{await answer(session, url, probe)}"] += 1
                check_engines_saw_only_the_proxys_params(prefill, decode)

    await asyncio.gather(*(client(count // 8) for _ in range(8)))
    return statuses


async def still_serving(session: aiohttp.ClientSession, url: str) -> dict[str, Any]:
    """A well-formed request is answered right; the proxy's ``/status``."""
    body = {"model": "m", "prompt": PROMPT, "max_tokens": 4}
    async with session.post(url + COMPLETIONS, json=body) as resp:
        assert resp.status == 200
        assert (await resp.json())["choices"][0]["text"] == " w100 w101 w102 w103"

    async def settled() -> dict[str, Any] | None:
        """The proxy's status once nothing is in flight (a stream whose client
        left ends at the proxy's next write)."""
        async with session.get(url + "/status") as resp:
            status: dict[str, Any] = await resp.json()
        engines = status["prefill"] + status["decode"]
        return status if all(e["in_flight"] == 0 for e in engines) else None

    status: dict[str, Any] | None = await eventually(settled)
    assert status is not None, "requests still in flight"
    # The engines are healthy: a failure counted against one would be a misattribution.
    assert not [k for k in status["requests"] if "failed" in k], status["requests"]
    return status


@synchronous
async def test_hostile_bodies_get_one_well_formed_answer_each() -> None:
    prefill, decode = Engine(prefill=True), Engine(prefill=False)
    async with proxied(prefill, decode) as (session, url):
        statuses = await blast(url, HostileBodies(seed=41), 400, prefill, decode)
        await still_serving(session, url)
    kinds = {key.split(":")[0] for key in statuses}
    assert len(kinds) >= 9, statuses  # the draws reached (nearly) every family


@pytest.mark.slow
@synchronous
async def test_ten_thousand_hostile_requests_against_the_proxy_process(tmp_path: Path) -> None:
    """The issue's target, against ``kvtier pd-proxy`` as its own process:
    each request answered once, the process serving throughout and after,
    its private memory bounded (printed; asserted only loosely)."""
    prefill, decode = Engine(prefill=True), Engine(prefill=False)
    runners = []
    log = tmp_path / "pd-proxy.log"
    proc: subprocess.Popen[str] | None = None
    try:
        for engine in (prefill, decode):
            runner, engine_url = await serve(engine_app(engine))
            runners.append((runner, engine_url))
        (_, prefill_url), (_, decode_url) = runners
        command = [sys.executable, "-m", "kvtier", "pd-proxy", "--port", "0"]
        command += ["--prefill", prefill_url, "--decode", decode_url]
        with log.open("w") as stderr:
            proc = subprocess.Popen(
                command, stdout=subprocess.PIPE, stderr=stderr, text=True, cwd=ROOT, env=clean_env()
            )
        assert proc.stdout is not None
        ready = await asyncio.to_thread(read_line, proc.stdout, 60.0)
        assert ready and ready.startswith("kvtier pd-proxy: http://"), (ready, log.read_text())
        url = ready.split()[2]
        bodies = HostileBodies(seed=14)
        await blast(url, bodies, 800, prefill, decode)  # warm: buffers, pools, caches
        before = rss_anon_bytes(proc.pid)
        statuses = await blast(url, bodies, HOSTILE_REQUESTS, prefill, decode)
        after = rss_anon_bytes(proc.pid)
        print(
            f"pd-proxy: {sum(statuses.values())} hostile requests, RssAnon "
            f"{before / 2**20:.1f} -> {after / 2**20:.1f} MiB "
            f"(+{(after - before) / 2**20:.1f} MiB); {dict(sorted(statuses.items()))}"
        )
        assert sum(statuses.values()) == HOSTILE_REQUESTS
        assert proc.poll() is None, log.read_text()
        async with aiohttp.ClientSession() as session:
            status = await still_serving(session, url)
        assert after - before < 200 << 20, (before, after)
        assert status["requests"].get("refused_by_decode", 0) > 0  # huge max_tokens reached it
        assert "Traceback" not in log.read_text(), log.read_text()
    finally:
        if proc is not None:
            stop_process(proc, signal.SIGTERM)
        for runner, _ in runners:
            await runner.cleanup()
