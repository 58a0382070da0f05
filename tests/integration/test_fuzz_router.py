"""Hostile HTTP against a live ``kvtier route`` (gateway and router) over
stand-in engines (issue 41).

The router runs as its own process (its memory is measured alone); the
stand-in engines run on a thread of this one. ``HostileRequests(seed)`` draws
what a hostile or careless client sends: bytes that are not JSON, truncated
bodies, nesting far past any real request, numbers past every range, known
fields with values of the wrong type, engine-internal fields, bad or absurd
API keys, paths and methods the router does not serve, the operator's
endpoints without the operator's token, and streaming clients that read one
event and hang up, among well-formed requests. Every request must get
exactly one well-formed answer (never a 5xx: the engines are up), the
router must keep serving, and no engine may be taken out because of a client.
"""

from __future__ import annotations

import asyncio
import http.client
import json
import random
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, TypeVar
from urllib.parse import urlsplit

import aiohttp
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.integration.router_host import Engines, Router, request, route_toml, running_router
from tests.unit.router.standin import StandIn

OPERATOR = "fuzz-operator"
KEYS = {"acme": "key-acme", "tiny": "key-tiny"}
GENERATE = ("/v1/completions", "/v1/chat/completions")
T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class Probe:
    kind: str
    method: str
    path: str
    headers: dict[str, str]
    body: bytes
    allowed: frozenset[int]  # the statuses a correct router may answer
    hang_up: bool = False  # a streaming client that leaves after the first event


# ------------------------------------------------------------- drawing

EDGE_NUMBERS = [
    "-1",
    "0",
    "4294967296",
    "18446744073709551616",
    "1e400",
    "-1e400",
    "1" + "0" * 5000,
    "NaN",
    "Infinity",
    "1.5",
    "true",
    "null",
]
READ_FIELDS = ["prompt", "messages", "model", "stream", "max_tokens", "max_completion_tokens"]
OTHER_FIELDS = ["temperature", "n", "stop", "top_p", "logprobs", "user", "seed", "echo"]
ENGINE_FIELDS = ["kv_transfer_params", "priority", "request_id", "vllm_xargs", "prompt_embeds"]


