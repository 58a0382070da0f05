from __future__ import annotations

import json

import pytest

from kvtier import __version__
from kvtier.commands.cli import main
from kvtier.units import format_size, parse_size


def test_version(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["version"]) == 0
    assert capsys.readouterr().out.strip() == f"kvtier {__version__}"


def test_selfcheck_passes(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["selfcheck", "--l1-size", "64MiB"]) == 0
    out = capsys.readouterr().out
    assert "L1 hit chunks (expected)       24 (24)" in out
    assert "after restart, hits from fs    24 (24)" in out
    assert "bytes identical                yes" in out
    assert out.strip().endswith("OK")


def test_selfcheck_json(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["selfcheck", "--json", "-", "--l1-size", "64MiB"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["ok"] is True
    assert result["l2_hit_chunks"] == result["expected_hit_chunks"] == 24
    assert result["locks_left"] == 0


def test_selfcheck_too_small_l1_fails_loudly(capsys: pytest.CaptureFixture[str]) -> None:
    # 4 MiB holds 8 of the 32 chunks: the hits fall short and the check says so.
    assert main(["selfcheck", "--l1-size", "4MiB"]) == 1
    assert "FAILED" in capsys.readouterr().out


def test_bad_size_names_the_flag(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["selfcheck", "--l1-size", "lots"]) == 2
    assert "--l1-size: cannot read 'lots' as a size" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("text", "expected"),
    [("4096", 4096), ("2GiB", 2 << 30), ("512MiB", 512 << 20), ("1.5GB", 1_500_000_000), (7, 7)],
)
def test_parse_size(text: str, expected: int) -> None:
    assert parse_size(text) == expected


@pytest.mark.parametrize("text", ["", "-1", "0", "2 XB", "GiB"])
def test_parse_size_rejects(text: str) -> None:
    with pytest.raises(ValueError, match="--flag"):
        parse_size(text, "--flag")


def test_format_size() -> None:
    assert format_size(512) == "512 B"
    assert format_size(3 << 20) == "3.0 MiB"
