"""A configuration's numbers from request results and counter samples, the
targets checked on them, and the Markdown report: exact values on
hand-made inputs."""

from __future__ import annotations

import pytest

from kvtier.bench.replay import RequestResult
from kvtier.bench.report import _target_lines, targets
from kvtier.bench.runner import ConfigRun, fault_summary
from kvtier.bench.sampler import Sample, by_key, parse_counters
from kvtier.bench.summary import mismatches, percentiles, summarize

METRICS = """# HELP vllm:prefix_cache_hits Prefix cache hits
# TYPE vllm:prefix_cache_hits counter
vllm:prefix_cache_hits_total{engine="0",model_name="m"} 512.0
# TYPE vllm:external_prefix_cache_hits counter
vllm:external_prefix_cache_hits_total{engine="0",model_name="m"} 256.0
# TYPE kvtier_storage_prefetch_loaded_objects counter
kvtier_storage_prefetch_loaded_objects_total{adapter="redis"} 3.0
# TYPE kvtier_storage_l2_load_bytes counter
kvtier_storage_l2_load_bytes_total{adapter="redis"} 3145728.0
"""


def result(rid: str, sent: float, ttft: float, tokens: list[int], cached: int = 0) -> RequestResult:
    r = RequestResult(rid, sent, sent_s=sent, ttft_s=ttft, prompt_tokens=1000, cached_tokens=cached)
    r.tokens = tokens
    r.token_times_s = [ttft + 0.01 * i for i in range(len(tokens))]
    return r


def test_parse_counters_and_keys() -> None:
    counters = parse_counters(METRICS, "vllm:")
    assert counters == {
        "vllm:prefix_cache_hits_total": 512.0,
        "vllm:external_prefix_cache_hits_total": 256.0,
    }
    kvtier = parse_counters(METRICS, "kvtier_")
    assert by_key(kvtier, "kvtier_storage_prefetch_loaded_objects_total") == {"redis": 3.0}
    assert kvtier["kvtier_storage_l2_load_bytes_total{redis}"] == 3145728.0


def test_percentiles_interpolate() -> None:
    values = [float(v) for v in range(1, 101)]
    assert percentiles(values, "ttft") == {
        "ttft_p50_s": 50.5,
        "ttft_p95_s": pytest.approx(95.05),
        "ttft_p99_s": pytest.approx(99.01),
    }
    assert percentiles([], "itl") == {"itl_p50_s": None, "itl_p95_s": None, "itl_p99_s": None}


def test_mismatches_report_the_first_difference() -> None:
    reference = {"a": [1, 2, 3], "b": [4, 5, 6]}
    same, different = result("a", 0, 0.1, [1, 2, 3]), result("b", 0, 0.1, [4, 9, 6])
    failed = result("a", 0, 0.1, [])
    failed.error = "HTTP 500"
    assert mismatches([same, different, failed], reference) == [{"id": "b", "first_difference": 1}]
    assert mismatches([different], None) == []


