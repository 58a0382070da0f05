"""CacheServer operations in process: sessions, locks released exactly once,
reservations, time-to-live, errors for bad requests."""

from __future__ import annotations

import numpy as np
import pytest

from kvtier.keys import Namespace, TokenHasher
from kvtier.l1 import L1Result
from kvtier.protocol import messages as p
from kvtier.server.core import CacheServer
from kvtier.server.limits import ServerLimits
from kvtier.server.requests import Awaiting, Deferred
from kvtier.storage import L1, StorageManager
from kvtier.tenancy.tenants import TenantTable
from tests.conftest import FakeClock
from tests.ledger import assert_clean

LAYOUT = p.LayoutSpec(0, num_layers=1, kv_heads=1, head_dim=8, dtype="float32")
OBJECT = 2 * 8 * 4 * 16  # K+V, head_dim 8, fp32, 16 tokens per chunk


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
    return answer(server, peer, msg, frames)[0]


def answer(
    server: CacheServer, peer: bytes, msg: p.Message, frames: list[bytes] | None = None
) -> tuple[p.Reply, list[np.ndarray]]:
    """The reply and its frames; work the server defers runs at once, as its
    pool would run it, and an answer that awaits a lookup comes once it settles."""
    outcome = server.handle(peer, msg, frames or [])  # type: ignore[arg-type]
    if isinstance(outcome, Deferred):
        outcome = outcome.finish(outcome.work())
    if isinstance(outcome, Awaiting):
        assert outcome.lookup.wait(10) is not None
        outcome = outcome.finish()
    return outcome


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
    assert_clean(storage)


def test_ranks_count_only_chunks_every_rank_has(
    server: CacheServer, storage: StorageManager
) -> None:
    hello(server, ranks=2)
    hs = hashes(3)
    store(server, b"A", hs, ranks=2)
    held = [k for k, _ in storage.held_sizes(L1)]
    rank1_chunk1 = [k for k in held if k.chunk_hash == hs[1] and k.kv_rank == 1]
    assert storage.delete_l1(rank1_chunk1) == [L1Result.SUCCESS]
    call(server, b"A", p.Lookup("r", hs))
    assert call(server, b"A", p.Query("r")).hit_chunks == 1
    assert (
        storage.status()["held_lookup_locks"] == 2
    )  # chunk 0, both ranks; rank 0 of chunk 1 released
    call(server, b"A", p.EndSession("r"))
    assert_clean(storage)


def test_store_reservation_commit_and_abort(server: CacheServer, storage: StorageManager) -> None:
    hello(server)
    hs = hashes(2)
    reserved = call(server, b"A", p.StoreReserve("w", hs))
    assert isinstance(reserved, p.Reserved) and all(o >= 0 for o in reserved.offsets)
    assert storage.l1_status()["staging_objects"] == 2
    assert call(server, b"A", p.StoreCommit(reserved.reservation)) == p.Committed(2)
    assert isinstance(call(server, b"A", p.StoreCommit(reserved.reservation)), p.Error)
    again = call(server, b"A", p.StoreReserve("w2", hs + hashes(1, seed=9)))
    assert isinstance(again, p.Reserved) and again.offsets[:2] == [-1, -1]  # resident already
    assert call(server, b"A", p.StoreAbort(again.reservation)) == p.Ack()
    assert_clean(storage)


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
    assert server.status().store_reservations == 0
    assert_clean(storage)
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
    assert server.status().clients == 1
    assert_clean(storage)


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
    server = CacheServer(storage, 16, TenantTable.single("s3cret"), clock=clock)
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
    assert server.status().sessions == 0
    assert_clean(storage)


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
    assert_clean(storage)


# ------------------------------------------------------- hostile clients


