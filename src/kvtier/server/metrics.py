"""The cache server's Prometheus metrics, in one registry.

- Latency histograms (``ServerMetrics``), observed where the work happens
  (Prometheus metric objects are thread-safe).
- Everything else comes from the status snapshot (``StatusCollector``): each
  number of ``ServerStatus`` that the document marks as a counter or a gauge
  (``kvtier.protocol.status``), under ``kvtier_`` and its field path, a
  family's key as a label: ``server.hit_tokens["L1"]`` is
  ``kvtier_server_hit_tokens_total{tier="L1"}``, ``storage.l2["fs"].store_keys``
  is ``kvtier_storage_l2_store_keys_total{adapter="fs"}``, and a ledger row's
  ``tenant`` and ``namespace`` label its numbers.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from msgspec import inspect
from prometheus_client import CollectorRegistry, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from kvtier.protocol.status import COUNTER, ServerStatus

_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0, 5.0)
PREFIX = "kvtier"


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


@dataclass(slots=True)
class _Family:
    kind: str  # COUNTER or GAUGE
    samples: list[tuple[dict[str, str], float]] = field(default_factory=list)


class StatusCollector(Collector):
    """``status()``'s numbers as counters and gauges (see the module docstring).
    ``status`` is read once per scrape (the transport's snapshot: no lock)."""

    def __init__(self, status: Callable[[], ServerStatus]) -> None:
        self._status = status

    def collect(self) -> Iterator[Metric]:
        families: dict[str, _Family] = {}
        _walk(_info(), self._status(), [PREFIX], {}, families)
        for name, family in families.items():
            labels = list(family.samples[0][0]) if family.samples else []
            help_text = " ".join(name.split("_")[1:])
            metric: CounterMetricFamily | GaugeMetricFamily
            if family.kind == COUNTER:
                metric = CounterMetricFamily(name, help_text, labels=labels)
            else:
                metric = GaugeMetricFamily(name, help_text, labels=labels)
            for values, value in family.samples:
                metric.add_metric([values[k] for k in labels], value)
            yield metric


@functools.cache
def _info() -> inspect.Type:
    return inspect.type_info(ServerStatus)


def _walk(
    t: inspect.Type,
    value: Any,
    path: list[str],
    labels: dict[str, str],
    out: dict[str, _Family],
) -> None:
    """Add the metrics in ``value`` (of type ``t``) under ``path`` and ``labels``."""
    if value is None:
        return
    if isinstance(t, inspect.Metadata):
        extra = t.extra or {}
        if "metric" in extra:
            name = "_".join(path)
            out.setdefault(name, _Family(extra["metric"])).samples.append((labels, float(value)))
        elif "label" in extra and isinstance(t.type, inspect.DictType):
            for key, item in value.items():
                _walk(t.type.value_type, item, path, {**labels, extra["label"]: key}, out)
    elif isinstance(t, inspect.StructType):
        own = dict(labels)
        for f in t.fields:  # a row's label fields label its numbers
            if isinstance(f.type, inspect.Metadata) and isinstance(f.type.type, inspect.StrType):
                label = (f.type.extra or {}).get("label")
                if label:
                    own[label] = getattr(value, f.name)
        for f in t.fields:
            _walk(f.type, getattr(value, f.name), [*path, f.name], own, out)
    elif isinstance(t, inspect.UnionType):  # X | None, and value is not None
        for member in t.types:
            if not isinstance(member, inspect.NoneType):
                _walk(member, value, path, labels, out)
    elif isinstance(t, inspect.ListType) and isinstance(t.item_type, inspect.StructType):
        for item in value:
            _walk(t.item_type, item, path, labels, out)


__all__ = ["PREFIX", "ServerMetrics", "StatusCollector"]
