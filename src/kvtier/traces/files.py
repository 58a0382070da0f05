"""Trace files: kvtier's own format, written and read, and Mooncake's, read
through a ``ReplaySpec``; ``load_trace`` tells them apart by their first line.

kvtier's format is JSONL, one request per line: ``{"id", "arrival_s",
"prompt" (token ids), "output_tokens", "label", "warm", "tenant"}``.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import asdict
from pathlib import Path

from kvtier.traces.mooncake import ReplaySpec, SkippedLines, is_mooncake_line, replay_requests
from kvtier.traces.synthetic import TraceRequest


def write_trace(path: Path, trace: Iterable[TraceRequest]) -> None:
    with path.open("w") as out:
        for request in trace:
            out.write(json.dumps(asdict(request), separators=(",", ":")) + "\n")


def read_trace(path: Path) -> list[TraceRequest]:
    """A trace file; ValueError naming the line for anything malformed."""
    trace = []
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            request = TraceRequest(
                id=str(row["id"]),
                arrival_s=float(row["arrival_s"]),
                prompt=tuple(int(t) for t in row["prompt"]),
                output_tokens=int(row["output_tokens"]),
                label=str(row.get("label", "")),
                warm=bool(row.get("warm", False)),
                tenant=str(row.get("tenant", "")),
            )
        except (ValueError, KeyError, TypeError) as exc:
            raise ValueError(f"--trace {path}:{number}: not a trace request ({exc!r})") from None
        if not request.prompt or request.output_tokens < 1 or request.arrival_s < 0:
            raise ValueError(
                f"--trace {path}:{number}: a request needs a prompt, output_tokens >= 1 "
                "and arrival_s >= 0"
            )
        trace.append(request)
    if not any(not r.warm for r in trace):
        raise ValueError(f"--trace {path}: no (measured) requests in it")
    if len({r.id for r in trace}) != len(trace):
        raise ValueError(f"--trace {path}: request ids must be unique")
    return sorted(trace, key=lambda r: (not r.warm, r.arrival_s, r.id))


def is_mooncake_file(path: Path) -> bool:
    """Whether ``path`` is a Mooncake-format trace (by its first line)."""
    with path.open() as lines:
        return is_mooncake_line(next((line for line in lines if line.strip()), ""))


def load_trace(
    path: Path, replay: ReplaySpec | None = None, skipped: SkippedLines | None = None
) -> list[TraceRequest]:
    """The requests of a trace file in either format: kvtier's, or Mooncake's
    replayed through ``replay`` (default ``ReplaySpec()``)."""
    if not is_mooncake_file(path):
        return read_trace(path)
    trace = list(replay_requests(path, replay or ReplaySpec(), skipped))
    if not trace:
        raise ValueError(f"--trace {path}: no request inside the window and sample")
    return trace


__all__ = ["is_mooncake_file", "load_trace", "read_trace", "write_trace"]
