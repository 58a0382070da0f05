"""The store controller through StorageManager: store policies, read locks
held only while an L2 store runs, the in-flight bound, objects evicted before
their turn, store failures and bad store input."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kvtier.controllers import StoreConfig
from kvtier.keys import ObjectKey
from kvtier.l1 import L1Result
from kvtier.l2.fs import FSAdapter
from kvtier.l2.mock import MockAdapter
from kvtier.layout import KVLayout
from kvtier.storage import StorageManager
from tests import storage_parts
from tests.conftest import FakeClock, S, make_key
from tests.ledger import assert_clean
from tests.unit.controllers import (
    LAYOUT,
    OBJ,
    PAGE,
    Stack,
    adapter,
    assert_settled,
    counters,
    failures,
    payload,
    wait_until,
)


@pytest.fixture
def stack(tmp_path: Path) -> Iterator[Stack]:
    made = Stack(tmp_path)
    yield made
    made.close_all()


def fs_files(fs: FSAdapter) -> list[Path]:
    return sorted(fs.root.rglob("*.kv"))


def store_status(storage: StorageManager) -> dict[str, object]:
    status = storage.status()["store"]
    assert isinstance(status, dict)
    return status


# ------------------------------------------------------------------ policies


def test_policy_all_writes_every_object_to_every_writable_adapter(stack: Stack) -> None:
    storage = stack.build({"type": "mock"}, stack.fs())
    mock, fs = storage_parts.adapters(storage)
    assert isinstance(mock, MockAdapter) and isinstance(fs, FSAdapter)
    keys = [make_key(i) for i in range(5)]
    assert storage.store(keys, [payload(i) for i in range(5)], LAYOUT) == [L1Result.SUCCESS] * 5
    assert storage.flush(timeout=10)
    assert set(mock.keys()) == set(keys)
    assert [p.name for p in fs_files(fs)] == sorted(f"{k.to_str()}.kv" for k in keys)
    status = store_status(storage)
    assert counters(status, "stored_objects.mock") == 5
    assert counters(status, "stored_objects.fs") == 5
    assert counters(status, "stored_bytes.fs") == fs.status()["used_bytes"]
    assert counters(status, "stored_bytes.mock") == mock.status()["used_bytes"]
    assert counters(status, "failed_objects.mock") == counters(status, "failed_objects.fs") == 0
    assert mock.status()["store_keys"] == fs.status()["store_keys"] == 5
    assert_settled(storage)


def test_write_false_excludes_an_adapter_from_write_back(stack: Stack) -> None:
    storage = stack.build({"type": "mock", "write": False}, stack.fs())
    mock, fs = storage_parts.adapters(storage)
    assert isinstance(mock, MockAdapter) and isinstance(fs, FSAdapter)
    keys = [make_key(i) for i in range(3)]
    storage.store(keys, [payload(i) for i in range(3)], LAYOUT)
    assert storage.flush(timeout=10)
    assert mock.keys() == []
    assert counters(mock.status(), "store_keys") == 0
    assert fs.status()["objects"] == 3
    status = store_status(storage)
    assert "stored_objects.mock" not in status
    assert counters(status, "stored_objects.fs") == 3
    assert_settled(storage)


def test_hit_count_policy_writes_an_object_after_its_second_hit(stack: Stack) -> None:
    storage = stack.build({"type": "mock"}, store=StoreConfig(policy="hit_count>=2"))
    (mock,) = storage_parts.adapters(storage)
    assert isinstance(mock, MockAdapter)
    keys = [make_key(i) for i in range(3)]
    storage.store(keys, [payload(i) for i in range(3)], LAYOUT)
    assert storage.flush(timeout=10)
    assert mock.keys() == []  # admitted, never hit
    assert store_status(storage)["candidates"] == 3

    assert storage.lookup(keys[:2], LAYOUT).hit_chunks == 2  # first hit of 0 and 1
    storage.release(keys[:2])
    assert storage.flush(timeout=10)
    assert mock.keys() == []

    assert storage.lookup(keys[:1], LAYOUT).hit_chunks == 1  # second hit of 0 only
    storage.release(keys[:1])
    assert storage.flush(timeout=10)
    assert mock.keys() == [keys[0]]

    assert storage.lookup(keys, LAYOUT).hit_chunks == 3  # second hit of 1, first of 2
    storage.release(keys)
    assert storage.flush(timeout=10)
    assert set(mock.keys()) == {keys[0], keys[1]}
    status = store_status(storage)
    assert counters(status, "stored_objects.mock") == 2
    assert status["candidates"] == 1
    assert_settled(storage)


def test_an_object_written_again_under_another_layout_is_not_written_back_as_the_first(
    stack: Stack,
) -> None:
    """A write-back reads its object under the layout it was admitted with:
    one evicted while queued and written again under another layout (same
    size, same key: a client that does not fold the layout into its hashes)
    is skipped, never sent to L2 under the first layout's header (a reader
    of the first layout would then load the second's bytes as a hit)."""
    other = KVLayout(1, 1, 64, "bfloat16", 32)
    config = StoreConfig(policy="hit_count>=1", max_inflight_bytes=OBJ)
    storage = stack.build({"type": "mock"}, store=config)
    (mock,) = storage_parts.adapters(storage)
    assert isinstance(mock, MockAdapter)
    gate = stack.gate(mock, "_store")
    ahead, key = make_key(0), make_key(1)
    storage.store([ahead, key], [payload(0), payload(1)], LAYOUT)
    assert storage.lookup([ahead], LAYOUT).hit_chunks == 1  # its write-back is held
    storage.release([ahead])
    gate.wait_for(lambda g: g.calls >= 1, "the first write-back to reach the adapter")
    assert storage.lookup([key], LAYOUT).hit_chunks == 1  # queued behind it
    storage.release([key])
    wait_until(lambda: store_status(storage)["queued_objects"] == 1, "the second to queue")
    assert storage.delete_l1([key]) == [S]
    assert storage.store([key], [payload(9)], other) == [S]
    gate.open()
    assert storage.flush(timeout=10)
    assert mock.keys() == [ahead]
    assert counters(store_status(storage), "skipped_evicted") == 1
    assert storage.delete_l1([key]) == [S]
    assert storage.lookup([key], LAYOUT).hit_chunks == 0
    assert_settled(storage)