def test_summarize() -> None:
    results = [
        result("a", 0.0, 0.2, [1, 2, 3], cached=500),  # finishes at 0.22
        result("b", 1.0, 0.8, [4, 5], cached=0),  # finishes at 1.81
        result("c", 2.0, 0.4, [6, 7, 8, 9], cached=1000),  # finishes at 2.43
    ]
    broken = RequestResult("d", 2.5, sent_s=2.5, error="HTTP 500")
    before = Sample(0.0, parse_counters(METRICS, "vllm:") | parse_counters(METRICS, "kvtier_"), 10)
    after_counters = dict(before.counters)
    after_counters["vllm:prefix_cache_hits_total"] += 1000
    after_counters["vllm:external_prefix_cache_hits_total"] += 500
    after_counters["kvtier_storage_prefetch_loaded_objects_total{redis}"] += 2
    after_counters["kvtier_storage_l2_load_bytes_total{redis}"] += 2 << 20
    after_counters["kvtier_storage_l1_staging_bytes"] = 4096.0
    after = Sample(3.0, after_counters, 30)
    reference = {"a": [1, 2, 3], "b": [4, 0], "c": [6, 7, 8, 9]}
    s = summarize([*results, broken], [before, after], 0.5, 4096, reference, chunk_tokens=256)
    assert s["requests"] == 4 and s["failed_requests"] == 1 and s["failure_rate"] == 0.25
    assert s["duration_s"] == pytest.approx(2.43)  # first send to last token
    assert s["ttft_p50_s"] == pytest.approx(0.4)
    assert s["goodput_rps"] == pytest.approx(2 / 2.43)  # a and c within 0.5 s
    assert s["throughput_rps"] == pytest.approx(3 / 2.43)
    assert s["itl_p50_s"] == pytest.approx(0.01)
    assert s["hit_tokens"] == 1500 and s["prompt_tokens"] == 3000 and s["hit_ratio"] == 0.5
    assert s["hit_tokens_by_tier"] == {"vllm_apc": 1000, "connector": 500}
    assert s["l2_loaded_tokens"] == {"redis": 512}
    assert s["connector_bytes"] == 500 * 4096
    assert s["l2_bytes"] == {"redis": {"read_bytes": 2 << 20}}
    assert s["peak_rss_bytes"] == 30 and s["peak_staging_bytes"] == 4096
    assert s["output_mismatches"] == 1
    assert s["mismatched_requests"] == [{"id": "b", "first_difference": 1}]


def config(p50: float, p95: float, hits: int, diffs: int = 0, failed: int = 0) -> dict[str, object]:
    return {
        "ttft_p50_s": p50,
        "ttft_p95_s": p95,
        "hit_tokens": hits,
        "output_mismatches": diffs,
        "failed_requests": failed,
    }


def test_targets() -> None:
    configs = {
        "apc": config(1.0, 3.0, 10),
        "apc+l1": config(0.4, 1.0, 50),
        "lmcache": config(0.5, 1.2, 40),
    }
    found = targets(configs, {"output_mismatches": 0, "failed_requests": 0})
    assert found["apc+l1_ttft_speedup_over_apc"] == {"p50": 2.5, "p95": 3.0, "met": True}
    assert found["apc+l1_ttft_p50_over_lmcache"] == {"ratio": pytest.approx(0.8), "met": True}
    assert found["apc+l1_hit_tokens_vs_lmcache"]["met"] is True
    assert found["no_output_differences"]["met"] and found["no_failed_requests"]["met"]
    worse = targets(
        {
            "apc": config(1.0, 1.5, 10),
            "apc+l1": config(0.6, 1.0, 30, diffs=1),
            "lmcache": config(0.5, 1, 40),
        },
        {"output_mismatches": 0, "failed_requests": 2},
    )
    assert worse["apc+l1_ttft_speedup_over_apc"]["met"] is False  # p95 only 1.5x
    assert worse["apc+l1_ttft_p50_over_lmcache"]["met"] is False
    assert worse["apc+l1_hit_tokens_vs_lmcache"]["met"] is False
    assert worse["no_output_differences"]["by_configuration"]["apc+l1"] == 1
    assert worse["no_failed_requests"]["by_configuration"]["fault"] == 2
    assert not worse["no_output_differences"]["met"] and not worse["no_failed_requests"]["met"]


