"""A real ``kvtier serve`` publishes what it holds: chunks into L1 and the fs
L2, out of L1 on a wipe, and after a restart only what the disk kept; a
purge of one tenant never announces what another tenant still holds. A
subscriber bound for vLLM's own publisher shrugs off another process's
batch."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import msgspec
import pytest
import zmq

from kvtier.bench.stores import free_port
from kvtier.commands.admin import call
from kvtier.events.subscriber import EventSubscriber
from kvtier.events.wire import BlockStored as KvtierStored
from kvtier.events.wire import EventBatch, encode_batch
from kvtier.keys import Namespace, TokenHasher
from kvtier.protocol.client import CacheClient
from tests.integration import workload as w
from tests.integration.harness import ServerFactory, tenants_toml, wait_for, wait_written_back
from tests.integration.test_tenants import client, finished_purges, hits
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
        # The mirror matched before the restart too: a snapshot from after the new run's drain.
        assert restarted.fresh_status()["events"]["chunks"] == {"fs": CHUNKS}
    finally:
        client.close()
        sub.close()


def test_a_purge_announces_only_what_no_other_tenant_holds(
    kvtier_server: ServerFactory, tmp_path: Path
) -> None:
    """acme and globex store the same raw chunk hashes under their own salts.
    Purging acme removes acme's objects; the chunks stay announced in L1 and
    on disk, for globex. Purging globex too announces their removal."""
    tenants = tmp_path / "tenants.toml"
    tenants.write_text(tenants_toml())
    pub, replay = free_port(), free_port()
    args = ["--tenants-file", str(tenants), "--set", "purge.settle_s=0.1"]
    server = kvtier_server.start(*args, *events_flags(pub, replay))
    mirror = Mirror()
    sub = EventSubscriber(f"tcp://127.0.0.1:{pub}", f"tcp://127.0.0.1:{replay}", mirror.apply)
    sub.start()
    hashes = w.chunk_hashes(256, 11, CHUNKS)
    acme, globex = client(server.rpc, "acme-token"), client(server.rpc, "globex-token")
    ops = client(server.rpc, "ops-token")
    try:
        assert acme.store("a", hashes, w.payloads(11, CHUNKS, SIZE)) == CHUNKS
        assert globex.store("g", hashes, w.payloads(12, CHUNKS, SIZE)) == CHUNKS
        wait_written_back(ops.status, 2 * CHUNKS)
        both = {"kvtier:L1": set(hashes), "kvtier:fs": set(hashes)}
        assert wait_for(mirror.view, lambda v: v == both) == both

        started = call(server.http, "ops-token", "POST", "/admin/purge", {"tenant": "acme"})
        finished_purges(server, started["jobs"])
        assert hits(acme, hashes, "a1") == 0 and hits(globex, hashes, "g1") == CHUNKS
        # One ordered stream: once a later store is announced, so is all of the purge.
        (marker,) = w.chunk_hashes(256, 13, 1)
        assert globex.store("m", [marker], w.payloads(13, 1, SIZE)) == 1
        seen = wait_for(mirror.view, lambda v: marker in v.get("kvtier:L1", set()))
        assert seen["kvtier:L1"] == {*hashes, marker} and seen["kvtier:fs"] >= set(hashes)

        started = call(server.http, "ops-token", "POST", "/admin/purge", {"tenant": "globex"})
        finished_purges(server, started["jobs"])
        assert wait_for(mirror.view, lambda v: v == {}) == {}
    finally:
        for c in (acme, globex, ops):
            c.close()
        sub.close()


def test_kvtier_batches_with_their_epoch_decode_as_vllm_batches() -> None:
    kv_events = pytest.importorskip("vllm.distributed.kv_events")
    stored = KvtierStored([b"\x01" * 32], None, [], 256, None, "CPU", None, ownership="kvtier:L1")
    payload = encode_batch(EventBatch(1.0, [stored], None, epoch=(1 << 63) - 1))
    theirs = msgspec.msgpack.Decoder(kv_events.KVEventBatch).decode(payload)
    assert theirs.ts == 1.0 and theirs.events[0].block_hashes == [b"\x01" * 32]


def vllm_batch(kv_events: Any, block: int) -> Any:
    """A batch as vLLM's own publisher sends it: one one-token block stored."""
    stored = kv_events.BlockStored(
        block_hashes=[block],
        parent_block_hash=None,
        token_ids=[block],
        block_size=1,
        lora_id=None,
        medium="GPU",
        lora_name=None,
    )
    return kv_events.KVEventBatch(ts=time.time(), events=[stored])