def test_policy_none_writes_nothing(stack: Stack) -> None:
    storage = stack.build({"type": "mock"}, stack.fs(), store=StoreConfig(policy="none"))
    mock, fs = storage_parts.adapters(storage)
    assert isinstance(mock, MockAdapter) and isinstance(fs, FSAdapter)
    keys = [make_key(i) for i in range(4)]
    storage.store(keys, [payload(i) for i in range(4)], LAYOUT)
    assert storage.lookup(keys, LAYOUT).hit_chunks == 4  # hits do not trigger writes either
    storage.release(keys)
    assert storage.flush(timeout=10)
    assert mock.keys() == []
    assert fs_files(fs) == []
    assert counters(mock.status(), "store_keys") == counters(fs.status(), "store_keys") == 0
    status = store_status(storage)
    assert status["policy"] == "none"
    assert [k for k in status if k.startswith(("stored_", "failed_", "skipped_"))] == []
    assert counters(status, "queued_objects") == counters(status, "inflight_bytes") == 0
    assert_settled(storage)


def test_unknown_policy_is_refused() -> None:
    with pytest.raises(ValueError, match="hit_count>=N"):
        StoreConfig(policy="sometimes")


# -------------------------------------------------- locks and in-flight bound


def test_locked_until_written_back_and_at_most_one_batch_in_flight(stack: Stack) -> None:
    """Every L2 store is held at the adapter until the test lets it through. The
    adapter has threads for several batches, yet at every step exactly one
    batch is outstanding and only its objects are fenced in L1. Every object
    not yet written back stays read-locked (pinned since its admission), so
    L1 cannot evict it first; once written, nothing of it is held."""
    batch = 2
    storage = stack.build(
        {"type": "mock", "io_threads": 8},
        store=StoreConfig(batch_objects=batch, max_inflight_bytes=batch * OBJ),
    )
    (mock,) = storage_parts.adapters(storage)
    gate = stack.gate(mock, "_store")
    keys = [make_key(i) for i in range(8)]
    storage.store(keys, [payload(i) for i in range(8)], LAYOUT)
    for step in range(1, 5):
        queued = len(keys) - step * batch
        wait_until(
            lambda queued=queued: (
                gate.active_bytes == batch * OBJ
                and store_status(storage).get("queued_objects") == queued
            ),
            f"batch {step} to be in flight with {queued} objects queued",
        )
        in_flight = keys[(step - 1) * batch : step * batch]
        assert sorted(gate.keys[-batch:], key=keys.index) == in_flight
        assert len(gate.keys) == step * batch
        audit = storage.l1_audit()
        pending = len(keys) - (step - 1) * batch  # in flight or queued
        assert audit["read_locks"] == pending and audit["io_fences"] == batch, audit
        assert storage.delete_l1(keys[(step - 1) * batch :]) == [L1Result.LOCKED] * pending
        assert store_status(storage)["inflight_bytes"] == batch * OBJ
        assert store_status(storage)["pinned_bytes"] == queued * OBJ
        gate.release_entered()
    assert storage.flush(timeout=10)
    assert gate.peak_bytes == batch * OBJ
    assert mock.status()["store_keys"] == mock.status()["store_ok"] == 8
    assert set(mock.keys()) == set(keys)
    assert_settled(storage)
    assert storage.delete_l1(keys) == [L1Result.SUCCESS] * 8  # nothing kept locked


