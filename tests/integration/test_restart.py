"""The server goes away and comes back: clients degrade without raising, then
register again and find what was stored before in the fs L2."""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

import numpy as np

from kvtier.protocol import messages as p
from kvtier.protocol.client import CacheClient
from kvtier.protocol.status import ServerStatus
from tests.integration import workload as w
from tests.integration.harness import (
    SHM_DIR,
    ServerFactory,
    doomed_parent,
    running,
    wait_for,
    wait_written_back,
)

CHUNKS = 4
SIZE = w.object_bytes(256)


def store_and_flush(client: CacheClient, seed: int, n: int) -> list[bytes]:
    """Store ``n`` chunks and wait until the fs L2 has every one of them."""
    hashes = w.chunk_hashes(256, seed, n)
    assert client.store(f"store-{seed}", hashes, w.payloads(seed, n, SIZE)) == n
    wait_written_back(client.status, n)
    return hashes


def test_client_degrades_while_down_then_hits_after_restart(
    kvtier_server: ServerFactory,
) -> None:
    server = kvtier_server.start()
    client = CacheClient(w.client_config(server.rpc, shm=True, request_timeout_s=1.5, retry_s=0.2))
    try:
        assert client.boot_id == server.boot_id
        hashes = store_and_flush(client, seed=31, n=CHUNKS)
        kvtier_server.kill(server)

        # Down: a miss / nothing stored (the first call after request_timeout_s).
        state = client.lookup("down", hashes)
        assert (state.acked, state.hit_chunks, state.miss_reason) == (False, 0, "no_server")
        assert client.query(state) == 0
        assert client.store("down", hashes[:1], w.payloads(31, 1, SIZE)) == 0
        assert client.ping() is False
        assert client.status() is None
        assert client.degraded and client.chunk_size is None
        assert client.stats.degraded_requests >= 1

        restarted = kvtier_server.restart(server, kill=False)
        assert restarted.port == server.port and restarted.boot_id != server.boot_id
        assert wait_for(client.ping, bool) is True
        assert client.boot_id == restarted.boot_id
        assert client.chunk_size == 256 and not client.degraded

        state = client.lookup("up", hashes)
        assert state.acked
        assert client.query(state, timeout_s=10.0) == CHUNKS
        assert state.miss_reason == ""
        out = w.empty_buffers(CHUNKS, SIZE)
        assert client.retrieve_into("up", 0, CHUNKS, out)
        for got, want in zip(out, w.payloads(31, CHUNKS, SIZE), strict=True):
            assert np.array_equal(got, want)

        # The prefetcher counts a lookup's hits just after it answers it: wait for them.
        def fs_hits(status: ServerStatus | None) -> bool:
            return status is not None and status.storage.prefetch.hit_objects.get("fs") == CHUNKS

        status = wait_for(client.status, fs_hits)
        assert status is not None
        assert status.storage.prefetch.hit_objects.get("fs") == CHUNKS
        assert status.storage.held_lookup_locks == 0

        # Stores work again too (a chunk never stored before).
        new = w.chunk_hashes(256, 32, 1)
        assert client.store("after", new, w.payloads(32, 1, SIZE)) == 1
    finally:
        client.close()


def test_idle_client_registers_again_by_itself(kvtier_server: ServerFactory) -> None:
    """No call while the server is down: the socket's monitor sees the link
    drop and the client says hello again, to the new server once it is up;
    its next call is served, and no call was answered degraded."""
    server = kvtier_server.start()
    client = CacheClient(w.client_config(server.rpc, shm=False, request_timeout_s=5.0))
    try:
        hashes = store_and_flush(client, seed=41, n=2)
        restarted = kvtier_server.restart(server)  # SIGKILL, then the same port and dir
        assert wait_for(lambda: client.boot_id, lambda boot: boot == restarted.boot_id)
        assert client.stats.dropped_links == 1
        state = client.lookup("again", hashes)
        assert state.acked
        assert client.query(state, timeout_s=10.0) == 2
        assert client.stats.degraded_requests == 0
        client.release("again", 0, 2)
    finally:
        client.close()


