"""KV events: the wire format (both encodings), chunk residency, and a
publisher/subscriber pair that converges through gaps, late starts,
restarts and a buffer too small for the history."""

from __future__ import annotations

import time

import msgspec
import pytest
import zmq

from kvtier.bench.stores import free_port
from kvtier.events import subscriber
from kvtier.events.publisher import EventPublisher, EventsConfig
from kvtier.events.residency import HASHES_PER_EVENT, L1_TIER, Residency, Tier
from kvtier.events.subscriber import EventSubscriber
from kvtier.events.wire import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventBatch,
    decode_batch,
    encode_batch,
    seq_bytes,
    seq_of,
)
from kvtier.keys import ObjectKey
from tests.unit.events.mirror import Mirror

SHARED_TIER = Tier("redis", shared=True)


def key(i: int, rank: int = 0, salt: str = "") -> ObjectKey:
    return ObjectKey(i.to_bytes(32, "big"), "m", rank, salt=salt)


def chunk(i: int) -> bytes:
    return i.to_bytes(32, "big")


# ------------------------------------------------------------------ wire


def test_batch_round_trip_in_map_encoding() -> None:
    stored = BlockStored([chunk(1)], None, [], 256, None, "CPU", None, ownership="kvtier:L1")
    batch = EventBatch(1.5, [stored, BlockRemoved([7], "GPU"), AllBlocksCleared()], 0)
    decoded = decode_batch(encode_batch(batch))
    assert decoded.events == batch.events and decoded.ts == 1.5 and decoded.skipped == 0
    raw = msgspec.msgpack.decode(encode_batch(batch))
    assert (
        isinstance(raw, list) and raw[1][0]["type"] == "BlockStored"
    )  # positional batch, map events
    assert raw[1][0]["lora_id"] is None and "medium" in raw[1][1]  # required by vLLM: always there


def test_decodes_the_older_positional_events() -> None:
    payload = msgspec.msgpack.encode(
        [2.0, [["BlockStored", [1, 2], 0, [5, 6], 16, None, "GPU"], ["BlockRemoved", [1], "GPU"]]]
    )
    decoded = decode_batch(payload)
    assert decoded.events == [
        BlockStored([1, 2], 0, [5, 6], 16, None, "GPU"),
        BlockRemoved([1], "GPU"),
    ]


def test_unknown_event_types_are_skipped_and_malformed_ones_refused() -> None:
    payload = msgspec.msgpack.encode(
        [1.0, [{"type": "Future", "x": 1}, ["Other"], {"type": "AllBlocksCleared"}]]
    )
    decoded = decode_batch(payload)
    assert decoded.events == [AllBlocksCleared()] and decoded.skipped == 2
    with pytest.raises(msgspec.ValidationError):
        decode_batch(msgspec.msgpack.encode([1.0, [{"type": "BlockStored", "block_hashes": "x"}]]))
    with pytest.raises(msgspec.DecodeError):
        decode_batch(b"\xc1garbage")


# ------------------------------------------------------------- residency


def test_a_chunk_is_stored_at_its_first_object_and_removed_at_its_last() -> None:
    residency = Residency(256)
    residency.added(L1_TIER, [key(1, 0), key(1, 1), key(2, 0)])
    residency.removed(L1_TIER, [key(1, 0)])
    events = residency.drain()
    assert [type(e) for e in events] == [BlockStored]
    assert events[0].block_hashes == [chunk(1), chunk(2)]
    residency.removed(L1_TIER, [key(1, 1), key(9)])  # 9 was never there: nothing to say
    assert residency.drain() == [
        BlockRemoved([chunk(1)], "CPU", locality="LOCAL", ownership="kvtier:L1")
    ]


def test_a_shared_tier_announces_each_chunk_once() -> None:
    residency = Residency(256)
    residency.added(SHARED_TIER, [key(1), key(1, 1)])
    residency.added(SHARED_TIER, [key(1)])
    (stored,) = residency.drain()
    assert isinstance(stored, BlockStored) and stored.locality == "SHARED"
    assert stored.medium == "STORAGE" and stored.block_hashes == [chunk(1)]
    residency.removed(SHARED_TIER, [key(1)])  # a lookup found it gone
    assert [type(e) for e in residency.drain()] == [BlockRemoved]


