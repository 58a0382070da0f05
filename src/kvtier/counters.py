"""``Counters``: thread-safe named counters and gauges behind ``status()``."""

from __future__ import annotations

import threading
from collections import Counter


class Counters:
    """Counters that any thread may add to, and gauges that one thread sets."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._values: Counter[str] = Counter()

    def add(self, name: str, n: int = 1) -> None:
        if n:
            with self._lock:
                self._values[name] += n

    def set(self, **gauges: int) -> None:
        with self._lock:
            for name, value in gauges.items():
                self._values[name] = value

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            return dict(self._values)
