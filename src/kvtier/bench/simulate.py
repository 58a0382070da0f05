"""A discrete-event simulation of many nodes, to see how routing policies
scale past this machine.

Each simulated node is an engine with its own prefix cache
(``engine_chunks`` chunks, LRU) and its cache server's L1 (``l1_chunks``,
LRU); with ``shared_s_per_token`` set, all nodes also share one L2 store
that keeps everything, its bandwidth shared by all nodes when
``shared_tokens_per_s`` is set. Costs come from ``SimCosts``, measured on the
real engine and tiers (``kvtier bench`` with ``bench = "route"`` reports
them) or stated GPU-like ones.

Each engine schedules as vLLM's does, in steps: a step computes up to
``step_tokens`` tokens, the running requests' next ones first, then
waiting requests in arrival order (chunked prefill, many requests a step),
and takes ``overhead_s`` plus ``prefill_s_per_token`` per token computed. A
request's first token comes at the end of the step that computes its last
prompt token. With ``decode_s_per_token`` set, a request then decodes its
``output_tokens`` one a step, each costing that much, ahead of new prompts
in the budget, and at most ``max_running`` requests are admitted at once
(vLLM's ``max_num_seqs``); without, a request leaves at its first token.

Nodes may differ: ``SimConfig.speeds`` makes node ``i``'s steps (their
overhead and their tokens) ``speeds[i]`` times as long (a slower GPU, a
busier host), and ``SimConfig.l1_sizes`` gives each node its own L1. Loads
cost the same everywhere.

Like the real connector, a node loads the longest prefix it can (its own
cache first, then L1, then the shared store) and computes the rest, whatever
the router planned; what it can load is read when the request is admitted
to a step, not when it arrives. Loads take the tier's cost per token (the
store's, behind every other node's loads when its bandwidth is
shared); a request waits for them aside while other requests step.

The router is the real one: the same ``ChunkIndex`` (routed chunks credited
to their node until announced, ``pending_ttl_s``), fed with the events a
real cache server would send (stored on completion, removed on eviction),
the same ``score`` and policies (the kvtier policy's work weight from the
router's ``ClusterLoad``), a ``CostModel`` that learns from the simulated
TTFTs as it would from real ones, and each node's queue kept by the router's
``PrefillQueue`` (or ``SimConfig.queue``, to compare another). Not
modelled: the engines' KV memory limit on requests in flight, preemption,
and chunks stored before a prefill ends.

``ORACLE`` is a policy only the simulation can run: per request it sends to
the node with the least true time to first token, knowing every node's work
in flight and what its cache will hold when the request starts (the
requests ahead of it stored; evictions meanwhile not foreseen), the node's
steps taken as full ones. It bounds what any per-request policy could do
here. It knows each node's own costs.

``SimResult.learned`` is what the router's cost model learned of each node
and ``SimResult.truth`` the node's real terms (its step overhead and its
time per token), to compare.
"""

from __future__ import annotations

import heapq
import itertools
from collections import OrderedDict, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from kvtier.bench.simresult import SimResult
from kvtier.events.wire import BlockRemoved, BlockStored, DecodedBatch
from kvtier.keys import Namespace, TokenHasher, salt_label
from kvtier.router.chunks import ChunkIndex
from kvtier.router.cost import CostConfig, CostModel, Observation
from kvtier.router.load import ClusterLoad
from kvtier.router.queue import PrefillQueue, ServiceLine
from kvtier.router.scoring import Decision, make_policy, score
from kvtier.traces import TraceRequest

SHARED = "redis"
ORACLE = "oracle"


