"""Routing policies: which engine gets a request.

``score`` gathers, for one request and every live engine, what the policies
look at (``Candidates``): the engine's queue (prefill tokens in flight), the
prefix its own cache holds (``BlockIndex``), and, chunk by chunk along the
kvtier prefix, the cheapest tier that engine's node could load it from
(``ChunkIndex``: L1, a node-local L2, or a shared store the node reads).

Policies (a registry, ``POLICIES``):

- ``kvtier``: the engine with the least expected cost, the request's
  expected time to first token there plus the delay its work there imposes
  on the requests that will queue behind it (``router/load.py``)::

      ttft = queue + service,  cost = ttft + work_weight x service
      service = prefill(engine, prompt - covered(j)) + sum of load(chunk i < j)
                + the set-up of each tier it loads from

  minimised over how many kvtier chunks ``j`` to load (up to the prefix the
  node has): a chunk counts only where loading it from its tier beats
  recomputing it, ``covered(j)`` is the larger of the engine's own prefix and
  ``j`` chunks, and the last prompt token is always computed. ``prefill``
  is the engine's learned cost, a fixed time per step and a time per token
  (``router/cost.py``). Engines whose
  connector loads every chunk it finds (kvtier's today:
  ``CostConfig.engine_loads_whole_prefix``) are planned as they will act, with
  ``j`` the whole reachable prefix, so a node that would load from a tier
  dearer than recomputing is priced as the slow node it is. ``queue`` is
  the engine's work in flight in seconds (its projected drain time,
  ``router/queue.py``); ``work_weight`` is ``rho / (1 - rho)`` at the
  cluster's measured utilisation: 0 when idle (the least expected TTFT),
  large near saturation, where a prefix hit's saved work matters more than
  a shorter queue elsewhere.
- ``longest_prefix``: llm-d's default scorers: 3 x the matched fraction of the
  prompt (fixed tier weights: engine 1, L1 0.8, node-local L2 0.5, shared
  0.3) + 2 x (1 - queue / longest queue).
- ``least_loaded``: the fewest prefill tokens in flight.
- ``round_robin``.

Ties go to the engine with less in flight, then the lower index (the kvtier
policy counts costs within ``NEAR`` of the best as ties and gives those to
the engine with the fewest requests in flight).

How it stays fast (``benchmarks/bench_route_scoring.py``): nodes are bits of
Python ints. Walking the chunks, nodes that found every chunk so far in the
same tiers form one ``_Path``; a path splits when its nodes part ways and
ends when none of them has the next chunk, so the work per chunk is a few
bit operations per path, not per node. Only the chosen node's plan is spelt
out (``Decision``).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from kvtier.costfit import Estimator
from kvtier.router.chunks import L1_SLOT, LOCAL_SLOTS
from kvtier.router.cost import ENGINE, CostModel

PREFIX_WEIGHTS = {"engine": 1.0, "L1": 0.8, "local": 0.5, "shared": 0.3}
NEAR = 0.1  # the kvtier policy: expected TTFTs this close are a tie
_FIELD = (1 << 64) - 1


@dataclass(frozen=True, slots=True)
class Tier:
    name: str
    kind: str  # "L1", "local" or "shared"
    cost: float  # seconds per token
    setup: float = 0.0  # seconds a load from it costs whatever its size


@dataclass(frozen=True, slots=True)
class Decision:
    node: int
    expected_ttft_s: float  # the kvtier policy's estimate (whoever picks, for the logs)
    prefill_tokens: int  # queue excluded
    queue_tokens: int
    queue_s: float  # expected wait for the work ahead of it
    loaded: dict[str, int]  # tier -> tokens to load
    load_chunks: int  # kvtier chunks the plan loads (from the first)


class _Path:
    """Nodes (``mask``) that found chunks 0..``length``-1 in the same tiers."""

    __slots__ = ("cost_max", "length", "load_s", "mask", "parent", "tier", "used", "weighted")

    def __init__(
        self,
        mask: int,
        parent: _Path | None,
        tier: int,
        load_s: float,
        cost_max: float,
        weighted: float,
        used: int = 0,
    ) -> None:
        self.mask = mask
        self.parent = parent
        self.tier = tier  # of the last chunk (-1 for the root)
        self.length: int = 0 if parent is None else parent.length + 1
        self.load_s = load_s  # loading the whole path, whole chunks, set-ups included
        self.used = used  # the tiers on it (bit t: tier t)
        self.cost_max = cost_max  # the dearest tier on it
        self.weighted = weighted  # tokens x fixed tier weights (longest_prefix)

    def tiers(self) -> list[int]:
        out = []
        path: _Path | None = self
        while path is not None and path.parent is not None:
            out.append(path.tier)
            path = path.parent
        return out[::-1]


@dataclass(frozen=True, slots=True, eq=False)
class Candidates:
    """One request's features over ``nodes`` (engine indices, all live, in
    order); everything per node is indexed like ``nodes``."""

    nodes: list[int]
    prompt_tokens: int
    chunk_size: int
    queue_tokens: list[int]  # prefill tokens in flight
    queue_s: list[float]  # the expected work in flight, in seconds (its plans' own times)
    requests: list[int]  # requests in flight (prefilling or decoding)
    engine_tokens: list[int]  # its own prefix cache's hit
    ttft: list[float]  # the kvtier plan's expected time to first token
    chunks: list[int]  # kvtier chunks the plan loads
    matched: list[float]  # tokens x fixed tier weights (longest_prefix)
    paths: list[_Path | None]
    tiers: list[Tier]
    work_weight: float = 0.0  # seconds of later requests' delay per second of work

    def decision(self, j: int) -> Decision:
        """Candidate ``j``'s plan, spelt out."""
        size, last = self.chunk_size, max(self.prompt_tokens - 1, 0)
        engine = min(self.engine_tokens[j], last)
        loaded: dict[str, int] = {ENGINE: engine} if engine else {}
        path = self.paths[j]
        chunks = self.chunks[j]
        if path is not None:
            for i, tier in enumerate(path.tiers()[:chunks]):
                tokens = _beyond(i, size, last, engine)
                if tokens:
                    name = self.tiers[tier].name
                    loaded[name] = loaded.get(name, 0) + tokens
        covered = min(max(engine, chunks * size), last)
        return Decision(
            self.nodes[j],
            self.ttft[j],
            self.prompt_tokens - covered,
            self.queue_tokens[j],
            self.queue_s[j],
            loaded,
            chunks,
        )