def test_in_flight_bytes_stay_under_a_bound_that_is_not_a_whole_batch(stack: Stack) -> None:
    storage = stack.build(
        {"type": "mock", "io_threads": 8},
        store=StoreConfig(batch_objects=2, max_inflight_bytes=3 * OBJ),
    )
    (mock,) = storage_parts.adapters(storage)
    gate = stack.gate(mock, "_store")
    keys = [make_key(i) for i in range(8)]
    storage.store(keys, [payload(i) for i in range(8)], LAYOUT)

    def launched() -> int:  # objects taken off the queue by the first launch round
        return len(keys) - counters(store_status(storage), "queued_objects")

    wait_until(
        lambda: "queued_objects" in store_status(storage) and gate.active_bytes == launched() * OBJ,
        "the first launch round to reach the adapter",
    )
    assert gate.active_bytes <= 3 * OBJ  # 4 * OBJ: two batches of two
    gate.open()
    assert storage.flush(timeout=10)
    assert_settled(storage)


def test_objects_not_yet_written_back_are_never_evicted(stack: Stack) -> None:
    """A tiny L1 while the first L2 store is held: every admitted object stays
    locked until written, so once L1 is full of them a new store is refused
    (OUT_OF_MEMORY: it is not reported as stored) instead of evicting one."""
    storage = stack.build(
        {"type": "mock"},
        l1_bytes=16 * PAGE,  # eight objects
        store=StoreConfig(batch_objects=1, max_inflight_bytes=OBJ, pinned_fraction=1.0),
    )
    (mock,) = storage_parts.adapters(storage)
    assert isinstance(mock, MockAdapter)
    gate = stack.gate(mock, "_store")
    keys = [make_key(i) for i in range(10)]
    data = [payload(i) for i in range(10)]
    storage.store(keys[:1], data[:1], LAYOUT)
    gate.wait_for(lambda g: g.active_bytes == OBJ, "the first store to be in flight")
    results = [storage.store([k], [d], LAYOUT)[0] for k, d in zip(keys[1:], data[1:], strict=True)]
    assert results == [L1Result.SUCCESS] * 7 + [L1Result.OUT_OF_MEMORY] * 2
    assert storage.l1_status()["evictions"] == 0
    assert storage.delete_l1(keys[:8]) == [L1Result.LOCKED] * 8
    gate.open()
    assert storage.flush(timeout=10)
    status = store_status(storage)
    assert counters(status, "stored_objects.mock") == 8
    assert "skipped_evicted" not in status
    assert set(mock.keys()) == set(keys[:8])
    assert_settled(storage)
    assert storage.store(keys[8:], data[8:], LAYOUT) == [L1Result.SUCCESS] * 2  # room again
    assert storage.flush(timeout=10)
    assert_settled(storage)


