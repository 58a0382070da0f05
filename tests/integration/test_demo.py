"""``kvtier demo`` end to end on a short trace, and its flag errors."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from kvtier.commands.cli import main
from kvtier.process import clean_env
from tests.integration.harness import ROOT

CONFIGURATIONS = ("no_cache", "kvtier_cold", "kvtier_warm")
SHORT_TRACE = [
    "--requests", "3", "--documents", "2", "--system-tokens", "40",
    "--doc-tokens", "300:500", "--question-tokens", "8:16", "--new-tokens", "3",
]  # fmt: skip


def run_demo(*args: str) -> subprocess.CompletedProcess[str]:
    """``python -m kvtier demo ARGS`` in a child process."""
    return subprocess.run(
        [sys.executable, "-m", "kvtier", "demo", *args],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=clean_env(),
        timeout=120,
    )


@pytest.mark.slow
def test_demo_runs_and_reports_identical_outputs(tmp_path: Path) -> None:
    out = tmp_path / "out.json"
    done = run_demo(*SHORT_TRACE, "--model-dir", str(tmp_path / "model"), "--json", str(out))
    assert done.returncode == 0, done.stdout + done.stderr
    assert "outputs identical: yes" in done.stdout
    assert (tmp_path / "model" / "config.json").exists()  # built where it was told
    results = json.loads(out.read_text())

    assert results["outputs_identical"] is True
    assert results["max_abs_logit_diff"] <= 1e-4
    trace = results["trace"]
    assert (trace["requests"], trace["documents"], trace["new_tokens_per_request"]) == (3, 2, 3)
    for name in CONFIGURATIONS:
        r = results[name]
        assert r["requests"] == 3
        assert r["prompt_tokens"] == trace["prompt_tokens"]
        assert r["hit_tokens"] + r["computed_tokens"] == r["prompt_tokens"]
        assert 0 < r["ttft_p50_s"] <= r["ttft_p95_s"]
        assert len(r["ttft_s"]) == 3
    for name in CONFIGURATIONS[1:]:
        assert results[name]["outputs_identical"] is True
        assert results[name]["max_abs_logit_diff"] <= 1e-4

    none, cold, warm = (results[name] for name in CONFIGURATIONS)
    assert none["hit_tokens"] == 0 and none["bytes_stored"] == none["bytes_loaded"] == 0
    # Cold: the first request misses, so cold hits fewer tokens than warm, where
    # every request finds all of its full chunks (stored by the cold pass).
    assert cold["bytes_stored"] > 0 and warm["bytes_stored"] == 0
    assert warm["hit_tokens"] > cold["hit_tokens"]
    # Warm computes at most each prompt's last partial 256-token chunk.
    assert warm["computed_tokens"] < 3 * 256
    assert sum(warm["tokens_by_tier"].values()) >= warm["hit_tokens"]
    # The savings ledger's word for each pass, beside what it measurably saved
    # (the numbers' agreement is a benchmark's, in BENCHMARKS.md).
    assert none["ledger_saved_s"] is None and none["saved_s"] == 0.0
    assert warm["ledger_saved_s"] is not None and warm["ledger_saved_s"] > 0


@pytest.mark.parametrize(
    ("flag", "value", "match"),
    [
        ("--doc-tokens", "5:1", "--doc-tokens must be MIN:MAX with 1 <= MIN <= MAX"),
        ("--question-tokens", "0:4", "--question-tokens must be MIN:MAX"),
        ("--requests", "0", "--requests must be at least 1"),
    ],
)
def test_demo_bad_flag_exits_2_naming_it(
    capsys: pytest.CaptureFixture[str], flag: str, value: str, match: str
) -> None:
    assert main(["demo", *SHORT_TRACE, flag, value]) == 2
    err = capsys.readouterr().err
    assert err.startswith("kvtier demo: ") and match in err


@pytest.mark.slow
def test_demo_bad_flag_exits_2_as_a_command(tmp_path: Path) -> None:
    done = run_demo("--doc-tokens", "5:1", "--model-dir", str(tmp_path / "model"))
    assert done.returncode == 2, done.stdout + done.stderr
    assert "--doc-tokens must be MIN:MAX" in done.stderr
    assert not (tmp_path / "model").exists()  # refused before building anything


def test_demo_unparsable_span_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["demo", "--doc-tokens", "many"])
    assert exc.value.code == 2
    assert "expected MIN:MAX token counts, got 'many'" in capsys.readouterr().err
