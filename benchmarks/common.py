"""Shared helpers for the benchmark scripts: timing and reporting."""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt


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


def object_options(parser: argparse.ArgumentParser, objects: int, repeats: int) -> None:
    """``--objects``, ``--object-mib`` (8) and ``--repeats``: what a benchmark
    of whole objects moves, and how often."""
    parser.add_argument("--objects", type=int, default=objects)
    parser.add_argument("--object-mib", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=repeats)


def objects_of(args: argparse.Namespace) -> tuple[int, list[npt.NDArray[np.uint8]]]:
    """The object size and the random objects ``object_options`` asked for."""
    size = int(args.object_mib) << 20
    return size, random_objects(int(args.objects), size)


def random_objects(count: int, size: int, seed: int = 0) -> list[npt.NDArray[np.uint8]]:
    """``count`` payloads of ``size`` random bytes (incompressible, as KV is to
    a byte codec), the same for a seed."""
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, size, dtype=np.uint8) for _ in range(count)]


def report(title: str, rows: list[tuple[str, str]], results: dict[str, Any]) -> None:
    """Print a readable table and one JSON line (for BENCHMARKS.md)."""
    print(f"## {title}  ({platform.machine()}, python {platform.python_version()})")
    width = max(len(name) for name, _ in rows)
    for name, value in rows:
        print(f"  {name:<{width}}  {value}")
    print("json:", json.dumps(results, sort_keys=True))


CONVERSATION = (
    Path(__file__).resolve().parents[2] / "shared" / "traces" / "conversation_trace.jsonl"
)


def trace_options(parser: argparse.ArgumentParser, shapes: str) -> None:
    """``--trace FILE`` (repeatable; the conversation trace when none),
    ``--shapes`` of ``kvtier.traces.shapes`` and their ``--seed`` (1)."""
    parser.add_argument("--trace", type=Path, action="append", default=[])
    parser.add_argument("--shapes", default=shapes)
    parser.add_argument("--seed", type=int, default=1)


def named_traces(
    args: argparse.Namespace, out: Path, held_back: int | None = None
) -> dict[str, Path]:
    """The traces ``trace_options`` named, by name: the files, then each
    shape generated into ``out`` (again under seed ``held_back``, if given)."""
    from kvtier.traces.shapes import ShapeSpec, shape_trace, write_mooncake

    paths = {path.stem: path for path in args.trace}
    if not paths and CONVERSATION.exists():
        paths["conversation"] = CONVERSATION
    seeds = [args.seed] + ([held_back] if held_back is not None else [])
    for seed in seeds:
        for shape in [s for s in args.shapes.split(",") if s]:
            name = shape if seed == args.seed else f"{shape} (held back)"
            paths[name] = out / f"{shape}-{seed}.jsonl"
            write_mooncake(paths[name], shape_trace(ShapeSpec(shape, seed=seed)))
    return paths
