"""Hand-offs through the cache server (``kvtier.server.handoff.table``): a producer
offers committed chunks, one consumer takes them once and loads them with an
ordinary lookup, and the lease reclaims whatever a dead party leaves; every
scenario ends with nothing locked."""

from __future__ import annotations

import time
from collections.abc import Iterator

import numpy as np
import pytest

from kvtier.l1 import L1Config
from kvtier.protocol import messages as p
from kvtier.protocol.status import HandoffHolds
from kvtier.server.core import CacheServer
from kvtier.server.handoff.table import MAX_HELD, REMEMBERED
from kvtier.server.limits import ServerLimits
from kvtier.storage import StorageConfig, StorageManager
from tests.conftest import FakeClock
from tests.integration.harness import wait_for
from tests.ledger import assert_clean
from tests.servers import RedisProcess
from tests.unit.layout.test_repage import rank_pages
from tests.unit.server.test_core import OBJECT, answer, call, hashes, hello, store


@pytest.fixture
def server(storage: StorageManager, clock: FakeClock) -> CacheServer:
    limits = ServerLimits(session_ttl_s=100, client_ttl_s=1000)
    return CacheServer(storage, chunk_size=16, limits=limits, clock=clock)


def offer(
    server: CacheServer, hs: list[bytes], hid: str = "h1", lease_s: float = 30, consumer: str = ""
) -> p.Reply:
    return call(server, b"P", p.HandoffOffer(hid, hs, lease_s, consumer))


def take(
    server: CacheServer,
    peer: bytes,
    hs: list[bytes],
    hid: str = "h1",
    consumer: str = "",
    taker: str = "",
) -> str:
    reply = call(server, peer, p.HandoffTake(hid, hs, consumer, taker=taker))
    assert isinstance(reply, p.HandoffState), reply
    return reply.outcome


def done(
    server: CacheServer, peer: bytes, hid: str = "h1", consumer: str = "", taker: str = ""
) -> str:
    reply = call(server, peer, p.HandoffDone(hid, consumer, taker))
    assert isinstance(reply, p.HandoffState), reply
    return reply.outcome


@pytest.fixture
def parties(server: CacheServer) -> list[bytes]:
    """A producer P and two consumers D and E, all of one namespace; P stored 3 chunks."""
    for peer in (b"P", b"D", b"E"):
        assert isinstance(hello(server, peer), p.Welcome)
    return hashes(3)


def test_offer_take_load_done_releases_everything(
    server: CacheServer, storage: StorageManager, parties: list[bytes]
) -> None:
    hs = parties
    assert take(server, b"D", hs) == "pending"  # before the offer: ask again
    store(server, b"P", hs)
    assert offer(server, hs) == p.HandoffState("offered")
    assert storage.l1_status()["locked_objects"] == 3  # held for the consumer
    assert take(server, b"D", hs) == "granted"
    assert take(server, b"D", hs) == "granted"  # the same taker asking again (a lost reply)
    call(server, b"D", p.Lookup("r", hs))
    assert call(server, b"D", p.Query("r")) == p.QueryResult(3, {"L1": 3})
    assert isinstance(call(server, b"D", p.Retrieve("r", 0, 3)), p.Objects)
    call(server, b"D", p.EndSession("r"))
    assert done(server, b"D") == "released"
    assert take(server, b"D", hs) == "consumed"  # ended: its outcome is remembered
    assert server.status().handoffs == HandoffHolds(held=0, held_bytes=0, taken=0)
    counters = server.counters.snapshot()
    assert counters["handoffs.offered"] == counters["handoffs.consumed"] == 1
    assert_clean(storage)


