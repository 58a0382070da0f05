"""One configuration's numbers from its request results and counter samples.

Latencies are percentiles over successful requests (numpy's linear
interpolation). Goodput counts requests that succeeded within the TTFT SLO,
per second of the run (first send to last token). Hit tokens are the prompt
tokens vLLM did not compute (``cached_tokens``: its own prefix cache plus the
connector), split by where they came from with vLLM's counters (``vllm_apc``,
``connector``); for kvtier, ``l2_loaded_tokens`` are the tokens its lookups
brought up from each L2 adapter into L1 (one object per chunk at TP 1). An output mismatch
is a request whose generated token ids differ from the reference
configuration's for the same request. A speed-up over repeated runs
(seeds, rounds) is the ratio of the runs' medians with a bootstrap 95 %
interval (``ratio_interval``).
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from kvtier.bench.replay import RequestResult
from kvtier.bench.sampler import L2_LOADS, Counters, Sample, by_key, delta

_L2_BYTES = re.compile(r"kvtier_storage_l2_(?P<kind>load|store)_bytes_total\{(?P<adapter>.+)\}$")


def percentiles(values: Sequence[float], prefix: str) -> dict[str, float | None]:
    keys = (f"{prefix}_p50_s", f"{prefix}_p95_s", f"{prefix}_p99_s")
    if not values:
        return dict.fromkeys(keys)
    p50, p95, p99 = np.percentile(np.asarray(values, dtype=np.float64), [50, 95, 99])
    return dict(zip(keys, (float(p50), float(p95), float(p99)), strict=True))


def ratio_interval(
    theirs: Sequence[float], ours: Sequence[float], rng: np.random.Generator, draws: int = 1000
) -> tuple[float, float, float]:
    """median(theirs) / median(ours) over repeated runs, and its 95 %
    bootstrap interval (each side resampled with replacement)."""
    x, y = np.asarray(theirs, dtype=np.float64), np.asarray(ours, dtype=np.float64)
    ratio = float(np.median(x) / max(float(np.median(y)), 1e-12))
    a = np.median(rng.choice(x, (draws, len(x))), axis=1)
    b = np.maximum(np.median(rng.choice(y, (draws, len(y))), axis=1), 1e-12)
    low, high = np.percentile(a / b, [2.5, 97.5])
    return ratio, float(low), float(high)


def mismatches(
    results: Sequence[RequestResult], reference: Mapping[str, Sequence[int]] | None
) -> list[dict[str, Any]]:
    """Requests whose tokens differ from ``reference`` (by request id), with the
    first position that differs; failed requests are counted as failures, not here."""
    if reference is None:
        return []
    found = []
    for result in results:
        expected = reference.get(result.id)
        if not result.ok or expected is None or list(expected) == result.tokens:
            continue
        first = next(
            (i for i, (a, b) in enumerate(zip(expected, result.tokens, strict=False)) if a != b),
            min(len(expected), len(result.tokens)),
        )
        found.append({"id": result.id, "first_difference": first})
    return found


def _bytes_by_adapter(after: Counters, before: Counters) -> dict[str, dict[str, float]]:
    moved: dict[str, dict[str, float]] = {}
    for name in after:
        match = _L2_BYTES.match(name)
        if match:
            kind = "read_bytes" if match["kind"] == "load" else "written_bytes"
            moved.setdefault(match["adapter"], {})[kind] = delta(after, before, name)
    return moved


def summarize(
    results: Sequence[RequestResult],
    samples: Sequence[Sample],
    slo_ttft_s: float,
    kv_bytes_per_token: int,
    reference: Mapping[str, Sequence[int]] | None = None,
    chunk_tokens: int = 256,
) -> dict[str, Any]:
    ok = [r for r in results if r.ok]
    failed = len(results) - len(ok)
    duration = max((r.finished_s for r in ok), default=0.0) - min(
        (r.sent_s for r in results), default=0.0
    )
    duration = max(duration, 1e-9)
    ttfts = [r.ttft_s for r in ok if r.ttft_s is not None]
    itls = [gap for r in ok for gap in r.itls()]
    prompt_tokens = sum(r.prompt_tokens for r in ok)
    hit_tokens = sum(r.cached_tokens or 0 for r in ok)
    before, after = (samples[0].counters, samples[-1].counters) if samples else ({}, {})
    connector = delta(after, before, "vllm:external_prefix_cache_hits_total")
    loaded = {
        adapter: (objects - by_key(before, L2_LOADS).get(adapter, 0.0)) * chunk_tokens
        for adapter, objects in by_key(after, L2_LOADS).items()
    }
    staging = [s.counters.get("kvtier_storage_l1_staging_bytes", 0.0) for s in samples]
    different = mismatches(results, reference)
    return {
        "requests": len(results),
        "failed_requests": failed,
        "failure_rate": failed / len(results) if results else 0.0,
        **percentiles(ttfts, "ttft"),
        "ttft_mean_s": float(np.mean(ttfts)) if ttfts else None,
        **percentiles(itls, "itl"),
        "duration_s": duration,
        "throughput_rps": len(ok) / duration,
        "output_tokens_per_s": sum(len(r.tokens) for r in ok) / duration,
        "slo_ttft_s": slo_ttft_s,
        "goodput_rps": sum(1 for t in ttfts if t <= slo_ttft_s) / duration,
        "prompt_tokens": prompt_tokens,
        "hit_tokens": hit_tokens,
        "hit_ratio": hit_tokens / prompt_tokens if prompt_tokens else 0.0,
        "hit_tokens_by_tier": {
            "vllm_apc": delta(after, before, "vllm:prefix_cache_hits_total"),
            "connector": connector,
        },
        "l2_loaded_tokens": loaded,
        "connector_bytes": connector * kv_bytes_per_token,
        "l2_bytes": _bytes_by_adapter(after, before),
        "preemptions": delta(after, before, "vllm:num_preemptions_total"),
        "peak_rss_bytes": max((s.rss_bytes for s in samples), default=0),
        "peak_staging_bytes": max(staging, default=0.0),
        "output_mismatches": len(different),
        "mismatched_requests": different,
    }


__all__ = ["mismatches", "percentiles", "summarize"]
