"""CacheServer operations in process: sessions, locks released exactly once,
reservations, time-to-live, errors for bad requests."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest

from kvtier.keys import Namespace, TokenHasher
from kvtier.l1 import L1Config, L1Result
from kvtier.server import protocol as p
from kvtier.server.core import CacheServer, ServerLimits
from kvtier.storage import StorageConfig, StorageManager
from tests.conftest import FakeClock
from tests.ledger import assert_clean

LAYOUT = p.LayoutSpec(0, num_layers=1, kv_heads=1, head_dim=8, dtype="float32")
OBJECT = 2 * 8 * 4 * 16  # K+V, head_dim 8, fp32, 16 tokens per chunk


@pytest.fixture
def storage() -> Iterator[StorageManager]:
    manager = StorageManager(StorageConfig(l1=L1Config(size_bytes=1 << 20, populate=False)))
    yield manager
    manager.close()


@pytest.fixture
def server(storage: StorageManager, clock: FakeClock) -> CacheServer:
    limits = ServerLimits(session_ttl_s=10, client_ttl_s=30)
    return CacheServer(storage, chunk_size=16, limits=limits, clock=clock)


def hello(server: CacheServer, peer: bytes = b"A", ranks: int = 1, **kw: object) -> p.Reply:
    msg = p.Hello(p.PROTOCOL_VERSION, peer.decode(), "org/m", [LAYOUT], ranks, 16, **kw)  # type: ignore[arg-type]
    return call(server, peer, msg)


def call(
    server: CacheServer, peer: bytes, msg: p.Message, frames: list[bytes] | None = None
) -> p.Reply:
    reply, _ = server.handle(peer, msg, frames or [])  # type: ignore[arg-type]
    return reply


def hashes(n: int, seed: int = 0) -> list[bytes]:
    tokens = np.random.default_rng(seed).integers(0, 50000, 16 * n, dtype=np.uint32)
    return TokenHasher(Namespace("org/m"), 16).chunk_hashes(tokens)


def store(server: CacheServer, peer: bytes, hs: list[bytes], ranks: int = 1) -> int:
    frames = [np.full(OBJECT, i % 251, np.uint8).tobytes() for i in range(len(hs) * ranks)]
    reply = call(server, peer, p.Store("w", hs), frames)
    assert isinstance(reply, p.Committed)
    return reply.stored


def test_lookup_query_retrieve_release(server: CacheServer, storage: StorageManager) -> None:
    assert isinstance(hello(server), p.Welcome)
    hs = hashes(4)
    assert store(server, b"A", hs) == 4
    assert isinstance(call(server, b"A", p.Lookup("r", hs)), p.Ack)
    assert call(server, b"A", p.Query("r")) == p.QueryResult(4, {"L1": 4})
    assert isinstance(call(server, b"A", p.Query("r")), p.Error)  # consumed once
    objects = call(server, b"A", p.Retrieve("r", 0, 4))
    assert isinstance(objects, p.Objects) and objects.sizes == [OBJECT] * 4
    assert storage.status()["held_lookup_locks"] == 4
    assert call(server, b"A", p.Release("r", 0, 2)) == p.Ack()
    assert call(server, b"A", p.Release("r", 0, 2)) == p.Ack()  # already released: no-op
    assert storage.status()["held_lookup_locks"] == 2
    err = call(server, b"A", p.Retrieve("r", 1, 3))
    assert isinstance(err, p.Error) and err.code == "released"
    assert call(server, b"A", p.EndSession("r")) == p.Ack()  # releases chunks 2 and 3
    assert storage.status()["held_lookup_locks"] == 0
    assert_clean(storage.l1)


def test_ranks_count_only_chunks_every_rank_has(
    server: CacheServer, storage: StorageManager
) -> None:
    hello(server, ranks=2)
    hs = hashes(3)
    store(server, b"A", hs, ranks=2)
    rank1_chunk1 = [k for k in storage.l1._resident if k.chunk_hash == hs[1] and k.kv_rank == 1]
    assert storage.l1.delete(rank1_chunk1) == [L1Result.SUCCESS]
    call(server, b"A", p.Lookup("r", hs))
    assert call(server, b"A", p.Query("r")).hit_chunks == 1
    assert (
        storage.status()["held_lookup_locks"] == 2
    )  # chunk 0, both ranks; rank 0 of chunk 1 released
    call(server, b"A", p.EndSession("r"))
    assert_clean(storage.l1)


def test_store_reservation_commit_and_abort(server: CacheServer, storage: StorageManager) -> None:
    hello(server)
    hs = hashes(2)
    reserved = call(server, b"A", p.StoreReserve("w", hs))
    assert isinstance(reserved, p.Reserved) and all(o >= 0 for o in reserved.offsets)
    assert storage.l1.status()["staging_objects"] == 2
    assert call(server, b"A", p.StoreCommit(reserved.reservation)) == p.Committed(2)
    assert isinstance(call(server, b"A", p.StoreCommit(reserved.reservation)), p.Error)
    again = call(server, b"A", p.StoreReserve("w2", hs + hashes(1, seed=9)))
    assert isinstance(again, p.Reserved) and again.offsets[:2] == [-1, -1]  # resident already
    assert call(server, b"A", p.StoreAbort(again.reservation)) == p.Ack()
    assert_clean(storage.l1)


def test_vanished_client_is_reclaimed(
    server: CacheServer, storage: StorageManager, clock: FakeClock
) -> None:
    hello(server)
    hs = hashes(3)
    store(server, b"A", hs)
    call(server, b"A", p.Lookup("r", hs))
    call(server, b"A", p.Query("r"))
    call(server, b"A", p.StoreReserve("w", hashes(2, seed=5)))
    assert storage.status()["held_lookup_locks"] == 3
    clock.advance(31)  # no ping, no request: the client is gone
    server.tick()
    assert storage.status()["held_lookup_locks"] == 0
    assert server.status()["store_reservations"] == 0
    assert_clean(storage.l1)
    err = call(server, b"A", p.Query("r"))
    assert isinstance(err, p.Error) and err.code == "no_hello"


def test_idle_session_expires_but_pinging_client_stays(
    server: CacheServer, storage: StorageManager, clock: FakeClock
) -> None:
    hello(server)
    hs = hashes(2)
    store(server, b"A", hs)
    call(server, b"A", p.Lookup("r", hs))
    call(server, b"A", p.Query("r"))
    for _ in range(3):
        clock.advance(5)
        call(server, b"A", p.Ping())
        server.tick()
    assert storage.status()["held_lookup_locks"] == 0  # the session's 10 s ran out
    assert server.status()["clients"] == 1
    assert_clean(storage.l1)


def test_hello_errors(server: CacheServer, storage: StorageManager) -> None:
    err = call(server, b"A", p.Hello(99, "c", "m", [LAYOUT]))
    assert isinstance(err, p.Error) and err.code == "version"
    err = call(server, b"A", p.Hello(p.PROTOCOL_VERSION, "c", "m", []))
    assert isinstance(err, p.Error) and "layout" in err.message
    err = hello(server, salt="a/b")
    assert isinstance(err, p.Error) and err.code == "bad_request"
    err = call(server, b"B", p.Lookup("r", hashes(1)))
    assert isinstance(err, p.Error) and err.code == "no_hello"


def test_auth_token(storage: StorageManager, clock: FakeClock) -> None:
    server = CacheServer(storage, 16, auth_token="s3cret", clock=clock)
    assert isinstance(hello(server), p.Error)
    assert isinstance(hello(server, token="wrong"), p.Error)
    assert isinstance(hello(server, token="s3cret"), p.Welcome)


def test_bad_requests_get_errors(server: CacheServer) -> None:
    hello(server)
    cases = [
        p.Lookup("r", [b"short"]),
        p.Lookup("r", hashes(1), group=5),
        p.Retrieve("nope", 0, 1),
        p.Release("nope", 0, 1),
        p.StoreCommit(12345),
        p.EndSession("nope"),
        p.Store("w", hashes(2)),  # no data frames
    ]
    for msg in cases:
        assert isinstance(call(server, b"A", msg), p.Error), msg
    call(server, b"A", p.Lookup("r", []))
    assert call(server, b"A", p.Query("r")).hit_chunks == 0
    err = call(server, b"A", p.Retrieve("r", 0, 1))
    assert isinstance(err, p.Error) and err.code == "bad_range"


def test_refused_lookup_leaves_no_session(server: CacheServer, storage: StorageManager) -> None:
    hello(server)
    h = hashes(1)
    err = call(server, b"A", p.Lookup("r", h + h))  # the same chunk twice
    assert isinstance(err, p.Error) and err.code == "bad_request"
    assert server.status()["sessions"] == 0
    assert_clean(storage.l1)


def test_both_store_paths_count_resident_objects_as_stored(
    server: CacheServer, storage: StorageManager
) -> None:
    hello(server)
    hs = hashes(2)
    assert store(server, b"A", hs) == 2
    assert store(server, b"A", hs) == 2  # bytes path: resident already, still stored
    more = hs + hashes(1, seed=3)
    reserved = call(server, b"A", p.StoreReserve("w", more))
    assert isinstance(reserved, p.Reserved) and reserved.offsets[:2] == [-1, -1]
    assert call(server, b"A", p.StoreCommit(reserved.reservation)) == p.Committed(3)
    assert_clean(storage.l1)
