"""A real ``kvtier serve`` publishes what it holds: chunks into L1 and the fs
L2, out of L1 on a wipe, and after a restart only what the disk kept."""

from __future__ import annotations

from typing import Any

from kvtier.bench.stores import free_port
from kvtier.events.subscriber import EventSubscriber
from kvtier.keys import Namespace, TokenHasher
from kvtier.server.client import CacheClient
from tests.integration import workload as w
from tests.integration.harness import ServerFactory, wait_for, wait_written_back
from tests.unit.events.mirror import Mirror

CHUNKS = 6
SIZE = w.object_bytes(256)


def events_flags(pub: int, replay: int) -> list[str]:
    return [
        "--set",
        f"events.endpoint=tcp://127.0.0.1:{pub}",
        "--set",
        f"events.replay_endpoint=tcp://127.0.0.1:{replay}",
    ]


def test_server_events_follow_l1_and_disk_through_a_wipe_and_a_restart(
    kvtier_server: ServerFactory,
) -> None:
    pub, replay = free_port(), free_port()
    server = kvtier_server.start(*events_flags(pub, replay))
    mirror = Mirror()
    sub = EventSubscriber(f"tcp://127.0.0.1:{pub}", f"tcp://127.0.0.1:{replay}", mirror.apply)
    sub.start()
    client = CacheClient(w.client_config(server.rpc, shm=True))
    try:
        hashes = w.chunk_hashes(256, 7, CHUNKS)
        assert client.store("r", hashes, w.payloads(7, CHUNKS, SIZE)) == CHUNKS
        wait_written_back(client.status, CHUNKS)
        both = {"kvtier:L1": set(hashes), "kvtier:fs": set(hashes)}
        assert wait_for(mirror.view, lambda v: v == both) == both
        event = mirror.stored_events[-1]
        assert event.block_size == 256 and event.token_ids == []
        assert {(e.medium, e.locality) for e in mirror.stored_events} == {
            ("CPU", "LOCAL"),
            ("STORAGE", "LOCAL"),
        }

        # What a router needs to hash prompts as this client did.
        status: dict[str, Any] = wait_for(server.status, lambda s: s["hash_namespaces"])
        (entry,) = status["hash_namespaces"]  # the snapshot is refreshed every tick
        chunk_size = entry.pop("chunk_size")
        hasher = TokenHasher(Namespace(**entry), chunk_size)
        assert hasher.chunk_hashes(w.prompt_tokens(7, CHUNKS, 256)) == hashes
        assert status["events"]["next_seq"] > 0

        # An L1 wipe announces the removals; the disk keeps its copies.
        assert server.http_get("/clear", method="POST")[0] == 200
        disk = {"kvtier:fs": set(hashes)}
        assert wait_for(mirror.view, lambda v: v == disk) == disk

        # A restart: the new run clears what the old one said, then announces the disk.
        client.close()
        restarted = kvtier_server.restart(server, *events_flags(pub, replay), kill=False)
        sub.resync()  # what a router does when it sees the boot id change
        assert wait_for(mirror.view, lambda v: v == disk) == disk
        assert restarted.status()["events"]["chunks"] == {"fs": CHUNKS}
    finally:
        client.close()
        sub.close()