class HostileRequests:
    """Draws probes; a pure function of the seed."""

    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)
        self.kinds = {
            "valid": (self.valid, 8),
            "hang_up": (self.hang_up, 3),
            "rate_limited": (self.rate_limited, 3),
            "random_bytes": (self.random_bytes, 8),
            "truncated": (self.truncated, 6),
            "deep_nesting": (self.deep_nesting, 4),
            "huge_numbers": (self.huge_numbers, 8),
            "wrong_types": (self.wrong_types, 14),
            "engine_fields": (self.engine_fields, 6),
            "bad_keys": (self.bad_keys, 8),
            "bad_paths": (self.bad_paths, 6),
            "operator_paths": (self.operator_paths, 3),
        }

    def __iter__(self) -> Iterator[Probe]:
        names = list(self.kinds)
        weights = [w for _, w in self.kinds.values()]
        while True:
            yield self.kinds[self.rng.choices(names, weights)[0]][0]()

    # -- helpers

    def _good_body(self, chat: bool) -> dict[str, Any]:
        text = "".join(self.rng.choices("abcdef ", k=self.rng.randint(1, 40)))
        if chat:
            return {"messages": [{"role": "user", "content": text}], "max_tokens": 4}
        prompt: Any = (
            text if self.rng.random() < 0.5 else [self.rng.randrange(50_000) for _ in text]
        )
        return {"prompt": prompt, "max_tokens": 4}

    def _post(
        self, kind: str, body: bytes, allowed: set[int], key: str = "key-acme", path: str = ""
    ) -> Probe:
        headers = {"Content-Type": "application/json"}
        if key:
            headers["Authorization"] = f"Bearer {key}"
        path = path or self.rng.choice(GENERATE)
        return Probe(kind, "POST", path, headers, body, frozenset(allowed))

    # -- kinds

    def valid(self) -> Probe:
        path = self.rng.choice(GENERATE)
        body = self._good_body(path.endswith("chat/completions"))
        body["stream"] = self.rng.random() < 0.3
        return self._post("valid", json.dumps(body).encode(), {200}, path=path)

    def hang_up(self) -> Probe:
        path = self.rng.choice(GENERATE)
        body = {**self._good_body(path.endswith("chat/completions")), "stream": True}
        probe = self._post("hang_up", json.dumps(body).encode(), {200}, path=path)
        return Probe(**{**_fields(probe), "hang_up": True})

    def rate_limited(self) -> Probe:
        path = self.rng.choice(GENERATE)
        body = json.dumps(self._good_body(path.endswith("chat/completions"))).encode()
        return self._post("rate_limited", body, {200, 429}, key=KEYS["tiny"], path=path)

    def random_bytes(self) -> Probe:
        body = self.rng.randbytes(self.rng.randint(0, 200))
        return self._post("random_bytes", body, {400})

    def truncated(self) -> Probe:
        whole = json.dumps(self._good_body(self.rng.random() < 0.5)).encode()
        return self._post("truncated", whole[: self.rng.randrange(len(whole))], {400})

    def deep_nesting(self) -> Probe:
        depth = self.rng.choice([101, 1000, 10_000, 100_000])
        opener, closer = self.rng.choice([(b"[", b"]"), (b'{"k":', b"}")])
        where = self.rng.choice(["extra", "prompt", "messages"])
        body = b'{"%s": ' % where.encode() + opener * depth + b"1" + closer * depth + b"}"
        return self._post("deep_nesting", body, {400})

    def huge_numbers(self) -> Probe:
        number = self.rng.choice(EDGE_NUMBERS)
        name = self.rng.choice(["max_tokens", "max_completion_tokens", "prompt", "temperature"])
        value = f"[{number}]" if name == "prompt" else number
        chat = self.rng.random() < 0.5 and name != "prompt"
        base = self._good_body(chat)
        base.pop(name, None)
        text = json.dumps(base)[:-1] + f', "{name}": {value}}}'
        # Past every range, or not JSON: refused whatever the field. Else a value
        # the router reads must be right for it; one it does not is the engine's.
        fine = number not in ("1e400", "-1e400", "1" + "0" * 5000, "NaN", "Infinity")
        if name == "prompt":
            fine = fine and number == "0"
        elif name != "temperature":
            fine = fine and number in ("0", "null")  # larger: past the context
        path = GENERATE[1] if chat else GENERATE[0]
        return self._post("huge_numbers", text.encode(), {200} if fine else {400}, path=path)

    def wrong_types(self) -> Probe:
        chat = self.rng.random() < 0.5
        body = self._good_body(chat)
        for _ in range(self.rng.randint(1, 3)):
            body[self.rng.choice(READ_FIELDS + OTHER_FIELDS)] = self._junk(3)
        path = GENERATE[1] if chat else GENERATE[0]
        # 200 when the junk happens to be valid, 404 for an unknown model name
        return self._post("wrong_types", json.dumps(body).encode(), {200, 400, 404}, path=path)

    def engine_fields(self) -> Probe:
        body = {**self._good_body(False), self.rng.choice(ENGINE_FIELDS): self._junk(2)}
        return self._post("engine_fields", json.dumps(body).encode(), {400}, path=GENERATE[0])

    def bad_keys(self) -> Probe:
        key = self.rng.choice(
            [
                "",
                "key-acm",
                "KEY-ACME",
                "x" * self.rng.choice([1, 100, 5000]),
                "".join(self.rng.choices("abc-=+/ ", k=20)),
            ]
        )
        scheme = self.rng.choice(["Bearer ", "bearer ", "Basic ", ""])
        headers = {"Content-Type": "application/json", "Authorization": scheme + key}
        body = json.dumps(self._good_body(False)).encode()
        path = self.rng.choice(GENERATE)
        return Probe("bad_keys", "POST", path, headers, body, frozenset({401}))

    def bad_paths(self) -> Probe:
        method = self.rng.choice(["GET", "PUT", "DELETE", "POST", "PATCH"])
        path = self.rng.choice(
            [
                "/v1/completions/",
                "/V1/completions",
                "/v1/models/x",
                "/tokenize",
                "/" + "".join(self.rng.choices("abz019-_.~", k=self.rng.randint(0, 30))),
                "/v1/" + "a" * self.rng.choice([10, 2000]),
                "/v1/completions?x=" + "%" * 3,
            ]
        )
        if method in ("GET", "POST") and path in ("/v1/models", "/health"):
            path = "/nope"
        headers = {"Authorization": "Bearer key-acme"}
        allowed = {400, 404, 405}  # 400: a query on a served path, the empty body refused
        return Probe("bad_paths", method, path, headers, b"{}", frozenset(allowed))

    def operator_paths(self) -> Probe:
        key = self.rng.choice(["", "Bearer key-acme", "Bearer " + OPERATOR + "x", "Basic x"])
        headers = {"Authorization": key} if key else {}
        path = self.rng.choice(["/status", "/metrics"])
        return Probe("operator_paths", "GET", path, headers, b"", frozenset({401}))

    def _junk(self, depth: int) -> Any:
        choices = [
            None,
            True,
            self.rng.randint(-(2**70), 2**70),
            self.rng.random() * 1e300,
            "".join(self.rng.choices("ab\x00\u2603 ", k=self.rng.randint(0, 10))),
        ]
        if depth > 0:
            choices.append([self._junk(depth - 1) for _ in range(self.rng.randint(0, 3))])
            choices.append(
                {"k" + str(i): self._junk(depth - 1) for i in range(self.rng.randint(0, 2))}
            )
        return self.rng.choice(choices)


