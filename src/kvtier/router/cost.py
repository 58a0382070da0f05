"""``CostModel``: what prefilling and loading cost on each engine, measured.

Each cost has a fixed part and a part per token (``kvtier.costfit``):

- ``engine(node)``: the engine's prefill, ``fixed x steps + per_token x
  tokens`` (an engine step's own time, and each token's; ``step_tokens`` is
  the engines' step budget, vLLM's ``max_num_batched_tokens``).
- ``tier(name)``: loading KV from a tier (``L1``, a node-local L2 by name, a
  shared store by name): a set-up and a time per token.

They start from ``CostConfig`` (what ``kvtier bench`` calibrates, or a guess)
and follow what the router sees, after each streamed request:

- one that had its engine to itself (no prefill in flight when it was
  sent, none sent there before its first token): a request whose computed
  tokens are at least ``dominant_fraction`` of its prompt is a sample of its
  engine's prefill: its time, less the loads as predicted, for its computed
  tokens; one that mostly loaded from one tier is a sample of that tier: its
  time less the engine's prefill and the other loads;
- one that was first in its engine's line when its first token came, and
  was planned to load nothing, not even from its engine's own prefix cache
  (the router's view of that cache lags: a prefix evicted before the engine
  turned to the request is computed, and the sample would charge those
  tokens to the planned ones): a sample of the engine's prefill, its service
  measured from when the engine turned to it (``ServiceLine``:
  ``Observation.served_s``). A node busy all the time has few requests alone,
  and learnt so little that a node twice as slow as the rest went on drawing
  as much work as they did for minutes (the tail of the unequal pools in
  docs/bench-log/routing.md). Its loads are not measured so: they overlap the
  request ahead.

Tiers learn only from requests alone: an engine batches prompts into steps
(chunked prefill), so a request that shared its engine also waits for other
requests' tokens, and on the conversation trace at 8 simulated nodes near
saturation that wait, read as load time, made L1 look 75 times dearer than it
is (docs/bench-log/routing.md).

Each engine and tier keeps its own fit over its last ``window`` samples,
robust to outliers (a stalled engine): a short prompt's time is mostly the
engine's fixed step, and taking it as a rate (``estimator =
"single_rate"``, the router's estimator before) made identical simulated
nodes learn rates 1.35-2.28 times the truth, different from node to node, so the
nodes that happened to learn a lower one drew the long cold prompts.
"""

from __future__ import annotations

import statistics
import threading
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field

from kvtier.costfit import CostFit, Estimator, Learner, ScaledCost, SingleRate

ENGINE = "engine"  # the engine's own prefix cache: free
OWN_SAMPLES = 8  # a node's own fit prices it once it has this many samples
RATIO_SAMPLES = 4  # until then, its measured slowness does, once it has this many
ESTIMATORS = ("fit", "single_rate")


@dataclass(frozen=True, slots=True, kw_only=True)
class CostConfig:
    prefill_s_per_token: float = 1e-3  # a computed token's time, before anything is measured
    prefill_fixed_s: float = 0.0  # an engine step's own time, before anything is measured
    step_tokens: int = 8192  # the engines' step budget (vLLM's max_num_batched_tokens)
    tier_s_per_token: dict[str, float] = field(default_factory=lambda: {"L1": 2e-5, "fs": 5e-5})
    default_tier_s_per_token: float = 1e-4  # a tier not named above (a shared store)
    estimator: str = "fit"  # "fit": fixed + per token; "single_rate": the old EWMA of time/tokens
    window: int = 64  # samples each fit keeps
    ewma: float = 0.2  # single_rate's weight of a new sample
    learn: bool = True
    dominant_fraction: float = 0.6  # a request teaches what took this share of its tokens
    # The engines' connectors load every chunk they find (kvtier's does): plan that,
    # not the cheaper choice they cannot make. False: plan the cheapest prefix.
    engine_loads_whole_prefix: bool = True

    def __post_init__(self) -> None:
        if self.prefill_s_per_token <= 0:
            raise ValueError("cost.prefill_s_per_token must be positive")
        if self.prefill_fixed_s < 0:
            raise ValueError("cost.prefill_fixed_s must be >= 0")
        if self.step_tokens < 1:
            raise ValueError(f"cost.step_tokens must be >= 1, got {self.step_tokens}")
        if any(v < 0 for v in self.tier_s_per_token.values()):
            raise ValueError("cost.tier_s_per_token values must be >= 0")
        if self.estimator not in ESTIMATORS:
            raise ValueError(
                f"cost.estimator must be one of {', '.join(ESTIMATORS)}, got {self.estimator!r}"
            )
        if self.window < 2:
            raise ValueError(f"cost.window must be >= 2, got {self.window}")
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
    served_s: float | None = None  # its service, measured (first in line: ServiceLine)


