"""A client SIGKILLed mid-store or mid-retrieve: after the client time-to-live
the server gives back its store reservations, staging memory and read locks."""

from __future__ import annotations

from typing import Any

import pytest

from kvtier.protocol.client import CacheClient
from tests.integration import workload as w
from tests.integration.harness import (
    PeerFactory,
    Server,
    ServerFactory,
    spawn_args,
    wait_for,
    wait_written_back,
)

SHORT_TTLS = "[limits]\nclient_ttl_s = 1\nsession_ttl_s = 2\n"
CHUNKS = 3


@pytest.fixture
def short_ttl_server(kvtier_server: ServerFactory) -> Server:
    return kvtier_server.start(config=SHORT_TTLS)


def holdings(status: dict[str, Any]) -> dict[str, int]:
    storage = status["storage"]
    return {
        "held_lookup_locks": storage["held_lookup_locks"],
        "store_reservations": status["store_reservations"],
        "locked_bytes": storage["l1"]["locked_bytes"],
        "staging_objects": storage["l1"]["staging_objects"],
        "staging_bytes": storage["l1"]["staging_bytes"],
        "clients": status["clients"],
        "sessions": status["sessions"],
    }


NOTHING_HELD = {
    "held_lookup_locks": 0,
    "store_reservations": 0,
    "locked_bytes": 0,
    "staging_objects": 0,
    "staging_bytes": 0,
    "clients": 0,
    "sessions": 0,
}


@pytest.mark.parametrize("source", ["toml", "env"])
def test_short_client_ttl_from_file_or_environment(
    kvtier_server: ServerFactory, source: str
) -> None:
    if source == "toml":
        server = kvtier_server.start(config=SHORT_TTLS)
    else:
        server = kvtier_server.start(
            env={"KVTIER_LIMITS_CLIENT_TTL_S": "1", "KVTIER_LIMITS_SESSION_TTL_S": "2"}
        )
    # The TTLs are not in /status; what is: a registered client silent for
    # longer than 1 s is expired (well before the default 60 s).
    client = CacheClient(w.client_config(server.rpc, shm=False))
    try:
        assert client.chunk_size == 256
        status = wait_for(server.status, lambda s: s["server"].get("expired_clients") == 1)
        assert status["server"].get("expired_clients") == 1
        assert status["clients"] == 0
        # The client notices nothing: its next call registers it again.
        hashes = w.chunk_hashes(256, 1, 1)
        assert client.store("s", hashes, w.payloads(1, 1, w.object_bytes(256))) == 1
        assert client.stats.server_restarts == 1  # counted as a no_hello round trip
    finally:
        client.close()


def test_client_killed_mid_store_loses_its_reservation(
    short_ttl_server: Server, peers: PeerFactory
) -> None:
    server = short_ttl_server
    size = w.object_bytes(256)
    proc = peers.spawn("reserve-and-hang", *spawn_args(address=server.rpc, seed=4, chunks=CHUNKS))
    assert peers.read(proc) == {"reserved": CHUNKS, "sizes": [size] * CHUNKS}

    # While the peer lives (it pings), its reservation and staging bytes stay.
    held = wait_for(lambda: holdings(server.status()), lambda h: h["store_reservations"] == 1)
    assert held["store_reservations"] == 1
    assert held["staging_objects"] == CHUNKS
    assert held["staging_bytes"] == CHUNKS * size
    assert held["clients"] == 1

    peers.kill(proc)
    after = wait_for(lambda: holdings(server.status()), lambda h: h == NOTHING_HELD)
    assert after == NOTHING_HELD
    status = server.status()
    assert status["server"]["expired_clients"] == 1
    assert status["storage"]["l1"]["resident_objects"] == 0  # nothing was committed

    # The aborted chunks can be stored and found by a live client.
    client = CacheClient(w.client_config(server.rpc, shm=True))
    try:
        hashes = w.chunk_hashes(256, 4, CHUNKS)
        assert client.store("again", hashes, w.payloads(4, CHUNKS, size)) == CHUNKS
        assert client.query(client.lookup("r", hashes), timeout_s=10.0) == CHUNKS
        client.release("r", 0, CHUNKS)
    finally:
        client.close()


def test_client_killed_mid_retrieve_loses_its_locks(
    short_ttl_server: Server, peers: PeerFactory
) -> None:
    server = short_ttl_server
    size = w.object_bytes(256)
    writer = CacheClient(w.client_config(server.rpc, shm=False))
    try:
        hashes = w.chunk_hashes(256, 6, CHUNKS)
        assert writer.store("w", hashes, w.payloads(6, CHUNKS, size)) == CHUNKS
        wait_written_back(writer.status, CHUNKS)  # so that only the peer locks them
    finally:
        writer.close()

    proc = peers.spawn("lookup-and-hang", *spawn_args(address=server.rpc, seed=6, chunks=CHUNKS))
    assert peers.read(proc) == {"hit": CHUNKS, "retrieved_frames": 1}
    held = wait_for(lambda: holdings(server.status()), lambda h: h["held_lookup_locks"] == CHUNKS)
    assert held["held_lookup_locks"] == CHUNKS
    assert held["locked_bytes"] == CHUNKS * size

    peers.kill(proc)
    after = wait_for(lambda: holdings(server.status()), lambda h: h == NOTHING_HELD)
    assert after == NOTHING_HELD
    status = server.status()
    assert status["server"]["expired_clients"] == 2  # the writer went silent too
    l1 = status["storage"]["l1"]
    assert l1["resident_objects"] == CHUNKS  # unlocked, still cached
    assert l1["locked_objects"] == 0