@dataclass(frozen=True, slots=True, kw_only=True)
class SimCosts:
    prefill_s_per_token: float
    l1_s_per_token: float
    shared_s_per_token: float | None  # None: no shared store
    overhead_s: float = 0.0  # each engine step's
    shared_tokens_per_s: float | None = None  # the store's bandwidth, all nodes (None: unbounded)
    decode_s_per_token: float = 0.0  # a decode step's cost per request (0: no decode)

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
    step_tokens: int = 8192  # each engine step's tokens (vLLM's max_num_batched_tokens)
    max_running: int = 1 << 30  # requests an engine runs at once (vLLM's max_num_seqs)
    work_cost: bool = True  # the kvtier policy prices the work it adds (False: TTFT alone)
    learn_from_all: bool = False  # the cost model learns from every request (the router's old rule)
    estimator: str = "fit"  # the router's cost estimator (CostConfig.estimator)
    speeds: tuple[float, ...] = ()  # each node's step-time factor (empty: all 1.0)
    l1_sizes: tuple[int, ...] = ()  # each node's L1 chunks (empty: all l1_chunks)

    def __post_init__(self) -> None:
        if self.step_tokens < 1:
            raise ValueError(f"step_tokens must be >= 1, got {self.step_tokens}")
        for name, values in (("speeds", self.speeds), ("l1_sizes", self.l1_sizes)):
            if values and len(values) != self.nodes:
                raise ValueError(f"{name} must give all {self.nodes} nodes, got {len(values)}")
        if any(speed <= 0 for speed in self.speeds):
            raise ValueError("speeds must be positive")

    def speed(self, node: int) -> float:
        return self.speeds[node] if self.speeds else 1.0

    def l1_of(self, node: int) -> int:
        return self.l1_sizes[node] if self.l1_sizes else self.l1_chunks


@dataclass(slots=True, eq=False)
class _Job:
    """A routed request, from its arrival to its first token."""

    index: int  # in arrival order
    node: int
    arrival_s: float
    hashes: list[bytes]
    prompt: int
    plan: Decision
    planned_at: float  # its first token, as the router's queue projected it
    remaining: int = 0  # prompt tokens still to compute (known once admitted)
    decode: int = 0  # tokens still to generate after the first
    routed_to: int = 0  # its node's requests routed, itself included


class _Node:
    def __init__(self, queue: PrefillQueue) -> None:
        self.engine: OrderedDict[bytes, None] = OrderedDict()
        self.l1: OrderedDict[bytes, None] = OrderedDict()
        self.queue = queue  # the router's view of this node
        self.line = ServiceLine()  # the router's record of this node's line
        self.waiting: deque[_Job] = deque()  # routed here, not admitted yet (FIFO)
        self.loading: list[_Job] = []  # admitted, their loads in flight
        self.running: list[_Job] = []  # admitted and loaded, prefilling or decoding
        self.step: list[tuple[_Job, int]] = []  # the step in progress: (job, tokens)
        self.step_end = 0.0
        self.requests = 0  # requests routed here and not done


def _prefix(cache: OrderedDict[bytes, None] | set[bytes], hashes: Sequence[bytes]) -> int:
    count = 0
    for chunk in hashes:
        if chunk not in cache:
            break
        count += 1
    return count


@dataclass(frozen=True, slots=True)
class _StepEnd:
    node: int