def _fields(probe: Probe) -> dict[str, Any]:
    return {name: getattr(probe, name) for name in Probe.__slots__}


# ------------------------------------------------------------ running


@pytest.fixture(scope="module")
def router(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Router, Engines]]:
    tmp = tmp_path_factory.mktemp("fuzz-router")
    engines = Engines([StandIn("e0", stream_chunks=30), StandIn("e1", stream_chunks=30)])
    options = [
        "port = 0",
        'policy = "least_loaded"',
        "down_s = 600",  # an engine taken out stays out: the test would see it
        f'operator_token = "{OPERATOR}"',
    ]
    tenants = [
        *("[[tenants]]", 'name = "acme"', 'api_keys = ["key-acme"]', 'salt = "acme-salt"'),
        *("[[tenants]]", 'name = "tiny"', 'api_keys = ["key-tiny"]', "requests_per_s = 5"),
    ]
    config = tmp / "route.toml"
    config.write_text(route_toml(engines, options, tenants))
    try:
        with running_router(config, tmp / "router.log", OPERATOR) as server:
            yield server, engines
    finally:
        engines.close()


def check_answer(probe: Probe, status: int, data: bytes) -> None:
    """Exactly the answer a correct router gives: an allowed status, and for
    the generation routes an OpenAI error body carrying that status."""
    assert status in probe.allowed, (probe.kind, probe.path, probe.body[:120], status, data[:300])
    if status >= 400 and probe.path in GENERATE and probe.method == "POST":
        error = json.loads(data)["error"]
        assert error["code"] == status and error["message"], (probe, data)


def check_still_serving(router: Router) -> dict[str, Any]:
    """The router alive, every engine in, nothing charged to one; its status."""
    assert router.proc.poll() is None, router.log
    status = router.status()
    nodes = status["router"]["nodes"]
    assert all(n["live"] and n["failures"] == {} for n in nodes), nodes
    assert all(n["inflight_requests"] == 0 for n in nodes), nodes
    code, data = request(
        router.url,
        "POST",
        "/v1/completions",
        {"Authorization": "Bearer key-acme", "Content-Type": "application/json"},
        json.dumps({"prompt": "still here", "max_tokens": 2}).encode(),
    )
    assert code == 200, data
    log = router.log
    assert "Traceback" not in log and "Error handling request" not in log, log[-3000:]
    return status


# --------------------------------------------------------------- tests


