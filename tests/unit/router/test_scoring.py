"""The router's indexes and scoring, against a plain reference written per node."""

from __future__ import annotations

import math

import numpy as np
import pytest

from kvtier.events.wire import AllBlocksCleared, BlockRemoved, BlockStored, DecodedBatch
from kvtier.router.blocks import BlockIndex, block_keys
from kvtier.router.chunks import ChunkIndex
from kvtier.router.core import Node, NoEngine, Routed, Router
from kvtier.router.cost import ENGINE, CostConfig, CostModel
from kvtier.router.load import RHO_MAX, ClusterLoad
from kvtier.router.scoring import NEAR, make_policy

NAMESPACE = {
    "model": "m",
    "revision": "r",
    "lora": "",
    "kv_dtype": "float16",
    "layout": "l",
    "chunk_size": 16,
}
TIERS = (("L1", "LOCAL"), ("fs", "LOCAL"), ("redis", "SHARED"))


def batch(*events: object) -> DecodedBatch:
    return DecodedBatch(0.0, list(events), None, 0)  # type: ignore[arg-type]


def stored(hashes: list[bytes], tier: str, locality: str = "LOCAL") -> BlockStored:
    return BlockStored(list(hashes), ownership=f"kvtier:{tier}", locality=locality)


def removed(hashes: list[bytes], tier: str, locality: str = "LOCAL") -> BlockRemoved:
    return BlockRemoved(list(hashes), ownership=f"kvtier:{tier}", locality=locality)


NOW = 100.0  # the routers' clock in these tests: it stands still


def router(n: int, policy: str = "kvtier", cost: CostModel | None = None) -> Router:
    nodes = [Node(i, f"n{i}", f"http://e{i}") for i in range(n)]
    r = Router(nodes, policy, cost, chunks=ChunkIndex(clock=lambda: NOW), clock=lambda: NOW)
    r.set_namespace(NAMESPACE)
    return r


# ------------------------------------------------------------------ index


def test_removals_and_restarts_take_claims_away() -> None:
    index = ChunkIndex()
    a, b = b"a" * 32, b"b" * 32
    index.apply(0, batch(stored([a, b], "L1"), stored([a], "redis", "SHARED")))
    index.apply(1, batch(stored([a], "fs")))
    assert index.holds(0, a, "L1") and index.holds(1, a, "fs") and index.holds(0, a, "redis")
    assert not index.holds(1, a, "redis")  # node 1 never said it reads that store
    index.apply(0, batch(removed([a], "L1")))
    assert not index.holds(0, a, "L1") and index.holds(0, b, "L1")
    index.apply(0, batch(AllBlocksCleared()))  # node 0 restarted
    assert not index.holds(0, b, "L1") and index.holds(1, a, "fs")
    assert index.holds(0, a, "redis")  # a shared store outlives one node's restart
    index.apply(0, batch(removed([a], "redis", "SHARED")))
    assert not index.holds(0, a, "redis")


def test_events_it_cannot_place_are_counted() -> None:
    index = ChunkIndex()
    index.apply(0, batch(BlockStored([b"x" * 32], medium="GPU")))  # no kvtier ownership
    assert index.malformed == 1 and len(index) == 0
    with pytest.raises(ValueError, match="outside"):
        index.apply(64, batch())


def test_routed_chunks_are_credited_until_announced_or_expired() -> None:
    """A routed chunk counts as the node's L1 for ``pending_ttl_s``, or
    until the node's own events speak for it; a silent node's credits last
    ``approx_ttl_s``."""
    now = [0.0]
    index = ChunkIndex(approx_ttl_s=10, pending_ttl_s=2, clock=lambda: now[0])
    a, b = b"a" * 32, b"b" * 32
    index.note_routed(3, [a, b])
    assert index.view([a, b]) == [1 << 3, 1 << 3]
    index.apply(3, batch(removed([b], "L1")))  # the node spoke for b: gone from its L1
    assert index.view([b]) == []
    now[0] = 2.5
    assert index.view([a]) == []
    assert index.expire() == 1
    index.approximate.add(3)
    index.note_routed(3, [a])
    now[0] = 11.0
    assert index.view([a]) == [1 << 3]
    now[0] = 12.6
    assert index.view([a]) == []
    assert ChunkIndex(pending_ttl_s=0).view([a]) == []