def test_a_call_lost_with_its_link_does_not_degrade_the_rejoined_client(
    kvtier_server: ServerFactory,
) -> None:
    """A call on the wire when its server dies is lost with the link; the
    client rejoins the restarted server at once, and that call's timeout,
    when it comes, only ends that call: the new registration stays (no
    second connect, no window of calls answered degraded)."""
    server = kvtier_server.start()
    client = CacheClient(w.client_config(server.rpc, heartbeat_s=0, request_timeout_s=3.0))
    try:
        os.kill(server.pid, signal.SIGSTOP)  # then killed: it never answers
        pings = [threading.Thread(target=client.ping)]
        pings[0].start()
        time.sleep(0.5)  # the ping is on the wire
        restarted = kvtier_server.restart(server)
        assert wait_for(lambda: client.boot_id, lambda boot: boot == restarted.boot_id)
        pings[0].join(timeout=30)
        assert not pings[0].is_alive()
        connects = client.stats.reconnects
        assert client.ping() is True and not client.degraded
        assert client.stats.reconnects == connects == 1
    finally:
        client.close()


def test_a_server_slow_to_come_back_is_joined_as_soon_as_it_listens(
    kvtier_server: ServerFactory,
) -> None:
    """The server stays away past the HELLO's timeout, so the client degrades;
    it then says HELLO the moment the server's link is made, not after its
    back-off (a minute here: the old client joined only then)."""
    server = kvtier_server.start()
    config = w.client_config(server.rpc, request_timeout_s=1.0, retry_s=60.0, max_retry_s=60.0)
    client = CacheClient(config)
    try:
        hashes = store_and_flush(client, seed=43, n=2)
        kvtier_server.kill(server)
        assert wait_for(lambda: client.degraded, bool) is True  # the HELLO after the drop timed out
        assert client.lookup("down", hashes).miss_reason == "no_server"
        restarted = kvtier_server.restart(server, kill=False)
        assert wait_for(lambda: client.boot_id, lambda boot: boot == restarted.boot_id) == (
            restarted.boot_id
        )
        state = client.lookup("back", hashes)
        assert state.acked and client.query(state, timeout_s=10.0) == 2
        client.release("back", 0, 2)
    finally:
        client.close()


def test_an_idle_client_sees_a_killed_server_without_a_call(kvtier_server: ServerFactory) -> None:
    """The finding: a dead server was found only by the timeout of the next
    call (the socket reconnects silently). Heartbeat off, no call made: the
    socket's monitor alone unregisters the client, which says hello again;
    when that goes unanswered, calls are misses."""
    server = kvtier_server.start()
    client = CacheClient(w.client_config(server.rpc, heartbeat_s=0, request_timeout_s=1.0))
    try:
        assert not client.degraded
        kvtier_server.kill(server)
        assert wait_for(lambda: client.degraded, bool, timeout_s=20.0) is True
        assert client.stats.dropped_links == 1
        state = client.lookup("down", w.chunk_hashes(256, 5, 1))
        assert (state.acked, state.miss_reason) == (False, "no_server")
    finally:
        client.close()


def thread_cpu_s(thread: threading.Thread) -> float:
    """CPU seconds a thread of this process has used (user + system)."""
    fields = Path(f"/proc/self/task/{thread.native_id}/stat").read_text().rpartition(")")[2]
    utime, stime = (int(v) for v in fields.split()[11:13])
    return (utime + stime) / os.sysconf("SC_CLK_TCK")


def test_a_server_away_past_the_heartbeat_costs_the_client_no_cpu(
    kvtier_server: ServerFactory,
) -> None:
    """The finding: once a heartbeat fell due while the server was away, the
    client's wait had a past-due timer and became a busy loop (a core per
    engine process until the server came back). A server frozen for twelve
    heartbeats: the client's I/O thread uses a bounded share of one CPU
    second (a busy loop would use most of the six), then registers again."""
    server = kvtier_server.start()
    config = w.client_config(server.rpc, heartbeat_s=0.5, request_timeout_s=1.0, retry_s=0.2)
    before = set(threading.enumerate())
    client = CacheClient(config)
    (thread,) = [t for t in set(threading.enumerate()) - before if t.name == "kvtier-client"]
    try:
        assert not client.degraded
        with server.stalled():
            assert wait_for(lambda: client.degraded, bool, timeout_s=20.0) is True
            used = thread_cpu_s(thread)
            time.sleep(6.0)  # twelve heartbeats away
            used = thread_cpu_s(thread) - used
        assert used < 0.5, f"the client's I/O thread used {used:.2f} CPU s of 6 s away"
        assert wait_for(client.ping, bool) is True
        assert not client.degraded
    finally:
        client.close()


