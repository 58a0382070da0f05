"""The operator's dashboard: a page at ``/`` on the admin port, fed by
``GET /admin/dashboard``.

``History`` samples the server's status snapshot every ``interval_s`` (on the
server loop's upkeep clock, the last ``keep`` samples) into the series the page
draws: hit ratio by tier (hit tokens of each tier / tokens looked up, per
interval), bytes in and out per tier per second (L1: engines' stores and L2
loads in, reads by engines and write-backs out; each L2 adapter: written
back in, loaded out), L1 occupancy and staging, and errors by reason. The
page (``dashboard.html``, plain HTML and script, no build step and no
third-party code: the charts are drawn on canvases by the page itself) asks
for an admin token when the server has tokens (typed in, or after ``#token=``
in the address, which never leaves the browser) and polls every two
seconds; besides the charts it shows the savings ledger, the top namespaces
and tenants by L1 bytes, and the totals ``/metrics`` reports.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections import deque
from collections.abc import Callable
from importlib import resources
from typing import Any

from kvtier.protocol.status import ServerStatus

Snapshot = ServerStatus


def page() -> bytes:
    return resources.files("kvtier.operations").joinpath("dashboard.html").read_bytes()


def sample(snapshot: Snapshot | None, now: float) -> dict[str, Any]:
    """The cumulative numbers one sample keeps (deltas are taken at read);
    all zero without a snapshot."""
    if snapshot is None:
        return {
            "t": now,
            "hit_tokens": {},
            "lookup_tokens": 0.0,
            "flows": {},
            "l1_used": 0.0,
            "l1_staging": 0.0,
            "l1_capacity": 0.0,
            "errors": {},
        }
    server, storage = snapshot.server, snapshot.storage
    written = storage.store.stored_bytes
    loaded = storage.prefetch.loaded_bytes
    flows = {
        "L1 in": float(server.stored_bytes + sum(loaded.values())),
        "L1 out": float(server.retrieved_bytes + sum(written.values())),
    }
    for adapter in sorted(set(written) | set(loaded)):
        flows[f"{adapter} in"] = float(written.get(adapter, 0))
        flows[f"{adapter} out"] = float(loaded.get(adapter, 0))
    return {
        "t": now,
        "hit_tokens": {tier: float(n) for tier, n in server.hit_tokens.items()},
        "lookup_tokens": float(server.lookup_tokens),
        "flows": flows,
        "l1_used": float(storage.l1.used_bytes),
        "l1_staging": float(storage.l1.staging_bytes),
        "l1_capacity": float(storage.l1.capacity_bytes),
        "errors": {code: float(n) for code, n in server.errors.items()},
    }


class History:
    """The last ``keep`` samples of ``snapshot()``; see the module docstring.

    ``record()`` takes one sample: the server calls it every ``interval_s``
    on its loop's upkeep clock (``kvtier.server.upkeep``); ``series()`` is
    read from the admin HTTP threads. One lock guards the samples."""

    def __init__(
        self,
        snapshot: Callable[[], Snapshot],
        interval_s: float = 1.0,
        keep: int = 600,
    ) -> None:
        self._snapshot = snapshot
        self.interval_s = interval_s
        self._samples: deque[dict[str, Any]] = deque(maxlen=keep)
        self._lock = threading.Lock()

    def record(self) -> None:
        """Sample the snapshot now (nothing while it is empty)."""
        snapshot = self._snapshot()
        if snapshot:
            entry = sample(snapshot, time.time())
            with self._lock:
                self._samples.append(entry)

    def series(self) -> dict[str, Any]:
        """Per interval: time, hit ratio by tier, bytes/s per flow; and L1."""
        with self._lock:
            samples = list(self._samples)
        out: dict[str, Any] = {"t": [], "hit_ratio": {}, "flows": {}, "l1": {}}
        for before, after in itertools.pairwise(samples):
            dt = max(after["t"] - before["t"], 1e-9)
            looked = after["lookup_tokens"] - before["lookup_tokens"]
            out["t"].append(after["t"])
            n = len(out["t"]) - 1
            for tier in set(after["hit_tokens"]) | set(out["hit_ratio"]):
                hit = after["hit_tokens"].get(tier, 0) - before["hit_tokens"].get(tier, 0)
                out["hit_ratio"].setdefault(tier, [0.0] * n).append(hit / looked if looked else 0.0)
            for flow in set(after["flows"]) | set(out["flows"]):
                moved = after["flows"].get(flow, 0) - before["flows"].get(flow, 0)
                out["flows"].setdefault(flow, [0.0] * n).append(moved / dt)
            for name in ("l1_used", "l1_staging"):
                out["l1"].setdefault(name, []).append(after[name])
        last = samples[-1] if samples else sample(None, time.time())
        out["l1_capacity"] = last["l1_capacity"]
        out["errors"] = last["errors"]
        return out


def totals(snapshot: Snapshot) -> dict[str, float]:
    """The numbers the page shows as they are, each one ``/metrics`` reports
    too (its sample there, labels and all, is the key)."""
    server, l1 = snapshot.server, snapshot.storage.l1
    out = {
        f'kvtier_server_hit_tokens_total{{tier="{tier}"}}': float(n)
        for tier, n in server.hit_tokens.items()
    }
    out["kvtier_server_lookup_tokens_total"] = float(server.lookup_tokens)
    out["kvtier_server_lookups_total"] = float(server.lookups)
    out["kvtier_storage_l1_used_bytes"] = float(l1.used_bytes)
    out["kvtier_storage_l1_resident_objects"] = float(l1.resident_objects)
    for code, n in server.errors.items():
        out[f'kvtier_server_errors_total{{reason="{code}"}}'] = float(n)
    for row in snapshot.ledger:
        where = f'namespace="{row.namespace}",tenant="{row.tenant}"'
        out[f"kvtier_ledger_loaded_tokens_total{{{where}}}"] = float(row.loaded_tokens)
    return out


__all__ = ["History", "page", "sample", "totals"]