def hello_layout(server: CacheServer, peer: bytes = b"A", **changes: object) -> p.Reply:
    fields = {"group": 0, "num_layers": 1, "kv_heads": 1, "head_dim": 8, "dtype": "float32"}
    layout = p.LayoutSpec(**{**fields, **changes})  # type: ignore[arg-type]
    msg = p.Hello(p.PROTOCOL_VERSION, "c", "org/m", [layout], 1, 16)
    return call(server, peer, msg)


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"num_layers": 2**62}, "num_layers 4611686018427387904 is outside [1, 4096]"),
        ({"kv_heads": 0}, "kv_heads 0 is outside"),
        ({"head_dim": -1}, "head_dim -1 is outside"),
        ({"group": 2**40}, "group 1099511627776 is outside"),
        ({"dtype": "float128"}, "dtype 'float128' is not one of"),
        ({"format": "x" * 300}, "format is 300 characters"),
        ({"lossy_codec": "int3"}, "lossy_codec 'int3' is not one of ['int8', 'int4']"),
        ({"lossy_codec": "int8", "dtype": "int8"}, "lossy_codec needs the canonical byte order"),
        ({"window_layers": 2, "window_tokens": 8}, "window_layers 2 is outside [0, 1]"),
        ({"window_layers": 1, "window_tokens": 2**62}, "window_tokens 4611686018427387904 is"),
        ({"window_layers": 1, "window_tokens": -8}, "window_tokens -8 is outside"),
        ({"window_layers": 1}, "window_tokens positive"),  # a window layer keeping nothing
        ({"window_layers": 1, "window_tokens": 8}, "window_tokens must be in [1, tokens"),
        # K+V x 4096 layers x 4096 heads x 65536 x fp32 x 16 tokens = 2**47 bytes
        (
            {"num_layers": 4096, "kv_heads": 4096, "head_dim": 65536},
            "takes 140737488355328 bytes (16 tokens), more than the server's whole L1",
        ),
    ],
)
def test_hello_bounds_every_layout_field_and_the_object_size(
    server: CacheServer, changes: dict[str, object], message: str
) -> None:
    """The adversarial run's finding: num_layers=2**62 was accepted, and a later
    STORE_RESERVE built a reply with a 2**73-byte size that could not be encoded."""
    err = hello_layout(server, **changes)
    assert isinstance(err, p.Error) and err.code == "bad_request", err
    assert message in err.message
    assert server.status().clients == 0
    assert server.status().chunk_size_frozen is False


def test_hello_cannot_freeze_an_absurd_chunk_size(server: CacheServer) -> None:
    """The finding: block_alignment=2**40 fixed the chunk size for everyone."""
    msg = p.Hello(p.PROTOCOL_VERSION, "c", "org/m", [LAYOUT], 1, block_alignment=2**40)
    err = call(server, b"A", msg)
    assert isinstance(err, p.Error) and "block_alignment 1099511627776 is outside" in err.message
    assert server.status().chunk_size_frozen is False
    assert isinstance(hello(server), p.Welcome)  # a sane engine after it sets the size
    assert server.status().chunk_size == 16


@pytest.mark.parametrize(
    "changes",
    [
        {"num_ranks": 0},
        {"num_ranks": 4096},
        {"rank": 5},
        {"client_id": "c" * 1000},
        {"layouts": [LAYOUT, LAYOUT]},
        {"layouts": [LAYOUT] * 20},
    ],
)
def test_hello_bounds_the_rest(server: CacheServer, changes: dict[str, object]) -> None:
    fields: dict[str, object] = {
        "version": p.PROTOCOL_VERSION,
        "client_id": "c",
        "model": "org/m",
        "layouts": [LAYOUT],
        "block_alignment": 16,
        **changes,
    }
    err = call(server, b"A", p.Hello(**fields))  # type: ignore[arg-type]
    assert isinstance(err, p.Error) and err.code == "bad_request", err


def test_a_non_ascii_token_is_refused_not_a_crash(storage: StorageManager) -> None:
    server = CacheServer(storage, 16, TenantTable.single("s3cret"))
    err = hello(server, token="sécret")
    assert isinstance(err, p.Error) and err.code == "unauthorized"


def test_registration_is_bound_to_the_connection(server: CacheServer) -> None:
    """The finding: with ROUTER_HANDOVER a peer presenting a registered
    client's routing id inherited its registration. The transport gives each
    connection its own id; the same routing id on another connection is not
    registered."""
    msg = p.Hello(p.PROTOCOL_VERSION, "c", "org/m", [LAYOUT], 1, 16)
    assert isinstance(server.handle(b"A", msg, [], "c1")[0], p.Welcome)
    store_msg = p.Store("w", hashes(1))
    frames = [np.zeros(OBJECT, np.uint8).tobytes()]
    assert isinstance(server.handle(b"A", store_msg, frames, "c1")[0], p.Committed)  # type: ignore[arg-type]
    stolen = server.handle(b"A", p.Lookup("r", hashes(1)), [], "c2")[0]
    assert isinstance(stolen, p.Error) and stolen.code == "no_hello"
    assert server.lookup_settled(b"A", "r", "c2")
    assert isinstance(server.handle(b"A", p.Lookup("r", hashes(1)), [], "c1")[0], p.Ack)


