"""Trace files of either format as ``kvtier bench --trace`` reads them: a
file that cannot be opened is one line naming the flag (not a traceback),
kvtier's own format names a line that is too long or not UTF-8, a gzip file
of either format is read, and ``--max-line-size`` reaches the reader."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest

from kvtier.bench.command import replay_spec, resolve
from kvtier.commands.cli import build_parser, main
from kvtier.traces import TraceRequest, is_mooncake_file, load_trace, read_trace, write_trace
from tests.unit.traces.conversations import conversation_rows, write_rows

REQUESTS = [TraceRequest("a", 0.0, (1, 2, 3), 4), TraceRequest("b", 1.0, (1, 2, 5), 4)]


@pytest.mark.parametrize("bench", ["engines", "route"])
@pytest.mark.parametrize("what", ["missing", "directory"])
def test_kvtier_bench_names_a_trace_it_cannot_open_in_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], what: str, bench: str
) -> None:
    path = tmp_path / "missing.jsonl" if what == "missing" else tmp_path
    reason = "No such file or directory" if what == "missing" else "Is a directory"
    out = tmp_path / "out"
    assert main(["bench", "--bench", bench, "--trace", str(path), "--out", str(out)]) == 2
    assert capsys.readouterr().err == f"kvtier bench: --trace {path}: cannot open it ({reason})\n"
    assert not out.exists()  # refused before anything started


def test_kvtier_trace_lines_that_are_too_long_or_not_text_are_named(tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl"
    write_trace(path, REQUESTS)
    lines = path.read_bytes().splitlines(keepends=True)
    path.write_bytes(lines[0] + b'{"id": "\xff"}\n')
    with pytest.raises(ValueError) as caught:
        read_trace(path)
    assert str(caught.value) == (
        f"--trace {path}:2: not UTF-8 text (byte 0xff at offset 8 of the line)"
    )
    path.write_bytes(b"".join(lines))
    assert read_trace(path) == REQUESTS
    with pytest.raises(ValueError, match=rf"^--trace {path}:1: longer than 40 bytes"):
        read_trace(path, max_line_bytes=40)


def test_a_gzip_trace_of_either_format_is_loaded(tmp_path: Path) -> None:
    ours, mooncake = tmp_path / "k.jsonl", write_rows(tmp_path / "m.jsonl", conversation_rows(8))
    write_trace(ours, REQUESTS)
    for path in (ours, mooncake):
        zipped = tmp_path / f"{path.stem}.gz"
        zipped.write_bytes(gzip.compress(path.read_bytes()))
        assert is_mooncake_file(zipped) == (path == mooncake)
        assert load_trace(zipped) == load_trace(path)


def test_the_format_is_told_by_the_first_readable_line(tmp_path: Path) -> None:
    """A Mooncake trace whose first line is bad is still Mooncake's, so
    --skip-bad-lines can skip that line."""
    path = tmp_path / "m.jsonl"
    rows = conversation_rows(5)
    path.write_bytes(b"\x80\n" + b"".join(json.dumps(r).encode() + b"\n" for r in rows))
    assert is_mooncake_file(path)
    assert not is_mooncake_file(path, max_line_bytes=10)  # every line is then bad


def test_bench_max_line_size_reaches_the_reader(tmp_path: Path) -> None:
    path = write_rows(tmp_path / "m.jsonl", conversation_rows(5))
    argv = ["bench", "--trace", str(path), "--max-line-size", "1KiB", "--skip-bad-lines"]
    spec = replay_spec(resolve(build_parser().parse_args(argv)))
    assert spec.max_line_bytes == 1024
    assert replay_spec(resolve(build_parser().parse_args(argv[:3]))).max_line_bytes == 1 << 20
    longest = max(len(line) for line in path.read_bytes().splitlines())
    tight = replay_spec(resolve(build_parser().parse_args([*argv[:3], "--max-line-size", "64"])))
    assert longest > 64
    with pytest.raises(ValueError, match="longer than 64 bytes, the most --max-line-size"):
        load_trace(path, tight)