def test_the_hold_keeps_the_chunks_in_l1_against_eviction(clock: FakeClock) -> None:
    small = StorageManager(StorageConfig(l1=L1Config(size_bytes=1 << 18, populate=False)))
    try:
        server = CacheServer(small, chunk_size=16, clock=clock)
        for peer in (b"P", b"D"):
            hello(server, peer)
        hs = hashes(2)
        store(server, b"P", hs)
        assert offer(server, hs) == p.HandoffState("offered")
        for seed in range(1, 5):  # 4 x 32 chunks (4 KiB slots) through a 256 KiB arena
            store(server, b"P", hashes(32, seed=seed))
        assert small.l1_status()["evictions"] > 0
        assert take(server, b"D", hs) == "granted"
        call(server, b"D", p.Lookup("r", hs))
        assert call(server, b"D", p.Query("r")).hit_chunks == 2
        call(server, b"D", p.EndSession("r"))
        assert done(server, b"D") == "released"
        assert_clean(small)
    finally:
        small.close()


def test_two_consumers_racing_one_wins_the_other_is_told(
    server: CacheServer, storage: StorageManager, parties: list[bytes]
) -> None:
    store(server, b"P", parties)
    offer(server, parties)
    assert take(server, b"D", parties) == "granted"
    assert take(server, b"E", parties) == "taken"
    assert done(server, b"E") == "wrong_consumer"  # not its hand-off to end
    assert done(server, b"D") == "released"
    assert take(server, b"E", parties) == "consumed"
    assert_clean(storage)


def test_a_take_that_names_its_token_is_its_takers_over_any_connection(
    server: CacheServer, storage: StorageManager, parties: list[bytes]
) -> None:
    """A consumer whose connection dropped with its take's answer asks again
    over a new one (here: another peer) with the same token: still its own."""
    store(server, b"P", parties)
    offer(server, parties)
    assert take(server, b"D", parties, taker="t1") == "granted"
    assert take(server, b"E", parties, taker="t1") == "granted"  # the same request, reconnected
    assert take(server, b"E", parties, taker="t2") == "taken"  # another request
    assert take(server, b"D", parties) == "taken"  # the connection alone is not the token's
    assert done(server, b"D", taker="t2") == "wrong_consumer"
    err = call(server, b"D", p.HandoffTake("h1", parties, taker="t" * 257))
    assert isinstance(err, p.Error) and "taker token" in err.message
    assert done(server, b"E", taker="t1") == "released"
    assert_clean(storage)


def test_an_expected_consumer_is_the_only_taker(
    server: CacheServer, storage: StorageManager, parties: list[bytes]
) -> None:
    store(server, b"P", parties)
    offer(server, parties, consumer="decode-0")
    assert take(server, b"D", parties, consumer="decode-1") == "wrong_consumer"
    assert take(server, b"D", parties) == "wrong_consumer"  # no name at all
    assert take(server, b"E", parties, consumer="decode-0") == "granted"
    assert done(server, b"E", consumer="decode-0") == "released"
    assert server.counters.snapshot()["handoffs.refused.wrong_consumer"] == 2
    assert_clean(storage)


def test_the_lease_reclaims_what_a_dead_consumer_leaves(
    server: CacheServer, storage: StorageManager, clock: FakeClock, parties: list[bytes]
) -> None:
    store(server, b"P", parties)
    offer(server, parties, lease_s=5)
    assert take(server, b"D", parties) == "granted"  # ... and the consumer dies here
    clock.advance(4)
    server.tick()
    assert server.status().handoffs.held == 1
    clock.advance(1)
    server.tick()
    assert server.status().handoffs.held == 0
    assert take(server, b"E", parties) == "expired"
    assert done(server, b"D") == "expired"
    assert server.counters.snapshot()["handoffs.expired"] == 1
    assert_clean(storage)
    # The chunks stay in L1 as ordinary cache entries, for later requests' prefixes.
    call(server, b"E", p.Lookup("later", parties))
    assert call(server, b"E", p.Query("later")).hit_chunks == 3
    call(server, b"E", p.EndSession("later"))


def test_an_offer_of_chunks_not_all_in_l1_holds_nothing_and_is_remembered(
    server: CacheServer, storage: StorageManager, parties: list[bytes]
) -> None:
    store(server, b"P", parties[:2])  # the last store did not land
    reply = offer(server, parties)
    assert reply == p.HandoffState("incomplete", "1 of 3 objects are not in L1")
    assert take(server, b"D", parties) == "incomplete"  # the consumer's wait ends at once
    assert_clean(storage)