@dataclass(frozen=True, slots=True)
class _Loaded:
    job: _Job


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
            CostConfig(
                prefill_s_per_token=costs.prefill_s_per_token,
                step_tokens=config.step_tokens,
                tier_s_per_token=tiers,
                estimator=config.estimator,
            )
        )
        self.load = ClusterLoad()
        self.policy = None if policy_name == ORACLE else make_policy(policy_name)
        self.nodes = [_Node(config.queue()) for _ in range(config.nodes)]
        self.shared: set[bytes] = set()
        self.store_free_at = 0.0  # when the shared store's bandwidth is free again
        self.hashers: dict[str, TokenHasher] = {}
        self.result = SimResult(policy_name, routed=[0] * config.nodes)
        self.result.truth = [
            (costs.overhead_s * config.speed(i), costs.prefill_s_per_token * config.speed(i))
            for i in range(config.nodes)
        ]
        self.events: list[tuple[float, int, TraceRequest | _StepEnd | _Loaded]] = []
        self.order = itertools.count()

    def run(self, trace: Sequence[TraceRequest]) -> SimResult:
        self.result.ttft_s = [0.0] * len(trace)
        self.result.sources = [{} for _ in trace]
        # an arrival's tie-breaker is its index in the trace; the engines' events come after
        self.events = [(r.arrival_s, i, r) for i, r in enumerate(trace)]
        self.order = itertools.count(len(trace))
        heapq.heapify(self.events)
        first = min((r.arrival_s for r in trace), default=0.0)
        while self.events:
            self.now, order, item = heapq.heappop(self.events)
            if isinstance(item, _StepEnd):
                self.step_ended(item.node)
            elif isinstance(item, _Loaded):
                self.loaded(item.job)
            else:
                self.arrive(order, item)
        self.result.duration_s = self.now - first
        self.result.learned = self.cost.status()
        return self.result

    def push(self, at: float, item: _StepEnd | _Loaded) -> None:
        heapq.heappush(self.events, (at, next(self.order), item))

    def arrive(self, index: int, request: TraceRequest) -> None:
        size, now = self.config.chunk_size, self.now
        hasher = self.hashers.get(request.tenant)
        if hasher is None:
            namespace = Namespace("sim-model", salt=salt_label(request.tenant))
            hasher = self.hashers[request.tenant] = TokenHasher(namespace, size)
        hashes = hasher.chunk_hashes(np.asarray(request.prompt, dtype=np.uint32))
        prompt = len(request.prompt)
        work_weight = self.load.work_weight(now, self.config.nodes) if self.config.work_cost else 0
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
            work_weight,
        )
        choice = self.oracle(hashes, prompt) if self.policy is None else self.policy(candidates)
        plan = candidates.decision(choice)
        node = self.nodes[plan.node]
        service = plan.expected_ttft_s - plan.queue_s
        planned_at = node.queue.dispatch(now, service, plan.prefill_tokens)
        self.load.dispatch(now, service)
        self.index.note_routed(plan.node, hashes)
        node.requests += 1
        decode = max(request.output_tokens - 1, 0) if self.config.costs.decode_s_per_token else 0
        self.result.routed[plan.node] += 1
        routed_to = self.result.routed[plan.node]
        node.line.dispatched(routed_to, now)
        job = _Job(
            index,
            plan.node,
            now,
            hashes,
            prompt,
            plan,
            planned_at,
            decode=decode,
            routed_to=routed_to,
        )
        node.waiting.append(job)
        if not node.step:
            self.schedule(plan.node)

    def schedule(self, i: int) -> None:
        """Node ``i``'s next step, as vLLM's scheduler builds one: the running
        prefills first, then waiting requests in order, up to ``step_tokens``.
        A request is admitted reading what the node holds *now*; one with
        loads waits for them aside (others go on) and joins when loaded."""
        node, budget = self.nodes[i], self.config.step_tokens
        step: list[tuple[_Job, int]] = []
        for job in node.running:
            if not budget:
                break
            take = min(job.remaining, budget) if job.remaining else 1  # 1: a decode
            step.append((job, take))
            budget -= take
        while node.waiting and budget and len(node.running) < self.config.max_running:
            job = node.waiting.popleft()
            ready_at = self.admit(node, job)
            if ready_at > self.now:
                node.loading.append(job)
                self.push(ready_at, _Loaded(job))
                continue
            node.running.append(job)
            take = min(job.remaining, budget)
            step.append((job, take))
            budget -= take
        node.step = step
        if step:
            costs = self.config.costs
            decodes = sum(1 for job, _ in step if not job.remaining)
            tokens = sum(take for _, take in step) - decodes
            seconds = tokens * costs.prefill_s_per_token + decodes * costs.decode_s_per_token
            node.step_end = self.now + (costs.overhead_s + seconds) * self.config.speed(i)
            self.push(node.step_end, _StepEnd(i))

    def admit(self, node: _Node, job: _Job) -> float:
        """What ``job`` loads on its node now; when its loads are done."""
        loaded = self.loads(node, job.hashes, job.prompt)
        job.remaining = job.prompt - sum(loaded.values())
        self.result.sources[job.index] = {"prefill": job.remaining, **loaded}
        costs = self.config.costs
        ready_at = self.now + self.load_s(loaded)
        shared = loaded.get(SHARED, 0)
        if shared and costs.shared_tokens_per_s:
            transfer = shared / costs.shared_tokens_per_s
            self.store_free_at = max(self.now, self.store_free_at) + transfer
            ready_at = max(ready_at, self.store_free_at)
        return ready_at

    def load_s(self, loaded: dict[str, int]) -> float:
        """Loading ``loaded``'s tiers one after the other, the store uncontended."""
        return sum(tokens * self.config.costs.tier_cost(tier) for tier, tokens in loaded.items())

    def loaded(self, job: _Job) -> None:
        node = self.nodes[job.node]
        node.loading.remove(job)
        node.running.append(job)
        if not node.step:
            self.schedule(job.node)

    def step_ended(self, i: int) -> None:
        node = self.nodes[i]
        for job, take in node.step:
            if not job.remaining:  # a decode step
                job.decode -= 1
            else:
                job.remaining -= take
                if not job.remaining:
                    self.first_token(job)
            if not job.remaining and not job.decode:
                node.running.remove(job)
                node.requests -= 1
        node.step = []
        self.schedule(i)

    def oracle(self, hashes: list[bytes], prompt: int) -> int:
        """The node with the least true TTFT for this request (``ORACLE``):
        the node's work ahead of it (what is left of its prefills, and the
        waiting requests' with what the node will hold when they start),
        done in full steps after the step in progress, then its own loads
        (decodes and ``max_running`` not counted)."""
        costs, budget = self.config.costs, self.config.step_tokens
        best, best_ttft = 0, float("inf")
        for index, node in enumerate(self.nodes):
            at = node.step_end if node.step else self.now
            in_step = dict(node.step)  # jobs compare by identity
            tokens, ahead = 0, set[bytes]()
            for job in node.running + node.loading:
                tokens += max(job.remaining - in_step.get(job, 0), 0)
                ahead.update(job.hashes)
            for job in node.waiting:
                tokens += job.prompt - sum(self.loads(node, job.hashes, job.prompt, ahead).values())
                ahead.update(job.hashes)
            loaded = self.loads(node, hashes, prompt, ahead)
            tokens += prompt - sum(loaded.values())
            steps = -(-tokens // budget)
            ttft = at + (steps * costs.overhead_s + tokens * costs.prefill_s_per_token) * (
                self.config.speed(index)
            )
            ttft += self.load_s(loaded)
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

    def first_token(self, job: _Job) -> None:
        """The prefill is done: the node stores its chunks, the router learns."""
        now = self.now
        node = self.nodes[job.node]
        ttft = now - job.arrival_s
        self.result.ttft_s[job.index] = ttft
        node.queue.first_token(now, job.planned_at, job.plan.prefill_tokens)
        self.insert(job.node, node.engine, job.hashes, self.config.engine_chunks, None)
        self.insert(job.node, node.l1, job.hashes, self.config.l1_of(job.node), "L1")
        fresh = [h for h in job.hashes if h not in self.shared]
        if fresh and self.config.costs.shared_s_per_token is not None:
            self.shared.update(fresh)
            self.announce(
                job.node, BlockStored(list(fresh), ownership=f"kvtier:{SHARED}", locality="SHARED")
            )
        plan = job.plan
        served = node.line.first_token(job.routed_to, now)
        alone = not plan.queue_tokens and self.result.routed[job.node] == job.routed_to
        if self.config.learn_from_all:  # the old rule: every request, as if alone
            alone, served = True, None
        self.cost.observe(
            Observation(
                job.node, ttft, plan.queue_s, plan.prefill_tokens, plan.loaded, alone, served
            )
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


__all__ = ["ORACLE", "SimConfig", "SimCosts", "SimResult", "simulate"]