@pytest.mark.parametrize("tier", [L1_TIER, SHARED_TIER], ids=["local", "shared"])
def test_a_chunk_is_removed_only_when_no_namespace_holds_it(tier: Tier) -> None:
    """Two tenants hold one raw chunk hash under their own salts: a purge of
    one removes its objects, and the chunk stays announced for the other."""
    residency = Residency(256)
    residency.added(tier, [key(1, salt="acme"), key(1, salt="globex"), key(2, salt="acme")])
    (stored,) = residency.drain()
    assert isinstance(stored, BlockStored) and stored.block_hashes == [chunk(1), chunk(2)]
    residency.removed(tier, [key(1, salt="acme"), key(2, salt="acme")])  # acme purged
    (removed,) = residency.drain()
    assert isinstance(removed, BlockRemoved) and removed.block_hashes == [chunk(2)]
    assert truth(residency) == {tier.ownership: {chunk(1)}}
    residency.removed(tier, [key(1, salt="globex")])
    (removed,) = residency.drain()
    assert isinstance(removed, BlockRemoved) and removed.block_hashes == [chunk(1)]
    assert residency.chunks(tier) == 0


def test_events_keep_their_order_and_split_at_the_event_size() -> None:
    residency = Residency(16)
    residency.added(L1_TIER, [key(i) for i in range(HASHES_PER_EVENT + 1)])
    residency.removed(L1_TIER, [key(0)])
    residency.added(L1_TIER, [key(0)])
    kinds = [(type(e).__name__, len(e.block_hashes)) for e in residency.drain()]  # type: ignore[union-attr]
    assert kinds == [
        ("BlockStored", HASHES_PER_EVENT),
        ("BlockStored", 1),
        ("BlockRemoved", 1),
        ("BlockStored", 1),
    ]


# ------------------------------------------------- publisher and subscriber


def truth(residency: Residency) -> dict[str, set[bytes | int]]:
    # Only read once the publisher drained everything (the tables are its thread's).
    out: dict[str, set[bytes | int]] = {}
    for event in residency.snapshot():
        if isinstance(event, BlockStored):
            out.setdefault(event.ownership or "", set()).update(event.block_hashes)
    return {k: v for k, v in out.items() if v}


def wait_for(predicate, timeout: float = 10.0) -> bool:  # type: ignore[no-untyped-def]
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if predicate():
            return True
        time.sleep(0.01)
    return predicate()


def caught_up(pub: EventPublisher, sub: EventSubscriber) -> bool:
    """Wait until the publisher has sent every report and ``sub`` has applied
    the batch that carried the last of them (or a later one); whether it did."""
    if not wait_for(lambda: pub.residency.pending() == 0):
        return False
    sent = pub.status()["next_seq"]  # that batch's number, or a later one
    assert isinstance(sent, int)

    def expected() -> int:  # the number of the next batch the subscriber will apply
        seq = sub.status()["next_seq"]
        return seq if isinstance(seq, int) else -1

    return wait_for(lambda: expected() > sent)


def publisher(buffer_batches: int = 10_000) -> EventPublisher:
    config = EventsConfig(
        endpoint="tcp://127.0.0.1:*",
        replay_endpoint="tcp://127.0.0.1:*",
        buffer_batches=buffer_batches,
        interval_s=0.002,
        heartbeat_s=0.05,
    )
    pub = EventPublisher(config, Residency(256))
    pub.start()
    return pub


def restarted(old: EventPublisher, held: list[ObjectKey]) -> EventPublisher:
    """A new run on ``old``'s (closed) endpoints, holding ``held`` in L1 from the start."""
    config = EventsConfig(
        endpoint=old.endpoint,
        replay_endpoint=old.replay_endpoint,
        interval_s=0.002,
        heartbeat_s=0.05,
    )
    for _ in range(100):  # the old sockets close on zmq's I/O thread
        try:
            pub = EventPublisher(config, Residency(256))
            break
        except ValueError:
            time.sleep(0.05)
    pub.residency.added(L1_TIER, held)
    pub.start()
    return pub