def test_a_take_of_another_prompt_namespace_or_layout_is_refused(
    server: CacheServer, storage: StorageManager, parties: list[bytes]
) -> None:
    store(server, b"P", parties)
    offer(server, parties)
    assert take(server, b"D", hashes(3, seed=1)) == "prompt_mismatch"
    assert take(server, b"D", parties[:2]) == "prompt_mismatch"
    hello(server, b"T", salt="other")
    assert take(server, b"T", parties) == "namespace_mismatch"
    hello(server, b"W", ranks=2)  # another TP size
    assert take(server, b"W", parties) == "layout_mismatch"
    wide = p.LayoutSpec(0, num_layers=1, kv_heads=2, head_dim=8, dtype="float32")
    call(server, b"X", p.Hello(p.PROTOCOL_VERSION, "X", "org/m", [wide], 1, 16))
    assert take(server, b"X", parties) == "layout_mismatch"
    assert take(server, b"D", parties) == "granted"  # refusals took nothing
    assert done(server, b"D") == "released"
    assert_clean(storage)


def test_bad_offers_are_refused_with_the_field_to_change(
    server: CacheServer, parties: list[bytes]
) -> None:
    store(server, b"P", parties)
    for lease in (0, -1, float("nan"), 301):
        err = offer(server, parties, lease_s=lease)
        assert isinstance(err, p.Error) and "lease_s" in err.message
    err = offer(server, parties, hid="")
    assert isinstance(err, p.Error) and "id" in err.message
    assert offer(server, parties) == p.HandoffState("offered")
    err = offer(server, parties[:2])  # another offer under its id
    assert isinstance(err, p.Error) and "offered already" in err.message
    err = call(server, b"P", p.HandoffOffer("h2", [b"short"], 30))
    assert isinstance(err, p.Error) and "32" in err.message


def test_an_offer_sent_again_is_answered_with_its_state_and_held_once(
    server: CacheServer, storage: StorageManager, parties: list[bytes]
) -> None:
    """A producer's client sends an offer again when its connection dropped
    while the first was out: the server may see it twice."""
    store(server, b"P", parties)
    assert offer(server, parties) == p.HandoffState("offered")
    locked = storage.l1_status()["locked_objects"]
    assert offer(server, parties) == p.HandoffState("offered", "offered already")
    assert storage.l1_status()["locked_objects"] == locked  # not held twice
    assert take(server, b"D", parties) == "granted"
    assert done(server, b"D") == "released"
    assert offer(server, parties) == p.HandoffState("consumed", "it ended already")
    counters = server.counters.snapshot()
    assert counters["handoffs.offered"] == 1 and counters["handoffs.offered_again"] == 2
    assert_clean(storage)


def test_held_and_remembered_hand_offs_are_bounded(
    server: CacheServer, storage: StorageManager, parties: list[bytes]
) -> None:
    store(server, b"P", parties[:1])
    for i in range(MAX_HELD):
        assert offer(server, parties[:1], hid=f"h{i}") == p.HandoffState("offered")
    err = offer(server, parties[:1], hid="one-more")
    assert isinstance(err, p.Error) and err.code == "busy"
    server.close()  # a stopping server drops every hold
    assert_clean(storage)
    assert len(server.handoffs._ended) == min(MAX_HELD, REMEMBERED)


def test_a_draining_server_takes_no_offers(storage: StorageManager, clock: FakeClock) -> None:
    server = CacheServer(storage, chunk_size=16, clock=clock)
    hello(server, b"P")
    hs = hashes(1)
    store(server, b"P", hs)
    server.draining = True
    err = offer(server, hs)
    assert isinstance(err, p.Error) and err.code == "draining"
    assert_clean(storage)


# A model of 4 KV heads, head dim 8, one layer: TP 1, 2 and 4 hold 4, 2 and 1 heads a rank.
HEADS, DIM, TOKENS = 4, 8, 16


