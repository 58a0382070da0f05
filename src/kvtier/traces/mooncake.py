"""Mooncake-format request traces (the FAST'25 release), read line by line.

One JSON object a line: ``timestamp`` (ms from the trace's start),
``input_length``, ``output_length`` and ``hash_ids``: one id per
``TRACE_BLOCK_TOKENS`` (512) tokens of the input, prefix-chained (two requests
share block *i* only if they share every block before it), the last block
possibly partial. The tokens themselves are not released.

A trace is streamed, never loaded whole, and may be gzip-compressed
(``lines.py``): ``read_mooncake`` yields one checked ``MooncakeRecord`` at a
time. A bad line (longer than ``max_line_bytes``, not UTF-8, not JSON, a
missing field, a negative length, ``hash_ids`` that do not cover
``input_length``, a timestamp before the previous line's) raises
``ValueError`` naming the file, the line and the field, or, with
``skip_bad_lines``, is counted in ``SkippedLines`` and left out.

``replay_requests`` turns records into kvtier ``TraceRequest``s with
synthetic tokens: each hash id becomes its own block of ``block_tokens``
token ids, a pure function of (seed, hash id), so requests that share blocks
in the trace share exactly those tokens. A smaller ``block_tokens`` than 512
scales every prompt down by ``block_tokens / 512`` for small engines; reports
state the block size they replayed at.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from kvtier.traces.lines import DEFAULT_MAX_LINE_BYTES, MAX_LINE_FLAG, TraceLine, trace_lines
from kvtier.traces.synthetic import TraceRequest

TRACE_BLOCK_TOKENS = 512
FIELDS = ("timestamp", "input_length", "output_length", "hash_ids")
_KEPT_REASONS = 5


@dataclass(frozen=True, slots=True)
class MooncakeRecord:
    line: int  # 1-based line number in its file
    timestamp_ms: float
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]

    def block_lengths(self) -> list[int]:
        """Tokens of each block in the trace (512, the last one possibly fewer)."""
        full = len(self.hash_ids) - 1
        return [TRACE_BLOCK_TOKENS] * full + [self.input_length - full * TRACE_BLOCK_TOKENS]


@dataclass(slots=True)
class SkippedLines:
    """Lines ``--skip-bad-lines`` left out: how many, and the first reasons."""

    count: int = 0
    reasons: list[str] = field(default_factory=list)

    def add(self, reason: str) -> None:
        self.count += 1
        if len(self.reasons) < _KEPT_REASONS:
            self.reasons.append(reason)


def is_mooncake_line(line: str) -> bool:
    """Whether a trace line is in Mooncake's format (it has ``hash_ids``)."""
    try:
        row = json.loads(line)
    except ValueError:
        return False
    return isinstance(row, dict) and "hash_ids" in row


def _count(row: dict[str, Any], name: str, least: int) -> int:
    value = row[name]
    if isinstance(value, bool) or not isinstance(value, int) or value < least:
        raise ValueError(f"field {name!r} must be an integer >= {least}, got {value!r}")
    return value


def _record(row: Any, line: int, previous_ms: float) -> MooncakeRecord:
    if not isinstance(row, dict):
        raise ValueError("not a JSON object")
    for name in FIELDS:
        if name not in row:
            raise ValueError(f"field {name!r} is missing")
    timestamp = row["timestamp"]
    if (
        isinstance(timestamp, bool)
        or not isinstance(timestamp, int | float)
        or not math.isfinite(timestamp)
        or timestamp < 0
    ):
        raise ValueError(f"field 'timestamp' must be a number of ms >= 0, got {timestamp!r}")
    if timestamp < previous_ms:
        raise ValueError(
            f"field 'timestamp' {timestamp} is before the previous line's {previous_ms:g}: "
            "a trace must be in time order"
        )
    input_length = _count(row, "input_length", 1)
    output_length = _count(row, "output_length", 0)
    ids = row["hash_ids"]
    if not isinstance(ids, list) or not all(
        isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids
    ):
        raise ValueError("field 'hash_ids' must be a list of integers >= 0")
    blocks = math.ceil(input_length / TRACE_BLOCK_TOKENS)
    if len(ids) != blocks:
        raise ValueError(
            f"field 'hash_ids' has {len(ids)} ids but input_length {input_length} "
            f"makes {blocks} blocks of {TRACE_BLOCK_TOKENS} tokens"
        )
    if len(set(ids)) != len(ids):
        raise ValueError("field 'hash_ids' repeats an id (ids are prefix-chained)")
    return MooncakeRecord(line, float(timestamp), input_length, output_length, tuple(ids))


def _row(line: TraceLine) -> Any:
    if line.error is not None:
        raise ValueError(line.error)
    try:
        return json.loads(line.text)
    except ValueError as exc:
        raise ValueError(f"not JSON ({exc})") from None


def read_mooncake(
    path: Path,
    *,
    skip_bad_lines: bool = False,
    skipped: SkippedLines | None = None,
    max_line_bytes: int = DEFAULT_MAX_LINE_BYTES,
) -> Iterator[MooncakeRecord]:
    """The checked records of ``path``, one at a time, in file order; no
    line is held longer than ``max_line_bytes`` (``lines.trace_lines``).

    A bad line raises ``ValueError`` naming ``path``, the line and the field;
    with ``skip_bad_lines`` it is counted in ``skipped`` instead. Blank lines
    are ignored. A file that cannot be read raises ``ValueError`` naming
    ``--trace`` and ``path``, skipped lines or not."""
    previous_ms = 0.0
    for line in trace_lines(path, max_line_bytes):
        if line.blank:
            continue
        try:
            record = _record(_row(line), line.number, previous_ms)
        except ValueError as exc:
            reason = f"{path}:{line.number}: {exc}"
            if not skip_bad_lines:
                raise ValueError(f"{reason} (--skip-bad-lines leaves such lines out)") from None
            if skipped is not None:
                skipped.add(reason)
            continue
        previous_ms = record.timestamp_ms
        yield record