def test_engine_blocks_follow_vllm_events_with_the_salt() -> None:
    blocks = BlockIndex()
    tokens = np.arange(64, dtype=np.uint32)
    event = BlockStored(
        [101, 102], None, tokens[:32].tolist(), 16, None, "GPU", None, extra_keys=[["s"], None]
    )
    blocks.apply(2, batch(event))
    child = BlockStored([103], 102, tokens[32:48].tolist(), 16, None, "GPU", None)
    blocks.apply(2, batch(child))
    assert blocks.prefix_tokens(tokens, "s") == {2: 48}
    assert blocks.prefix_tokens(tokens, "other") == {}  # another tenant's salt: no hit
    blocks.apply(2, batch(BlockRemoved([102], "GPU")))
    assert blocks.prefix_tokens(tokens, "s") == {2: 16}
    orphan = BlockStored([200], 999, tokens[:16].tolist(), 16, None, "GPU", None)
    blocks.apply(1, batch(orphan))  # a parent never seen: skipped, not guessed
    assert blocks.skipped == 1
    keys = block_keys(tokens, 16, "s")
    assert len(keys) == 4 and len(set(keys)) == 4


# ---------------------------------------------------------------- scoring


def reference(r: Router, tokens: np.ndarray, salt: str) -> list[tuple[float, int]]:
    """Per node, the plan written out plainly: (expected TTFT, chunks loaded)."""
    hashes, size = r.chunk_hashes(tokens, salt)
    engine = r.blocks.prefix_tokens(tokens, salt)
    prompt, last = len(tokens), len(tokens) - 1
    out = []
    for node in r.nodes:
        fit = r.cost.engine(node.index)
        e = min(engine.get(node.index, 0), last)
        base = prompt
        best, best_j, load, used = fit.seconds(base - e), 0, 0.0, set()
        for i, chunk in enumerate(hashes):
            held = [t for t, _ in TIERS if r.chunks.holds(node.index, chunk, t)]
            if not held:
                break
            tier = min(held, key=r.cost.tier_cost)
            tokens = max(0, min((i + 1) * size, last) - max(i * size, e))
            if tokens and tier not in used:
                load += r.cost.tier_setup(tier)
                used.add(tier)
            load += tokens * r.cost.tier_cost(tier)
            value = fit.seconds(base - min(max(e, (i + 1) * size), last)) + load
            if value < best or r.cost.config.engine_loads_whole_prefix:
                best, best_j = value, i + 1
        out.append((node.queue.wait_s(NOW) + best, best_j))
    return out


