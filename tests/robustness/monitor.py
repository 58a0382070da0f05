"""``Monitor``: samples what the cache server holds while a robustness run
goes on, for the ``bounded_memory`` rule (guarantee 9): its resident memory
and the size of every table a client can add to (quality-board and ledger
rows per tenant, clients, sessions, the objects they name, remembered
layouts and hash namespaces). Each sample is one "memory" operation of the
history, with the bounds it is checked against in its arguments.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

from tests.robustness.background import Background
from tests.robustness.cluster import NAMESPACE_ROWS, Cluster
from tests.robustness.history import History

EVERY_S = 0.5
# Growth of the server's resident memory over its first sample, per process
# (a restart starts again): tables are bounded and L1 is a fixed arena, so
# what is left is the interpreter's own churn; a leak of a row per name of
# the flood's thousands is far past it.
RSS_GROWTH_BYTES = 96 << 20
REMEMBERED = 64  # kvtier.server.registrations.REMEMBERED
MAX_CLIENTS = 1024  # kvtier.server.limits.ServerLimits.max_clients, the harness's
MAX_SESSION_OBJECTS = 4 << 20  # ServerLimits.max_session_objects


def rss_bytes(pid: int) -> int | None:
    """Resident memory of a running process; None once it is gone."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


class Monitor(Background):
    """Samples every ``EVERY_S`` on its own thread until ``stop`` is set."""

    def __init__(self, cluster: Cluster, history: History) -> None:
        super().__init__("monitor")
        self.cluster, self.history = cluster, history

    def _run(self) -> None:
        while not self.stop.wait(EVERY_S):
            self.sample()

    def sample(self) -> None:
        pid = self.cluster.server.pid
        rss = rss_bytes(pid)
        status = self.cluster.status()
        if rss is None or status is None:
            return  # killed, stopped or restarting: the next sample
        bounds = {
            "rows_per_tenant": NAMESPACE_ROWS,
            "clients": MAX_CLIENTS,
            "session_objects": MAX_SESSION_OBJECTS,
            "remembered": REMEMBERED,
            "rss_growth_bytes": RSS_GROWTH_BYTES,
        }
        with self.history.record("monitor", "memory", **bounds) as op:
            op.outcome, op.result = "ok", {"pid": pid, "rss_bytes": rss, **tables(status)}


def tables(status: dict[str, Any]) -> dict[str, Any]:
    """The sizes of the tables a client can add to, from ``/status``."""
    return {
        "quality_rows": dict(Counter(row["tenant"] for row in status["quality"])),
        "ledger_rows": dict(Counter(row["tenant"] for row in status["ledger"])),
        "clients": status["clients"],
        "session_objects": status["session_objects"],
        "layouts": len(status["layouts"]),
        "hash_namespaces": len(status["hash_namespaces"]),
    }
