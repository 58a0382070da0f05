"""Lookup sessions over ZeroMQ: QUERY answers once, WAIT returns a QueryResult,
pending (None) is not a miss (0), and refused requests leave nothing behind.

The pending cases need a lookup that stays pending until the test says so:
those use the ``gated`` server (``conftest``): the real ``ServerTransport`` and
``CacheServer`` in this process over a mock L2 whose lookups wait on a gate.
"""

from __future__ import annotations

import threading
from typing import Any

import pytest
import zmq

from kvtier.controllers import PrefetchHandle
from kvtier.protocol import messages as p
from kvtier.protocol.client import CacheClient
from tests.integration import workload as w
from tests.integration.conftest import Gated
from tests.integration.harness import Server

SIZE = w.object_bytes(256)


def registered(socket: zmq.Socket[bytes]) -> None:
    reply, _ = w.call(socket, w.hello())
    assert isinstance(reply, p.Welcome), reply


def error_code(reply: p.Reply) -> str:
    assert isinstance(reply, p.Error), reply
    return reply.code


def test_pending_is_none_then_miss_is_zero_then_consumed(gated: Gated) -> None:
    hashes = w.chunk_hashes(256, seed=1, n_chunks=2)
    with w.raw_dealer(gated.address) as socket:
        registered(socket)
        assert w.call(socket, p.Lookup("r", hashes))[0] == p.Ack()
        # Pending: QUERY says None, and asking again is allowed while pending.
        assert w.call(socket, p.Query("r"))[0].hit_chunks is None
        assert w.call(socket, p.Query("r"))[0].hit_chunks is None
        # A WAIT that times out answers None too (it is parked, then answered).
        assert w.call(socket, p.Wait("r", 0.05))[0].hit_chunks is None
        gated.gate.set()
        # Done: the L2 has nothing, so a miss, 0 and not None.
        assert w.call(socket, p.Wait("r", 10.0))[0].hit_chunks == 0
        assert error_code(w.call(socket, p.Query("r"))[0]) == "consumed"
        assert error_code(w.call(socket, p.Wait("r", 1.0))[0]) == "consumed"
        assert error_code(w.call(socket, p.Retrieve("r", 0, 1))[0]) == "bad_range"


def test_parked_wait_is_answered_when_the_lookup_settles(gated: Gated) -> None:
    hashes = w.chunk_hashes(256, seed=2, n_chunks=1)
    with w.raw_dealer(gated.address) as waiter, w.raw_dealer(gated.address) as other:
        registered(waiter)
        assert w.call(waiter, p.Lookup("r", hashes))[0] == p.Ack()
        w.send_raw(waiter, [p.encode(p.Wait("r", 30.0))])
        # The parked WAIT does not hold up another client...
        assert isinstance(w.call(other, p.Ping())[0], p.Pong)
        registered(other)
        assert w.call(other, p.Query("none"))[0] == p.Error(
            "no_session", "no session 'none'; send lookup first"
        )
        assert waiter.poll(0) == 0  # ...and is still unanswered: the gate is shut
        gated.gate.set()
        assert w.recv_reply(waiter)[0].hit_chunks == 0


def test_client_lookup_state_pending_then_done(gated: Gated) -> None:
    client = CacheClient(w.client_config(gated.address, shm=False))
    try:
        state = client.lookup("r", w.chunk_hashes(256, seed=3, n_chunks=2))
        assert state.acked and not state.done and state.hit_chunks is None
        assert client.query(state) is None
        assert (state.done, state.polls) == (False, 1)
        gated.gate.set()
        assert client.query(state, timeout_s=10.0) == 0
        assert (state.done, state.hit_chunks, state.polls) == (True, 0, 2)
        assert client.query(state) == 0  # answered from the state: no third round trip
        assert state.polls == 2
        assert client.stats.errors == {}
    finally:
        client.close()


