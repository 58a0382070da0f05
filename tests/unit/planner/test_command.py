"""``kvtier plan`` on the command line: the seed's flags give the seed's
numbers in the table (GB and GiB) and in JSON; config files and flags combine;
bad input exits 2 naming the flag."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from kvtier.commands.cli import main
from tests.unit.planner.test_hf_config import DEEPSEEK_V3, GEMMA2_9B, LLAMA_31_8B

GiB = 1 << 30
SEED_FLAGS = [
    "--layers",
    "32",
    "--kv-heads",
    "8",
    "--head-dim",
    "128",
    "--dtype",
    "bf16",
    "--prefix-tokens",
    "6144",
    "--prefixes",
    "1000",
    "--replicas",
    "2",
    "--utilization",
    "0.7",
    "--chunk-size",
    "256",
    "--tp",
    "4",
    "--qps",
    "20",
    "--write-fraction",
    "0.1",
    "--write-tokens",
    "8192",
    "--nic-gbps",
    "200",
    "--nic-efficiency",
    "0.7",
    "--staging-ms",
    "100",
]


def plan_json(capsys: pytest.CaptureFixture[str], *flags: str) -> dict[str, Any]:
    assert main(["plan", *flags, "--json", "-"]) == 0
    result: dict[str, Any] = json.loads(capsys.readouterr().out)
    return result


def test_seed_table_says_gb_and_gib(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", *SEED_FLAGS]) == 0
    out = capsys.readouterr().out
    for text in (
        "128.00 KiB",
        "0.75 GiB",
        "805.31 GB",
        "750.00 GiB",
        "1,500.00 GiB",
        "2,142.86 GiB",
        "24,000",
        "96,000",
        "192,000",
        "8.00 MiB",
        "15.00 GiB/s",
        "25.00 GB/s",
        "23.28 GiB/s",
        "16.30 GiB/s",
        "4.00 GiB/s",
        "1,920",
        "1.50 GiB",
        "read headroom is 1.09x (under 1.3x)",
    ):
        assert text in out, text


def test_seed_json(capsys: pytest.CaptureFixture[str]) -> None:
    plan = plan_json(capsys, *SEED_FLAGS)
    assert plan["total_bytes"] == 750 * GiB
    assert plan["pool_bytes"] == 1500 * GiB / 0.7
    assert plan["metadata_objects_per_s"] == 1920
    assert plan["write_bytes_per_s"] == pytest.approx(4 * GiB)
    assert plan["verdict"] is None


def test_read_or_recompute_flags(capsys: pytest.CaptureFixture[str]) -> None:
    plan = plan_json(
        capsys, *SEED_FLAGS, "--gpu-tflops", "989", "--mfu", "0.5", "--model-params", "8B"
    )
    assert plan["compute"]["model_params"] == 8e9
    # 2 x 8e9 x 6144 FLOPs over 4 ranks x 989e12 x 0.5
    assert plan["recompute_seconds_per_prefix"] == pytest.approx(2 * 8e9 * 6144 / (4 * 494.5e12))
    # 46.0 ms to load (0.75 GiB at 17.5 GB/s) against 49.7 ms to recompute
    assert plan["load_seconds_per_prefix"] == pytest.approx(0.75 * GiB / 17.5e9)
    assert plan["verdict"] == "load"


def test_model_config_and_flags(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "config.json"
    path.write_text(json.dumps(LLAMA_31_8B))
    plan = plan_json(capsys, "--model-config", str(path))
    assert plan["bytes_per_token"] == 128 * 1024 and plan["shape"]["name"] == "llama"
    fp8 = plan_json(capsys, "--model-config", str(path), "--dtype", "fp8")  # a flag wins
    assert fp8["bytes_per_token"] == 64 * 1024
    path.write_text(json.dumps(GEMMA2_9B))
    gemma = plan_json(capsys, "--model-config", str(path), "--tp", "2", "--chunk-size", "512")
    assert [g["name"] for g in gemma["groups"]] == ["full attention", "sliding window 4096"]
    path.write_text(json.dumps(DEEPSEEK_V3))
    mla = plan_json(capsys, "--model-config", str(path), "--tp", "8")
    assert mla["tp_replication"] == 8 and mla["bytes_per_token"] == 61 * 576 * 2


def test_sliding_window_alone_means_every_attention_layer(
    capsys: pytest.CaptureFixture[str],
) -> None:
    flags = ["--layers", "32", "--kv-heads", "8", "--head-dim", "128", "--sliding-window", "4096"]
    plan = plan_json(capsys, *flags, "--prefix-tokens", "8192")
    assert plan["shape"]["sliding_layers"] == 32
    assert plan["bytes_per_prefix"] == 4096 * 128 * 1024  # every layer keeps 4096 tokens


def test_mla_from_flags(capsys: pytest.CaptureFixture[str]) -> None:
    plan = plan_json(capsys, "--layers", "61", "--mla-latent-dim", "512", "--mla-rope-dim", "64")
    assert plan["bytes_per_token"] == 70_272


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        ("--kv-heads 8 --head-dim 128", "--layers is missing"),
        ("--layers 32 --head-dim 128", "--kv-heads is missing"),
        ("--layers 32 --kv-heads 8 --head-dim 128 --utilization 1.5", "--utilization"),
        ("--layers 32 --kv-heads 8 --head-dim 128 --qps -3", "--qps must be zero or more"),
        ("--layers 32 --kv-heads 8 --head-dim 128 --tp 3", "--tp 3 does not divide"),
        ("--layers -1 --kv-heads 8 --head-dim 128", "--layers must be positive"),
        ("--model-config /nonexistent/config.json", "--model-config /nonexistent/config.json"),
    ],
)
def test_bad_input_exits_2_naming_the_flag(
    flags: str, message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["plan", *flags.split()]) == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        ("--dtype int4", "--dtype"),
        ("--model-params lots", "parameter count"),
        ("--state-bytes x", "--state-bytes"),
        ("--trace t.jsonl --max-line-size lots", "--max-line-size"),
        ("--trace t.jsonl --max-line-size 0", "--max-line-size: must be positive"),
    ],
)
def test_unparseable_flags_exit_2(
    flags: str, message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["plan", "--layers", "2", "--kv-heads", "1", "--head-dim", "8", *flags.split()])
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("what", ["missing", "directory"])
def test_a_trace_that_cannot_be_opened_is_one_line_naming_the_flag(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], what: str
) -> None:
    """Not a traceback: exit 2 and one line naming --trace and the path."""
    path = tmp_path / "missing.jsonl" if what == "missing" else tmp_path
    reason = "No such file or directory" if what == "missing" else "Is a directory"
    assert main(["plan", "--trace", str(path)]) == 2
    assert capsys.readouterr().err == f"kvtier plan: --trace {path}: cannot open it ({reason})\n"


def test_max_line_size_bounds_the_trace_lines(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``--max-line-size`` reaches the reader: a 2 KiB line passes the default
    (1 MiB), is refused at 1KiB naming the limit and the flag, and is
    skipped and counted with --skip-bad-lines."""
    row = {"timestamp": 1, "input_length": 600, "output_length": 3, "hash_ids": [0, 1]}
    long = {**row, "timestamp": 2, "hash_ids": [0, 2], "note": "x" * 2048}
    trace = tmp_path / "t.jsonl"
    trace.write_text(f"{json.dumps(row)}\n{json.dumps(long)}\n")
    assert main(["plan", "--trace", str(trace), "--json", "-"]) == 0
    assert json.loads(capsys.readouterr().out)["trace"]["requests"] == 2
    assert main(["plan", "--trace", str(trace), "--max-line-size", "1KiB"]) == 2
    assert capsys.readouterr().err == (
        f"kvtier plan: {trace}:2: longer than 1024 bytes, the most --max-line-size allows "
        "(raise it, e.g. --max-line-size 4MiB) (--skip-bad-lines leaves such lines out)\n"
    )
    flags = ["--max-line-size", "1KiB", "--skip-bad-lines", "--json", "-"]
    assert main(["plan", "--trace", str(trace), *flags]) == 0
    report = json.loads(capsys.readouterr().out)["trace"]
    assert report["requests"] == 1 and report["skipped_lines"] == 1


def test_the_installed_command() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "kvtier", "plan", *SEED_FLAGS, "--json", "-"],
        capture_output=True,
        text=True,
        check=True,
    )
    assert json.loads(result.stdout)["objects"] == 96_000
