"""How long an engine step spends in the connector, step by step.

The scheduler thread runs every engine step; whatever the connector does on it
(a lookup's bounded wait, a session end handed to the client) delays every
request in the batch, and so does what a worker's ``wait_for_save`` does
before the step returns. ``StepTimer`` measures either and logs a summary.
"""

from __future__ import annotations

import logging
import time

log = logging.getLogger(__name__)

LOG_EVERY_STEPS = 1000
LOG_EVERY_S = 30.0  # or this often, when steps are few (vLLM may end without a shutdown)


class StepTimer:
    """Seconds a step spends in the connector's calls (``with timer:`` around
    each call; ``step()`` once per step), logged every ``LOG_EVERY_STEPS``
    steps or ``LOG_EVERY_S`` seconds as ``<name>: N steps; <what> p50 ...``."""

    def __init__(
        self, name: str = "kvtier scheduler", what: str = "connector time per step"
    ) -> None:
        self.name = name
        self.what = what
        self.steps: list[float] = []  # per step, since the last summary
        self.total_steps = 0
        self.max_s = 0.0
        self._current = 0.0
        self._entered = 0.0
        self._since = time.monotonic()

    def __enter__(self) -> StepTimer:
        self._entered = time.perf_counter()
        return self

    def __exit__(self, *exc: object) -> None:
        self._current += time.perf_counter() - self._entered

    def step(self) -> bool:
        """End a step; True when this logged a summary."""
        self.steps.append(self._current)
        self.max_s = max(self.max_s, self._current)
        self.total_steps += 1
        self._current = 0.0
        if len(self.steps) < LOG_EVERY_STEPS and time.monotonic() - self._since < LOG_EVERY_S:
            return False
        self.report()
        return True

    def report(self) -> None:
        if not self.steps:
            return
        ordered = sorted(self.steps)
        p50, p99 = (ordered[min(len(ordered) - 1, int(q * len(ordered)))] for q in (0.5, 0.99))
        log.info(
            "%s: %d steps; %s p50 %.3f ms, p99 %.3f ms, max %.3f ms (over %d steps)",
            self.name,
            len(ordered),
            self.what,
            p50 * 1e3,
            p99 * 1e3,
            self.max_s * 1e3,
            self.total_steps,
        )
        self.steps.clear()
        self._since = time.monotonic()