@pytest.mark.parametrize("loads_all", [True, False])
@pytest.mark.parametrize("seed", range(30))
def test_the_plan_matches_the_reference(seed: int, loads_all: bool) -> None:
    rng = np.random.default_rng(seed)
    n = int(rng.integers(1, 9))
    tiers = {"L1": 2e-5, "fs": float(rng.choice([5e-5, 3e-3])), "redis": 1e-4}  # fs may lose
    config = CostConfig(
        prefill_s_per_token=1e-3,
        prefill_fixed_s=float(rng.choice([0.0, 0.02])),
        step_tokens=int(rng.choice([32, 8192])),  # a prompt of several steps, or one
        tier_s_per_token=tiers,
        engine_loads_whole_prefix=loads_all,
    )
    r = router(n, cost=CostModel(config))
    for tier in tiers:  # a set-up per tier, as learned
        r.cost.tier(tier).fixed_s = float(rng.choice([0.0, 0.01]))  # type: ignore[union-attr]
    tokens = rng.integers(0, 1000, int(rng.integers(16, 200)), dtype=np.uint32)
    hashes, _ = r.chunk_hashes(tokens, "t")
    for node in range(n):
        r.nodes[node].queue.tokens = int(rng.integers(0, 300))
        r.nodes[node].queue.drain_at = NOW + float(rng.uniform(-0.3, 0.3))
        r.nodes[node].inflight_requests = int(rng.integers(0, 4))
        for tier, locality in TIERS:
            if rng.random() < 0.5 and hashes:
                held = hashes[: int(rng.integers(0, len(hashes) + 1))]
                r.chunks.apply(node, batch(stored(held, tier, locality)))
        if rng.random() < 0.3:
            blocks = int(rng.integers(1, len(tokens) // 16 + 1))
            keys = list(range(1000 * node, 1000 * node + blocks))
            event = BlockStored(
                keys,
                None,
                tokens[: blocks * 16].tolist(),
                16,
                None,
                "GPU",
                None,
                extra_keys=[["t"]] + [None] * (blocks - 1),
            )
            r.blocks.apply(node, batch(event))
    want = reference(r, tokens, "t")
    routed = r.route(tokens, "t")
    chosen = routed.decision.node
    assert math.isclose(routed.decision.expected_ttft_s, want[chosen][0], rel_tol=1e-9)
    assert routed.decision.load_chunks == want[chosen][1]
    best = min(w[0] for w in want)
    near = [n for n, w in enumerate(want) if w[0] <= best * (1 + NEAR)]
    fewest = min(r.nodes[n].inflight_requests for n in near)
    assert chosen in near and r.nodes[chosen].inflight_requests == fewest
    loaded = routed.decision.loaded
    assert sum(loaded.values()) + routed.decision.prefill_tokens == len(tokens)
    assert routed.decision.prefill_tokens >= 1  # the last token is always computed


def test_loading_counts_only_where_it_beats_recomputing() -> None:
    slow_disk = CostConfig(
        prefill_s_per_token=1e-3, tier_s_per_token={"fs": 5e-3}, engine_loads_whole_prefix=False
    )
    r = router(2, cost=CostModel(slow_disk))
    tokens = np.arange(160, dtype=np.uint32)
    hashes, _ = r.chunk_hashes(tokens, "t")
    r.chunks.apply(1, batch(stored(hashes, "fs")))
    decision = r.route(tokens, "t").decision
    assert decision.load_chunks == 0 and decision.loaded == {}  # recomputing is cheaper
    r.chunks.apply(1, batch(stored(hashes[:4], "L1")))
    decision = r.route(tokens, "t").decision
    assert (decision.node, decision.load_chunks, decision.loaded) == (1, 4, {"L1": 64})


def test_an_engine_that_loads_whatever_it_finds_is_priced_so() -> None:
    slow_disk = CostConfig(prefill_s_per_token=1e-3, tier_s_per_token={"fs": 5e-3})
    r = router(2, cost=CostModel(slow_disk))
    tokens = np.arange(160, dtype=np.uint32)
    hashes, _ = r.chunk_hashes(tokens, "t")
    r.chunks.apply(1, batch(stored(hashes, "fs")))
    decision = r.route(tokens, "t").decision
    assert decision.node == 0  # node 1 would load the slow copy: node 0 recomputes sooner
    assert decision.loaded == {}


def test_the_queue_outweighs_a_small_hit() -> None:
    r = router(2)
    tokens = np.arange(320, dtype=np.uint32)
    hashes, _ = r.chunk_hashes(tokens, "t")
    r.chunks.apply(0, batch(stored(hashes[:2], "L1")))
    assert r.route(tokens, "t").decision.node == 0
    r.nodes[0].queue.drain_at = NOW + 1.0  # a second of work ahead
    assert r.route(tokens, "t").decision.node == 1


def test_a_busy_cluster_keeps_a_prefix_home_until_its_queue_outweighs_the_work() -> None:
    """Node 0 holds the prompt in L1 but has a second of work ahead; idle
    node 1 would recompute it in 0.32 s. Idle cluster: the least expected
    TTFT, node 1. At a measured utilisation of 0.9 every second of work
    costs 9 more of later requests' waiting: node 0's 7 ms plan beats node
    1's 320 ms, and only a longer queue (5 s) sends the request away."""
    r = router(2)
    tokens = np.arange(320, dtype=np.uint32)
    hashes, _ = r.chunk_hashes(tokens, "t")
    r.chunks.apply(0, batch(stored(hashes, "L1")))
    r.nodes[0].queue.drain_at = NOW + 1.0
    assert r.route(tokens, "t").decision.node == 1
    r.load.dispatch(NOW, 0.9 * 2 * r.load.window_s)  # 0.9 of two engines' time
    assert r.load.utilisation(NOW, 2) == pytest.approx(0.9)
    assert r.load.work_weight(NOW, 2) == pytest.approx(9.0)
    assert r.route(tokens, "t").decision.node == 0
    r.nodes[0].queue.drain_at = NOW + 5.0
    assert r.route(tokens, "t").decision.node == 1
    assert r.status()["utilisation"] == pytest.approx(0.9)


def test_the_measured_load_follows_the_work_routed() -> None:
    """A steady 1.5 s of work a second over 2 engines reads 0.75; it decays
    once the work stops; the price of work is capped at RHO_MAX."""
    load = ClusterLoad(window_s=10.0)
    for step in range(2000):
        load.dispatch(step * 0.1, 0.15)
    assert load.utilisation(199.9, 2) == pytest.approx(0.75, rel=0.02)
    assert load.utilisation(199.9 + 10.0, 2) == pytest.approx(0.75 / math.e, rel=0.02)
    load.dispatch(300.0, 1e6)
    assert load.work_weight(300.0, 2) == pytest.approx(RHO_MAX / (1 - RHO_MAX))


def test_a_request_teaches_its_own_service_never_its_wait() -> None:
    """Two 320-token prompts go to one engine at once. The first's first
    token comes after 0.64 s, the second's 0.64 s later: each was first in
    line when it came, so each teaches 0.64 s for 320 tokens (2 ms a token),
    the second's wait behind the first left out (a prompt of whole engine
    steps: one shorter than a step may share its step with the next). A request whose first token
    comes while an earlier one is still in line (out of order: its time
    overlapped another's) teaches nothing."""
    clock = [NOW]
    nodes = [Node(0, "n0", "http://e0")]
    cost = CostModel(CostConfig(prefill_s_per_token=1e-3, step_tokens=64))  # 5 steps a prompt
    r = Router(
        nodes, "round_robin", cost, chunks=ChunkIndex(clock=lambda: NOW), clock=lambda: clock[0]
    )
    r.set_namespace(NAMESPACE)

    def sent(i: int) -> Routed:
        routed = r.route(np.arange(320, dtype=np.uint32) + 1000 * i, "t")
        r.dispatched(routed)
        return routed

    first, second = sent(0), sent(1)
    for routed in (first, second):
        clock[0] += 0.64
        r.first_token(routed, clock[0] - NOW)
        assert cost.engine(0).per_token_s == pytest.approx(0.64 / 320)
    assert cost.samples == 2
    _third, fourth = sent(2), sent(3)
    clock[0] += 5.0
    r.first_token(fourth, 5.0)  # third is still ahead of it
    assert cost.samples == 2 and cost.engine(0).per_token_s == pytest.approx(0.64 / 320)


def test_a_request_planned_to_load_teaches_only_when_alone() -> None:
    """A request that shared its engine and was planned to load from its
    engine's prefix cache: the router's view of that cache lags, so its
    computed tokens are not known, and it teaches its engine's fit nothing."""
    clock = [NOW]
    nodes = [Node(0, "n0", "http://e0")]
    cost = CostModel(CostConfig(prefill_s_per_token=1e-3))
    r = Router(
        nodes, "round_robin", cost, chunks=ChunkIndex(clock=lambda: NOW), clock=lambda: clock[0]
    )
    r.set_namespace(NAMESPACE)
    tokens = np.arange(320, dtype=np.uint32)
    event = BlockStored([1], None, tokens[:16].tolist(), 16, None, "GPU", None, extra_keys=[["t"]])
    r.blocks.apply(0, batch(event))
    hit, other = r.route(tokens, "t"), r.route(tokens + 5000, "t")
    assert hit.decision.loaded == {"engine": 16}
    r.dispatched(hit)
    r.dispatched(other)  # sent before hit's first token: hit is not alone
    clock[0] += 0.64
    r.first_token(hit, 0.64)
    assert cost.status()["engines"] == {}  # no fit of its own (a slowness sample at most)


def test_tenants_do_not_see_each_others_chunks() -> None:
    r = router(2)
    tokens = np.arange(320, dtype=np.uint32)
    hashes, _ = r.chunk_hashes(tokens, "alice")
    r.chunks.apply(1, batch(stored(hashes, "L1")))
    assert r.route(tokens, "alice").decision.node == 1
    other = r.route(tokens, "bob").decision
    assert other.node == 0 and other.loaded == {}


def test_engine_hit_then_chunks_from_the_cache_server() -> None:
    r = router(2)
    tokens = np.arange(320, dtype=np.uint32)
    hashes, _ = r.chunk_hashes(tokens, "t")
    event = BlockStored(
        [1, 2, 3], None, tokens[:48].tolist(), 16, None, "GPU", None, extra_keys=[["t"], None, None]
    )
    r.blocks.apply(0, batch(event))
    r.chunks.apply(0, batch(stored(hashes[:10], "L1")))
    decision = r.route(tokens, "t").decision
    assert decision.node == 0
    assert decision.loaded == {ENGINE: 48, "L1": 160 - 48}
    assert decision.prefill_tokens == 160


def test_baseline_policies() -> None:
    tokens = np.arange(64, dtype=np.uint32)
    rr = router(3, "round_robin")
    assert [rr.route(tokens, "t").decision.node for _ in range(4)] == [0, 1, 2, 0]
    ll = router(3, "least_loaded")
    ll.nodes[0].queue.tokens, ll.nodes[1].queue.tokens = 5, 0
    ll.nodes[2].queue.tokens = 9
    assert ll.route(tokens, "t").decision.node == 1
    lp = router(2, "longest_prefix")
    hashes, _ = lp.chunk_hashes(tokens, "t")
    lp.chunks.apply(1, batch(stored(hashes, "redis", "SHARED")))
    assert lp.route(tokens, "t").decision.node == 1
    with pytest.raises(ValueError, match="choose one of"):
        make_policy("random")


def test_failed_engines_are_skipped_until_their_time_is_up() -> None:
    now = [0.0]
    r = Router([Node(0, "a", "u"), Node(1, "b", "v")], clock=lambda: now[0], down_s=5)
    r.set_namespace(NAMESPACE)
    tokens = np.arange(32, dtype=np.uint32)
    r.failed(0, "timeout")
    assert r.route(tokens, "t").decision.node == 1
    with pytest.raises(NoEngine):
        r.route(tokens, "t", exclude=[1])
    now[0] = 6.0
    assert r.route(tokens, "t", exclude=[1]).decision.node == 0
    assert r.status()["nodes"][0]["failures"] == {"timeout": 1}  # type: ignore[index]


def test_near_ties_go_to_the_engine_with_fewer_requests_in_flight() -> None:
    r = router(2)
    tokens = np.arange(320, dtype=np.uint32)
    r.nodes[0].inflight_requests = 2  # decoding: no prefill queue, but busy
    assert r.route(tokens, "t").decision.node == 1
    hashes, _ = r.chunk_hashes(tokens, "t")
    r.chunks.apply(0, batch(stored(hashes, "L1")))  # a real advantage beats the tie-break
    assert r.route(tokens, "t").decision.node == 0
