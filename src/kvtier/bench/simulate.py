"""A discrete-event simulation of many nodes, to see how routing policies
scale past this machine.

Each simulated node is an engine with a FIFO prefill queue, its own prefix
cache (``engine_chunks`` chunks, LRU), and its cache server's L1
(``l1_chunks``, LRU); all nodes share one L2 store that keeps everything
(Redis with room to spare). Service times come from ``SimCosts``, measured
on the real engine and tiers (``kvtier bench`` with ``bench = "route"``
reports them): a request's prefill takes ``prefill_s_per_token`` per token
it computes, plus ``tier_s_per_token[tier]`` per token it loads, plus
``overhead_s``. Like the real connector, a node loads the longest prefix it
can (its own cache first, then L1, then the shared store) and computes the
rest, whatever the router planned.

The router is the real one: the same ``ChunkIndex``, fed with the events a
real cache server would send (stored on completion, removed on eviction),
the same ``score`` and policies, and a ``CostModel`` that learns from the
simulated TTFTs as it would from real ones. Queues are as the real router
keeps them: the plans of the requests it sent that have not finished prefill.
"""

from __future__ import annotations

import heapq
import itertools
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from kvtier.events.wire import BlockRemoved, BlockStored, DecodedBatch
from kvtier.keys import Namespace, TokenHasher, salt_label
from kvtier.router.chunks import ChunkIndex
from kvtier.router.cost import CostConfig, CostModel, Observation
from kvtier.router.scoring import Decision, make_policy, score
from kvtier.traces import TraceRequest

SHARED = "redis"


@dataclass(frozen=True, slots=True, kw_only=True)
class SimCosts:
    prefill_s_per_token: float
    l1_s_per_token: float
    shared_s_per_token: float
    overhead_s: float = 0.0

    def tier_cost(self, tier: str) -> float:
        return {"L1": self.l1_s_per_token, SHARED: self.shared_s_per_token}.get(tier, 0.0)


@dataclass(frozen=True, slots=True, kw_only=True)
class SimConfig:
    nodes: int
    l1_chunks: int
    engine_chunks: int
    costs: SimCosts
    chunk_size: int = 256


@dataclass(slots=True)
class SimResult:
    policy: str
    ttft_s: list[float] = field(default_factory=list)
    tokens: dict[str, int] = field(default_factory=dict)  # source -> prompt tokens
    routed: list[int] = field(default_factory=list)  # requests per node

    def summary(self) -> dict[str, object]:
        t = np.array(self.ttft_s)
        total = max(sum(self.tokens.values()), 1)
        mean = max(float(np.mean(self.routed)), 1e-9)
        return {
            "requests": len(t),
            "ttft_p50_s": round(float(np.percentile(t, 50)), 4),
            "ttft_p95_s": round(float(np.percentile(t, 95)), 4),
            "ttft_p99_s": round(float(np.percentile(t, 99)), 4),
            "token_share": {k: round(v / total, 3) for k, v in sorted(self.tokens.items())},
            "load_max_over_mean": round(max(self.routed) / mean, 2),
        }


class _Node:
    def __init__(self) -> None:
        self.engine: OrderedDict[bytes, None] = OrderedDict()
        self.l1: OrderedDict[bytes, None] = OrderedDict()
        self.busy_until = 0.0
        self.inflight = 0  # prefill tokens routed here, not yet done
        self.inflight_s = 0.0  # the router's plans for them, in seconds
        self.requests = 0  # requests routed here and not done (the simulation has no decode)


def _prefix(cache: OrderedDict[bytes, None], hashes: Sequence[bytes]) -> int:
    count = 0
    for chunk in hashes:
        if chunk not in cache:
            break
        count += 1
    return count


@dataclass(frozen=True, slots=True)
class _Done:
    """A prefill that ends: what the node then holds, what the router learns."""

    node: int
    hashes: list[bytes]
    prefill: int
    ttft_s: float
    plan: Decision


