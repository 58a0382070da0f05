"""``PrefillQueue``: when a node's prefill work drains, projected.

The router predicts each request's wait as the work ahead of it. Summing
the plans of every request without a first token counts a half-done prefill
in full, and at 8-16 nodes without a shared store that error made the
kvtier policy lose to longest-prefix (docs/routing.md). The queue instead
keeps one projected time, ``drain_at``, at which the node's work in flight
is done:

- ``dispatch(now, service_s)``: the request starts when the work ahead
  drains, so ``drain_at = max(now, drain_at) + service_s``; its planned
  first token is that time (returned, the request keeps it).
- ``first_token(now, planned_at)``: the prefill ended ``now``; the work
  behind it moves by the error, ``drain_at += now - planned_at``, never
  before ``now``.
- ``cancel(now, planned_at, service_s)``: a request left before its first
  token; its remaining share of the work goes.

``wait_s(now)`` is the queue a new request sees. ``tokens`` counts the
prefill tokens in flight (the least-loaded policy's measure).

``ServiceLine`` is the same node's line as it really went, for the cost
model: an engine turns to its requests in the order they came (vLLM's
scheduler is first come, first served, and a prefill in progress gets the
step's budget before a new one), so a request that is first in line when its
first token comes was served from its dispatch or the previous first token
there, whichever is later, to now. That time is its own service, measured,
whatever queue it waited in: a node busy all the time still teaches its
costs (``router/cost.py``). Not thread-safe: the router's lock guards both.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field


@dataclass(slots=True)
class PrefillQueue:
    drain_at: float = 0.0
    tokens: int = 0  # prefill tokens routed here without a first token
    requests: int = 0  # requests without a first token

    def wait_s(self, now: float) -> float:
        return max(self.drain_at - now, 0.0)

    def dispatch(self, now: float, service_s: float, tokens: int) -> float:
        """Queue a request of ``service_s`` seconds; its planned first token."""
        self.drain_at = max(now, self.drain_at) + max(service_s, 0.0)
        self.tokens += tokens
        self.requests += 1
        return self.drain_at

    def first_token(self, now: float, planned_at: float, tokens: int) -> None:
        self._leave(tokens)
        self.drain_at = now if not self.requests else max(now, self.drain_at + now - planned_at)

    def cancel(self, now: float, planned_at: float, service_s: float, tokens: int) -> None:
        self._leave(tokens)
        remaining = min(max(planned_at - now, 0.0), service_s)
        self.drain_at = now if not self.requests else max(now, self.drain_at - remaining)

    def _leave(self, tokens: int) -> None:
        self.tokens -= tokens
        self.requests = max(self.requests - 1, 0)


@dataclass(slots=True)
class ServiceLine:
    """See the module docstring. Requests are named by their node's routing
    count (``Routed.routed_to``), which only grows."""

    last_first_token: float = float("-inf")
    _waiting: OrderedDict[int, float] = field(default_factory=OrderedDict)  # seq -> dispatched

    def dispatched(self, seq: int, now: float) -> None:
        self._waiting[seq] = now

    def first_token(self, seq: int, now: float) -> float | None:
        """Request ``seq``'s first token came ``now``: its service, measured
        (None when another request was ahead of it in line, or it came in the
        step of the previous first token, which then took its time too)."""
        head = next(iter(self._waiting), None) == seq
        dispatched = self._waiting.pop(seq, None)
        last, self.last_first_token = self.last_first_token, now
        if not head or dispatched is None or now <= last:
            return None
        return now - max(dispatched, last)

    def left(self, seq: int) -> None:
        """Request ``seq`` ended without a first token (or is done)."""
        self._waiting.pop(seq, None)


__all__ = ["PrefillQueue", "ServiceLine"]