def _beyond(i: int, size: int, last: int, engine: int) -> int:
    """Tokens of chunk ``i`` that loading brings: past the engine's own hit,
    short of the last prompt token."""
    return max(0, min((i + 1) * size, last) - max(i * size, engine))


def score(
    nodes: Sequence[int],
    prompt_tokens: int,
    chunk_size: int,
    queue_tokens: Sequence[int],
    queue_s: Sequence[float],
    requests: Sequence[int],
    engine_tokens: Sequence[int],
    masks: Sequence[int],
    slot_names: dict[int, str],
    store_names: dict[int, str],
    store_readers: dict[int, int],
    cost: CostModel,
    work_weight: float = 0.0,
) -> Candidates:
    """Every candidate's features and kvtier plan. ``masks``: the request's
    chunks as ``ChunkIndex.view`` gives them (one int per chunk, up to the
    first that nobody has); ``work_weight``: ``ClusterLoad.work_weight``."""
    tiers = [
        Tier(
            slot_names.get(slot, "L1" if slot == L1_SLOT else f"slot{slot}"),
            "L1" if slot == L1_SLOT else "local",
            0.0,
        )
        for slot in range(LOCAL_SLOTS)
    ]
    tiers += [Tier(name, "shared", 0.0) for name in store_names.values()]
    tiers = [Tier(t.name, t.kind, cost.tier_cost(t.name), cost.tier_setup(t.name)) for t in tiers]
    order = sorted(range(len(tiers)), key=lambda t: tiers[t].cost)  # cheapest first
    stores = list(store_names)
    readers = [store_readers.get(store, 0) for store in stores]
    weights = [PREFIX_WEIGHTS[t.kind] for t in tiers]
    size, last = chunk_size, max(prompt_tokens - 1, 0)

    live = 0
    for node in nodes:
        live |= 1 << node
    ended: list[_Path] = []
    paths = [_Path(live, None, -1, 0.0, 0.0, 0.0)]
    costs = [t.cost for t in tiers]
    setups = [t.setup for t in tiers]
    local_order = [t for t in order if t < LOCAL_SLOTS]
    for i, mask in enumerate(masks):
        tokens = max(min((i + 1) * size, last) - i * size, 0)
        shared = mask >> (LOCAL_SLOTS * 64)
        # (tier, nodes holding the chunk there), cheapest first, empty ones left out
        holders = []
        for t in order if shared else local_order:
            held = (
                (mask >> (t * 64)) & _FIELD
                if t < LOCAL_SLOTS
                else readers[t - LOCAL_SLOTS] * (shared >> stores[t - LOCAL_SLOTS] & 1)
            )
            if held:
                holders.append((t, held))
        grown: list[_Path] = []
        for path in paths:
            rest = path.mask
            for t, held in holders:
                part = rest & held
                if part:
                    rest ^= part
                    c = costs[t]
                    bit = 1 << t
                    setup = 0.0 if path.used & bit else setups[t]
                    grown.append(
                        _Path(
                            part,
                            path,
                            t,
                            path.load_s + tokens * c + setup,
                            c if c > path.cost_max else path.cost_max,
                            path.weighted + tokens * weights[t],
                            path.used | bit,
                        )
                    )
                    if not rest:
                        break
            if rest:  # these nodes' prefix ends here: the path is theirs now
                path.mask = rest
                ended.append(path)
        paths = grown
        if not paths:
            break
    ended += paths

    # Every candidate's plan without kvtier chunks (its own engine hit only), then
    # the candidates on a path: only they can do better.
    engines, default_engine = cost.engine_table()
    loads_all = cost.config.engine_loads_whole_prefix
    engine_fit = [engines.get(node, default_engine) for node in nodes]
    engine_of = [min(e, last) for e in engine_tokens]
    ttft = [
        q + f.seconds(prompt_tokens - e)
        for q, e, f in zip(queue_s, engine_of, engine_fit, strict=True)
    ]
    chunks = [0] * len(nodes)
    engine_weight = PREFIX_WEIGHTS["engine"]
    matched = [e * engine_weight for e in engine_of]
    node_paths: list[_Path | None] = [None] * len(nodes)
    position = {node: j for j, node in enumerate(nodes)}
    for done in ended:
        if not done.length:
            continue
        covered = min(done.length * size, last)
        bits = done.mask
        while bits:
            low = bits & -bits
            bits ^= low
            j = position[low.bit_length() - 1]
            node_paths[j] = done
            fit, engine = engine_fit[j], engine_of[j]
            if engine == 0 and (done.cost_max < fit.per_token_s or loads_all):  # load them all
                whole = queue_s[j] + fit.seconds(prompt_tokens - covered) + done.load_s
                if whole < ttft[j] or loads_all:
                    ttft[j], chunks[j] = whole, done.length
                matched[j] = done.weighted
            else:
                best, chunks[j], matched[j] = _exact(
                    done, tiers, weights, fit, prompt_tokens, engine, size, last, loads_all
                )
                ttft[j] = queue_s[j] + best
    return Candidates(
        list(nodes),
        prompt_tokens,
        chunk_size,
        list(queue_tokens),
        list(queue_s),
        list(requests),
        list(engine_tokens),
        ttft,
        chunks,
        matched,
        node_paths,
        tiers,
        work_weight,
    )


