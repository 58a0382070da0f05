"""The router's part of a robustness run: ``kvtier route`` (a process of its
own) in front of two stand-in engines (``tests.integration.router_host``), a
worker sending completions through it, and the two faults of an engine that
the router alone must handle:

| fault          | what happens                                                    |
|----------------|-----------------------------------------------------------------|
| engine_silent  | one engine accepts connections and answers nothing, not even    |
|                | /health, for a while (a stopped process, a wedged server)      |
| engine_slow    | one engine waits before each answer's first byte, past the      |
|                | router's first-byte timeout or not, while /health answers       |

The router runs with short timeouts so a run sees both outcomes: a silent
engine is found by its health probe (every ``PROBE_INTERVAL_S``, answered
within ``PROBE_TIMEOUT_S``) and its requests are answered by the other; a
slow one stays in, and only a non-streamed answer past ``FIRST_BYTE_S`` is a
504 (a stream with no first token by then is retried elsewhere). Each
request is a "route" operation of the history, with its bound; each fault
records what the router counted, for the ``fails_over`` rule.
"""

from __future__ import annotations

import contextlib
import json
import random
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tests.integration.router_host import Engines, Router, request, route_toml, running_router
from tests.robustness.background import Background
from tests.robustness.history import History
from tests.unit.router.standin import StandIn

FIRST_BYTE_S = 3.0
PROBE_INTERVAL_S = 0.5
PROBE_TIMEOUT_S = 1.0
DOWN_S = 3.0
DETECT_S = 2 * PROBE_INTERVAL_S + PROBE_TIMEOUT_S  # a silent engine is out by then
SLACK_S = 3.0  # a busy machine
ROUTE_BOUND_S = FIRST_BYTE_S + DETECT_S + SLACK_S
OPERATOR = "robustness-operator"
API_KEY = "robustness-key"
GENERATE = "/v1/completions"