def hello_tp(server: CacheServer, peer: bytes, tp: int, fmt: str = "", **kw: object) -> None:
    spec = p.LayoutSpec(0, num_layers=1, kv_heads=HEADS // tp, head_dim=DIM, dtype="float32")
    spec.format = fmt
    msg = p.Hello(p.PROTOCOL_VERSION, peer.decode(), "org/m", [spec], tp, 16, **kw)  # type: ignore[arg-type]
    assert isinstance(call(server, peer, msg), p.Welcome)


def rank_objects(kv: np.ndarray, tp: int) -> list[bytes]:
    """What TP ``tp`` stores for one chunk ``kv`` ([1, K/V, heads, tokens, dim])."""
    share = HEADS // tp
    return [kv[:, :, r * share : (r + 1) * share].tobytes() for r in range(tp)]


def chunk_kv(n: int) -> list[np.ndarray]:
    rng = np.random.default_rng(7)
    return [rng.standard_normal((1, 2, HEADS, TOKENS, DIM), np.float32) for _ in range(n)]


def take_tp(
    server: CacheServer, peer: bytes, hs: list[bytes], source: list[bytes], kv_heads: int = HEADS
) -> p.Reply:
    return call(server, peer, p.HandoffTake("h1", hs, source_hashes=source, kv_heads=kv_heads))


@pytest.mark.parametrize(("producer_tp", "consumer_tp"), [(1, 2), (2, 1), (1, 4), (4, 2)])
def test_a_consumer_of_another_tp_size_loads_its_own_rank_split(
    server: CacheServer, storage: StorageManager, producer_tp: int, consumer_tp: int
) -> None:
    hello_tp(server, b"P", producer_tp)
    hello_tp(server, b"D", consumer_tp, shm=False)  # objects come back as frames
    source, own = hashes(3), hashes(3, seed=1)  # one prompt under each side's namespace
    kv = chunk_kv(3)
    frames = [o for chunk in kv for o in rank_objects(chunk, producer_tp)]
    assert call(server, b"P", p.Store("w", source), frames) == p.Committed(3 * producer_tp)
    assert call(server, b"P", p.HandoffOffer("h1", source, 30, kv_heads=HEADS)) == (
        p.HandoffState("offered")
    )
    assert take_tp(server, b"D", own, source) == p.HandoffState("granted")
    assert take_tp(server, b"D", own, source) == p.HandoffState("granted")  # asked again
    held = server.status().handoffs
    chunk_bytes = 2 * HEADS * TOKENS * DIM * 4  # K and V of every head, fp32
    assert held.held_bytes == 2 * 3 * chunk_bytes  # both splits of 3 chunks
    call(server, b"D", p.Lookup("r", own))
    assert call(server, b"D", p.Query("r")).hit_chunks == 3  # type: ignore[union-attr]
    objects, got = answer(server, b"D", p.Retrieve("r", 0, 3))
    assert isinstance(objects, p.Objects)
    want = [o for chunk in kv for o in rank_objects(chunk, consumer_tp)]
    assert [bytes(g) for g in got] == want  # byte for byte what the consumer's ranks store
    call(server, b"D", p.EndSession("r"))
    assert done(server, b"D") == "released"
    assert server.counters.snapshot()["handoffs.resharded"] == 1
    assert_clean(storage)


@pytest.mark.parametrize(("producer", "consumer"), [((1, 8), (2, 16)), ((2, 16), (2, 8))])
def test_a_consumer_of_another_block_size_loads_its_own_pages(
    server: CacheServer,
    storage: StorageManager,
    producer: tuple[int, int],
    consumer: tuple[int, int],
) -> None:
    """vLLM CPU pages of another block size (and TP size) are re-paged."""
    (producer_tp, producer_block), (consumer_tp, consumer_block) = producer, consumer
    hello_tp(server, b"P", producer_tp, fmt=f"vllm-cpu-vec-bs{producer_block}")
    hello_tp(server, b"D", consumer_tp, fmt=f"vllm-cpu-vec-bs{consumer_block}", shm=False)
    source, own = hashes(2), hashes(2, seed=1)
    kv = chunk_kv(2)
    frames = [o for chunk in kv for o in rank_pages(chunk, producer_tp, producer_block)]
    call(server, b"P", p.Store("w", source), frames)
    call(server, b"P", p.HandoffOffer("h1", source, 30, kv_heads=HEADS))
    assert take_tp(server, b"D", own, source) == p.HandoffState("granted")
    call(server, b"D", p.Lookup("r", own))
    assert call(server, b"D", p.Query("r")).hit_chunks == 2  # type: ignore[union-attr]
    _, got = answer(server, b"D", p.Retrieve("r", 0, 2))
    want = [o for chunk in kv for o in rank_pages(chunk, consumer_tp, consumer_block)]
    assert [bytes(g) for g in got] == want
    call(server, b"D", p.EndSession("r"))
    assert done(server, b"D") == "released"
    assert_clean(storage)


def test_what_cannot_be_resharded_is_refused_naming_why(
    server: CacheServer, storage: StorageManager
) -> None:
    hello_tp(server, b"P", 1)
    source = hashes(2)
    frames = [o for chunk in chunk_kv(2) for o in rank_objects(chunk, 1)]
    call(server, b"P", p.Store("w", source), frames)
    call(server, b"P", p.HandoffOffer("h1", source, 30, kv_heads=HEADS))
    hello_tp(server, b"D", 2)
    own = hashes(2, seed=1)
    refused = take_tp(server, b"D", own, [])  # no source hashes: nothing to convert by
    assert refused == p.HandoffState("layout_mismatch", refused.message)  # type: ignore[union-attr]
    assert "cannot be loaded as it is" in refused.message  # type: ignore[union-attr]
    assert take_tp(server, b"D", own, source, kv_heads=8).outcome == "layout_mismatch"  # type: ignore[union-attr]
    assert take_tp(server, b"D", own, hashes(2, seed=2)).outcome == "prompt_mismatch"  # type: ignore[union-attr]
    assert take_tp(server, b"D", own[:1], source).outcome == "prompt_mismatch"  # type: ignore[union-attr]
    hello_tp(server, b"R", 2, rank=0)  # a worker's client: one rank
    assert "one rank only" in take_tp(server, b"R", own, source).message  # type: ignore[union-attr]
    hello_tp(server, b"F", 2, fmt="vllm-cuda-NHD-bs16")  # pages not cut by heads
    reply = take_tp(server, b"F", own, source)
    assert reply.outcome == "layout_mismatch"  # type: ignore[union-attr]
    assert "page formats differ ('canonical' vs 'vllm-cuda-NHD-bs16')" in reply.message  # type: ignore[union-attr]
    assert server.status().handoffs.taken == 0  # refusals took nothing
    assert take_tp(server, b"D", own, source) == p.HandoffState("granted")
    assert done(server, b"D") == "released"
    assert_clean(storage)


def test_a_hand_off_that_ends_while_it_is_resharded_grants_nothing(
    server: CacheServer, storage: StorageManager, clock: FakeClock
) -> None:
    hello_tp(server, b"P", 1)
    hello_tp(server, b"D", 2)
    source, own = hashes(2), hashes(2, seed=1)
    call(server, b"P", p.Store("w", source), [o for c in chunk_kv(2) for o in rank_objects(c, 1)])
    call(server, b"P", p.HandoffOffer("h1", source, 5, kv_heads=HEADS))
    deferred = server.handle(
        b"D", p.HandoffTake("h1", own, source_hashes=source, kv_heads=HEADS), []
    )
    assert not isinstance(deferred, tuple)  # the re-sharding runs off the loop
    clock.advance(6)
    server.tick()  # the lease ends first
    reply, _ = deferred.finish(deferred.work())
    assert reply == p.HandoffState("expired", "it ended while its objects were re-sharded")
    assert_clean(storage)


@pytest.fixture
def two_nodes(
    redis_server: RedisProcess, clock: FakeClock
) -> Iterator[tuple[CacheServer, CacheServer]]:
    """Two cache servers (two nodes) sharing one real Redis as their L2."""
    shared = ({"type": "redis", "url": redis_server.url, "name": "shared"},)
    storages = [
        StorageManager(StorageConfig(l1=L1Config(size_bytes=1 << 20, populate=False), l2=shared))
        for _ in range(2)
    ]
    limits = ServerLimits(session_ttl_s=100, client_ttl_s=1000)
    a, b = (CacheServer(s, chunk_size=16, limits=limits, clock=clock) for s in storages)
    yield a, b
    for storage in storages:
        storage.close()


def find(server: CacheServer, peer: bytes, hs: list[bytes], hid: str = "h1") -> p.Reply:
    """Take with ``find``: answered once its lookup in the server's tiers settles."""
    return call(server, peer, p.HandoffTake(hid, hs, find=True))


def test_a_hand_off_offered_on_another_node_is_found_through_the_shared_l2(
    two_nodes: tuple[CacheServer, CacheServer],
) -> None:
    a, b = two_nodes
    hello(a, b"P")
    hello(b, b"D", shm=False)
    hello(b, b"E")
    hs = hashes(3, seed=time.monotonic_ns() % 2**32)  # new to the session's Redis
    assert find(b, b"D", hs) == p.HandoffState(
        "pending", "0 of 3 chunks are in this server's tiers so far"
    )  # the producer has not stored yet
    store(a, b"P", hs)
    assert offer(a, hs) == p.HandoffState("offered")
    assert take(b, b"D", hs) == "pending"  # without find: this server never heard of it
    assert a.storage.flush(timeout=10)  # written back to the shared L2
    assert find(b, b"D", hs) == p.HandoffState("granted")
    assert find(b, b"E", hs) == p.HandoffState("taken", "another consumer took it")
    call(b, b"D", p.Lookup("r", hs))
    assert call(b, b"D", p.Query("r")) == p.QueryResult(3, {"L1": 3})  # held in B's L1
    objects, frames = answer(b, b"D", p.Retrieve("r", 0, 3))
    assert isinstance(objects, p.Objects)
    assert [bytes(f) for f in frames] == [np.full(OBJECT, i, np.uint8).tobytes() for i in range(3)]
    call(b, b"D", p.EndSession("r"))
    assert done(b, b"D") == "released"
    assert find(b, b"D", hs) == p.HandoffState("consumed")
    assert b.counters.snapshot()["handoffs.found"] == 1
    assert_clean(b.storage)
    a.close()  # the producer's own hold ends with its lease (here: its server stops)
    assert_clean(a.storage)


def test_found_hand_offs_are_not_resharded_and_their_lease_reclaims_them(
    two_nodes: tuple[CacheServer, CacheServer], clock: FakeClock
) -> None:
    a, b = two_nodes
    hello(a, b"P")
    hello(b, b"D")
    hs = hashes(2, seed=time.monotonic_ns() % 2**32)
    store(a, b"P", hs)
    assert a.storage.flush(timeout=10)
    reply = call(b, b"D", p.HandoffTake("h1", hs, source_hashes=hashes(2, seed=1), find=True))
    assert isinstance(reply, p.HandoffState) and reply.outcome == "layout_mismatch"
    assert "same TP size" in reply.message
    assert find(b, b"D", hs) == p.HandoffState("granted")  # the consumer dies here
    clock.advance(b.handoffs.max_lease_s)
    b.tick()
    assert find(b, b"D", hs) == p.HandoffState("expired")
    assert_clean(b.storage)
    # A lookup whose consumer stops asking is abandoned after the lease, its locks released.
    other = hashes(2, seed=time.monotonic_ns() % 2**32)
    store(a, b"P", other)
    assert a.storage.flush(timeout=10)
    b.handle(b"D", p.HandoffTake("h2", other, find=True), [])  # ... and the consumer is gone
    locked = wait_for(lambda: b.storage.l1_status()["locked_objects"], lambda n: n == 2)
    assert locked == 2  # the lookup came back, holding both objects, and nobody asks
    clock.advance(b.handoffs.max_lease_s)
    b.tick()
    assert_clean(b.storage)
