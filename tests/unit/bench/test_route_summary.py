"""The routing bench's report: the anchors' metric set per policy, and the
kvtier policy's speed-ups with intervals over rounds."""

from __future__ import annotations

from typing import Any

import pytest

from kvtier.bench.replay import RequestResult
from kvtier.bench.routing import speedups, summarize


def run(ttfts: list[float], cached: int, wall_s: float) -> dict[str, Any]:
    results = [
        RequestResult(
            f"r{i}",
            0.0,
            ttft_s=t,
            token_times_s=[t, t + 0.05, t + 0.15],
            tokens=[1, 2, 3],
            prompt_tokens=100,
            cached_tokens=cached,
        )
        for i, t in enumerate(ttfts)
    ]
    node = {"name": "engine0", "routed": len(ttfts), "failures": {}}
    return {
        "results": results,
        "cache_hits": [{"L1": cached * len(ttfts)}],
        "router": {
            "router": {"nodes": [node], "cost": {}, "chunks": {}, "blocks": {}},
            "events": {},
        },
        "wall_s": wall_s,
    }


def test_a_policy_reports_the_anchors_metric_set() -> None:
    runs = [run([0.2, 0.4, 0.6, 0.8], 40, 10.0), run([0.3, 1.0], 0, 10.0)]
    summary = summarize("kvtier", runs, {f"r{i}": [1, 2, 3] for i in range(4)}, slo_ttft_s=0.5)
    assert summary["requests"] == 6 and summary["failed"] == 0
    assert summary["output_differences"] == 0
    assert summary["ttft_mean_s"] == pytest.approx(3.3 / 6)
    assert summary["goodput"] == pytest.approx(3 / 6)  # 0.2, 0.4, 0.3 within 0.5 s
    assert summary["cached_share"] == pytest.approx(160 / 600, abs=1e-3)
    assert summary["computed_share"] == pytest.approx(1 - 160 / 600, abs=1e-3)
    assert summary["cache_tokens_per_s"] == pytest.approx(160 / 20)
    assert summary["itl_s"]["itl_p50_s"] == pytest.approx(0.075)
    assert summary["kvtier_hit_tokens"] == {"L1": 160}
    assert [r["ttft_p50_s"] for r in summary["ttft_s_by_round"]] == pytest.approx([0.5, 0.65])
    differing = summarize("kvtier", runs[:1], {"r0": [9, 9, 9]})
    assert differing["output_differences"] == 1


def test_speed_ups_are_ratios_of_the_rounds_medians_with_an_interval() -> None:
    rounds = [run([0.2, 0.4], 0, 1.0), run([0.4, 0.4], 0, 1.0), run([0.3, 0.5], 0, 1.0)]
    slower = [run([0.6, 0.8], 0, 1.0), run([0.8, 1.2], 0, 1.0), run([0.9, 0.9], 0, 1.0)]
    summaries = {
        "kvtier": summarize("kvtier", rounds, {}),
        "round_robin": summarize("round_robin", slower, {}),
    }
    ratio, low, high = speedups(summaries)["round_robin"]["p50"]
    assert ratio == pytest.approx(
        0.9 / 0.4, abs=0.01
    )  # medians of (0.7, 1.0, 0.9), (0.3, 0.4, 0.4)
    assert low <= ratio <= high
    assert speedups({"round_robin": summaries["round_robin"]}) == {}
