"""A discrete-event simulation of many nodes, to see how routing policies
scale past this machine.

Each simulated node is an engine with a FIFO prefill queue, its own prefix
cache (``engine_chunks`` chunks, LRU), and its cache server's L1
(``l1_chunks``, LRU); with ``shared_s_per_token`` set, all nodes also share
one L2 store that keeps everything (Redis with room to spare). Service times
come from ``SimCosts``, measured on the real engine and tiers (``kvtier
bench`` with ``bench = "route"`` reports them) or stated GPU-like ones: a
request's prefill takes ``prefill_s_per_token`` per token it computes, plus
the tier's cost per token it loads, plus ``overhead_s``. Like the real
connector, a node loads the longest prefix it can (its own cache first, then
L1, then the shared store) and computes the rest, whatever the router
planned; what it can load is read when the request *starts*, after the work
ahead of it, not when it arrives.

The router is the real one: the same ``ChunkIndex`` (routed chunks credited
to their node until announced, ``pending_ttl_s``), fed with the events a
real cache server would send (stored on completion, removed on eviction),
the same ``score`` and policies, a ``CostModel`` that learns from the
simulated TTFTs as it would from real ones, and each node's queue kept by
the router's ``PrefillQueue`` (or ``SimConfig.queue``, to compare another).
Not modelled: batching and chunked prefill (one prefill at a time per
node), decode, and the shared store's bandwidth.

``ORACLE`` is a policy only the simulation can run: per request it sends to
the node with the least true time to first token, knowing every node's work
in flight and what its cache will hold when the request starts (the
requests ahead of it stored; evictions meanwhile not foreseen). It bounds
what any per-request policy could do here.
"""

from __future__ import annotations

import heapq
import itertools
from collections import OrderedDict, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from kvtier.events.wire import BlockRemoved, BlockStored, DecodedBatch
from kvtier.keys import Namespace, TokenHasher, salt_label
from kvtier.router.chunks import ChunkIndex
from kvtier.router.cost import CostConfig, CostModel, Observation
from kvtier.router.queue import PrefillQueue
from kvtier.router.scoring import Decision, make_policy, score
from kvtier.traces import TraceRequest

SHARED = "redis"
ORACLE = "oracle"


@dataclass(frozen=True, slots=True, kw_only=True)
class SimCosts:
    prefill_s_per_token: float
    l1_s_per_token: float
    shared_s_per_token: float | None  # None: no shared store
    overhead_s: float = 0.0

    def tier_cost(self, tier: str) -> float:
        return {"L1": self.l1_s_per_token, SHARED: self.shared_s_per_token or 0.0}.get(tier, 0.0)


@dataclass(frozen=True, slots=True, kw_only=True)
class SimConfig:
    nodes: int
    l1_chunks: int
    engine_chunks: int
    costs: SimCosts
    chunk_size: int = 256
    pending_ttl_s: float = 30.0  # the router's credit for routed, unannounced chunks
    queue: Callable[[], PrefillQueue] = PrefillQueue  # each node's queue, as the router keeps it


@dataclass(slots=True)
class SimResult:
    """Per request, in arrival order: its TTFT and where its prompt came from."""

    policy: str
    ttft_s: list[float] = field(default_factory=list)
    sources: list[dict[str, int]] = field(default_factory=list)  # source -> prompt tokens
    routed: list[int] = field(default_factory=list)  # requests per node
    duration_s: float = 0.0  # the first arrival to the last first token

    @property
    def tokens(self) -> dict[str, int]:
        """Prompt tokens by source (``prefill``, ``engine``, ``L1``, the store)."""
        total: dict[str, int] = {}
        for sources in self.sources:
            for source, tokens in sources.items():
                total[source] = total.get(source, 0) + tokens
        return total

    def summary(self, slo_s: float | None = None) -> dict[str, object]:
        """The anchors' metric set: TTFT mean and percentiles, goodput at the
        TTFT SLO, each source's share of prompt tokens (the hit rate per tier,
        and the share computed), and the effective cache throughput (prompt
        tokens per second served from any cache)."""
        t = np.array(self.ttft_s)
        tokens = self.tokens
        total = max(sum(tokens.values()), 1)
        cached = total - tokens.get("prefill", 0)
        mean = max(float(np.mean(self.routed)), 1e-9)
        out: dict[str, object] = {
            "requests": len(t),
            "ttft_mean_s": round(float(np.mean(t)), 4),
            "ttft_p50_s": round(float(np.percentile(t, 50)), 4),
            "ttft_p90_s": round(float(np.percentile(t, 90)), 4),
            "ttft_p95_s": round(float(np.percentile(t, 95)), 4),
            "ttft_p99_s": round(float(np.percentile(t, 99)), 4),
            "token_share": {k: round(v / total, 3) for k, v in sorted(tokens.items())},
            "computed_share": round(tokens.get("prefill", 0) / total, 3),
            "cache_tokens_per_s": round(cached / max(self.duration_s, 1e-9), 1),
            "load_max_over_mean": round(max(self.routed) / mean, 2),
        }
        if slo_s is not None:
            out["goodput"] = round(float(np.mean(t <= slo_s)), 4)
        return out