@dataclass(frozen=True, slots=True)
class ReplaySpec:
    """How a Mooncake trace becomes kvtier requests."""

    block_tokens: int = TRACE_BLOCK_TOKENS  # synthetic tokens per trace block
    vocab_size: int = 4096
    seed: int = 0
    time_scale: float = 1.0  # replay seconds per trace second (0.5: twice as fast)
    start_s: float = 0.0  # the window: trace seconds [start_s, start_s + duration_s)
    duration_s: float | None = None
    sample: float = 1.0  # share of sessions kept
    session_blocks: int = 2  # a session: the requests sharing their first blocks
    max_output_tokens: int | None = None
    skip_bad_lines: bool = False
    max_line_bytes: int = DEFAULT_MAX_LINE_BYTES  # a longer line is bad (lines.py)

    def __post_init__(self) -> None:
        checks = (
            ("--trace-block-tokens", self.block_tokens, ">= 1", self.block_tokens >= 1),
            ("--vocab-size", self.vocab_size, ">= 2", self.vocab_size >= 2),
            ("--time-scale", self.time_scale, "> 0", self.time_scale > 0),
            ("--window-start-s", self.start_s, ">= 0", self.start_s >= 0),
            ("--window-s", self.duration_s, "> 0", self.duration_s is None or self.duration_s > 0),
            ("--sample", self.sample, "in (0, 1]", 0 < self.sample <= 1),
            ("--session-blocks", self.session_blocks, ">= 1", self.session_blocks >= 1),
            (
                "--max-output-tokens",
                self.max_output_tokens,
                ">= 1",
                self.max_output_tokens is None or self.max_output_tokens >= 1,
            ),
            (MAX_LINE_FLAG, self.max_line_bytes, ">= 1", self.max_line_bytes >= 1),
        )
        for flag, value, want, ok in checks:
            if not ok:
                raise ValueError(f"{flag} must be {want}, got {value!r}")

    def in_window(self, record: MooncakeRecord) -> bool:
        seconds = record.timestamp_ms / 1000
        end = math.inf if self.duration_s is None else self.start_s + self.duration_s
        return self.start_s <= seconds < end

    def sampled(self, record: MooncakeRecord) -> bool:
        """Whether ``record``'s session is in the sample: a pure function of
        the seed and the session's first ``session_blocks`` ids."""
        if self.sample >= 1:
            return True
        session = record.hash_ids[: self.session_blocks]
        digest = hashlib.blake2b(repr((self.seed, session)).encode(), digest_size=8).digest()
        return int.from_bytes(digest) / 2**64 < self.sample


def block_token_ids(hash_id: int, spec: ReplaySpec) -> np.ndarray:
    """The ``spec.block_tokens`` token ids of trace block ``hash_id``: a
    counter-based hash (splitmix64) of (seed, hash id, position)."""
    with np.errstate(over="ignore"):
        x = np.arange(spec.block_tokens, dtype=np.uint64)
        x += np.uint64((spec.seed * 0x9E3779B97F4A7C15 + hash_id * 0xBF58476D1CE4E5B9) % 2**64)
        x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        x ^= x >> np.uint64(31)
    return (x % np.uint64(spec.vocab_size)).astype(np.int64)


def replay_prompt(record: MooncakeRecord, spec: ReplaySpec) -> tuple[int, ...]:
    """``record``'s synthetic prompt: its blocks' tokens, the last block cut
    to its share of ``spec.block_tokens``."""
    last = record.block_lengths()[-1]
    last_tokens = max(1, math.ceil(last * spec.block_tokens / TRACE_BLOCK_TOKENS))
    blocks = [block_token_ids(i, spec) for i in record.hash_ids]
    blocks[-1] = blocks[-1][:last_tokens]
    return tuple(int(t) for t in np.concatenate(blocks))


def replay_requests(
    path: Path, spec: ReplaySpec, skipped: SkippedLines | None = None
) -> Iterator[TraceRequest]:
    """The requests of ``path`` inside ``spec``'s window and sample, in time
    order, arriving at ``(timestamp - start) * time_scale`` seconds."""
    records = read_mooncake(
        path,
        skip_bad_lines=spec.skip_bad_lines,
        skipped=skipped,
        max_line_bytes=spec.max_line_bytes,
    )
    for record in records:
        if not spec.in_window(record) or not spec.sampled(record):
            continue
        output = max(1, record.output_length)
        if spec.max_output_tokens is not None:
            output = min(output, spec.max_output_tokens)
        yield TraceRequest(
            id=f"line-{record.line:06d}",
            arrival_s=(record.timestamp_ms / 1000 - spec.start_s) * spec.time_scale,
            prompt=replay_prompt(record, spec),
            output_tokens=output,
            label=f"{len(record.hash_ids)} blocks from line {record.line}",
        )


__all__ = [
    "TRACE_BLOCK_TOKENS",
    "MooncakeRecord",
    "ReplaySpec",
    "SkippedLines",
    "block_token_ids",
    "is_mooncake_line",
    "read_mooncake",
    "replay_prompt",
    "replay_requests",
]