@dataclass(eq=False)
class RouterLeg:
    """The router and its engines, for one run."""

    engines: Engines
    router: Router
    stack: contextlib.ExitStack

    @classmethod
    def start(cls, root: Path) -> RouterLeg:
        engines = Engines([StandIn("e0"), StandIn("e1")])
        options = [
            "port = 0",
            f"first_byte_timeout_s = {FIRST_BYTE_S}",
            f"health_probe_interval_s = {PROBE_INTERVAL_S}",
            f"health_probe_timeout_s = {PROBE_TIMEOUT_S}",
            f"down_s = {DOWN_S}",
            f'operator_token = "{OPERATOR}"',
        ]
        tenants = ["[[tenants]]", 'name = "acme"', f'api_keys = ["{API_KEY}"]']
        config = root / "route.toml"
        config.write_text(route_toml(engines, options, tenants))
        stack = contextlib.ExitStack()
        stack.callback(engines.close)
        try:
            router = stack.enter_context(running_router(config, root / "router.log", OPERATOR))
        except BaseException:
            stack.close()
            raise
        return cls(engines, router, stack)

    def engine(self, name: str) -> StandIn:
        return next(e for e in self.engines.engines if e.name == name)

    def nodes(self) -> list[dict[str, Any]]:
        """The router's view of its engines (empty if it does not answer)."""
        try:
            return list(self.router.status()["router"]["nodes"])
        except (OSError, AssertionError, ValueError, KeyError):
            return []

    def failures(self, name: str) -> dict[str, int]:
        """What the router counted against engine ``name``, by reason."""
        return next((dict(n["failures"]) for n in self.nodes() if n["name"] == name), {})

    def wait_live(self, timeout_s: float) -> bool:
        """Whether every engine is in again within ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            nodes = self.nodes()
            if nodes and all(n["live"] for n in nodes):
                return True
            time.sleep(0.1)
        return False

    def close(self) -> list[str]:
        """Stop the router and the engines; what went wrong with the router."""
        alive = self.router.proc.poll() is None
        log = self.router.log
        self.stack.close()
        problems = [] if alive else [f"the router exited by itself:\n{log[-2000:]}"]
        if "Traceback" in log:
            problems.append(f"the router logged a traceback:\n{log[-3000:]}")
        return problems


class RouterWorker(Background):
    """Sends completions through the router on its own thread until ``stop``,
    half of them streamed; each is one "route" operation."""

    def __init__(self, leg: RouterLeg, history: History, seed: int) -> None:
        super().__init__("traffic-router")
        self.leg, self.history = leg, history
        self.rng = random.Random(f"{seed}-router")

    def _run(self) -> None:
        n = 0
        while not self.stop.is_set():
            n += 1
            self.complete(n, stream=self.rng.random() < 0.5)
            time.sleep(self.rng.uniform(0.02, 0.08))

    def complete(self, n: int, stream: bool) -> None:
        body = {"model": "standin-model", "prompt": f"p{n}", "max_tokens": 4, "stream": stream}
        headers = {"Authorization": f"Bearer {API_KEY}", "Content-Type": "application/json"}
        with self.history.record("router", "route", ROUTE_BOUND_S, stream=stream) as op:
            try:
                status, data = request(
                    self.leg.router.url,
                    "POST",
                    GENERATE,
                    headers,
                    json.dumps(body).encode(),
                    timeout_s=4 * ROUTE_BOUND_S,
                )
            except OSError as exc:  # no answer at all: the router's fault
                op.outcome, op.result = "error", {"status": 0, "error": repr(exc)}
                return
            op.result = {"status": status, **answer(data, stream)}
            op.outcome = "ok" if status == 200 and "error" not in op.result else "error"


def answer(data: bytes, stream: bool) -> dict[str, Any]:
    """The engine that answered, or the error the client got (for a stream:
    an error event, or no ``[DONE]``)."""
    text = data.decode(errors="replace")
    try:
        if not stream:
            body = json.loads(text)
            if "error" in body:
                return {"error": body["error"].get("message", ""), "type": body["error"]["type"]}
            return {"engine": json.loads(body["choices"][0]["text"])["engine"]}
        events = [line[6:] for line in text.splitlines() if line.startswith("data: ")]
        if "[DONE]" not in events:
            return {"error": "the stream ended without [DONE]"}
        first = json.loads(events[0])
        if "error" in first:
            return {"error": first["error"].get("message", ""), "type": first["error"]["type"]}
        return {"engine": json.loads(first["choices"][0]["text"])["engine"]}
    except (ValueError, KeyError, IndexError, TypeError) as exc:
        return {"error": f"an answer that is not a completion ({exc!r}): {text[:200]}"}


def engine_silent(leg: RouterLeg, rng: random.Random) -> dict[str, Any]:
    """One engine silent for 3.5-5 s. The requests it held (a generation or a
    /tokenize) early enough to be found before its silence ends
    (``held_early``) must have taken it out: ``silent_failures`` is what the
    router counted as silence meanwhile."""
    engine = leg.engine(rng.choice(["e0", "e1"]))
    silent_s = round(rng.uniform(3.5, 5.0), 2)
    before = leg.failures(engine.name).get("silent", 0)
    asked = len(engine.unanswered)
    leg.engines.silence(engine)
    time.sleep(silent_s - DETECT_S - 1.0)
    held_early = sum(path != "/health" for path in list(engine.unanswered)[asked:])
    time.sleep(DETECT_S + 1.0)
    silent_failures = leg.failures(engine.name).get("silent", 0) - before
    leg.engines.release(engine)
    return {
        "engine": engine.name,
        "silent_s": silent_s,
        "held_early": held_early,
        "silent_failures": silent_failures,
        "live_again": leg.wait_live(DOWN_S + 30.0),
    }


def engine_slow(leg: RouterLeg, rng: random.Random) -> dict[str, Any]:
    """One engine waits 0.5-4.5 s before each first byte for 2-4 s (past
    ``FIRST_BYTE_S`` a non-streamed answer is a 504, and a stream that timed
    out takes it out for ``DOWN_S``)."""
    engine = leg.engine(rng.choice(["e0", "e1"]))
    stall_s, slow_s = round(rng.uniform(0.5, 4.5), 2), round(rng.uniform(2.0, 4.0), 2)
    leg.engines.stall(engine, stall_s)
    time.sleep(slow_s)
    leg.engines.stall(engine, 0.0)
    return {
        "engine": engine.name,
        "stall_s": stall_s,
        "slow_s": slow_s,
        "live_again": leg.wait_live(DOWN_S + stall_s + 30.0),
    }