def test_past_the_pinned_bound_objects_may_go_before_their_turn(stack: Stack) -> None:
    storage = stack.build(
        {"type": "mock"},
        l1_bytes=32 * PAGE,  # 16 objects
        store=StoreConfig(batch_objects=1, max_inflight_bytes=OBJ, pinned_fraction=0.125),
    )
    (mock,) = storage_parts.adapters(storage)
    assert isinstance(mock, MockAdapter)
    gate = stack.gate(mock, "_store")
    keys = [make_key(i) for i in range(4)]
    storage.store(keys, [payload(i) for i in range(4)], LAYOUT)
    wait_until(
        lambda: gate.active_bytes == OBJ and store_status(storage).get("queued_objects") == 3,
        "the first object to be in flight",
    )
    assert store_status(storage)["unpinned_over_bound"] == 2
    assert storage.delete_l1(keys[:2]) == [L1Result.LOCKED] * 2  # in flight, pinned
    assert storage.delete_l1(keys[2:]) == [L1Result.SUCCESS] * 2  # queued, unpinned
    gate.open()
    assert storage.flush(timeout=10)
    status = store_status(storage)
    assert status["skipped_evicted"] == 2
    assert counters(status, "stored_objects.mock") == 2
    assert set(mock.keys()) == set(keys[:2])
    assert_settled(storage)


# ------------------------------------------------------------------ failures


def test_store_failures_are_counted_and_nothing_reaches_l2(stack: Stack) -> None:
    storage = stack.build({"type": "mock", "fail_store_rate": 1.0})
    (mock,) = storage_parts.adapters(storage)
    assert isinstance(mock, MockAdapter)
    keys = [make_key(i) for i in range(4)]
    assert storage.store(keys, [payload(i) for i in range(4)], LAYOUT) == [L1Result.SUCCESS] * 4
    assert storage.flush(timeout=10)
    status = store_status(storage)
    assert counters(status, "failed_objects.mock") == 4
    assert counters(status, "stored_objects.mock") == 0
    assert counters(status, "stored_bytes.mock") == 0
    assert mock.keys() == []
    assert failures(mock) == {"error": 4}
    assert storage.delete_l1(keys) == [L1Result.SUCCESS] * 4
    result = storage.lookup(keys, LAYOUT)
    assert (result.hit_chunks, dict(result.objects_by_tier)) == (0, {})
    assert_settled(storage)


def test_store_failures_on_one_adapter_do_not_stop_the_other(stack: Stack) -> None:
    storage = stack.build({"type": "mock", "name": "bad", "fail_store_rate": 1.0}, stack.fs())
    bad, fs = adapter(storage, "bad"), adapter(storage, "fs")
    assert isinstance(bad, MockAdapter)
    keys = [make_key(i) for i in range(3)]
    storage.store(keys, [payload(i) for i in range(3)], LAYOUT)
    assert storage.flush(timeout=10)
    status = store_status(storage)
    assert counters(status, "failed_objects.bad") == 3
    assert counters(status, "stored_objects.fs") == 3
    assert bad.keys() == [] and fs.status()["objects"] == 3
    assert_settled(storage)