def test_an_offer_held_through_a_quiet_server_reaches_it_once(
    kvtier_server: ServerFactory,
) -> None:
    """The finding: a prefill engine's offer, posted while its connection was
    degraded (the server quiet past the request timeout), was answered with
    nothing at once and never sent; the engine still handed the proxy its
    hand-off, and the decode engine waited ``handoff_wait_s`` for an offer
    that never came, then recomputed. An offer posted to be held is kept
    while the connection is down, and when the connection drops with it on
    the wire, and sent once the server answers again; the server holds it
    once however many times it comes."""
    server = kvtier_server.start()
    config = w.client_config(server.rpc, shm=False, request_timeout_s=0.5, retry_s=0.2)
    producer, consumer = CacheClient(config), CacheClient(config)
    try:
        hashes = store_and_flush(producer, seed=61, n=2)
        with server.stalled():  # offered on the wire; the connection drops with it
            on_wire = producer.handoff(p.HandoffOffer("wire", hashes[:1], 30.0), hold_s=60.0)
            assert on_wire.wait(1.0) is None and not on_wire.ready
            assert wait_for(lambda: producer.degraded, bool)
            # Offered while the connection is down: held; without a hold, nothing.
            down = producer.handoff(p.HandoffOffer("down", hashes, 30.0), hold_s=60.0)
            lost = producer.handoff(p.HandoffOffer("lost", hashes, 30.0))
            assert lost.wait(5.0) is None and lost.ready
            assert down.wait(0.5) is None and not down.ready
        for call in (on_wire, down):  # the one on the wire may have come twice
            answer = call.wait(10.0)
            assert isinstance(answer, p.HandoffState) and answer.outcome == "offered", answer
        for handoff, offered in (("wire", hashes[:1]), ("down", hashes), ("lost", hashes)):
            taken = consumer.handoff(p.HandoffTake(handoff, offered, "")).wait(10.0)
            assert isinstance(taken, p.HandoffState)
            assert taken.outcome == ("pending" if handoff == "lost" else "granted"), handoff
            if taken.outcome == "granted":
                consumer.handoff(p.HandoffDone(handoff, "")).wait(10.0)
        # The status is a snapshot taken each tick: wait for the last DONE in it.
        seen = wait_for(server.status, lambda s: s["server"]["handoffs"]["consumed"] == 2)
        assert seen["server"]["handoffs"]["offered"] == seen["server"]["handoffs"]["consumed"] == 2
        assert seen["handoffs"]["held"] == 0
    finally:
        producer.close()
        consumer.close()


def test_a_take_whose_answer_was_lost_with_its_connection_is_still_its_own(
    kvtier_server: ServerFactory,
) -> None:
    """A decode engine's take goes out, the server goes quiet, the connection
    drops with the answer: the server granted it to the old connection. The
    take sent again over the new one names the same token, so it is still
    granted (without a token it is another consumer's: ``taken``), and its
    DONE, held through a dropped connection too, releases the hand-off."""
    server = kvtier_server.start()
    config = w.client_config(server.rpc, shm=False, request_timeout_s=0.5, retry_s=0.2)
    producer, consumer = CacheClient(config), CacheClient(config)
    try:
        hashes = store_and_flush(producer, seed=62, n=2)
        for handoff in ("with-token", "without"):
            offered = producer.handoff(p.HandoffOffer(handoff, hashes, 30.0)).wait(10.0)
            assert isinstance(offered, p.HandoffState) and offered.outcome == "offered"
        for handoff, token in (("with-token", "t1"), ("without", "")):
            take = p.HandoffTake(handoff, hashes, "", taker=token)
            with server.stalled():
                assert consumer.handoff(take).wait(5.0) is None  # dropped with the connection
            again = wait_for(
                lambda take=take: consumer.handoff(take).wait(5.0),
                lambda reply: isinstance(reply, p.HandoffState),
            )
            assert isinstance(again, p.HandoffState)
            assert again.outcome == ("granted" if token else "taken"), handoff
        with server.stalled():
            done = consumer.handoff(p.HandoffDone("with-token", "", "t1"), hold_s=60.0)
            assert done.wait(1.0) is None and not done.ready
        # Released by the DONE on the old connection, or by the one sent again.
        reply = done.wait(10.0)
        assert isinstance(reply, p.HandoffState) and reply.outcome in ("released", "consumed")
        seen = wait_for(server.status, lambda s: s["server"]["handoffs"]["consumed"] == 1)
        assert seen["server"]["handoffs"]["consumed"] == 1
    finally:
        producer.close()
        consumer.close()