def test_every_kind_of_hostile_request_gets_one_well_formed_answer(
    router: tuple[Router, Engines],
) -> None:
    """Each probe on one kept-alive connection, then a /health on the same
    connection: the next answer read is the health's, so each got exactly one."""
    server, _ = router
    parts = urlsplit(server.url)
    seen: Counter[str] = Counter()

    @settings(
        max_examples=300,
        deadline=None,
        database=None,
        suppress_health_check=[HealthCheck.too_slow],
    )
    @given(seed=st.integers(0, 2**32 - 1))
    def check(seed: int) -> None:
        probe = next(iter(HostileRequests(seed)))
        if probe.hang_up:
            return  # needs a client that leaves mid-stream: test_a_flood_...
        connection = http.client.HTTPConnection(parts.hostname, parts.port, timeout=60)
        try:
            connection.request(probe.method, probe.path, body=probe.body, headers=probe.headers)
            response = connection.getresponse()
            status, data = response.status, response.read()
            check_answer(probe, status, data)
            seen[probe.kind] += 1
            if response.will_close:
                return
            connection.request("GET", "/health")
            health = connection.getresponse()
            assert health.status == 200 and json.loads(health.read())["status"] == "ok"
        finally:
            connection.close()

    check()
    assert len(seen) >= 10, seen
    check_still_serving(server)


FLOOD = 10_000
WORKERS = 8


async def _send(session: aiohttp.ClientSession, url: str, probe: Probe) -> tuple[int, bytes]:
    async with session.request(
        probe.method, url + probe.path, data=probe.body, headers=probe.headers
    ) as response:
        if probe.hang_up:
            assert response.status == 200, await response.read()
            first = await response.content.readany()
            assert first.startswith(b"data: "), first
            response.close()  # the client leaves mid-stream
            return 200, b""
        return response.status, await response.read()


async def _flood(url: str, probes: list[Probe]) -> Counter[str]:
    answered: Counter[str] = Counter()
    queue: asyncio.Queue[Probe] = asyncio.Queue()
    for probe in probes:
        queue.put_nowait(probe)

    async def worker() -> None:
        timeout = aiohttp.ClientTimeout(total=120)
        async with aiohttp.ClientSession(timeout=timeout) as session:
            while not queue.empty():
                probe = queue.get_nowait()
                status, data = await _send(session, url, probe)
                check_answer(probe, status, data)
                answered[f"{probe.kind} {status}"] += 1

    await asyncio.gather(*(worker() for _ in range(WORKERS)))
    return answered


@pytest.mark.slow
def test_a_flood_of_ten_thousand_hostile_requests_leaves_the_router_serving(
    router: tuple[Router, Engines],
) -> None:
    """The issue's target: 10,000 hostile requests, each answered once and
    never with a 5xx; the router alive, every engine in, memory bounded."""
    server, engines = router
    draw = iter(HostileRequests(seed=41))
    warm = [next(draw) for _ in range(300)]  # the first allocations are not growth
    asyncio.run(_flood(server.url, warm))
    before = server.rss_bytes()
    probes = [next(draw) for _ in range(FLOOD)]
    answered = asyncio.run(_flood(server.url, probes))
    after = server.rss_bytes()
    growth = after - before
    print(f"router RSS {before >> 20} MiB -> {after >> 20} MiB (+{growth / 2**20:.1f} MiB)")
    print("answers:", dict(sorted(answered.items())))
    assert sum(answered.values()) == FLOOD
    assert {k.split()[0] for k in answered} == set(HostileRequests(0).kinds)
    assert not any(int(k.split()[1]) >= 500 for k in answered), answered
    assert growth < 200 << 20, (before, after)
    status = check_still_serving(server)
    hung_up = sum(p.hang_up for p in [*warm, *probes])
    gone = status["gateway"]["tenants"]["acme"]["requests"].get("client_gone", 0)
    assert 1 <= gone <= hung_up  # only a client that left is counted as gone
    cut = sum(e.streams_cut for e in engines.engines)
    assert cut >= 1  # some clients left while their engine still streamed: it was told