@dataclass(frozen=True, slots=True)
class _Job:
    """A routed request, from its arrival to its first token."""

    index: int  # in arrival order
    node: int
    arrival_s: float
    hashes: list[bytes]
    prompt: int
    plan: Decision
    planned_at: float  # its first token, as the router's queue projected it


class _Node:
    def __init__(self, queue: PrefillQueue) -> None:
        self.engine: OrderedDict[bytes, None] = OrderedDict()
        self.l1: OrderedDict[bytes, None] = OrderedDict()
        self.queue = queue  # the router's view of this node
        self.waiting: deque[_Job] = deque()  # the node's own FIFO
        self.running: _Job | None = None
        self.busy_until = 0.0  # when ``running``'s prefill ends
        self.requests = 0  # requests routed here and not done (the simulation has no decode)


def _prefix(cache: OrderedDict[bytes, None] | set[bytes], hashes: Sequence[bytes]) -> int:
    count = 0
    for chunk in hashes:
        if chunk not in cache:
            break
        count += 1
    return count


@dataclass(frozen=True, slots=True)
class _Done:
    """A prefill that ends: what the node then holds, what the router learns."""

    job: _Job
    service_s: float


class _Simulation:
    def __init__(self, config: SimConfig, policy_name: str) -> None:
        self.config = config
        costs = config.costs
        self.now = 0.0
        self.index = ChunkIndex(
            max_nodes=config.nodes, pending_ttl_s=config.pending_ttl_s, clock=lambda: self.now
        )
        tiers = {"L1": costs.l1_s_per_token}
        if costs.shared_s_per_token is not None:
            tiers[SHARED] = costs.shared_s_per_token
        self.cost = CostModel(
            CostConfig(prefill_s_per_token=costs.prefill_s_per_token, tier_s_per_token=tiers)
        )
        self.policy = None if policy_name == ORACLE else make_policy(policy_name)
        self.nodes = [_Node(config.queue()) for _ in range(config.nodes)]
        self.shared: set[bytes] = set()
        self.hashers: dict[str, TokenHasher] = {}
        self.result = SimResult(policy_name, routed=[0] * config.nodes)
        self.events: list[tuple[float, int, TraceRequest | _Done]] = []
        self.order = itertools.count()

    def run(self, trace: Sequence[TraceRequest]) -> SimResult:
        self.result.ttft_s = [0.0] * len(trace)
        self.result.sources = [{} for _ in trace]
        # an arrival's tie-breaker is its index in the trace; prefills ends come after
        self.events = [(r.arrival_s, i, r) for i, r in enumerate(trace)]
        self.order = itertools.count(len(trace))
        heapq.heapify(self.events)
        first = min((r.arrival_s for r in trace), default=0.0)
        while self.events:
            self.now, order, item = heapq.heappop(self.events)
            if isinstance(item, _Done):
                self.done(item)
            else:
                self.arrive(order, item)
        self.result.duration_s = self.now - first
        return self.result

    def arrive(self, index: int, request: TraceRequest) -> None:
        size, now = self.config.chunk_size, self.now
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
            [n.queue.tokens for n in self.nodes],
            [n.queue.wait_s(now) for n in self.nodes],
            [n.requests for n in self.nodes],
            [_prefix(n.engine, hashes) * size for n in self.nodes],
            self.index.view(hashes),
            {0: "L1"},
            {0: SHARED},
            dict(self.index.store_readers),
            self.cost,
        )
        choice = self.oracle(hashes, prompt) if self.policy is None else self.policy(candidates)
        plan = candidates.decision(choice)
        node = self.nodes[plan.node]
        service = plan.expected_ttft_s - plan.queue_s
        planned_at = node.queue.dispatch(now, service, plan.prefill_tokens)
        self.index.note_routed(plan.node, hashes)
        node.requests += 1
        node.waiting.append(_Job(index, plan.node, now, hashes, prompt, plan, planned_at))
        self.result.routed[plan.node] += 1
        if node.running is None:
            self.start(node)

    def start(self, node: _Node) -> None:
        """The node's next request starts: it loads what the node holds *now*."""
        job = node.waiting.popleft()
        loaded = self.loads(node, job.hashes, job.prompt)
        service, prefill = self.service(loaded, job.prompt)
        node.running, node.busy_until = job, self.now + service
        self.result.sources[job.index] = {"prefill": prefill, **loaded}
        heapq.heappush(self.events, (node.busy_until, next(self.order), _Done(job, service)))

    def service(self, loaded: dict[str, int], prompt: int) -> tuple[float, int]:
        """A prefill's seconds and computed tokens, given what it loads."""
        costs = self.config.costs
        prefill = prompt - sum(loaded.values())
        service = costs.overhead_s + prefill * costs.prefill_s_per_token
        service += sum(tokens * costs.tier_cost(tier) for tier, tokens in loaded.items())
        return service, prefill

    def oracle(self, hashes: list[bytes], prompt: int) -> int:
        """The node with the least true TTFT for this request (``ORACLE``)."""
        best, best_ttft = 0, float("inf")
        for index, node in enumerate(self.nodes):
            at, ahead = self.now, set[bytes]()
            if node.running is not None:
                at, ahead = node.busy_until, set(node.running.hashes)
            for job in node.waiting:
                at += self.service(self.loads(node, job.hashes, job.prompt, ahead), job.prompt)[0]
                ahead.update(job.hashes)
            ttft = at + self.service(self.loads(node, hashes, prompt, ahead), prompt)[0]
            if ttft < best_ttft:
                best, best_ttft = index, ttft
        return best

    def loads(
        self, node: _Node, hashes: list[bytes], prompt: int, ahead: set[bytes] | None = None
    ) -> dict[str, int]:
        """What the node really loads: the longest prefix it can, cheapest
        tier first (its own cache, L1, the shared store), whatever the plan;
        ``ahead``: chunks the node will have stored by then (the oracle)."""
        size, last = self.config.chunk_size, prompt - 1
        held = _prefix(node.engine, hashes)
        if ahead:
            held = max(held, _prefix(ahead, hashes))
        engine_hit = min(held * size, last)
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
        job, now = done.job, self.now
        node = self.nodes[job.node]
        ttft = now - job.arrival_s
        self.result.ttft_s[job.index] = ttft
        node.queue.first_token(now, job.planned_at, job.plan.prefill_tokens)
        node.requests -= 1
        node.running = None
        self.insert(job.node, node.engine, job.hashes, self.config.engine_chunks, None)
        self.insert(job.node, node.l1, job.hashes, self.config.l1_chunks, "L1")
        fresh = [h for h in job.hashes if h not in self.shared]
        if fresh and self.config.costs.shared_s_per_token is not None:
            self.shared.update(fresh)
            self.announce(
                job.node, BlockStored(list(fresh), ownership=f"kvtier:{SHARED}", locality="SHARED")
            )
        plan = job.plan
        self.cost.observe(
            Observation(job.node, ttft, plan.queue_s, plan.prefill_tokens, plan.loaded)
        )
        if node.waiting:
            self.start(node)

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


__all__ = ["ORACLE", "SimConfig", "SimCosts", "SimResult", "simulate"]