class _Simulation:
    def __init__(self, config: SimConfig, policy_name: str) -> None:
        self.config = config
        costs = config.costs
        self.index = ChunkIndex(max_nodes=config.nodes)
        self.cost = CostModel(
            CostConfig(
                prefill_s_per_token=costs.prefill_s_per_token,
                tier_s_per_token={"L1": costs.l1_s_per_token, SHARED: costs.shared_s_per_token},
            )
        )
        self.policy = make_policy(policy_name)
        self.nodes = [_Node() for _ in range(config.nodes)]
        self.shared: set[bytes] = set()
        self.hashers: dict[str, TokenHasher] = {}
        self.result = SimResult(policy_name, routed=[0] * config.nodes)

    def run(self, trace: Sequence[TraceRequest]) -> SimResult:
        order = itertools.count()
        events: list[tuple[float, int, TraceRequest | _Done]] = [
            (r.arrival_s, next(order), r) for r in trace
        ]
        heapq.heapify(events)
        while events:
            now, _, item = heapq.heappop(events)
            if isinstance(item, _Done):
                self.done(item)
            else:
                done = self.arrive(now, item)
                finish = self.nodes[done.node].busy_until
                heapq.heappush(events, (finish, next(order), done))
        return self.result

    def arrive(self, now: float, request: TraceRequest) -> _Done:
        size, costs = self.config.chunk_size, self.config.costs
        hasher = self.hashers.get(request.tenant)
        if hasher is None:
            namespace = Namespace("sim-model", salt=salt_label(request.tenant))
            hasher = self.hashers[request.tenant] = TokenHasher(namespace, size)
        hashes = hasher.chunk_hashes(np.asarray(request.prompt, dtype=np.uint32))
        prompt = len(request.prompt)
        candidates = score(
            list(range(self.config.nodes)),
            prompt,
            size,
            [n.inflight for n in self.nodes],
            [max(n.inflight_s, 0.0) for n in self.nodes],
            [n.requests for n in self.nodes],
            [_prefix(n.engine, hashes) * size for n in self.nodes],
            self.index.view(hashes),
            {0: "L1"},
            {0: SHARED},
            dict(self.index.store_readers),
            self.cost,
        )
        plan = candidates.decision(self.policy(candidates))
        node = self.nodes[plan.node]
        loaded = self.loads(node, hashes, prompt)
        prefill = prompt - sum(loaded.values())
        service = costs.overhead_s + prefill * costs.prefill_s_per_token
        service += sum(tokens * costs.tier_cost(tier) for tier, tokens in loaded.items())
        node.busy_until = max(now, node.busy_until) + service
        node.inflight += plan.prefill_tokens
        node.inflight_s += plan.expected_ttft_s - plan.queue_s
        node.requests += 1
        ttft = node.busy_until - now
        result = self.result
        result.ttft_s.append(ttft)
        result.routed[plan.node] += 1
        for source, tokens in [("prefill", prefill), *loaded.items()]:
            result.tokens[source] = result.tokens.get(source, 0) + tokens
        return _Done(plan.node, hashes, prefill, ttft, plan)

    def loads(self, node: _Node, hashes: list[bytes], prompt: int) -> dict[str, int]:
        """What the node really loads: the longest prefix it can, cheapest
        tier first (its own cache, L1, the shared store), whatever the plan."""
        size, last = self.config.chunk_size, prompt - 1
        engine_hit = min(_prefix(node.engine, hashes) * size, last)
        loaded: dict[str, int] = {"engine": engine_hit} if engine_hit else {}
        covered = engine_hit
        for i, chunk in enumerate(hashes):
            end = min((i + 1) * size, last)
            if end <= covered:
                continue
            tier = "L1" if chunk in node.l1 else SHARED if chunk in self.shared else None
            if tier is None:
                break
            loaded[tier] = loaded.get(tier, 0) + end - covered
            covered = end
        return loaded

    def done(self, done: _Done) -> None:
        node = self.nodes[done.node]
        node.inflight -= done.plan.prefill_tokens
        node.inflight_s -= done.plan.expected_ttft_s - done.plan.queue_s
        node.requests -= 1
        self.insert(done.node, node.engine, done.hashes, self.config.engine_chunks, None)
        self.insert(done.node, node.l1, done.hashes, self.config.l1_chunks, "L1")
        fresh = [h for h in done.hashes if h not in self.shared]
        if fresh:
            self.shared.update(fresh)
            self.announce(
                done.node, BlockStored(list(fresh), ownership=f"kvtier:{SHARED}", locality="SHARED")
            )
        plan = done.plan
        self.cost.observe(
            Observation(done.node, done.ttft_s, plan.queue_s, plan.prefill_tokens, plan.loaded)
        )

    def insert(
        self,
        node: int,
        cache: OrderedDict[bytes, None],
        hashes: list[bytes],
        limit: int,
        tier: str | None,
    ) -> None:
        """LRU-insert; the index hears of it when ``tier`` names a kvtier tier."""
        added = [h for h in hashes if h not in cache]
        for h in hashes:
            cache[h] = None
            cache.move_to_end(h)
        evicted = []
        while len(cache) > limit:
            evicted.append(cache.popitem(last=False)[0])
        if tier is None:
            return
        if added:
            self.announce(
                node, BlockStored(list(added), ownership=f"kvtier:{tier}", locality="LOCAL")
            )
        if evicted:
            self.announce(
                node, BlockRemoved(list(evicted), ownership=f"kvtier:{tier}", locality="LOCAL")
            )

    def announce(self, node: int, event: BlockStored | BlockRemoved) -> None:
        self.index.apply(node, DecodedBatch(0.0, [event], None, 0))


def simulate(trace: Sequence[TraceRequest], config: SimConfig, policy_name: str) -> SimResult:
    """Replay ``trace`` (arrival order) over ``config.nodes`` simulated nodes."""
    return _Simulation(config, policy_name).run(trace)


__all__ = ["SimConfig", "SimCosts", "SimResult", "simulate"]
