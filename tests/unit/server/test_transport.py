"""The server loop in process: nothing a request, the tick or a reply does can
end it; parked WAITs are bounded and never wait on a NaN."""

from __future__ import annotations

import math
import threading
from collections.abc import Iterator
from typing import Any

import pytest
import zmq

from kvtier.l1 import L1Config
from kvtier.protocol import messages as p
from kvtier.server.core import CacheServer
from kvtier.server.transport import ServerTransport
from kvtier.storage import StorageConfig, StorageManager
from tests.integration import workload as w
from tests.integration.harness import wait_for


class Loop:
    def __init__(self, transport: ServerTransport, gate: threading.Event) -> None:
        self.transport = transport
        self.gate = gate  # L2 lookups wait while it is clear (a pending lookup, for sure)
        self.stop = threading.Event()
        self.thread = threading.Thread(target=transport.serve, args=(self.stop,), daemon=True)
        self.thread.start()
        self.socket: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.DEALER)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.connect(transport.address)

    def call(self, message: p.Message) -> p.Reply:
        return w.call(self.socket, message)[0]

    def counters(self) -> dict[str, int]:
        return self.transport.core.transport_counters.snapshot()


MAX_MESSAGE = 1 << 20


@pytest.fixture
def loop() -> Iterator[Loop]:
    l1 = L1Config(size_bytes=1 << 20, populate=False)
    storage = StorageManager(StorageConfig(l1=l1, l2=({"type": "mock"},)))
    gate = threading.Event()
    gate.set()
    adapter: Any = storage.adapters[0]
    real_lookup = adapter._lookup

    def gated_lookup(keys: Any) -> list[bool]:
        assert gate.wait(30), "the test never opened the gate"
        result: list[bool] = real_lookup(keys)
        return result

    adapter._lookup = gated_lookup
    core = CacheServer(storage, chunk_size=256)
    transport = ServerTransport(core, "tcp://127.0.0.1:0", max_message_bytes=MAX_MESSAGE)
    running = Loop(transport, gate)
    yield running
    gate.set()
    running.socket.close(linger=0)
    running.stop.set()
    running.thread.join(timeout=10)
    core.close()
    storage.close()


def test_a_reply_that_cannot_be_encoded_becomes_an_internal_error(
    loop: Loop, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The finding: a reply with a 2**73-byte size raised OverflowError in send
    and stopped the server."""
    real = loop.transport.core.handle

    def handle(*args: Any) -> Any:
        if isinstance(args[1], p.Status):
            return p.Reserved(1, [0], [2**73]), []
        return real(*args)

    monkeypatch.setattr(loop.transport.core, "handle", handle)
    reply = loop.call(p.Status())
    assert isinstance(reply, p.Error) and reply.code == "internal"
    assert isinstance(loop.call(p.Ping()), p.Pong)
    assert loop.counters()["loop_errors"] == 1
    assert loop.thread.is_alive()


def test_a_failing_tick_is_counted_and_the_loop_goes_on(
    loop: Loop, monkeypatch: pytest.MonkeyPatch
) -> None:
    def tick() -> None:
        raise RuntimeError("injected")

    monkeypatch.setattr(loop.transport.core, "tick", tick)
    counters = wait_for(loop.counters, lambda c: c.get("loop_errors", 0) >= 2)
    assert counters["loop_errors"] >= 2
    assert isinstance(loop.call(p.Ping()), p.Pong)


def test_a_failing_request_is_an_internal_error(
    loop: Loop, monkeypatch: pytest.MonkeyPatch
) -> None:
    def handle(*args: Any) -> Any:
        raise KeyError("a bug")

    monkeypatch.setattr(loop.transport.core, "handle", handle)
    reply = loop.call(p.Ping())
    assert isinstance(reply, p.Error) and reply.code == "internal"


@pytest.mark.parametrize("timeout", [math.nan, -math.inf, -1.0])
def test_a_wait_with_no_usable_timeout_is_answered_at_once(loop: Loop, timeout: float) -> None:
    loop.gate.clear()
    assert isinstance(loop.call(w.hello(chunk_alignment=256)), p.Welcome)
    assert loop.call(p.Lookup("r", w.chunk_hashes(256, 1, 2))) == p.Ack()
    assert loop.call(p.Wait("r", timeout)) == p.QueryResult(None)  # pending: not parked


def test_one_wait_per_request_may_be_parked(loop: Loop) -> None:
    loop.gate.clear()
    assert isinstance(loop.call(w.hello(chunk_alignment=256)), p.Welcome)
    assert loop.call(p.Lookup("r", w.chunk_hashes(256, 1, 2))) == p.Ack()
    w.send_raw(loop.socket, [p.encode(p.Wait("r", math.inf))])  # parked until settled
    second = loop.call(p.Wait("r", 10.0))  # answered before the first
    assert isinstance(second, p.Error) and second.code == "busy"
    loop.gate.set()
    first, _ = w.recv_reply(loop.socket)
    assert first == p.QueryResult(0, {}, miss_reason="not_found")  # the mock has nothing


def test_an_oversized_message_closes_its_connection_and_is_counted(loop: Loop) -> None:
    """ZeroMQ drops a message over max_message_bytes with its connection, before
    the loop sees it: no reply, but a counted drop, and the server goes on."""
    w.send_raw(loop.socket, [bytes(MAX_MESSAGE + 1)])
    counters = wait_for(loop.counters, lambda c: c.get("disconnects", 0) >= 1)
    assert counters["disconnects"] >= 1
    assert isinstance(loop.call(p.Ping()), p.Pong)  # the DEALER reconnected