def test_parked_wait_never_blocks_the_loop(gated: Gated, monkeypatch: pytest.MonkeyPatch) -> None:
    """At its deadline a parked WAIT answers None at once. Regression: the loop
    used to call ``collect(handle, timeout_s)`` on the still-pending lookup and
    sit in it for another ``timeout_s``, serving nobody (the transport's
    docstring: "a WAIT never blocks other clients")."""
    blocking: list[float | None] = []
    collect = gated.storage.collect

    def spy(handle: PrefetchHandle, timeout: float | None = None) -> Any:
        if handle.result() is None and (timeout is None or timeout > 0):
            blocking.append(timeout)
        return collect(handle, timeout)

    monkeypatch.setattr(gated.storage, "collect", spy)
    with w.raw_dealer(gated.address) as socket:
        registered(socket)
        assert w.call(socket, p.Lookup("r", w.chunk_hashes(256, seed=4, n_chunks=1)))[0] == p.Ack()
        assert w.call(socket, p.Wait("r", 0.2))[0].hit_chunks is None
    assert blocking == []  # was [0.2]: the loop waited another 0.2 s


# ------------------------------------------------------------------ live


def test_query_answers_once_and_retrieve_follows(server: Server) -> None:
    hashes = w.chunk_hashes(256, seed=5, n_chunks=3)
    data = [d.tobytes() for d in w.payloads(5, 3, SIZE)]
    with w.raw_dealer(server.rpc) as socket:
        registered(socket)
        assert w.call(socket, p.Store("s", hashes), data)[0] == p.Committed(3)
        assert w.call(socket, p.Lookup("r", hashes))[0] == p.Ack()
        assert w.call(socket, p.Wait("r", 10.0))[0].hit_chunks == 3
        assert error_code(w.call(socket, p.Query("r"))[0]) == "consumed"
        # Consumed does not drop the locks: the hit can still be retrieved.
        objects, frames = w.call(socket, p.Retrieve("r", 1, 3))
        assert isinstance(objects, p.Objects) and frames == data[1:]
        assert w.call(socket, p.Release("r", 0, 3))[0] == p.Ack()
        assert error_code(w.call(socket, p.Retrieve("r", 0, 1))[0]) == "released"

        # A miss is 0, answered once as well.
        other = w.chunk_hashes(256, seed=6, n_chunks=2)
        assert w.call(socket, p.Lookup("m", other))[0] == p.Ack()
        assert w.call(socket, p.Wait("m", 10.0))[0].hit_chunks == 0
        assert error_code(w.call(socket, p.Wait("m", 1.0))[0]) == "consumed"

        # A session made by STORE_RESERVE has no lookup to ask about.
        reserved, _ = w.call(socket, p.StoreReserve("w", w.chunk_hashes(256, seed=9, n_chunks=1)))
        assert isinstance(reserved, p.Reserved)
        assert w.call(socket, p.StoreAbort(reserved.reservation))[0] == p.Ack()
        assert error_code(w.call(socket, p.Query("w"))[0]) == "no_lookup"
        assert error_code(w.call(socket, p.Query("s"))[0]) == "no_session"  # bytes STORE: none
        assert error_code(w.call(socket, p.Query("never"))[0]) == "no_session"


def test_end_session_and_a_new_lookup_release_locks(server: Server) -> None:
    hashes = w.chunk_hashes(256, seed=7, n_chunks=2)
    data = [d.tobytes() for d in w.payloads(7, 2, SIZE)]

    def held(socket: zmq.Socket[bytes]) -> int:
        return int(w.status_via(socket)["storage"]["held_lookup_locks"])

    with w.raw_dealer(server.rpc) as socket:
        registered(socket)
        assert w.call(socket, p.Store("s", hashes), data)[0] == p.Committed(2)
        assert w.call(socket, p.Lookup("r", hashes))[0] == p.Ack()
        assert w.call(socket, p.Wait("r", 10.0))[0].hit_chunks == 2
        assert held(socket) == 2
        # The same request id again replaces the session and drops its locks.
        assert w.call(socket, p.Lookup("r", hashes[:1]))[0] == p.Ack()
        assert w.call(socket, p.Wait("r", 10.0))[0].hit_chunks == 1
        assert held(socket) == 1
        assert w.call(socket, p.EndSession("r"))[0] == p.Ack()
        assert held(socket) == 0
        assert error_code(w.call(socket, p.EndSession("r"))[0]) == "no_session"
        assert error_code(w.call(socket, p.Retrieve("r", 0, 1))[0]) == "no_session"
        # A second hello from the same socket ends its sessions too.
        assert w.call(socket, p.Lookup("q", hashes))[0] == p.Ack()
        assert w.call(socket, p.Wait("q", 10.0))[0].hit_chunks == 2
        assert held(socket) == 2
        registered(socket)
        assert held(socket) == 0


