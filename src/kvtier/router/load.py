"""``ClusterLoad``: how busy the engines are, measured from what is routed.

The kvtier policy prices a request on an engine as its own time to first
token plus the delay its work imposes on the requests that will queue
behind it there (``scoring.expected_cost``). That delay per second of work
is ``rho / (1 - rho)``, the mean number of requests waiting in a queue at
utilisation ``rho``: nothing when the engines are idle, so the policy is
the plain least expected TTFT; tens of seconds per second near saturation,
where a prefix hit saves capacity that every later request needs, so a
prefix stays on its engine until that engine's queue outweighs the work it
saves (sticky until saturated, as one cost).

``rho`` is the planned service seconds dispatched per second per live
engine, an exponentially decaying average over ``window_s``; it is capped at
``RHO_MAX`` (a cluster past saturation still needs a finite price). Not
thread-safe: the router's lock guards it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

RHO_MAX = 0.95


@dataclass(slots=True)
class ClusterLoad:
    window_s: float = 60.0
    _rate: float = 0.0  # service seconds dispatched per second, decayed to ``_at``
    _at: float = 0.0

    def dispatch(self, now: float, service_s: float) -> None:
        self._rate = self._decayed(now) + max(service_s, 0.0) / self.window_s
        self._at = now

    def utilisation(self, now: float, engines: int) -> float:
        return self._decayed(now) / max(engines, 1)

    def work_weight(self, now: float, engines: int) -> float:
        """Seconds of delay to later requests per second of work: rho / (1 - rho)."""
        rho = min(self.utilisation(now, engines), RHO_MAX)
        return rho / (1 - rho)

    def _decayed(self, now: float) -> float:
        return self._rate * math.exp(-max(now - self._at, 0.0) / self.window_s)


__all__ = ["RHO_MAX", "ClusterLoad"]
