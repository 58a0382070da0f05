"""The operator's dashboard: a page at ``/`` on the admin port, fed by
``GET /admin/dashboard``.

``History`` samples the server's status snapshot every ``interval_s`` (on a
thread of its own, the last ``keep`` samples) into the series the page
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

Snapshot = dict[str, Any]


def page() -> bytes:
    return resources.files("kvtier.operations").joinpath("dashboard.html").read_bytes()


def _prefixed(counters: dict[str, Any], prefix: str) -> dict[str, float]:
    return {
        k[len(prefix) :]: float(v)
        for k, v in counters.items()
        if k.startswith(prefix) and isinstance(v, int | float)
    }


def sample(snapshot: Snapshot, now: float) -> dict[str, Any]:
    """The cumulative numbers one sample keeps (deltas are taken at read)."""
    server = snapshot.get("server", {})
    storage = snapshot.get("storage", {})
    l1 = storage.get("l1", {})
    store = storage.get("store", {})
    prefetch = storage.get("prefetch", {})
    written = _prefixed(store, "stored_bytes.")
    loaded = _prefixed(prefetch, "loaded_bytes.")
    flows = {
        "L1 in": float(server.get("stored_bytes", 0)) + sum(loaded.values()),
        "L1 out": float(server.get("retrieved_bytes", 0)) + sum(written.values()),
    }
    for adapter in sorted(set(written) | set(loaded)):
        flows[f"{adapter} in"] = written.get(adapter, 0.0)
        flows[f"{adapter} out"] = loaded.get(adapter, 0.0)
    return {
        "t": now,
        "hit_tokens": _prefixed(server, "hit_tokens."),
        "lookup_tokens": float(server.get("lookup_tokens", 0)),
        "flows": flows,
        "l1_used": float(l1.get("used_bytes", 0)),
        "l1_staging": float(l1.get("staging_bytes", 0)),
        "l1_capacity": float(l1.get("capacity_bytes", 0)),
        "errors": _prefixed(server, "errors."),
    }


class History:
    """The last ``keep`` samples of ``snapshot()``; see the module docstring."""

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
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kvtier-dashboard", daemon=True)
        self._thread.start()

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
        last = samples[-1] if samples else sample({}, time.time())
        out["l1_capacity"] = last["l1_capacity"]
        out["errors"] = last["errors"]
        return out

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    def _run(self) -> None:
        while True:
            snapshot = self._snapshot()
            if snapshot:
                with self._lock:
                    self._samples.append(sample(snapshot, time.time()))
            if self._stop.wait(self.interval_s):
                return


def totals(snapshot: Snapshot) -> dict[str, float]:
    """The numbers the page shows as they are, each one ``/metrics`` reports
    too (the name it has there is the key)."""
    server = snapshot.get("server", {})
    l1 = snapshot.get("storage", {}).get("l1", {})
    out = {
        f'kvtier_server_hit_tokens{{key="{tier}"}}': value
        for tier, value in _prefixed(server, "hit_tokens.").items()
    }
    out["kvtier_server_lookup_tokens"] = float(server.get("lookup_tokens", 0))
    out["kvtier_server_lookups"] = float(server.get("lookups", 0))
    out["kvtier_storage_l1_used_bytes"] = float(l1.get("used_bytes", 0))
    out["kvtier_storage_l1_resident_objects"] = float(l1.get("resident_objects", 0))
    for code, value in _prefixed(server, "errors.").items():
        out[f'kvtier_server_errors{{key="{code}"}}'] = value
    return out


__all__ = ["History", "page", "sample", "totals"]
