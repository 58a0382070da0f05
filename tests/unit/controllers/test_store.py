"""The store controller through StorageManager: store policies, read locks
held only while an L2 store runs, the in-flight bound, objects evicted before
their turn, store failures and bad store input."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from kvtier.controllers import StoreConfig
from kvtier.l1 import L1Result
from kvtier.l2.fs import FSAdapter
from kvtier.l2.mock import MockAdapter
from kvtier.storage import StorageManager
from tests.conftest import make_key
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
    mock, fs = storage.adapters
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
    mock, fs = storage.adapters
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
    (mock,) = storage.adapters
    assert isinstance(mock, MockAdapter)
    keys = [make_key(i) for i in range(3)]
    storage.store(keys, [payload(i) for i in range(3)], LAYOUT)
    assert storage.flush(timeout=10)
    assert mock.keys() == []  # admitted, never hit
    assert store_status(storage)["candidates"] == 3

    assert storage.lookup(keys[:2]).hit_chunks == 2  # first hit of 0 and 1
    storage.release(keys[:2])
    assert storage.flush(timeout=10)
    assert mock.keys() == []

    assert storage.lookup(keys[:1]).hit_chunks == 1  # second hit of 0 only
    storage.release(keys[:1])
    assert storage.flush(timeout=10)
    assert mock.keys() == [keys[0]]

    assert storage.lookup(keys).hit_chunks == 3  # second hit of 1, first of 2
    storage.release(keys)
    assert storage.flush(timeout=10)
    assert set(mock.keys()) == {keys[0], keys[1]}
    status = store_status(storage)
    assert counters(status, "stored_objects.mock") == 2
    assert status["candidates"] == 1
    assert_settled(storage)


def test_policy_none_writes_nothing(stack: Stack) -> None:
    storage = stack.build({"type": "mock"}, stack.fs(), store=StoreConfig(policy="none"))
    mock, fs = storage.adapters
    assert isinstance(mock, MockAdapter) and isinstance(fs, FSAdapter)
    keys = [make_key(i) for i in range(4)]
    storage.store(keys, [payload(i) for i in range(4)], LAYOUT)
    assert storage.lookup(keys).hit_chunks == 4  # hits do not trigger writes either
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


def test_read_locks_only_while_storing_and_at_most_one_batch_in_flight(stack: Stack) -> None:
    """Every L2 store is held at the adapter until the test lets it through. The
    adapter has threads for several batches, yet at every step exactly one
    batch is outstanding, and only its objects are read-locked and fenced in
    L1; the queued ones are neither."""
    batch = 2
    storage = stack.build(
        {"type": "mock", "io_threads": 8},
        store=StoreConfig(batch_objects=batch, max_inflight_bytes=batch * OBJ),
    )
    (mock,) = storage.adapters
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
        audit = storage.l1.audit()
        assert audit["read_locks"] == batch and audit["io_fences"] == batch, audit
        assert storage.l1.delete(in_flight) == [L1Result.LOCKED] * batch
        assert store_status(storage)["inflight_bytes"] == batch * OBJ
        gate.release_entered()
    assert storage.flush(timeout=10)
    assert gate.peak_bytes == batch * OBJ
    assert mock.status()["store_keys"] == mock.status()["store_ok"] == 8
    assert set(mock.keys()) == set(keys)
    assert_settled(storage)
    assert storage.l1.delete(keys) == [L1Result.SUCCESS] * 8  # nothing kept locked


def test_in_flight_bytes_stay_under_a_bound_that_is_not_a_whole_batch(stack: Stack) -> None:
    storage = stack.build(
        {"type": "mock", "io_threads": 8},
        store=StoreConfig(batch_objects=2, max_inflight_bytes=3 * OBJ),
    )
    (mock,) = storage.adapters
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


def test_objects_deleted_before_their_turn_are_skipped(stack: Stack) -> None:
    storage = stack.build(
        {"type": "mock"}, store=StoreConfig(batch_objects=1, max_inflight_bytes=OBJ)
    )
    (mock,) = storage.adapters
    assert isinstance(mock, MockAdapter)
    gate = stack.gate(mock, "_store")
    keys = [make_key(i) for i in range(4)]
    storage.store(keys, [payload(i) for i in range(4)], LAYOUT)
    wait_until(
        lambda: gate.active_bytes == OBJ and store_status(storage).get("queued_objects") == 3,
        "the first object to be in flight",
    )
    assert gate.keys == keys[:1]
    assert storage.l1.delete(keys[1:3]) == [L1Result.SUCCESS] * 2  # queued: not locked
    assert storage.l1.delete(keys[:1]) == [L1Result.LOCKED]  # in flight
    gate.open()
    assert storage.flush(timeout=10)
    status = store_status(storage)
    assert status["skipped_evicted"] == 2
    assert counters(status, "stored_objects.mock") == 2
    assert set(mock.keys()) == {keys[0], keys[3]}
    assert_settled(storage)


def test_objects_evicted_before_their_turn_are_skipped(stack: Stack) -> None:
    """A tiny L1 evicts queued objects while the first store is held; exactly
    those are skipped, and the ones still resident are written."""
    storage = stack.build(
        {"type": "mock"},
        l1_bytes=16 * PAGE,  # eight objects
        store=StoreConfig(batch_objects=1, max_inflight_bytes=OBJ),
    )
    (mock,) = storage.adapters
    assert isinstance(mock, MockAdapter)
    gate = stack.gate(mock, "_store")
    keys = [make_key(i) for i in range(20)]
    data = [payload(i) for i in range(20)]
    storage.store(keys[:1], data[:1], LAYOUT)
    gate.wait_for(lambda g: g.active_bytes == OBJ, "the first store to be in flight")
    for key, buffer in zip(keys[1:], data[1:], strict=True):
        assert storage.store([key], [buffer], LAYOUT) == [L1Result.SUCCESS]
    resident = [k for k in keys if storage.l1.contains(k)]
    assert keys[0] in resident  # locked by its store: never evicted
    assert storage.l1.status()["evictions"] == len(keys) - len(resident) > 0
    gate.open()
    assert storage.flush(timeout=10)
    status = store_status(storage)
    assert status["skipped_evicted"] == len(keys) - len(resident)
    assert counters(status, "stored_objects.mock") == len(resident)
    assert set(mock.keys()) == set(resident)
    assert_settled(storage)


# ------------------------------------------------------------------ failures


def test_store_failures_are_counted_and_nothing_reaches_l2(stack: Stack) -> None:
    storage = stack.build({"type": "mock", "fail_store_rate": 1.0})
    (mock,) = storage.adapters
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
    assert storage.l1.delete(keys) == [L1Result.SUCCESS] * 4
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


# ----------------------------------------------------------------- bad input


def test_store_with_a_buffer_of_the_wrong_size_names_the_buffer(stack: Stack) -> None:
    storage = stack.build({"type": "mock"})
    (mock,) = storage.adapters
    assert isinstance(mock, MockAdapter)
    keys = [make_key(i) for i in range(3)]
    buffers = [payload(0), payload(1)[:-4], payload(2)]
    with pytest.raises(ValueError, match=r"buffer 1 has 8188 bytes; the layout says 8192"):
        storage.store(keys, buffers, LAYOUT)
    with pytest.raises(ValueError, match="buffer 0 has"):
        storage.store(keys[:1], [np.zeros(OBJ, dtype=np.uint16)], LAYOUT)
    assert storage.l1.status()["resident_objects"] == 0  # nothing of the batch was stored
    assert storage.flush(timeout=10)
    assert mock.keys() == []
    assert_settled(storage)