def test_an_answered_lookup_keeps_only_its_hit(
    server: CacheServer, storage: StorageManager
) -> None:
    """The finding: a LOOKUP of 65,536 missing chunks pinned ~20 MiB until
    END_SESSION. Once answered, a session names only the chunks it hit."""
    hello(server)
    hs = hashes(3)
    store(server, b"A", hs)
    call(server, b"A", p.Lookup("r", hs + hashes(1000, seed=4)))
    assert server.status().session_objects == 1003
    assert call(server, b"A", p.Query("r")).hit_chunks == 3  # type: ignore[union-attr]
    assert server.status().session_objects == 3
    call(server, b"A", p.EndSession("r"))
    assert server.status().session_objects == 0
    assert_clean(storage)


def test_session_limits_are_clear_errors(storage: StorageManager, clock: FakeClock) -> None:
    limits = ServerLimits(
        max_objects_per_request=8,
        max_sessions_per_client=2,
        max_session_objects_per_client=10,
        max_clients=1,
        max_reservations_per_client=1,
    )
    server = CacheServer(storage, chunk_size=16, limits=limits, clock=clock)
    hello(server)
    err = call(server, b"A", p.Lookup("big", hashes(9)))
    assert isinstance(err, p.Error) and "9 chunks x 1 ranks" in err.message
    assert isinstance(call(server, b"A", p.Lookup("a", hashes(8))), p.Ack)
    err = call(server, b"A", p.Lookup("b", hashes(3, seed=1)))
    assert isinstance(err, p.Error) and err.code == "busy" and "would name 11" in err.message
    assert isinstance(call(server, b"A", p.Lookup("a", hashes(8, seed=2))), p.Ack)  # replaces
    assert isinstance(call(server, b"A", p.Lookup("b", hashes(2, seed=1))), p.Ack)
    err = call(server, b"A", p.Lookup("c", hashes(1, seed=3)))
    assert isinstance(err, p.Error) and err.code == "busy" and "2 sessions" in err.message
    call(server, b"A", p.EndSession("b"))
    reserved = call(server, b"A", p.StoreReserve("b", hashes(1, seed=5)))
    assert isinstance(reserved, p.Reserved)
    err = call(server, b"A", p.StoreReserve("b", hashes(1, seed=6)))
    assert isinstance(err, p.Error) and err.code == "busy"
    call(server, b"A", p.StoreAbort(reserved.reservation))
    assert isinstance(call(server, b"A", p.StoreReserve("b", hashes(1, seed=6))), p.Reserved)
    err = hello(server, peer=b"B")
    assert isinstance(err, p.Error) and err.code == "busy" and "clients" in err.message
    server.close()
    assert_clean(storage)


def test_a_store_reported_stored_is_kept_while_others_hold_most_of_l1(
    storage: StorageManager,
) -> None:
    """The finding: with other clients read-locking 48 of 64 MiB, a new 4 MiB
    store replied stored=1, was evicted by its own watermark round, and the
    next lookup hit 0 (every later store did the same). Here 12 of 16 objects
    are held by another client; each new store is kept until L1 is full."""
    server = CacheServer(storage, chunk_size=16)
    big = p.LayoutSpec(0, num_layers=32, kv_heads=1, head_dim=8, dtype="float32")  # 64 KiB
    for peer in (b"A", b"B"):
        msg = p.Hello(p.PROTOCOL_VERSION, peer.decode(), "org/m", [big], 1, 16)
        assert isinstance(call(server, peer, msg), p.Welcome)
    size = 2 * 32 * 8 * 4 * 16
    held = hashes(12)
    frames = [np.full(size, i, np.uint8).tobytes() for i in range(12)]
    assert call(server, b"A", p.Store("w", held), frames) == p.Committed(12)
    call(server, b"A", p.Lookup("hold", held))
    assert call(server, b"A", p.Query("hold")).hit_chunks == 12  # type: ignore[union-attr]
    assert storage.flush(timeout=10)  # no L2 here: nothing pinned for write-back
    for i in range(4):  # 13..16 of 16 objects: past the high watermark every time
        new = hashes(1, seed=100 + i)
        stored = call(server, b"B", p.Store(f"s{i}", new), [bytes(size)])
        assert stored == p.Committed(1)
        call(server, b"B", p.Lookup(f"r{i}", new))
        assert call(server, b"B", p.Query(f"r{i}")).hit_chunks == 1  # type: ignore[union-attr]
        call(server, b"B", p.EndSession(f"r{i}"))
    assert storage.l1_status()["evictions"] == 0
    call(server, b"A", p.EndSession("hold"))
    server.close()
    assert_clean(storage)
