"""``HealthProbe``: is an engine that has sent nothing yet busy, or silent?

A request waiting for an engine's first byte cannot tell a long generation
from an engine that will never answer (a stopped process, a wedged server
whose socket still accepts). The probe asks the engine a question that
costs it nothing: ``GET /health`` (vLLM's API server answers it while the
engine generates, without waiting on the engine core; SGLang serves it
too). Any HTTP answer within ``timeout_s``, whatever its status, means the
engine is there and the wait is its work; no answer means it is silent.

``check(node)`` returns None when the engine answered, else the counted
reason: ``"silent"`` (no answer within ``timeout_s``), ``"unreachable"``
(the connection was refused) or ``"broken"`` (it broke). Many requests
waiting on one engine share its probe: one in flight per engine, and an
answer younger than ``interval_s`` is taken as the answer now, so the engine
is asked at most about once per ``interval_s`` however many requests wait on
it. A failure is never reused: each verdict of silence is a fresh probe's.

The probe has its own HTTP session (its own connection pool): requests
holding every pooled connection must not make the probe wait for one and
time out, which would call a busy engine silent. Owned by the event loop's
thread (no lock).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

import aiohttp

from kvtier.router.core import Node

SILENT = "silent"  # the counted reason of an engine that answered nothing


class HealthProbe:
    """See the module docstring."""

    def __init__(
        self,
        session: aiohttp.ClientSession,
        timeout_s: float,
        interval_s: float,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.session = session
        self.timeout_s = timeout_s
        self.interval_s = interval_s
        self._clock = clock
        self._answered: dict[int, float] = {}  # node -> when it last answered
        self._asking: dict[int, asyncio.Task[str | None]] = {}  # node -> its probe in flight

    async def check(self, node: Node) -> str | None:
        """None if the engine answers (or did within ``interval_s``); else why not."""
        if self._clock() - self._answered.get(node.index, float("-inf")) < self.interval_s:
            return None
        task = self._asking.get(node.index)
        if task is None:
            task = asyncio.create_task(self._ask(node))
            self._asking[node.index] = task
            task.add_done_callback(lambda done: self._forget(node.index, done))
        # Shielded: a waiter that goes away (its client left) must not cancel
        # the probe the other waiters share.
        return await asyncio.shield(task)

    async def _ask(self, node: Node) -> str | None:
        timeout = aiohttp.ClientTimeout(total=self.timeout_s)
        try:
            async with self.session.get(node.url + "/health", timeout=timeout) as response:
                await response.read()
        except TimeoutError:  # aiohttp's timeouts are TimeoutErrors too
            return SILENT
        except aiohttp.ClientConnectorError:
            return "unreachable"
        except aiohttp.ClientError:
            return "broken"
        self._answered[node.index] = self._clock()
        return None

    def _forget(self, index: int, done: asyncio.Task[str | None]) -> None:
        if self._asking.get(index) is done:
            del self._asking[index]

    def close(self) -> None:
        """Cancel the probes in flight (the session is its owner's to close)."""
        for task in self._asking.values():
            task.cancel()
        self._asking.clear()


__all__ = ["SILENT", "HealthProbe"]
