"""The event publisher sleeps until there is something to do: a tier's report
wakes it (its heartbeat is an hour away here), and so does ``close()``."""

from __future__ import annotations

import threading
from collections.abc import Iterator

import pytest

from kvtier.events.publisher import EventPublisher, EventsConfig
from kvtier.events.residency import L1_TIER, Residency
from kvtier.keys import ObjectKey
from tests.integration.harness import wait_for

HOUR = 3600.0


@pytest.fixture
def publisher() -> Iterator[EventPublisher]:
    config = EventsConfig(endpoint="tcp://127.0.0.1:*", interval_s=0.005, heartbeat_s=HOUR)
    pub = EventPublisher(config, Residency(256))
    pub.start()
    try:
        yield pub
    finally:
        pub.close()


def next_seq(pub: EventPublisher) -> object:
    return pub.status()["next_seq"]


def test_a_report_wakes_the_publisher(publisher: EventPublisher) -> None:
    assert wait_for(lambda: next_seq(publisher), lambda seq: seq == 1) == 1  # batch 0: cleared
    for n in range(2, 5):  # each report comes while it sleeps
        publisher.residency.added(L1_TIER, [ObjectKey(n.to_bytes(32, "big"), "m", 0)])
        assert wait_for(lambda: next_seq(publisher), lambda seq, n=n: seq == n) == n
    assert publisher.status()["pending_reports"] == 0
    assert publisher.status()["events"] == 1 + 3  # AllBlocksCleared, then one per report


def test_close_wakes_a_sleeping_publisher(publisher: EventPublisher) -> None:
    assert wait_for(lambda: next_seq(publisher), lambda seq: seq == 1) == 1
    publisher.close()  # the fixture's close() after this one does nothing more
    assert "kvtier-events" not in [t.name for t in threading.enumerate()]