def test_a_stray_batch_on_a_bound_endpoint_costs_one_replay() -> None:
    """The router binds for vLLM's events; another process connects and sends
    one batch numbered 2^62. The subscriber asks vLLM's replay once, drops the
    batch nobody can fill the gap to, and follows the engine as before."""
    kv_events = pytest.importorskip("vllm.distributed.kv_events")
    endpoint, replay = f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}"
    mirror = Mirror()
    sub = EventSubscriber(endpoint, replay, mirror.apply, bind=True)
    sub.start()
    engine = kv_events.ZmqEventPublisher(0, endpoint=endpoint, replay_endpoint=replay)
    stray = zmq.Context.instance().socket(zmq.XPUB)
    stray.connect(endpoint)

    def publish(block: int) -> None:
        engine.publish(vllm_batch(kv_events, block))

    def replays() -> int:  # those asked for a reason, not for silence
        status = sub.status()
        return int(status["replays"]) - int(status.get("idle_replays", 0))

    try:
        publish(1)
        assert wait_for(mirror.view, lambda v: v == {"": {1}}) == {"": {1}}
        before = replays()
        assert stray.poll(10_000) and stray.recv()[:1] == b"\x01"  # it reaches the subscriber
        batch = kv_events.KVEventBatch(ts=time.time(), events=[kv_events.AllBlocksCleared()])
        stray.send_multipart((b"", (1 << 62).to_bytes(8, "big"), msgspec.msgpack.encode(batch)))
        status = wait_for(sub.status, lambda s: s.get("unfilled_gaps") == 1)
        assert status.get("unfilled_gaps") == 1, status
        publish(2)
        publish(3)
        want = {"": {1, 2, 3}}
        assert wait_for(mirror.view, lambda v: v == want) == want  # no clear from the stray
        assert wait_for(lambda: sub.synced, bool)
        assert replays() - before == 1 and sub.status()["next_seq"] == 3
    finally:
        stray.close(linger=0)
        engine.shutdown()
        sub.close()


def test_batches_older_than_the_engines_replay_buffer_are_counted_lost() -> None:
    """vLLM keeps ``buffer_steps`` batches and sends no snapshot: a subscriber
    that starts after five batches, with room for two, applies the two and
    counts three lost."""
    kv_events = pytest.importorskip("vllm.distributed.kv_events")
    replay = f"tcp://127.0.0.1:{free_port()}"
    nobody = f"tcp://127.0.0.1:{free_port()}"  # no live stream: only the replay counts
    engine = kv_events.ZmqEventPublisher(0, endpoint=nobody, replay_endpoint=replay, buffer_steps=2)
    asker = zmq.Context.instance().socket(zmq.DEALER)
    asker.connect(replay)

    def buffered() -> list[int]:
        asker.send_multipart((b"", (0).to_bytes(8, "big")))
        seqs: list[int] = []
        while asker.poll(10_000):
            frames = asker.recv_multipart()
            if frames[1] == b"" and frames[3] == b"":
                return seqs
            seqs.append(int.from_bytes(frames[2], "big"))
        return seqs

    mirror = Mirror()
    sub = EventSubscriber(nobody, replay, mirror.apply)
    try:
        for block in range(5):
            engine.publish(vllm_batch(kv_events, block))
        assert wait_for(buffered, lambda seqs: seqs == [3, 4]) == [3, 4]
        sub.start()
        assert wait_for(lambda: sub.synced, bool)
        assert mirror.view() == {"": {3, 4}}
        status = sub.status()
        assert status["lost_batches"] == 3 and status["next_seq"] == 5, status
    finally:
        asker.close(linger=0)
        engine.shutdown()
        sub.close()
