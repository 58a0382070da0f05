"""Mooncake-format traces: every bad line named by line and field (or
skipped and counted), records streamed one at a time, and a replay whose
tokens share exactly what the trace's blocks share."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest

from kvtier.traces import (
    ReplaySpec,
    SkippedLines,
    TraceRequest,
    load_trace,
    read_mooncake,
    replay_requests,
    write_trace,
)
from kvtier.traces.mooncake import block_token_ids
from tests.unit.traces.conversations import conversation_rows, write_rows

NOT_FINITE = '{{"timestamp": {}, "input_length": 1, "output_length": 1, "hash_ids": [0]}}'
GOOD = {"timestamp": 5, "input_length": 1000, "output_length": 20, "hash_ids": [0, 1]}


@pytest.mark.parametrize(
    ("line", "words"),
    [
        ("{not json", ["not JSON"]),
        ("[1, 2]", ["not a JSON object"]),
        ({**GOOD, "hash_ids": None} | {"x": 1}, ["'hash_ids'"]),
        ({k: v for k, v in GOOD.items() if k != "output_length"}, ["'output_length'", "missing"]),
        ({**GOOD, "input_length": -3}, ["'input_length'", ">= 1", "-3"]),
        ({**GOOD, "output_length": -1}, ["'output_length'", ">= 0"]),
        ({**GOOD, "timestamp": "soon"}, ["'timestamp'"]),
        (
            '{"timestamp": NaN, "input_length": 1, "output_length": 1, "hash_ids": [0]}',
            ["'timestamp'", "nan"],
        ),
        (
            '{"timestamp": Infinity, "input_length": 1, "output_length": 1, "hash_ids": [0]}',
            ["'timestamp'", "inf"],
        ),
        ({**GOOD, "timestamp": 1}, ["'timestamp'", "before the previous line's 5"]),
        ({**GOOD, "hash_ids": [0, 1, 2]}, ["'hash_ids'", "3 ids", "input_length 1000", "2 blocks"]),
        ({**GOOD, "hash_ids": [0, 0]}, ["'hash_ids'", "repeats"]),
        ({**GOOD, "hash_ids": [0, -1]}, ["'hash_ids'", ">= 0"]),
    ],
)
def test_a_bad_line_is_named_by_line_and_field(
    tmp_path: Path, line: object, words: list[str]
) -> None:
    path = write_rows(tmp_path / "t.jsonl", [GOOD, line])  # type: ignore[list-item]
    with pytest.raises(ValueError) as caught:
        list(read_mooncake(path))
    message = str(caught.value)
    assert f"{path}:2:" in message and "--skip-bad-lines" in message
    for word in words:
        assert word in message


def test_skip_bad_lines_counts_them_and_keeps_the_rest(tmp_path: Path) -> None:
    rows = [GOOD, "{", {**GOOD, "timestamp": 1}, "", {**GOOD, "timestamp": 9}]
    path = write_rows(tmp_path / "t.jsonl", rows)
    skipped = SkippedLines()
    records = list(read_mooncake(path, skip_bad_lines=True, skipped=skipped))
    assert [r.line for r in records] == [1, 5]  # the blank line 4 is no request
    assert skipped.count == 2
    assert skipped.reasons[0].startswith(f"{path}:2: not JSON")
    assert skipped.reasons[1].startswith(f"{path}:3: field 'timestamp'")


def test_records_stream_one_at_a_time(tmp_path: Path) -> None:
    """The first record arrives before a bad line further down is read."""
    path = write_rows(tmp_path / "t.jsonl", [GOOD, GOOD, "{"])
    records = read_mooncake(path)
    first = next(records)
    assert (first.line, first.input_length, first.hash_ids) == (1, 1000, (0, 1))
    assert first.block_lengths() == [512, 488]
    next(records)
    with pytest.raises(ValueError, match=":3: not JSON"):
        next(records)


def _common(a: list[int] | tuple[int, ...], b: list[int] | tuple[int, ...]) -> int:
    """The length of the common prefix of ``a`` and ``b``."""
    pairs = zip(a, b, strict=False)
    return sum(1 for _ in itertools.takewhile(lambda p: p[0] == p[1], pairs))


def test_replay_shares_exactly_the_blocks_the_trace_shares(tmp_path: Path) -> None:
    rows = conversation_rows(60)
    path = write_rows(tmp_path / "t.jsonl", rows)
    spec = ReplaySpec(block_tokens=64, vocab_size=50_000)
    trace = list(replay_requests(path, spec))
    assert len(trace) == len(rows)
    for row, request in zip(rows, trace, strict=True):
        full, last = divmod(row["input_length"], 512)
        assert len(request.prompt) == (full * 64 + -(-last * 64 // 512)), "scaled by 64/512"
        assert request.arrival_s == row["timestamp"] / 1000
    for (ra, a), (rb, b) in itertools.combinations(zip(rows, trace, strict=True), 2):
        common = _common(ra["hash_ids"], rb["hash_ids"])
        if common:  # shared blocks become shared tokens, and no more (vocab large)
            shorter = min(len(a.prompt), len(b.prompt), common * 64)
            assert _common(a.prompt, b.prompt) >= shorter
        assert _common(a.prompt, b.prompt) < common * 64 + 64


def test_replay_is_a_pure_function_of_seed_and_block() -> None:
    spec = ReplaySpec(block_tokens=32, vocab_size=1000, seed=3)
    assert (block_token_ids(7, spec) == block_token_ids(7, spec)).all()
    assert (block_token_ids(7, spec) != block_token_ids(8, spec)).any()
    other = ReplaySpec(block_tokens=32, vocab_size=1000, seed=4)
    assert (block_token_ids(7, spec) != block_token_ids(7, other)).any()
    assert block_token_ids(7, spec).max() < 1000


def test_window_time_scale_and_output_cap(tmp_path: Path) -> None:
    rows = conversation_rows(200)
    path = write_rows(tmp_path / "t.jsonl", rows)
    spec = ReplaySpec(start_s=10, duration_s=20, time_scale=0.5, max_output_tokens=8)
    trace = list(replay_requests(path, spec))
    inside = [r for r in rows if 10 <= r["timestamp"] / 1000 < 30]
    assert len(trace) == len(inside) > 0
    assert [t.arrival_s for t in trace] == [(r["timestamp"] / 1000 - 10) * 0.5 for r in inside]
    assert all(
        t.output_tokens == min(8, max(1, r["output_length"]))
        for t, r in zip(trace, inside, strict=True)
    )


def test_a_sample_keeps_whole_sessions(tmp_path: Path) -> None:
    rows = conversation_rows(300)
    path = write_rows(tmp_path / "t.jsonl", rows)
    kept = {r.label for r in replay_requests(path, ReplaySpec(sample=0.4))}
    lines = {int(label.rsplit(" ", 1)[1]) for label in kept}
    sessions = {}
    for number, row in enumerate(rows, 1):
        sessions.setdefault(tuple(row["hash_ids"][:2]), set()).add(number)
    whole = [s for s in sessions.values() if s <= lines]
    assert sum(len(s) for s in whole) == len(lines), "a session is kept whole or not at all"
    assert 0.2 < len(whole) / len(sessions) < 0.6
    again = {r.label for r in replay_requests(path, ReplaySpec(sample=0.4))}
    assert again == kept


def test_load_trace_reads_either_format(tmp_path: Path) -> None:
    mooncake = write_rows(tmp_path / "m.jsonl", conversation_rows(10))
    assert len(load_trace(mooncake, ReplaySpec(block_tokens=16))) == 10
    ours = tmp_path / "k.jsonl"
    write_trace(ours, [TraceRequest("a", 0.0, (1, 2, 3), 4)])
    assert load_trace(ours) == [TraceRequest("a", 0.0, (1, 2, 3), 4)]
    with pytest.raises(ValueError, match="no request inside the window"):
        load_trace(mooncake, ReplaySpec(start_s=10**6))


def test_replay_spec_names_the_flag() -> None:
    with pytest.raises(ValueError, match=r"--sample must be in \(0, 1\], got 0"):
        ReplaySpec(sample=0)
    with pytest.raises(ValueError, match="--trace-block-tokens must be >= 1, got 0"):
        ReplaySpec(block_tokens=0)
    with pytest.raises(ValueError, match="--window-s must be > 0, got -1"):
        ReplaySpec(duration_s=-1)
