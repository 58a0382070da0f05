"""Trace files read a bounded line at a time: a file that cannot be opened
is named with ``--trace``; a line that is not UTF-8 or too long is a bad line
like any other (named by file and line, or skipped and counted) and an
over-long one is never held whole; a gzip trace is read as it is, other
compressed ones refused by name."""

from __future__ import annotations

import bz2
import gzip
import json
import lzma
import tracemalloc
from pathlib import Path

import pytest

from kvtier.traces import (
    DEFAULT_MAX_LINE_BYTES,
    ReplaySpec,
    SkippedLines,
    load_trace,
    read_mooncake,
)
from kvtier.traces.lines import trace_lines
from tests.unit.traces.conversations import conversation_rows, write_rows

GOOD = {"timestamp": 5, "input_length": 1000, "output_length": 20, "hash_ids": [0, 1]}
LATER = {**GOOD, "timestamp": 9, "hash_ids": [2, 3]}
HUGE_IDS = 6_550_000  # the review's line: 6.55 M block ids, 51 MB of JSON
MiB = 1 << 20


@pytest.fixture(scope="module")
def huge(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """GOOD, then one Mooncake line of ``HUGE_IDS`` ids (written in pieces,
    so the test holds none of it), then LATER."""
    path = tmp_path_factory.mktemp("huge") / "t.jsonl"
    with path.open("w") as out:
        out.write(json.dumps(GOOD) + "\n")
        out.write(f'{{"timestamp": 7, "input_length": {HUGE_IDS * 512}, "output_length": 1, ')
        out.write('"hash_ids": [')
        step = 100_000
        for start in range(0, HUGE_IDS, step):
            ids = range(start + 10, min(HUGE_IDS, start + step) + 10)
            out.write(("," if start else "") + ",".join(map(str, ids)))
        out.write("]}\n")
        out.write(json.dumps(LATER) + "\n")
    assert path.stat().st_size > 48 * MiB
    return path


def test_a_missing_file_or_a_directory_is_named_with_the_flag(tmp_path: Path) -> None:
    missing = tmp_path / "missing.jsonl"
    with pytest.raises(ValueError) as caught:
        list(read_mooncake(missing))
    assert str(caught.value) == f"--trace {missing}: cannot open it (No such file or directory)"
    with pytest.raises(ValueError) as caught:
        list(read_mooncake(tmp_path))
    assert str(caught.value) == f"--trace {tmp_path}: cannot open it (Is a directory)"


def test_a_line_that_is_not_utf8_is_a_bad_line_named_by_file_and_line(tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl"
    path.write_bytes(b"\n".join([json.dumps(GOOD).encode(), b'{"x": "\x80\xff"}', b""]))
    with pytest.raises(ValueError) as caught:
        list(read_mooncake(path))
    assert str(caught.value) == (
        f"{path}:2: not UTF-8 text (byte 0x80 at offset 7 of the line) "
        "(--skip-bad-lines leaves such lines out)"
    )


def test_skip_bad_lines_skips_and_counts_a_line_that_is_not_utf8(tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl"
    lines = [json.dumps(GOOD).encode(), b"\xc3\x28 not text", json.dumps(LATER).encode(), b""]
    path.write_bytes(b"\n".join(lines))
    skipped = SkippedLines()
    records = list(read_mooncake(path, skip_bad_lines=True, skipped=skipped))
    assert [r.line for r in records] == [1, 3]
    assert skipped.count == 1 and skipped.reasons == [
        f"{path}:2: not UTF-8 text (byte 0xc3 at offset 0 of the line)"
    ]


@pytest.mark.parametrize("name", ["t.jsonl.gz", "t.jsonl"])  # known by its bytes, not its name
def test_a_gzip_trace_is_read_as_it_is(tmp_path: Path, name: str) -> None:
    plain = write_rows(tmp_path / "plain.jsonl", [*conversation_rows(30), "{"])
    zipped = tmp_path / "zipped" / name
    zipped.parent.mkdir()
    zipped.write_bytes(gzip.compress(plain.read_bytes()))
    assert zipped.read_bytes()[:2] == b"\x1f\x8b"
    skipped = SkippedLines()
    records = list(read_mooncake(zipped, skip_bad_lines=True, skipped=skipped))
    assert records == list(read_mooncake(plain, skip_bad_lines=True))
    assert len(records) == 30 and skipped.count == 1
    assert skipped.reasons[0].startswith(f"{zipped}:31: not JSON")


def test_a_damaged_gzip_stream_is_named(tmp_path: Path) -> None:
    data = gzip.compress(write_rows(tmp_path / "p.jsonl", conversation_rows(200)).read_bytes())
    cut = tmp_path / "cut.jsonl.gz"
    cut.write_bytes(data[: len(data) // 2])
    with pytest.raises(ValueError, match=rf"^--trace {cut}:\d+: cannot read it \(Compressed"):
        list(read_mooncake(cut, skip_bad_lines=True))


@pytest.mark.parametrize(
    ("name", "data", "command"),
    [
        ("zstd", b"\x28\xb5\x2f\xfd" + b"\0" * 16, "zstd -d"),
        ("bzip2", bz2.compress(b"{}\n"), "bunzip2 -k"),
        ("xz", lzma.compress(b"{}\n"), "unxz -k"),
    ],
    ids=["zstd", "bzip2", "xz"],
)
def test_other_compressed_traces_are_refused_by_name(
    tmp_path: Path, name: str, data: bytes, command: str
) -> None:
    path = tmp_path / "t.jsonl"
    path.write_bytes(data)
    with pytest.raises(ValueError) as caught:
        list(read_mooncake(path, skip_bad_lines=True))
    assert str(caught.value) == (
        f"--trace {path}: compressed with {name}, which kvtier does not read; "
        f"decompress it first ({command} {path}), or compress it with gzip"
    )


def test_a_50mib_line_is_refused_without_being_held(huge: Path) -> None:
    """The review's 50 MiB line took ``kvtier plan`` to 1.5 GiB: now the
    reader holds at most ``max_line_bytes`` of it and names the limit and
    the flag that raises it."""
    path = huge
    tracemalloc.start()
    try:
        with pytest.raises(ValueError) as caught:
            list(read_mooncake(path))
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert str(caught.value) == (
        f"{path}:2: longer than {DEFAULT_MAX_LINE_BYTES} bytes, the most --max-line-size "
        "allows (raise it, e.g. --max-line-size 4MiB) (--skip-bad-lines leaves such lines out)"
    )
    assert peak < 4 * MiB  # of a 50 MiB line


def test_skip_bad_lines_skips_a_50mib_line_without_holding_it(huge: Path) -> None:
    path = huge
    skipped = SkippedLines()
    tracemalloc.start()
    try:
        records = list(read_mooncake(path, skip_bad_lines=True, skipped=skipped))
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert [(r.line, r.hash_ids) for r in records] == [(1, (0, 1)), (3, (2, 3))]
    assert skipped.count == 1 and "t.jsonl:2: longer than 1048576 bytes" in skipped.reasons[0]
    assert peak < 4 * MiB


def test_the_line_limit_counts_the_bytes_before_the_line_break(tmp_path: Path) -> None:
    path = tmp_path / "t.txt"
    path.write_bytes(b"12345\n123456\n1234567\n1234\r\n123456")
    lines = list(trace_lines(path, max_line_bytes=6))
    assert [(line.number, line.text, line.error is None) for line in lines] == [
        (1, "12345\n", True),
        (2, "123456\n", True),
        (3, "", False),
        (4, "1234\r\n", True),
        (5, "123456", True),  # the last line needs no line break
    ]


def test_the_replay_spec_carries_the_limit(tmp_path: Path) -> None:
    path = write_rows(tmp_path / "t.jsonl", [GOOD, {**LATER, "pad": "x" * 100}])
    spec = ReplaySpec(block_tokens=16, max_line_bytes=100, skip_bad_lines=True)
    skipped = SkippedLines()
    assert [r.id for r in load_trace(path, spec, skipped)] == ["line-000001"]
    assert skipped.reasons == [
        f"{path}:2: longer than 100 bytes, the most --max-line-size allows "
        "(raise it, e.g. --max-line-size 4MiB)"
    ]
    assert len(load_trace(path, ReplaySpec(block_tokens=16))) == 2
    with pytest.raises(ValueError, match="--max-line-size must be >= 1, got 0"):
        ReplaySpec(max_line_bytes=0)
