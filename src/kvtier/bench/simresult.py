"""``SimResult``: what one simulated replay measured (``kvtier.bench.simulate``),
request by request, and its summary: the anchors' metric set, and how far the
router's learned costs ended from each node's truth."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from kvtier.router.cost import OWN_SAMPLES


@dataclass(slots=True)
class SimResult:
    """Per request, in arrival order: its TTFT and where its prompt came from."""

    policy: str
    ttft_s: list[float] = field(default_factory=list)
    sources: list[dict[str, int]] = field(default_factory=list)  # source -> prompt tokens
    routed: list[int] = field(default_factory=list)  # requests per node
    duration_s: float = 0.0  # the first arrival to the last first token
    learned: dict[str, object] = field(default_factory=dict)  # the router's cost model's status
    truth: list[tuple[float, float]] = field(default_factory=list)  # per node: (fixed, per token)

    def learned_error(self, min_samples: int) -> dict[str, float | None]:
        """The largest relative error of the nodes' own learned fixed and
        per-token terms, over the nodes whose own fit has at least
        ``min_samples`` samples (None: none had)."""
        engines = self.learned.get("engines", {})
        assert isinstance(engines, dict)
        fixed, per_token = [], []
        for node, (true_fixed, true_rate) in enumerate(self.truth):
            terms = engines.get(str(node))
            if terms is None or terms.get("samples", 0) < min_samples:
                continue
            fixed.append(abs(terms["fixed_s"] / true_fixed - 1) if true_fixed else None)
            per_token.append(abs(terms["per_token_s"] / true_rate - 1))
        known = [f for f in fixed if f is not None]
        return {
            "nodes": len(per_token),
            "fixed": round(max(known), 3) if known else None,
            "per_token": round(max(per_token), 3) if per_token else None,
        }

    @property
    def tokens(self) -> dict[str, int]:
        """Prompt tokens by source (``prefill``, ``engine``, ``L1``, the store)."""
        total: dict[str, int] = {}
        for sources in self.sources:
            for source, tokens in sources.items():
                total[source] = total.get(source, 0) + tokens
        return total

    def summary(self, slo_s: float | None = None) -> dict[str, object]:
        """The anchors' metric set: TTFT mean and percentiles, goodput at the
        TTFT SLO, each source's share of prompt tokens (the hit rate per tier,
        and the share computed), the share of requests that loaded nothing,
        and the effective cache throughput (prompt tokens per second served
        from any cache)."""
        t = np.array(self.ttft_s)
        tokens = self.tokens
        total = max(sum(tokens.values()), 1)
        cached = total - tokens.get("prefill", 0)
        mean = max(float(np.mean(self.routed)), 1e-9)
        out: dict[str, object] = {
            "requests": len(t),
            "ttft_mean_s": round(float(np.mean(t)), 4),
            "ttft_p50_s": round(float(np.percentile(t, 50)), 4),
            "ttft_p90_s": round(float(np.percentile(t, 90)), 4),
            "ttft_p95_s": round(float(np.percentile(t, 95)), 4),
            "ttft_p99_s": round(float(np.percentile(t, 99)), 4),
            "token_share": {k: round(v / total, 3) for k, v in sorted(tokens.items())},
            "computed_share": round(tokens.get("prefill", 0) / total, 3),
            "cache_tokens_per_s": round(cached / max(self.duration_s, 1e-9), 1),
            "load_max_over_mean": round(max(self.routed) / mean, 2),
        }
        nothing_loaded = [sum(s.values()) == s.get("prefill", 0) for s in self.sources]
        out["recomputed_requests"] = round(float(np.mean(nothing_loaded)), 3) if t.size else 0.0
        if slo_s is not None:
            out["goodput"] = round(float(np.mean(t <= slo_s)), 4)
        if self.learned:
            out["learned_error"] = self.learned_error(min_samples=OWN_SAMPLES)
            out["engine_spread"] = self.learned.get("engine_spread")
        return out


__all__ = ["SimResult"]
