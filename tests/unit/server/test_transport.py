"""The server loop in process: nothing a request, the tick or a reply does can
end it; parked WAITs are bounded and never wait on a NaN; other threads run
work on it (``call``) and it serves the descriptors it watches."""

from __future__ import annotations

import contextlib
import math
import os
import queue
import threading
from collections.abc import Iterator
from concurrent.futures import Future
from typing import Any

import pytest
import zmq

from kvtier.l1 import L1Config
from kvtier.protocol import messages as p
from kvtier.server.core import CacheServer
from kvtier.server.transport import LoopStopped, ServerTransport
from kvtier.storage import StorageConfig, StorageManager
from tests import storage_parts
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
    adapter: Any = storage_parts.adapters(storage)[0]
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


# ------------------------------------------- other threads, through the loop


def test_a_connection_is_named_on_the_loop(loop: Loop) -> None:
    """The ZAP handler has no thread: the loop answers it, once per connection."""
    assert isinstance(loop.call(p.Ping()), p.Pong)
    assert isinstance(loop.call(p.Ping()), p.Pong)
    assert loop.counters()["connections"] == 1


def test_call_runs_on_the_loop_and_returns_what_it_returns(loop: Loop) -> None:
    assert loop.transport.call(threading.get_ident, 10) == loop.thread.ident
    assert loop.transport.call(lambda: 6 * 7, 10) == 42


def test_call_raises_what_the_call_raised(loop: Loop) -> None:
    def unknown() -> None:
        raise LookupError("no tenant 'x'")

    with pytest.raises(LookupError, match="no tenant 'x'"):
        loop.transport.call(unknown, 10)
    assert "loop_errors" not in loop.counters()  # the caller's failure, not the loop's
    assert isinstance(loop.call(p.Ping()), p.Pong)


@contextlib.contextmanager
def busy_loop(loop: Loop) -> Iterator[None]:
    """The loop runs a call that blocks it until the block ends."""
    busy, release = threading.Event(), threading.Event()

    def block() -> None:
        busy.set()
        assert release.wait(30), "the test never released the loop"

    blocker = threading.Thread(target=loop.transport.call, args=(block, 30))
    blocker.start()
    assert busy.wait(10)  # the loop runs ``block`` now: nothing else runs there
    try:
        yield
    finally:
        release.set()
        blocker.join(10)


def test_a_call_the_loop_does_not_get_to_in_time_fails_and_never_runs(loop: Loop) -> None:
    ran: list[int] = []
    not_run = r"did not get to this call within 0\.2 s; it was not"
    with busy_loop(loop), pytest.raises(TimeoutError, match=not_run):
        loop.transport.call(lambda: ran.append(1), 0.2)
    assert loop.transport.call(lambda: "after", 10) == "after"  # the loop went past it
    assert ran == []


def test_a_call_still_running_at_its_deadline_says_so(loop: Loop) -> None:
    release = threading.Event()
    with pytest.raises(TimeoutError, match=r"within 0\.2 s; it still runs and may take effect"):
        loop.transport.call(lambda: release.wait(30), 0.2)
    release.set()
    assert loop.transport.call(lambda: "after", 10) == "after"


def test_many_concurrent_calls_each_run_once_on_the_loop(loop: Loop) -> None:
    ran: list[tuple[int, int | None]] = []
    answers: queue.SimpleQueue[object] = queue.SimpleQueue()

    def caller(i: int) -> None:
        def on_loop() -> int:
            ran.append((i, threading.get_ident()))
            return i

        answers.put(loop.transport.call(on_loop, 10))

    callers = [threading.Thread(target=caller, args=(i,)) for i in range(64)]
    for t in callers:
        t.start()
    for t in callers:
        t.join(30)
    assert sorted(answers.get_nowait() for _ in range(64)) == list(range(64))  # type: ignore[type-var]
    assert sorted(ran) == [(i, loop.thread.ident) for i in range(64)]


def test_calls_that_time_out_on_a_busy_loop_never_run_later(loop: Loop) -> None:
    ran: list[int] = []
    errors: queue.SimpleQueue[BaseException] = queue.SimpleQueue()

    def caller(i: int) -> None:
        try:
            loop.transport.call(lambda: ran.append(i), 0.2)
        except TimeoutError as exc:
            errors.put(exc)

    with busy_loop(loop):
        callers = [threading.Thread(target=caller, args=(i,)) for i in range(64)]
        for t in callers:
            t.start()
        for t in callers:
            t.join(30)
    assert loop.transport.call(lambda: "after", 10) == "after"  # past every queued call
    assert ran == []
    messages = {str(errors.get_nowait()) for _ in range(64)}
    assert messages == {"the server loop did not get to this call within 0.2 s; it was not run"}


def test_a_call_that_finishes_just_after_its_deadline_returns_its_result(
    loop: Loop, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The loop finishes the call between the caller's deadline and its attempt
    to cancel: the call took effect, so its caller gets its result."""
    release = threading.Event()

    class LateFuture(Future[Any]):
        def cancel(self) -> bool:
            release.set()  # the deadline passed: now let the call finish
            self.exception(10)
            return super().cancel()

    monkeypatch.setattr("kvtier.server.transport.Future", LateFuture)
    assert loop.transport.call(lambda: release.wait(30) and "done", 0.2) == "done"


@pytest.mark.parametrize("timeout", [0.0, -1.0, math.nan])
def test_a_call_needs_a_positive_timeout(loop: Loop, timeout: float) -> None:
    with pytest.raises(ValueError, match=f"call: timeout_s must be > 0 seconds, got {timeout}"):
        loop.transport.call(lambda: None, timeout)


def test_a_call_after_the_loop_stopped_fails_at_once(loop: Loop) -> None:
    loop.stop.set()
    loop.transport.wake()
    loop.thread.join(10)
    assert not loop.thread.is_alive()
    with pytest.raises(LoopStopped, match="the server loop has stopped"):
        loop.transport.call(lambda: None, 10)


def test_a_watched_descriptor_is_served_on_the_loop(loop: Loop) -> None:
    read, write = os.pipe()
    seen: queue.SimpleQueue[tuple[bytes, int]] = queue.SimpleQueue()

    def readable() -> None:
        seen.put((os.read(read, 16), threading.get_ident()))

    try:
        loop.transport.call(lambda: loop.transport.watch(read, readable), 10)
        os.write(write, b"x")
        assert seen.get(timeout=10) == (b"x", loop.thread.ident)
        loop.transport.call(lambda: loop.transport.unwatch(read), 10)
    finally:
        os.close(read)
        os.close(write)