def test_objects_l1_readmits_are_not_written_again(stack: Stack) -> None:
    """The soak's finding: 87,040 objects (11.4 GB) written to the fs L2 for
    960 distinct ones, because an object re-admitted to L1 was written to
    every adapter again. Now each adapter is asked first."""
    storage = stack.build(stack.fs(), {"type": "mock"})
    fs, mock = storage_parts.adapters(storage)
    keys = [make_key(i) for i in range(10)]
    data = [payload(i) for i in range(10)]
    for _ in range(5):  # stored, dropped from L1, stored again by the next request
        assert storage.store(keys, data, LAYOUT) == [L1Result.SUCCESS] * 10
        assert storage.flush(timeout=10)
        assert storage.delete_l1(keys) == [L1Result.SUCCESS] * 10
    status = store_status(storage)
    for a in (fs, mock):
        assert counters(a.status(), "store_keys") == 50  # asked about every time...
        assert counters(a.status(), "store_present") == 40  # ...written once
        assert counters(status, f"stored_objects.{a.name}") == 50
    assert counters(status, "stored_bytes.fs") == fs.status()["used_bytes"]  # ten files' worth
    assert fs.status()["objects"] == 10
    assert_settled(storage)


# ------------------------------------------------------------- re-seeding


def outage(storage: StorageManager, mock: MockAdapter, clock: FakeClock, *, wipe: bool) -> None:
    """The backend goes away (emptied, if ``wipe``), a lookup finds it down,
    it comes back and the next lookup finds it answering again."""
    mock.faults.unreachable = True
    if wipe:
        mock.wipe()
    probe = [make_key(1000)]  # never stored: every lookup asks the mock
    assert storage.lookup(probe, LAYOUT).hit_chunks == 0
    mock.faults.unreachable = False
    clock.advance(60.0)
    assert storage.lookup(probe, LAYOUT).hit_chunks == 0
    assert mock.recoveries == 1


def test_a_store_that_comes_back_empty_is_reseeded_from_l1(stack: Stack, clock: FakeClock) -> None:
    storage = stack.build({"type": "mock"}, stack.fs())
    mock, _ = storage_parts.adapters(storage)
    assert isinstance(mock, MockAdapter)
    mock.clock = clock
    keys = [make_key(i) for i in range(6)]
    storage.store(keys, [payload(i) for i in range(6)], LAYOUT)
    assert storage.flush(timeout=10)
    storage.delete_l1(keys[4:])  # L1 keeps four
    outage(storage, mock, clock, wipe=True)
    assert storage.flush(timeout=10)  # re-seeding is part of what flush waits for
    assert set(mock.keys()) == set(keys[:4])  # what L1 held; the rest is gone for good
    status = store_status(storage)
    assert counters(status, "reseeds.mock") == 1
    assert counters(status, "reseeded_objects.mock") == 4
    assert "reseeds.fs" not in status  # the fs adapter never failed
    assert counters(mock.status(), "store_present") == 0
    storage.delete_l1(keys[:4])
    result = storage.lookup(keys, LAYOUT)  # fs has all six; the mock is asked first
    assert (result.hit_chunks, dict(result.objects_by_tier)) == (6, {"mock": 4, "fs": 2})
    storage.release(keys)
    assert_settled(storage)


def test_a_store_that_kept_its_objects_costs_only_a_lookup_to_reseed(
    stack: Stack, clock: FakeClock
) -> None:
    storage = stack.build({"type": "mock"})
    (mock,) = storage_parts.adapters(storage)
    assert isinstance(mock, MockAdapter)
    mock.clock = clock
    keys = [make_key(i) for i in range(4)]
    storage.store(keys, [payload(i) for i in range(4)], LAYOUT)
    assert storage.flush(timeout=10)
    outage(storage, mock, clock, wipe=False)
    assert storage.flush(timeout=10)
    assert counters(store_status(storage), "reseeded_objects.mock") == 4
    assert counters(mock.status(), "store_present") == 4
    assert counters(mock.status(), "store_bytes") == counters(
        store_status(storage), "stored_bytes.mock"
    )  # nothing written twice
    assert_settled(storage)


