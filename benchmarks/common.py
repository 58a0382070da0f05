"""Shared helpers for the benchmark scripts: timing and reporting."""

from __future__ import annotations

import json
import platform
import statistics
import time
from collections.abc import Callable
from typing import Any


def timed(fn: Callable[[], object]) -> float:
    """Wall seconds of one call."""
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def median_time(fn: Callable[[], object], repeats: int) -> float:
    """Median wall seconds of ``repeats`` calls."""
    return statistics.median(timed(fn) for _ in range(repeats))


def percentile(samples: list[float], q: float) -> float:
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1)))]


def report(title: str, rows: list[tuple[str, str]], results: dict[str, Any]) -> None:
    """Print a readable table and one JSON line (for BENCHMARKS.md)."""
    print(f"## {title}  ({platform.machine()}, python {platform.python_version()})")
    width = max(len(name) for name, _ in rows)
    for name, value in rows:
        print(f"  {name:<{width}}  {value}")
    print("json:", json.dumps(results, sort_keys=True))