class CostModel:
    """See the module docstring. Thread-safe for ``observe`` and ``status``;
    the estimators ``engine_table`` hands out are read without the lock (a
    float read while a fit replaces it is the old value or the new)."""

    def __init__(self, config: CostConfig | None = None) -> None:
        self.config = config or CostConfig()
        self._lock = threading.RLock()  # load_s may make a tier's fit while held
        self._fits: dict[int, Learner] = {}  # each node's own fit
        self._ratios: dict[int, deque[float]] = {}  # each node's measured / configured service
        self._engines: dict[int, Estimator] = {}  # what prices each node now
        self._default: Learner = self._engine_estimator()
        self._tiers: dict[str, Learner] = {}
        self.samples = 0

    def engine(self, node: int) -> Estimator:
        """Node ``node``'s prefill cost: its own fit once it has ``OWN_SAMPLES``;
        before, the configured cost times the node's measured slowness (the
        median of its services over what the configured cost predicts), once
        it has ``RATIO_SAMPLES``; before, the configured cost."""
        return self._engines.get(node, self._default)

    def engine_table(self) -> tuple[dict[int, Estimator], Estimator]:
        """Every node's measured prefill cost, and the cost of the others."""
        return self._engines, self._default

    def tier(self, tier: str) -> Learner | None:
        """The tier's load cost (None: the engine's own cache, free)."""
        if tier == ENGINE:
            return None
        fit = self._tiers.get(tier)
        if fit is None:
            with self._lock:
                fit = self._tiers.setdefault(tier, self._tier_estimator(tier))
        return fit

    def tier_cost(self, tier: str) -> float:
        """Seconds per token loaded from ``tier``."""
        fit = self.tier(tier)
        return 0.0 if fit is None else fit.per_token_s

    def tier_setup(self, tier: str) -> float:
        """Seconds a load from ``tier`` costs whatever its size."""
        fit = self.tier(tier)
        return 0.0 if fit is None else fit.fixed_s

    def load_s(self, loaded: Mapping[str, int]) -> float:
        """Loading ``loaded`` (tier -> tokens), as predicted."""
        total = 0.0
        for tier, tokens in loaded.items():
            fit = self.tier(tier)
            if fit is not None and tokens > 0:
                total += fit.seconds(tokens)
        return total

    def observe(self, seen: Observation) -> None:
        if not self.config.learn or seen.ttft_s <= 0:
            return
        old = self.config.estimator == "single_rate"
        if not seen.alone:
            self._served(seen, old)
            return
        loaded = {t: n for t, n in seen.loaded.items() if n > 0}
        total = seen.prefill_tokens + sum(loaded.values())
        if total <= 0:
            return
        service = max(seen.ttft_s - seen.queue_s, 0.0)
        if not old and seen.served_s is not None:
            service = seen.served_s  # measured, not the queue as predicted
        with self._lock:
            self.samples += 1
            if not old and seen.served_s is not None:
                self._ratio(seen)
                self._price(seen.node)
            engine = self.engine(seen.node)
            if seen.prefill_tokens >= self.config.dominant_fraction * total:
                loads = self.load_s({t: n for t, n in loaded.items() if t != ENGINE})
                self._fit(seen.node).add(seen.prefill_tokens, service - loads)
                self._price(seen.node)
                return
            for tier, tokens in loaded.items():
                if tier != ENGINE and tokens >= self.config.dominant_fraction * total:
                    others = self.load_s({t: n for t, n in loaded.items() if t != tier})
                    prefill = engine.seconds(seen.prefill_tokens) if seen.prefill_tokens else 0.0
                    fit = self.tier(tier)
                    assert fit is not None  # not ENGINE
                    fit.add(tokens, service - prefill - others)

    def _served(self, seen: Observation, old: bool) -> None:
        """A sample of the engine's prefill from a request that was first in
        line (the single-rate estimator never learned from these)."""
        if old or seen.served_s is None:
            return
        planned = any(tokens for tokens in seen.loaded.values())
        with self._lock:
            self.samples += 1
            self._ratio(seen)
            if not planned and seen.prefill_tokens >= self.config.step_tokens:
                self._fit(seen.node).add(seen.prefill_tokens, seen.served_s)
            self._price(seen.node)

    def _ratio(self, seen: Observation) -> None:
        """The node's service, measured, over what the configured cost predicts."""
        assert seen.served_s is not None
        tokens = max(seen.prefill_tokens, 1)
        predicted = self._default.seconds(tokens) + self.load_s(seen.loaded)
        ratios = self._ratios.get(seen.node)
        if ratios is None:
            ratios = self._ratios[seen.node] = deque(maxlen=self.config.window)
        ratios.append(seen.served_s / predicted)

    def _fit(self, node: int) -> Learner:
        fit = self._fits.get(node)
        if fit is None:
            fit = self._fits[node] = self._engine_estimator()
        return fit

    def _price(self, node: int) -> None:
        """What prices ``node`` from now on (``engine``)."""
        fit = self._fits.get(node)
        ratios = self._ratios.get(node, ())
        if fit is not None and (fit.samples >= OWN_SAMPLES or len(ratios) < RATIO_SAMPLES):
            self._engines[node] = fit
        elif len(ratios) >= RATIO_SAMPLES:
            factor = statistics.median(ratios)
            self._engines[node] = ScaledCost(self._default, factor, len(ratios))

    def status(self) -> dict[str, object]:
        """Each engine's and tier's learned terms and sample counts, and how
        far apart the engines' per-token terms are (the largest over the
        smallest, among engines with a full window: 1.0 for identical nodes
        learned right)."""
        with self._lock:
            engines = {}
            for n, fit in sorted(self._fits.items()):
                engines[str(n)] = {**fit.status(), "priced_by": "own fit"}
            for n, priced in sorted(self._engines.items()):
                if isinstance(priced, ScaledCost):
                    engines[str(n)] = {
                        **engines.get(str(n), {}),
                        "priced_by": "configured x measured slowness",
                        "slowness": round(priced.factor, 4),
                        "ratios": priced.samples,
                    }
            full = [
                e.per_token_s
                for e in self._fits.values()
                if e.samples >= self.config.window and e.per_token_s > 0
            ]
            return {
                "estimator": self.config.estimator,
                "engines": engines,
                "default_engine": self._default.status(),
                "tiers": {t: f.status() for t, f in sorted(self._tiers.items())},
                "samples": self.samples,
                "engine_spread": round(max(full) / min(full), 3) if len(full) > 1 else None,
            }

    def _engine_estimator(self) -> Learner:
        c = self.config
        if c.estimator == "single_rate":
            return SingleRate(c.prefill_s_per_token, c.ewma)
        return CostFit(c.prefill_fixed_s, c.prefill_s_per_token, c.window, c.step_tokens)

    def _tier_estimator(self, tier: str) -> Learner:
        c = self.config
        per_token = c.tier_s_per_token.get(tier, c.default_tier_s_per_token)
        if c.estimator == "single_rate":  # the old clamp: around the engine's rate
            return SingleRate(per_token, c.ewma, around=c.prefill_s_per_token)
        return CostFit(0.0, per_token, c.window)


__all__ = ["ENGINE", "ESTIMATORS", "CostConfig", "CostModel", "Observation"]
