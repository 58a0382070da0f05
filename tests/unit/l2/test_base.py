"""``BlockingAdapter``'s own machinery, through the mock adapter: one thread
reconnects, recoveries are counted, a failing completion callback is counted,
and the back-off runs on the adapter's clock (no sleeping in tests)."""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Iterator

import numpy as np
import pytest

from kvtier.l2 import CompletionQueue, TaskResult, make_adapter
from kvtier.l2.mock import MockAdapter
from tests.conftest import FakeClock, make_key
from tests.integration.harness import wait_for
from tests.unit.l2.harness import Harness, payload

WAIT_S = 10.0  # a guard against a hang


def blank(n: int) -> list[np.ndarray]:
    return [np.zeros(100, np.uint8) for _ in range(n)]


@pytest.fixture
def mock(clock: FakeClock) -> Iterator[Harness]:
    queue = CompletionQueue()
    options = {"backoff_initial_s": 5.0, "backoff_max_s": 5.0, "io_threads": 4}
    adapter = make_adapter({"type": "mock", **options}, queue.put)
    assert isinstance(adapter, MockAdapter)
    adapter.clock = clock
    harness = Harness(adapter, queue)
    yield harness
    adapter.close()
    harness.drain()


def the_mock(h: Harness) -> MockAdapter:
    assert isinstance(h.adapter, MockAdapter)
    return h.adapter


def failures(h: Harness) -> Counter[str]:
    found = h.adapter.status()["failures"]
    assert isinstance(found, dict)
    return Counter(found)


def test_back_off_runs_on_the_adapter_clock(mock: Harness, clock: FakeClock) -> None:
    keys = [make_key(i) for i in range(2)]
    assert mock.store(keys, [payload(100, i) for i in range(2)]).ok == (True, True)
    the_mock(mock).faults.unreachable = True
    assert mock.lookup(keys).ok == (False, False)
    the_mock(mock).faults.unreachable = False
    assert mock.lookup(keys).ok == (False, False)  # still backing off
    assert failures(mock) == {"unreachable": 2, "backoff": 2}
    clock.advance(5.0)
    assert mock.lookup(keys).ok == (True, True)
    assert mock.adapter.recoveries == 1
    assert mock.adapter.status()["recoveries"] == 1
    assert mock.lookup(keys).ok == (True, True)
    assert mock.adapter.recoveries == 1  # counted once per outage


def test_only_one_thread_reconnects(mock: Harness, clock: FakeClock) -> None:
    adapter = the_mock(mock)
    keys = [make_key(i) for i in range(4)]
    assert mock.store(keys, [payload(100, i) for i in range(4)]).ok == (True,) * 4
    adapter.faults.unreachable = True
    assert mock.lookup(keys).ok == (False,) * 4
    adapter.faults.unreachable = False
    clock.advance(5.0)
    entered, release = threading.Event(), threading.Event()
    calls: list[int] = []

    def slow_reconnect() -> None:
        calls.append(1)
        entered.set()
        assert release.wait(WAIT_S)

    adapter._reconnect = slow_reconnect  # type: ignore[method-assign]
    first = adapter.submit_load(keys[:1], blank(1))
    assert entered.wait(WAIT_S)
    # While that part reconnects, every other part is a miss without reconnecting.
    others = mock.load(keys[1:], blank(3))
    assert others.ok == (False,) * 3
    assert failures(mock)["reconnecting"] == 3
    release.set()
    assert mock.wait(first).ok == (True,)
    assert calls == [1]
    assert mock.load(keys[1:], blank(3)).ok == (True,) * 3


def test_a_failing_callback_is_counted(clock: FakeClock) -> None:
    delivered: list[TaskResult] = []

    def callback(result: TaskResult) -> None:
        delivered.append(result)
        raise RuntimeError("a broken controller")

    adapter = make_adapter({"type": "mock"}, callback)
    try:
        adapter.submit_lookup([make_key(0)])
        status = wait_for(lambda: adapter.status(), lambda s: "callback_failures" in s)
        assert status["callback_failures"] == 1
        assert len(delivered) == 1
    finally:
        adapter.close()


def test_only_keys_stored_before_are_looked_up_first(mock: Harness) -> None:
    """A new object costs no extra round trip; a re-stored one a lookup, not a write."""
    adapter = the_mock(mock)
    asked: list[int] = []
    real = adapter._lookup

    def lookup(keys: list[object]) -> list[bool]:
        asked.append(len(keys))
        return real(keys)  # type: ignore[arg-type]

    adapter._lookup = lookup  # type: ignore[method-assign,assignment]
    keys = [make_key(i) for i in range(4)]
    assert mock.store(keys[:2], [payload(100, i) for i in range(2)]).ok == (True, True)
    assert asked == []
    stored = mock.store(keys, [payload(100, i) for i in range(4)])
    assert stored.ok == (True,) * 4 and sum(asked) == 2  # the two stored before (in parts)
    assert adapter.status()["store_present"] == 2
    adapter.wipe()  # the backend lost them: stored again after the lookup
    assert mock.store(keys[:1], [payload(100, 0)]).ok == (True,)
    assert adapter.keys() == keys[:1]