def test_remote_targets_compare_with_l1_at_p50_and_with_apc_at_p95() -> None:
    configs = {
        "apc": config(1.0, 3.0, 10),
        "apc+l1": config(0.40, 1.0, 50),
        "apc+l1+remote": config(0.43, 2.9, 50),
        "apc+l1+remote+async": config(0.48, 3.1, 50),
    }
    found = targets(configs, None)
    assert found["apc+l1+remote_ttft_p50_over_apc+l1"] == {
        "ratio": pytest.approx(1.075),
        "met": True,
    }
    assert found["apc+l1+remote_ttft_p95_vs_apc"]["met"] is True
    assert found["apc+l1+remote+async_ttft_p50_over_apc+l1"]["met"] is False  # 1.2x
    assert found["apc+l1+remote+async_ttft_p95_vs_apc"]["met"] is False  # 3.1 s > 3.0 s
    assert "apc+l1+remote_ttft_p50_over_apc+l1" not in targets({"apc": configs["apc"]}, None)
    shown = "\n".join(_target_lines({**found, "no_output_differences": {"met": True},
                                      "no_failed_requests": {"met": True}}))  # fmt: skip
    assert "- apc+l1+remote TTFT p50 1.07x apc+l1's (target <= 1.1x): met; p95 2,900" in shown
    assert "- apc+l1+remote+async TTFT p50 1.20x apc+l1's (target <= 1.1x): NOT met" in shown


def test_fault_summary_against_the_run_without_the_fault() -> None:
    def run(cached: list[int], name: str) -> ConfigRun:
        results = [result(f"r{i}", float(i), 0.1 * (i + 1), [1], c) for i, c in enumerate(cached)]
        summary = {"failed_requests": 0, "output_mismatches": 0}
        return ConfigRun(name, results, [], summary, {"kill": 1.5, "restart": 3.5})

    clean = run([100, 200, 300, 300, 300, 300], "apc+l1+remote")
    # sent at 0..5 s: before = r0, r1; during = r2, r3; after = r4, r5
    faulty = run([100, 200, 0, 100, 100, 300], "fault")
    report = fault_summary(faulty, clean, "redis")
    assert [report[p]["requests"] for p in ("before", "during", "after")] == [2, 2, 2]
    assert report["during"]["hit_tokens"] == 100
    assert report["during"]["without_fault"]["hit_tokens"] == 600
    assert report["after"]["hit_ratio"] == 0.2  # 400 of 2,000 prompt tokens
    assert report["before"]["ttft_p50_s"] == report["before"]["without_fault"]["ttft_p50_s"]
    assert report["hit_recovery_s"] == 1.5  # r5, sent at 5.0 s, is the first to hit as much
    assert report["l2_hits_resume_s"] is None  # no samples
    assert (report["reseeded_s"], report["recovery_s"]) == (None, None)
    never = fault_summary(run([100, 200, 0, 0, 0, 0], "fault"), clean, "redis")
    assert never["hit_recovery_s"] is None


def test_recovery_is_when_the_store_is_back_and_reseeded() -> None:
    def sample(t: float, reseeds: int, pending: int, reseeded: int, loads: int) -> Sample:
        counters = {
            "kvtier_storage_store_reseeds_total{redis}": float(reseeds),
            "kvtier_storage_store_reseed_objects": float(pending),
            "kvtier_storage_store_reseeded_objects_total{redis}": float(reseeded),
            "kvtier_storage_prefetch_loaded_objects_total{redis}": float(loads),
        }
        return Sample(t, counters, 0)

    samples = [
        sample(1.0, 0, 0, 0, 5),  # before the kill
        sample(3.0, 0, 0, 0, 5),  # down
        sample(4.0, 1, 30, 10, 5),  # back at 3.5: re-seeding
        sample(4.5, 1, 0, 40, 5),  # re-seeded
        sample(6.0, 1, 0, 40, 7),  # loads from it again
    ]
    results = [result("r0", 0.0, 0.1, [1], 100)]
    faulty = ConfigRun("fault", results, samples, {"failed_requests": 0, "output_mismatches": 0})
    faulty.events.update(kill=2.0, restart=3.5)
    report = fault_summary(faulty, None, "redis")
    assert (report["reseeded_s"], report["reseeded_objects"]) == (1.0, 40)
    assert report["l2_hits_resume_s"] == 2.5
    assert report["recovery_s"] == 1.0  # answering and re-seeded
