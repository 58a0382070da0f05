"""``FailureLog``: how a loop or worker thread reports an exception it survives.

A server thread that dies takes every engine's cache with it, so each loop
catches what its body raises, counts it and goes on. Logging every
occurrence of a defect that fires on every turn would bury the log, so the
traceback is logged the first time each defect (exception type and the line
that raised it) happens, with the context of that occurrence; later ones are
only counted (and logged at debug level).
"""

from __future__ import annotations

import logging
import sys
import threading
import traceback

from kvtier.counters import Counters


class FailureLog:
    def __init__(
        self, log: logging.Logger, counters: Counters, name: str = "worker_errors"
    ) -> None:
        self._log = log
        self._counters = counters
        self._name = name
        self._seen: set[tuple[str, str, int]] = set()
        self._lock = threading.Lock()

    def record(self, context: str) -> None:
        """Call from an ``except`` block: count the exception being handled and
        log it (with its traceback the first time this defect happens)."""
        exc = sys.exception()
        self._counters.add(self._name)
        frames = traceback.extract_tb(exc.__traceback__) if exc is not None else []
        where = (
            (type(exc).__name__, frames[-1].filename, frames[-1].lineno or 0)
            if frames
            else (
                type(exc).__name__,
                "",
                0,
            )
        )
        with self._lock:
            first = where not in self._seen
            self._seen.add(where)
        if first:
            self._log.error("%s failed; going on", context, exc_info=exc)
        else:
            self._log.debug("%s failed again (%r); going on", context, exc)