def _exact(
    path: _Path,
    tiers: list[Tier],
    weights: list[float],
    fit: Estimator,
    base: int,
    engine: int,
    size: int,
    last: int,
    loads_all: bool,
) -> tuple[float, int, float]:
    """The best number of chunks to load, chunk by chunk: with an engine hit
    of its own, or a tier dearer than recomputing on the path (``loads_all``:
    the whole path, as an engine that loads whatever it finds will)."""
    best, best_j = fit.seconds(base - engine), 0
    load = 0.0
    used = 0
    weighted = engine * PREFIX_WEIGHTS["engine"]
    for i, tier in enumerate(path.tiers()):
        tokens = _beyond(i, size, last, engine)
        if tokens and not used & (1 << tier):
            load += tiers[tier].setup
            used |= 1 << tier
        load += tokens * tiers[tier].cost
        weighted += tokens * weights[tier]
        covered = min(max(engine, (i + 1) * size), last)
        value = fit.seconds(base - covered) + load
        if value < best or loads_all:
            best, best_j = value, i + 1
    return best, best_j, weighted


Policy = Callable[[Candidates], int]  # -> index into candidates.nodes


def _least(values: Sequence[float], candidates: Candidates) -> int:
    """The index of the smallest value; ties: less in flight, then first."""
    low = min(values)
    tied = [j for j, v in enumerate(values) if v == low]
    return min(tied, key=lambda j: (candidates.queue_tokens[j], j))


def expected_cost(candidates: Candidates) -> int:
    """The least expected cost (TTFT + work_weight x service); costs within
    ``NEAR`` of it count as equal, and of those the engine with the fewest
    requests in flight wins (their decode steps slow a prefill down, and the
    estimates are noisy)."""
    w = candidates.work_weight
    cost = [t + w * (t - q) for t, q in zip(candidates.ttft, candidates.queue_s, strict=True)]
    limit = min(cost) * (1 + NEAR)
    near = [j for j, c in enumerate(cost) if c <= limit]
    return min(near, key=lambda j: (candidates.requests[j], cost[j], j))


def least_loaded(candidates: Candidates) -> int:
    return _least([float(q) for q in candidates.queue_tokens], candidates)


def longest_prefix(candidates: Candidates) -> int:
    prompt = max(candidates.prompt_tokens, 1)
    longest = max(max(candidates.queue_tokens), 1)
    scores = [
        -(3 * min(m / prompt, 1.0) + 2 * (1 - q / longest))
        for m, q in zip(candidates.matched, candidates.queue_tokens, strict=True)
    ]
    return _least(scores, candidates)


class RoundRobin:
    def __init__(self) -> None:
        self._next = itertools.count()

    def __call__(self, candidates: Candidates) -> int:
        return next(self._next) % len(candidates.nodes)


POLICIES: dict[str, Callable[[], Policy]] = {
    "kvtier": lambda: expected_cost,
    "longest_prefix": lambda: longest_prefix,
    "least_loaded": lambda: least_loaded,
    "round_robin": RoundRobin,
}


def make_policy(name: str) -> Policy:
    try:
        return POLICIES[name]()
    except KeyError:
        choices = sorted(POLICIES)
        raise ValueError(f"unknown routing policy {name!r}; choose one of {choices}") from None


__all__ = [
    "POLICIES",
    "Candidates",
    "Decision",
    "Policy",
    "Tier",
    "make_policy",
    "score",
]
