"""Latency histograms of the cache server, in one Prometheus registry.

Counters and gauges come from ``status()`` snapshots (``admin.SnapshotCollector``);
these histograms are observed where the work happens. Prometheus metric
objects are thread-safe.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Histogram

_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0, 5.0)


class ServerMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.lookup_seconds = Histogram(
            "kvtier_lookup_seconds",
            "LOOKUP to answer (L1 locks, L2 lookups and loads)",
            registry=self.registry,
            buckets=_BUCKETS,
        )
        self.store_seconds = Histogram(
            "kvtier_store_seconds",
            "STORE_RESERVE to STORE_COMMIT, or a bytes STORE",
            registry=self.registry,
            buckets=_BUCKETS,
        )
        self.retrieve_seconds = Histogram(
            "kvtier_retrieve_seconds",
            "RETRIEVE handling on the server (the client's copy not included)",
            registry=self.registry,
            buckets=_BUCKETS,
        )
