"""Clients sharing one server: across processes, over shared memory and bytes,
and with several ranks (a hit counts only chunks that every rank has)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from kvtier.keys import ObjectKey, model_label
from kvtier.l1 import L1Config
from kvtier.protocol import messages as p
from kvtier.protocol.client import CacheClient
from kvtier.server.core import CacheServer
from kvtier.storage import StorageConfig, StorageManager
from tests.integration import workload as w
from tests.integration.harness import PeerFactory, Server, spawn_args, wait_written_back
from tests.ledger import assert_clean

CHUNKS = 4


@pytest.mark.parametrize(("store_shm", "fetch_shm"), [(True, False), (False, True)])
def test_one_process_stores_another_retrieves_identical_bytes(
    server: Server, peers: PeerFactory, tmp_path: Path, store_shm: bool, fetch_shm: bool
) -> None:
    common = {"address": server.rpc, "seed": 11, "chunks": CHUNKS}
    stored = peers.run("store", *spawn_args(shm=store_shm, **common))
    assert stored == {"stored": CHUNKS, "chunk_size": 256, "arena": store_shm}

    out = tmp_path / "fetched.npy"
    fetched = peers.run("fetch", *spawn_args(shm=fetch_shm, out=out, **common))
    assert fetched == {"hit": CHUNKS, "retrieved": True, "acked": True, "arena": fetch_shm}
    got = np.load(out)
    expected = np.stack(w.payloads(11, CHUNKS, w.object_bytes(256)))
    assert got.shape == expected.shape == (CHUNKS, w.object_bytes(256))
    assert np.array_equal(got, expected)
    status = w.live_status(server.rpc)
    assert status["storage"]["held_lookup_locks"] == 0
    assert status["store_reservations"] == 0
    assert status["storage"]["l1"]["resident_objects"] == CHUNKS


def test_other_process_misses_unstored_prompt(server: Server, peers: PeerFactory) -> None:
    peers.run("store", *spawn_args(address=server.rpc, seed=1, chunks=2))
    fetched = peers.run("fetch", *spawn_args(address=server.rpc, seed=2, chunks=2))
    assert fetched == {"hit": 0, "retrieved": False, "acked": True, "arena": False}


@pytest.mark.parametrize("shm", [True, False], ids=["shm", "bytes"])
def test_in_process_clients_share_objects(server: Server, shm: bool) -> None:
    writer = CacheClient(w.client_config(server.rpc, shm=shm, client_id="writer"))
    reader = CacheClient(w.client_config(server.rpc, shm=shm, client_id="reader"))
    try:
        assert writer.chunk_size == reader.chunk_size == 256
        size = w.object_bytes(256)
        hashes = w.chunk_hashes(256, seed=5, n_chunks=6)
        buffers = w.payloads(5, 6, size)
        assert writer.store("w", hashes[:5], buffers[:5]) == 5

        state = reader.lookup("r", hashes)  # the sixth chunk was never stored
        assert state.acked and not state.done
        assert reader.query(state, timeout_s=10.0) == 5
        out = w.empty_buffers(5, size)
        assert reader.retrieve_into("r", 0, 5, out)
        for got, want in zip(out, buffers[:5], strict=True):
            assert np.array_equal(got, want)

        # The locks went with the retrieve's release (and the fs write-back,
        # which locks objects while it copies them, is waited for).
        status = wait_written_back(reader.status, 5)
        assert status.storage.held_lookup_locks == 0
        assert status.storage.l1.locked_bytes == 0
        assert status.storage.l1.resident_objects == 5
        assert writer.stats.errors == reader.stats.errors == {}
        assert writer.stats.degraded_requests == reader.stats.degraded_requests == 0
    finally:
        writer.close()
        reader.close()


def test_retrieve_reports_layout_object_sizes(server: Server) -> None:
    with w.raw_dealer(server.rpc) as socket:
        welcome, _ = w.call(socket, w.hello())
        assert isinstance(welcome, p.Welcome)
        assert welcome.arena is None  # bytes client: no arena name
        size = w.object_bytes(welcome.chunk_size)
        assert size == 2 * 2 * 2 * 16 * 2 * 256
        hashes = w.chunk_hashes(256, seed=3, n_chunks=2)
        data = [b.tobytes() for b in w.payloads(3, 2, size)]
        stored, _ = w.call(socket, p.Store("s", hashes), data)
        assert stored == p.Committed(2)
        assert w.call(socket, p.Lookup("r", hashes))[0] == p.Ack()
        assert w.call(socket, p.Wait("r", 10.0))[0] == p.QueryResult(2, {"L1": 2})
        objects, frames = w.call(socket, p.Retrieve("r", 0, 2))
        assert isinstance(objects, p.Objects)
        assert objects.sizes == [size, size]
        assert frames == data
        assert w.call(socket, p.Release("r", 0, 2))[0] == p.Ack()


# ------------------------------------------------------------------ ranks


def test_hit_needs_every_rank_live(server: Server) -> None:
    """A client of rank 0 of two (one TP worker) plants rank 0 of three chunks;
    a client of both ranks misses them until it stores rank 1 too."""
    size = w.object_bytes(256)
    hashes = w.chunk_hashes(256, seed=21, n_chunks=3, num_ranks=2)
    rank0 = CacheClient(
        w.client_config(server.rpc, shm=False, num_ranks=2, rank=0, client_id="rank0")
    )
    both = CacheClient(w.client_config(server.rpc, shm=False, num_ranks=2, client_id="both"))
    try:
        rank0_data = [w.payload(21, c, 0, size) for c in range(3)]
        assert rank0.store("r0", hashes, rank0_data) == 3

        state = both.lookup("a", hashes)
        assert both.query(state, timeout_s=10.0) == 0
        both.end_session("a")

        # Rank 0 of chunks 0 and 1 is resident already, rank 1 is new.
        pairs = [w.payload(21, c, 1, size) for c in range(2)]
        chunk_major = [rank0_data[0], pairs[0], rank0_data[1], pairs[1]]
        assert both.store("s", hashes[:2], chunk_major) == 4

        state = both.lookup("b", hashes)
        assert both.query(state, timeout_s=10.0) == 2
        status = both.status()
        assert status is not None
        # Two chunks x two ranks stay locked; chunk 2's rank-0 lock was dropped.
        assert status.storage.held_lookup_locks == 4
        out = w.empty_buffers(4, size)
        assert both.retrieve_into("b", 0, 2, out)
        for got, want in zip(out, chunk_major, strict=True):
            assert np.array_equal(got, want)
        status = both.status()
        assert status is not None
        assert status.storage.held_lookup_locks == 0
    finally:
        rank0.close()
        both.close()


def test_hit_stops_at_first_chunk_missing_a_rank_in_process() -> None:
    """In process: rank 1 of the middle chunk is missing, so the hit is one chunk
    and the locks the lookup took on the last chunk are released before the answer."""
    storage = StorageManager(StorageConfig(l1=L1Config(size_bytes=8 << 20, populate=False)))
    core = CacheServer(storage, chunk_size=256)
    try:
        size = w.object_bytes(256)
        peer = b"engine"
        welcome, _ = core.handle(peer, w.hello(num_ranks=2), [])
        assert isinstance(welcome, p.Welcome) and welcome.chunk_size == 256
        hashes = w.chunk_hashes(256, seed=9, n_chunks=3, num_ranks=2)
        model = model_label(w.MODEL)
        present = [(0, 0), (0, 1), (1, 0), (2, 0), (2, 1)]  # (chunk, rank); (1, 1) missing
        keys = [ObjectKey(hashes[c], model, r) for c, r in present]
        data = [w.payload(9, c, r, size) for c, r in present]
        assert len(storage.store(keys, data, w.chunk_layout(256, num_ranks=2))) == 5

        assert core.handle(peer, p.Lookup("r", hashes), []) == (p.Ack(), [])
        assert core.handle(peer, p.Query("r"), [])[0].hit_chunks == 1
        assert storage.status()["held_lookup_locks"] == 2
        assert storage.l1_status()["locked_objects"] == 2

        reply, frames = core.handle(peer, p.Retrieve("r", 0, 1), [])
        assert reply == p.Objects(reply.offsets, [size, size])  # type: ignore[union-attr]
        assert [bytes(f) for f in frames] == [d.tobytes() for d in data[:2]]
        reply, _ = core.handle(peer, p.Retrieve("r", 0, 2), [])
        assert isinstance(reply, p.Error) and reply.code == "bad_range"

        assert core.handle(peer, p.Release("r", 0, 1), []) == (p.Ack(), [])
        assert storage.status()["held_lookup_locks"] == 0
        assert_clean(storage)
    finally:
        core.close()
        storage.close()