def churn(residency: Residency, rounds: int, start: int = 0) -> None:
    for i in range(start, start + rounds):
        residency.added(L1_TIER, [key(i)])
        residency.added(SHARED_TIER, [key(i)])
        if i % 3 == 0:
            residency.removed(L1_TIER, [key(i // 2)])
        time.sleep(0.0005)


def test_a_late_subscriber_converges_even_past_the_buffer() -> None:
    pub = publisher(buffer_batches=4)  # far less than the history: a snapshot must cover it
    try:
        churn(pub.residency, 300)
        assert wait_for(lambda: pub.residency.pending() == 0)
        mirror = Mirror()
        sub = EventSubscriber(pub.endpoint, pub.replay_endpoint, mirror.apply)
        sub.start()
        try:
            churn(pub.residency, 100, start=300)
            assert wait_for(lambda: pub.residency.pending() == 0 and sub.synced)
            assert caught_up(pub, sub)
            assert wait_for(lambda: mirror.view() == truth(pub.residency))
            assert pub.counters.snapshot().get("snapshots", 0) >= 1
        finally:
            sub.close()
    finally:
        pub.close()


def test_a_gap_is_filled_by_replay() -> None:
    pub = publisher()
    mirror = Mirror()
    seen: list[int] = []
    sub = EventSubscriber(pub.endpoint, pub.replay_endpoint, mirror.apply)
    sub.start()
    try:
        assert wait_for(lambda: sub.synced)
        # Lose messages on purpose: this subscriber's socket sees nothing for a while.
        original = sub._on_live

        def lossy(frames: list[bytes]) -> None:
            seen.append(int.from_bytes(frames[1], "big", signed=True))
            if not 5 <= len(seen) <= 15:  # those are dropped
                original(frames)

        sub._on_live = lossy  # type: ignore[method-assign]
        churn(pub.residency, 200)
        assert caught_up(pub, sub)
        assert wait_for(lambda: mirror.view() == truth(pub.residency))
        status = sub.status()
        assert status["gaps"] >= 1 and status.get("lost_batches", 0) == 0
    finally:
        sub.close()
        pub.close()


def test_a_restarted_publisher_clears_what_its_predecessor_announced() -> None:
    pub = publisher()
    mirror = Mirror()
    sub = EventSubscriber(pub.endpoint, pub.replay_endpoint, mirror.apply)
    sub.start()
    try:
        churn(pub.residency, 50)
        assert wait_for(lambda: mirror.view() == truth(pub.residency) != {})
        pub.close()
        pub = restarted(pub, [key(1000)])
        assert wait_for(lambda: mirror.view() == {"kvtier:L1": {chunk(1000)}})
        replays = sub.status().get("replays", 0)
        sub.resync()  # what a router does when the boot id changes: same outcome
        assert wait_for(lambda: sub.status().get("replays", 0) != replays and sub.synced)
        assert wait_for(lambda: mirror.view() == {"kvtier:L1": {chunk(1000)}})
    finally:
        sub.close()
        pub.close()


def test_malformed_batches_are_counted_and_skipped() -> None:
    ctx = zmq.Context.instance()
    pub = ctx.socket(zmq.PUB)
    port = pub.bind_to_random_port("tcp://127.0.0.1")
    mirror = Mirror()
    sub = EventSubscriber(f"tcp://127.0.0.1:{port}", "", mirror.apply)
    sub.start()
    try:
        good = encode_batch(EventBatch(1.0, [BlockStored([chunk(1)], ownership="kvtier:L1")]))
        deadline = time.monotonic() + 10
        seq = 0
        while mirror.view() == {} and time.monotonic() < deadline:  # slow joiner: resend
            pub.send_multipart((b"", b"\xff" * 3, good))  # a bad sequence frame
            pub.send_multipart((b"", seq.to_bytes(8, "big"), b"\x93garbage"))
            pub.send_multipart((b"", (seq + 1).to_bytes(8, "big"), good))
            seq += 2
            time.sleep(0.02)
        assert mirror.view() == {"kvtier:L1": {chunk(1)}}
        assert sub.status()["malformed"] >= 2
    finally:
        sub.close()
        pub.close(linger=0)


def test_a_restart_after_a_short_run_is_found_by_its_epoch() -> None:
    """The new run's first batches go out before the subscriber reconnects:
    the first it sees carries the very number it expects next. The epoch
    still tells the runs apart; a late batch of the old run is then stale."""
    pub = publisher()
    mirror = Mirror()
    sub = EventSubscriber(pub.endpoint, pub.replay_endpoint, mirror.apply)
    sub.start()
    restarting: list[bool] = []
    old_batch: list[list[bytes]] = []  # the old run's last batch seen, delivered again late
    late: list[bool] = []
    live = sub._on_live

    def reconnecting(frames: list[bytes]) -> None:  # on the subscriber's thread
        if not restarting:
            old_batch[:] = [frames]
        elif seq_of(frames[1]) < (sub._expected or 0):
            return  # sent before the subscriber reconnected: never seen
        elif late:
            late.clear()
            live(old_batch[0])
        live(frames)

    sub._on_live = reconnecting  # type: ignore[method-assign]
    try:
        # joined: a batch (a heartbeat at least) of the old run has come live,
        # not only through the replay a slow subscriber starts with
        assert wait_for(lambda: bool(old_batch))
        pub.residency.added(L1_TIER, [key(1)])
        assert wait_for(lambda: mirror.view() == {"kvtier:L1": {chunk(1)}})
        pub.close()
        restarting.append(True)
        pub = restarted(pub, [key(2)])
        assert wait_for(lambda: mirror.view() == {"kvtier:L1": {chunk(2)}})
        assert sub.status()["restarts"] == 1 and sub.status()["epoch"] == pub.epoch

        late.append(True)
        assert wait_for(lambda: sub.status().get("stale_batches") == 1)
        assert sub.status()["restarts"] == 1 and mirror.view() == {"kvtier:L1": {chunk(2)}}
    finally:
        sub.close()
        pub.close()


def joined(sock: zmq.Socket[bytes]) -> None:
    """Wait until a subscriber (re)joined ``sock`` (an XPUB): what is sent next arrives."""
    while True:
        assert sock.poll(10_000), "no subscriber joined"
        if sock.recv()[:1] == b"\x01":  # (b"\x00": one left)
            return


def stored_batch(i: int) -> bytes:
    return encode_batch(EventBatch(1.0, [BlockStored([chunk(i)], ownership="kvtier:L1")]))


def joined_subscriber() -> tuple[zmq.Socket[bytes], EventSubscriber, Mirror]:
    """A started subscriber (no replay endpoint) that has joined a bound XPUB."""
    pub = zmq.Context.instance().socket(zmq.XPUB)
    port = pub.bind_to_random_port("tcp://127.0.0.1")
    mirror = Mirror()
    sub = EventSubscriber(f"tcp://127.0.0.1:{port}", "", mirror.apply)
    sub.start()
    joined(pub)
    return pub, sub, mirror


def test_a_garbage_batch_does_not_take_its_sequence_number() -> None:
    pub, sub, mirror = joined_subscriber()
    try:
        pub.send_multipart((b"", seq_bytes(0), stored_batch(1)))
        pub.send_multipart((b"", seq_bytes(1), b"\x93garbage"))
        pub.send_multipart((b"", seq_bytes(1), stored_batch(2)))  # the publisher's own batch 1
        assert wait_for(lambda: mirror.view() == {"kvtier:L1": {chunk(1), chunk(2)}})
        status = sub.status()
        assert status["malformed"] == 1 and status.get("lost_batches", 0) == 0
    finally:
        sub.close()
        pub.close(linger=0)


def test_a_batch_nested_too_deep_is_malformed_and_the_stream_goes_on() -> None:
    deep = b"\x92" + msgspec.msgpack.encode(1.0) + b"\x91" * 200_000 + b"\xc0"
    with pytest.raises(msgspec.DecodeError, match="nested too deeply"):
        decode_batch(deep)
    pub, sub, mirror = joined_subscriber()
    try:
        pub.send_multipart((b"", seq_bytes(0), deep))
        pub.send_multipart((b"", seq_bytes(0), stored_batch(1)))
        assert wait_for(lambda: mirror.view() == {"kvtier:L1": {chunk(1)}})
        assert sub.status()["malformed"] == 1 and "errors" not in sub.status()
    finally:
        sub.close()
        pub.close(linger=0)


def test_a_bound_subscriber_refuses_a_message_past_the_size_limit(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Anyone may connect to a bound endpoint: a message over the limit drops
    that connection unread, the sender connects again, and the stream goes on."""
    monkeypatch.setattr(subscriber, "MAX_MESSAGE_BYTES", 1 << 20, raising=False)
    huge = encode_batch(
        EventBatch(1.0, [BlockStored([chunk(i) for i in range(2, 40_000)], ownership="kvtier:L1")])
    )
    assert len(huge) > 1 << 20
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    mirror = Mirror()
    sub = EventSubscriber(endpoint, "", mirror.apply, bind=True)
    sub.start()
    pub = zmq.Context.instance().socket(zmq.XPUB)
    pub.setsockopt(zmq.XPUB_VERBOSE, 1)  # a subscription again after a reconnect, too
    pub.connect(endpoint)
    try:
        joined(pub)
        pub.send_multipart((b"", seq_bytes(0), huge))
        joined(pub)  # dropped, then connected again
        pub.send_multipart((b"", seq_bytes(1), stored_batch(1)))
        assert wait_for(lambda: mirror.view() == {"kvtier:L1": {chunk(1)}})
        assert sub.status()["batches"] == 1
    finally:
        sub.close()
        pub.close(linger=0)