def test_sigterm_stops_cleanly_with_locks_held(kvtier_server: ServerFactory) -> None:
    server = kvtier_server.start()
    client = CacheClient(w.client_config(server.rpc, shm=True))
    try:
        hashes = w.chunk_hashes(256, 51, 2)
        assert client.store("s", hashes, w.payloads(51, 2, SIZE)) == 2
        assert client.query(client.lookup("held", hashes), timeout_s=10.0) == 2
        assert (SHM_DIR / server.arena).exists()
    finally:
        client.close()
    assert kvtier_server.stop(server, signal.SIGTERM) == 0
    assert not (SHM_DIR / server.arena).exists()
    assert "Traceback" not in server.log


def test_a_killed_server_leaves_no_arena_behind(kvtier_server: ServerFactory) -> None:
    """The finding: after a SIGKILL the arena stayed in /dev/shm until another
    kvtier process started in the same directory. The server's reaper child
    removes it as soon as the server is gone; a client's mapping stays valid."""
    server = kvtier_server.start()
    client = CacheClient(w.client_config(server.rpc, shm=True))
    try:
        store_and_flush(client, seed=5, n=1)
        arena = SHM_DIR / server.arena
        assert arena.exists()
        server.proc.send_signal(signal.SIGKILL)  # by PID: no clean-up of its own
        server.proc.wait()
        assert wait_for(arena.exists, lambda exists: not exists) is False
    finally:
        client.close()


def test_a_lookup_against_a_dead_server_waits_for_its_ack_only(
    kvtier_server: ServerFactory,
) -> None:
    """The finding: a lookup with a pipelined WAIT blocked for the WAIT's time
    plus the request timeout, because the WAIT's timeout also covered the
    LOOKUP's ack. Against a dead server it now gives up after the ack's
    timeout (1 s here), not the hour the WAIT allows (the join is a guard
    against that hang, not a timing)."""
    server = kvtier_server.start()
    client = CacheClient(w.client_config(server.rpc, shm=False, request_timeout_s=1.0))
    try:
        hashes = w.chunk_hashes(256, 9, 2)
        kvtier_server.kill(server)
        states = []
        lookup = threading.Thread(target=lambda: states.append(client.lookup("x", hashes, 0, 3600)))
        lookup.start()
        lookup.join(timeout=120)
        assert not lookup.is_alive(), "the lookup waited for the WAIT's hour"
        assert (states[0].acked, states[0].hit_chunks) == (False, 0)
    finally:
        client.close()


PARENT = """
import sys
from pathlib import Path
from kvtier.process import ServerProcess

server = ServerProcess.start(
    ["--port", "0", "--http-port", "-1", "--l1-size", "16MiB", "--cache-dir", "none"],
    Path(sys.argv[1]),
)
print(server.pid, server.arena, flush=True)
sys.stdin.read()  # until the test kills this process
"""


def test_a_server_whose_parent_dies_stops_by_itself(tmp_path: Path) -> None:
    """The finding: a tool that started a server with ServerProcess and was
    killed (SIGKILL, or a SIGTERM it does not handle) left the server running
    with its L1 arena, 8 GiB of /dev/shm for blend-eval's, held for nobody.
    The server's stdin is a pipe only the parent holds: it stops when it ends."""
    log = tmp_path / "serve.log"
    with doomed_parent(PARENT, log) as (parent, words):
        pid, arena = int(words[0]), SHM_DIR / words[1]
        assert arena.exists() and running(pid)
        parent.send_signal(signal.SIGKILL)  # by PID: no clean-up of its own
        parent.wait()
        assert wait_for(lambda: running(pid), lambda up: not up) is False
        assert wait_for(arena.exists, lambda exists: not exists) is False
        assert "stdin closed; stopping" in log.read_text()
