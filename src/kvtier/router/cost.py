"""``CostModel``: what prefilling and loading cost on each engine, measured.

Two kinds of number, both in seconds per token:

- ``rate(node)``: the engine's prefill time per token.
- ``tier_cost(tier)``: loading one token's KV from a tier (``L1``, a node-local
  L2 by name, a shared store by name).

They start from ``CostConfig`` (what ``kvtier bench`` calibrates, or a guess)
and follow what the router sees: after each streamed request that had its
engine to itself (no prefill in flight when it was sent, none sent there
before its first token), the time to its first token against the work it
predicted. A request that mostly prefilled updates its engine's rate; one
that mostly loaded from one tier updates that tier's cost. Requests that
shared their engine teach nothing: an engine batches prompts into steps
(chunked prefill), so such a request's first token also waits for other
requests' tokens in its steps, and on the conversation trace at 8 simulated
nodes near saturation that wait, read as load time, made L1 look 75 times
dearer than it is (docs/bench-log/routing.md). Each is an exponentially
weighted mean (``ewma``), clamped to ``[floor, ceiling]`` so one outlier (a
stalled engine) cannot poison the next thousand decisions.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping
from dataclasses import dataclass, field

ENGINE = "engine"  # the engine's own prefix cache: free


@dataclass(frozen=True, slots=True, kw_only=True)
class CostConfig:
    prefill_s_per_token: float = 1e-3
    tier_s_per_token: dict[str, float] = field(default_factory=lambda: {"L1": 2e-5, "fs": 5e-5})
    default_tier_s_per_token: float = 1e-4  # a tier not named above (a shared store)
    ewma: float = 0.2
    learn: bool = True
    dominant_fraction: float = 0.6  # a request teaches what took this share of its tokens
    # The engines' connectors load every chunk they find (kvtier's does): plan that,
    # not the cheaper choice they cannot make. False: plan the cheapest prefix.
    engine_loads_whole_prefix: bool = True

    def __post_init__(self) -> None:
        if self.prefill_s_per_token <= 0:
            raise ValueError("cost.prefill_s_per_token must be positive")
        if any(v < 0 for v in self.tier_s_per_token.values()):
            raise ValueError("cost.tier_s_per_token values must be >= 0")
        if not 0 < self.ewma <= 1:
            raise ValueError(f"cost.ewma must be in (0, 1], got {self.ewma}")


@dataclass(frozen=True, slots=True)
class Observation:
    """One request as the router predicted and saw it."""

    node: int
    ttft_s: float
    queue_s: float  # the wait the router predicted
    prefill_tokens: int  # the tokens it predicted the engine computes
    loaded: Mapping[str, int]  # tier -> tokens predicted to load
    alone: bool = True  # its engine had no other prefill from its dispatch to its first token


class CostModel:
    """See the module docstring. Thread-safe."""

    def __init__(self, config: CostConfig | None = None) -> None:
        self.config = config or CostConfig()
        self._lock = threading.Lock()
        self._rates: dict[int, float] = {}
        self._tiers: dict[str, float] = dict(self.config.tier_s_per_token)
        self.samples = 0

    def rate(self, node: int) -> float:
        return self._rates.get(node, self.config.prefill_s_per_token)

    def rate_table(self) -> tuple[dict[int, float], float]:
        """Every measured rate (node -> s/token) and the rate of the others."""
        return self._rates, self.config.prefill_s_per_token

    def tier_cost(self, tier: str) -> float:
        if tier == ENGINE:
            return 0.0
        return self._tiers.get(tier, self.config.default_tier_s_per_token)

    def observe(self, seen: Observation) -> None:
        if not self.config.learn or seen.ttft_s <= 0 or not seen.alone:
            return
        with self._lock:
            self.samples += 1
            rate = self.rate(seen.node)
            load_s = sum(tokens * self.tier_cost(t) for t, tokens in seen.loaded.items())
            total = seen.prefill_tokens + sum(seen.loaded.values())
            if total <= 0:
                return
            service = max(seen.ttft_s - seen.queue_s, 0.0)
            if seen.prefill_tokens >= self.config.dominant_fraction * total:
                sample = max(service - load_s, 0.0) / seen.prefill_tokens
                self._rates[seen.node] = self._mix(rate, sample, self.config.prefill_s_per_token)
                return
            for tier, tokens in seen.loaded.items():
                if tier != ENGINE and tokens >= self.config.dominant_fraction * total:
                    others = load_s - tokens * self.tier_cost(tier)
                    sample = max(service - seen.prefill_tokens * rate - others, 0.0) / tokens
                    self._tiers[tier] = self._mix(self.tier_cost(tier), sample, rate)

    def status(self) -> dict[str, object]:
        with self._lock:
            return {
                "prefill_s_per_token": {str(n): r for n, r in self._rates.items()},
                "tier_s_per_token": dict(self._tiers),
                "samples": self.samples,
            }

    def _mix(self, old: float, sample: float, scale: float) -> float:
        """EWMA step, the sample clamped to [scale/100, scale*100]."""
        sample = min(max(sample, scale / 100), scale * 100)
        return (1 - self.config.ewma) * old + self.config.ewma * sample


__all__ = ["ENGINE", "CostConfig", "CostModel", "Observation"]
