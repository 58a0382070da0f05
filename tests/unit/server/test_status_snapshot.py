"""The transport's status snapshot is built when a reader asks for it, not on
every tick: a server nobody reads builds none; a reader gets one at most a
tick old; a loop that has stopped, or a build that fails, leaves the last
one."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass

import pytest

from kvtier.l1 import L1Config
from kvtier.protocol.status import ServerStatus
from kvtier.server.core import CacheServer
from kvtier.server.transport import TICK_S, ServerTransport
from kvtier.storage import StorageConfig, StorageManager
from tests.integration.harness import wait_for


@dataclass
class Served:
    transport: ServerTransport
    stop: threading.Event
    thread: threading.Thread
    builds: list[float]  # the monotonic time of each status build
    ticks: list[int]  # upkeep runs (one per tick)


@pytest.fixture
def served(monkeypatch: pytest.MonkeyPatch) -> Iterator[Served]:
    storage = StorageManager(StorageConfig(l1=L1Config(size_bytes=1 << 20, populate=False)))
    core = CacheServer(storage, chunk_size=16)
    builds: list[float] = []
    real_status = core.status

    def counted_status() -> ServerStatus:
        builds.append(time.monotonic())
        return real_status()

    monkeypatch.setattr(core, "status", counted_status)
    ticks: list[int] = []
    core.upkeep.every("count_ticks", TICK_S / 2, lambda: ticks.append(1))
    transport = ServerTransport(core, "tcp://127.0.0.1:0")
    stop = threading.Event()
    thread = threading.Thread(target=transport.serve, args=(stop,), daemon=True)
    thread.start()
    yield Served(transport, stop, thread, builds, ticks)
    stop.set()
    transport.wake()
    thread.join(timeout=10)
    core.close()
    storage.close()


def stale(served: Served) -> None:
    """Wait until the last build is more than a tick old (ticks go by meanwhile)."""
    last = served.builds[-1]
    assert wait_for(time.monotonic, lambda now: now > last + TICK_S)


def test_no_status_is_built_while_nothing_reads_it(served: Served) -> None:
    assert len(wait_for(lambda: served.ticks, lambda t: len(t) >= 4)) >= 4
    assert len(served.builds) == 1  # the transport's first, at construction


def test_a_reader_gets_a_status_built_on_the_loop_at_most_a_tick_old(served: Served) -> None:
    stale(served)
    asked = time.monotonic()
    status = served.transport.snapshot
    assert len(served.builds) == 2 and served.builds[-1] >= asked
    assert isinstance(status, ServerStatus)
    again = served.transport.snapshot
    # within the tick: the same document; past it: a new build
    assert (again is status) == (len(served.builds) == 2)


def test_a_stopped_loop_leaves_the_last_status(served: Served) -> None:
    first = served.transport.snapshot
    served.stop.set()
    served.transport.wake()
    served.thread.join(timeout=10)
    assert not served.thread.is_alive()
    builds = len(served.builds)
    stale(served)
    assert served.transport.snapshot is first
    assert len(served.builds) == builds


def test_a_failing_build_is_counted_and_the_last_status_kept(
    served: Served, monkeypatch: pytest.MonkeyPatch
) -> None:
    first = served.transport.snapshot

    def broken() -> ServerStatus:
        served.builds.append(time.monotonic())
        raise RuntimeError("injected")

    monkeypatch.setattr(served.transport.core, "status", broken)
    stale(served)
    assert served.transport.snapshot is first
    assert served.transport.counters.snapshot()["loop_errors"] == 1