def test_refused_store_reserve_leaves_no_reservation(server: Server) -> None:
    """Regression: STORE_RESERVE with an invalid request_id was refused after its
    reservation was made, leaking the reservation and its staged L1 memory."""
    hashes = w.chunk_hashes(256, seed=8, n_chunks=2)
    with w.raw_dealer(server.rpc) as socket:
        assert isinstance(w.call(socket, w.hello(shm=True))[0], p.Welcome)
        for request_id in ("", "x" * 257):
            reply, _ = w.call(socket, p.StoreReserve(request_id, hashes))
            assert error_code(reply) == "bad_request"
        tables = w.status_via(socket)
        assert tables["store_reservations"] == 0  # was 2
        assert tables["storage"]["l1"]["staging_objects"] == 0
        # (When they leaked, not even dropping the client gave them back.)
        assert isinstance(w.call(socket, w.hello(shm=True))[0], p.Welcome)
        assert w.status_via(socket)["store_reservations"] == 0


def test_a_slow_call_holds_up_no_other_engine_thread(gated: Gated) -> None:
    """Issue 15's finding: ``CacheClient`` held its lock across socket waits, so
    every engine thread queued behind one slow call (the heartbeat too). Now
    one thread's WAIT stays parked on a shut gate while seven others, sharing
    the same client, finish 20 requests each; the client counts the requests
    it had on the wire at once."""
    client = CacheClient(w.client_config(gated.address, shm=False))
    slow_done = threading.Event()
    seen_slow_done: list[bool] = []

    def slow() -> None:
        state = client.lookup("slow", w.chunk_hashes(256, seed=30, n_chunks=2), wait_s=30.0)
        assert state.hit_chunks == 0  # a miss, once the gate opens
        slow_done.set()

    def fast(i: int) -> None:
        hashes = w.chunk_hashes(256, seed=40 + i, n_chunks=1)
        for j in range(20):
            assert client.ping()
            assert client.store(f"s{i}-{j}", hashes, w.payloads(40 + i, 1, SIZE)) == 1
        seen_slow_done.append(slow_done.is_set())

    try:
        waiter = threading.Thread(target=slow)
        waiter.start()
        workers = [threading.Thread(target=fast, args=(i,)) for i in range(7)]
        for worker in workers:
            worker.start()
        for worker in workers:
            worker.join(timeout=60)
        assert seen_slow_done == [False] * 7  # all finished while the slow call waited
        assert client.stats.peak_in_flight >= 2
        gated.gate.set()
        waiter.join(timeout=60)
        assert slow_done.is_set()
        assert client.stats.errors == {} and client.stats.degraded_requests == 0
    finally:
        gated.gate.set()
        client.close()


def test_a_closed_client_drops_late_calls_without_raising(gated: Gated) -> None:
    """Review finding: a release or shadow report after ``close()`` wrote to
    the closed wake-up pipe and raised OSError into the engine."""
    client = CacheClient(w.client_config(gated.address, shm=False))
    assert client.ping()
    client.close()
    client.release("r", 0, 1, wait=False)
    client.end_session("r", wait=False)
    client.report_shadow(1, 0)
    assert client.ping() is False
