"""``kvtier route``'s Prometheus metrics (``GET /metrics``)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            "kvtier_route_requests",
            "requests by tenant and outcome",
            ["tenant", "outcome"],
            registry=r,
        )
        self.engine_failures = Counter(
            "kvtier_route_engine_failures",
            "engines taken out, by reason",
            ["engine", "reason"],
            registry=r,
        )
        self.retries = Counter(
            "kvtier_route_retries", "requests sent to another engine", registry=r
        )
        self.routed = Counter("kvtier_route_routed", "requests per engine", ["engine"], registry=r)
        self.planned = Counter(
            "kvtier_route_planned_tokens", "prompt tokens by planned source", ["source"], registry=r
        )
        self.prefetches = Counter(
            "kvtier_route_prefetches", "routing-time prefetches by outcome", ["outcome"], registry=r
        )
        self.cache_server_errors = Counter(
            "kvtier_route_cache_server_errors",
            "polls of a cache server's /status the router could not read, by reason",
            ["engine", "reason"],
            registry=r,
        )
        self.ttft = Histogram(
            "kvtier_route_ttft_seconds",
            "time to the first streamed token, through the router",
            ["engine"],
            buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30),
            registry=r,
        )
        self.scoring = Histogram(
            "kvtier_route_scoring_seconds",
            "time to pick an engine (hashing included)",
            buckets=(1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2),
            registry=r,
        )
        self.inflight = Gauge(
            "kvtier_route_inflight_prefill_tokens",
            "prefill tokens in flight",
            ["engine"],
            registry=r,
        )


__all__ = ["Metrics"]
