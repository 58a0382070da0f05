"""``Upkeep``: the cache server's periodic jobs, on one clock.

The transport's loop calls ``run_due()`` on every tick (``TICK_S``); a job
runs once its interval has passed since it was registered or last started.
No job has a thread that sleeps on a timer of its own, so a server at rest
wakes for its tick and nothing else. Two kinds of job::

    every(name, interval_s, job)                 on the loop, in the tick
    every(name, interval_s, job, on_loop=False)  on a thread started for the run

- **On the loop**: short work over state the loop owns or reads cheaply
  (the dashboard's sample of the status snapshot, which builds it).
- **Off the loop**: work that may take long (a retention sweep deletes
  files, a usage count lists a disk) would stall every engine's requests on
  the loop; each run gets a thread that ends with it. A run still going when
  its job is due again is not doubled: that turn is skipped and counted
  (``overran.<name>``). A thread kept per job would idle between runs; one
  started per run costs tens of microseconds every few seconds at most.

A job that raises is logged (its traceback the first time each defect
happens) and counted (``errors.<name>``); the other jobs, and the loop, go
on. ``runs.<name>`` counts the runs that returned.

Thread safety: ``every``, ``run_due`` and ``close`` are called from one
thread (the loop's; before it starts, the thread that builds the server);
the counters have their own lock, so ``status()`` may be read from any
thread.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from kvtier.counters import Counters
from kvtier.failures import FailureLog

log = logging.getLogger(__name__)


@dataclass(slots=True, eq=False)
class _Job:
    name: str
    interval_s: float
    run: Callable[[], object]
    on_loop: bool
    due: float
    failures: FailureLog
    thread: threading.Thread | None = None  # off the loop: the run in progress


class Upkeep:
    """Named periodic jobs; see the module docstring."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._jobs: dict[str, _Job] = {}
        self._closed = False
        self.counters = Counters()

    def every(
        self, name: str, interval_s: float, job: Callable[[], object], *, on_loop: bool = True
    ) -> None:
        """Run ``job`` every ``interval_s`` seconds from now on."""
        if not name or name in self._jobs:
            raise ValueError(f"upkeep job name {name!r} is empty or already taken")
        if not (math.isfinite(interval_s) and interval_s > 0):
            raise ValueError(f"upkeep job {name!r}: interval_s must be > 0, got {interval_s}")
        due = self._clock() + interval_s
        failures = FailureLog(log, self.counters, f"errors.{name}")
        self._jobs[name] = _Job(name, interval_s, job, on_loop, due, failures)

    def run_due(self) -> None:
        """Start every job whose time has come; never raises."""
        if self._closed:
            return
        for job in self._jobs.values():
            now = self._clock()
            if now < job.due:
                continue
            job.due = now + job.interval_s
            if job.on_loop:
                self._run(job)
            elif job.thread is not None and job.thread.is_alive():
                self.counters.add(f"overran.{job.name}")
            else:
                job.thread = threading.Thread(
                    target=self._run, args=(job,), name=f"kvtier-{job.name}", daemon=True
                )
                job.thread.start()

    def status(self) -> dict[str, int]:
        """``runs.<job>``, ``errors.<job>``, ``overran.<job>``."""
        return self.counters.snapshot()

    def close(self, timeout_s: float = 10.0) -> None:
        """Start nothing more; wait up to ``timeout_s`` for runs in progress."""
        self._closed = True
        deadline = time.monotonic() + timeout_s
        for job in self._jobs.values():
            if job.thread is not None:
                job.thread.join(max(0.0, deadline - time.monotonic()))
                if job.thread.is_alive():
                    log.warning("upkeep: %s still runs at close; left behind", job.name)

    def _run(self, job: _Job) -> None:
        try:
            job.run()
        except Exception:
            job.failures.record(f"upkeep: {job.name}")
        else:
            self.counters.add(f"runs.{job.name}")


__all__ = ["Upkeep"]