def test_no_reseed_under_other_policies(stack: Stack, clock: FakeClock) -> None:
    storage = stack.build({"type": "mock"}, store=StoreConfig(policy="hit_count>=1"))
    (mock,) = storage_parts.adapters(storage)
    assert isinstance(mock, MockAdapter)
    mock.clock = clock
    keys = [make_key(i) for i in range(2)]
    storage.store(keys, [payload(i) for i in range(2)], LAYOUT)
    outage(storage, mock, clock, wipe=True)
    assert storage.flush(timeout=10)
    assert mock.keys() == []
    assert "reseeds.mock" not in store_status(storage)
    assert_settled(storage)


# --------------------------------------------------------- worker failures


def test_a_failing_worker_step_is_counted_and_leaves_nothing_held(
    stack: Stack, monkeypatch: pytest.MonkeyPatch
) -> None:
    storage = stack.build({"type": "mock"})
    (mock,) = storage_parts.adapters(storage)
    assert isinstance(mock, MockAdapter)
    real_fence = storage_parts.l1(storage).fence
    failures_left = [1]

    def fence(keys: list[ObjectKey], tag: Any = None) -> Any:
        if tag is None and failures_left[0]:  # the store controller's fence
            failures_left[0] -= 1
            raise RuntimeError("injected")
        return real_fence(keys, tag)

    monkeypatch.setattr(storage_parts.l1(storage), "fence", fence)
    keys = [make_key(i) for i in range(4)]
    assert storage.store(keys[:2], [payload(i) for i in range(2)], LAYOUT) == [S, S]
    assert storage.flush(timeout=10)
    assert counters(store_status(storage), "worker_errors") == 1
    assert mock.keys() == []  # that batch was dropped, its pins given back
    assert storage.store(keys[2:], [payload(i) for i in range(2, 4)], LAYOUT) == [S, S]
    assert storage.flush(timeout=10)
    assert set(mock.keys()) == set(keys[2:])  # the worker goes on
    assert_settled(storage)


def test_stop_gives_back_the_pins_of_queued_objects(stack: Stack) -> None:
    storage = stack.build(
        {"type": "mock"}, store=StoreConfig(batch_objects=1, max_inflight_bytes=OBJ)
    )
    (mock,) = storage_parts.adapters(storage)
    gate = stack.gate(mock, "_store")
    keys = [make_key(i) for i in range(4)]
    storage.store(keys, [payload(i) for i in range(4)], LAYOUT)
    gate.wait_for(lambda g: g.calls == 1, "the first store to reach the adapter")
    assert storage.l1_audit()["read_locks"] == 4
    stopping = threading.Thread(target=storage_parts.store_controller(storage).stop)
    stopping.start()
    gate.open()
    stopping.join(timeout=10)
    assert not stopping.is_alive()
    assert counters(store_status(storage), "dropped_at_stop") == 3
    assert_clean(storage)
    controller = storage_parts.store_controller(storage)
    controller.on_admitted(keys[:1], "", OBJ, pinned=False)  # after stop: ignored
    assert storage.flush(timeout=1)


# ----------------------------------------------------------------- bad input


def test_store_with_a_buffer_of_the_wrong_size_names_the_buffer(stack: Stack) -> None:
    storage = stack.build({"type": "mock"})
    (mock,) = storage_parts.adapters(storage)
    assert isinstance(mock, MockAdapter)
    keys = [make_key(i) for i in range(3)]
    buffers = [payload(0), payload(1)[:-4], payload(2)]
    with pytest.raises(ValueError, match=r"buffer 1 has 8188 bytes; the layout says 8192"):
        storage.store(keys, buffers, LAYOUT)
    with pytest.raises(ValueError, match="buffer 0 has"):
        storage.store(keys[:1], [np.zeros(OBJ, dtype=np.uint16)], LAYOUT)
    assert storage.l1_status()["resident_objects"] == 0  # nothing of the batch was stored
    assert storage.flush(timeout=10)
    assert mock.keys() == []
    assert_settled(storage)
