"""Trace files: kvtier's own format, written and read, and Mooncake's, read
through a ``ReplaySpec``; ``load_trace`` tells them apart by their first
readable line. Either may be gzip-compressed; no line longer than
``max_line_bytes`` is held (``lines.py``).

kvtier's format is JSONL, one request per line: ``{"id", "arrival_s",
"prompt" (token ids), "output_tokens", "label", "warm", "tenant"}``.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import asdict
from pathlib import Path

from kvtier.traces.lines import DEFAULT_MAX_LINE_BYTES, trace_lines
from kvtier.traces.mooncake import ReplaySpec, SkippedLines, is_mooncake_line, replay_requests
from kvtier.traces.synthetic import TraceRequest


def write_trace(path: Path, trace: Iterable[TraceRequest]) -> None:
    with path.open("w") as out:
        for request in trace:
            out.write(json.dumps(asdict(request), separators=(",", ":")) + "\n")


def read_trace(path: Path, max_line_bytes: int = DEFAULT_MAX_LINE_BYTES) -> list[TraceRequest]:
    """A trace file; ValueError naming the line for anything malformed (a
    line longer than ``max_line_bytes`` or not UTF-8 too)."""
    trace = []
    for line in trace_lines(path, max_line_bytes):
        number = line.number
        if line.blank:
            continue
        if line.error is not None:
            raise ValueError(f"--trace {path}:{number}: {line.error}")
        try:
            row = json.loads(line.text)
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


def is_mooncake_file(path: Path, max_line_bytes: int = DEFAULT_MAX_LINE_BYTES) -> bool:
    """Whether ``path`` is a Mooncake-format trace, by its first line that is
    neither blank nor bad (a bad line is the reader's to report or skip);
    ValueError naming ``--trace`` and ``path`` when it cannot be read."""
    for line in trace_lines(path, max_line_bytes):
        if not line.blank and line.error is None:
            return is_mooncake_line(line.text)
    return False


def load_trace(
    path: Path, replay: ReplaySpec | None = None, skipped: SkippedLines | None = None
) -> list[TraceRequest]:
    """The requests of a trace file in either format: kvtier's, or Mooncake's
    replayed through ``replay`` (default ``ReplaySpec()``, whose
    ``max_line_bytes`` bounds the lines of either)."""
    replay = replay or ReplaySpec()
    if not is_mooncake_file(path, replay.max_line_bytes):
        return read_trace(path, replay.max_line_bytes)
    trace = list(replay_requests(path, replay, skipped))
    if not trace:
        raise ValueError(f"--trace {path}: no request inside the window and sample")
    return trace


__all__ = ["is_mooncake_file", "load_trace", "read_trace", "write_trace"]
