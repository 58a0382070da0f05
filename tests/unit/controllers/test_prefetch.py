"""The prefetch controller through StorageManager: L1 + L2 hits, the cascade,
warm restart, corrupt copies, injected faults (load failures, hangs,
unreachable backends), concurrency, chunks of several ranks,
``retain_loaded=False`` and bad lookup input."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

import numpy as np
import numpy.typing as npt
import pytest

from kvtier.controllers import L1_TIER, LookupResult, MissReason, PrefetchConfig
from kvtier.keys import ObjectKey
from kvtier.l1 import L1Result
from kvtier.l2.base import L2Adapter
from kvtier.l2.fs import FSAdapter
from kvtier.l2.mock import MockAdapter
from kvtier.layout import KVLayout
from kvtier.storage import StorageManager
from tests import storage_parts
from tests.conftest import FakeClock, make_key
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
    prefetch_idle,
    read_back,
    seed_l2,
    wait_until,
)

Data = dict[ObjectKey, npt.NDArray[np.uint8]]


@pytest.fixture
def stack(tmp_path: Path) -> Iterator[Stack]:
    made = Stack(tmp_path)
    yield made
    made.close_all()


def the_mock(storage: StorageManager, name: str = "mock") -> MockAdapter:
    found = adapter(storage, name)
    assert isinstance(found, MockAdapter)
    return found


def prefetch_status(storage: StorageManager) -> dict[str, object]:
    return storage.status()["prefetch"]


def assert_hit(
    storage: StorageManager,
    result: LookupResult,
    keys: Sequence[ObjectKey],
    data: Data,
    hit: int,
    tiers: dict[str, int],
) -> None:
    """The result locks exactly ``keys[:hit]`` with the right bytes."""
    assert result.hit_chunks == hit
    assert dict(result.objects_by_tier) == tiers
    assert list(result.placements) == list(keys[:hit])
    assert read_back(storage, keys[:hit]) == [data[k].tobytes() for k in keys[:hit]]


def flip_last_byte(value: bytes) -> bytes:
    return value[:-1] + bytes([value[-1] ^ 0xFF])


# -------------------------------------------------------------- L1 + L2 hits


def test_l1_part_and_l2_rest_make_a_full_hit(stack: Stack) -> None:
    storage = stack.build({"type": "mock"})
    mock = the_mock(storage)
    keys = [make_key(i) for i in range(8)]
    data = seed_l2(storage, keys, keep=keys[:3])
    result = storage.lookup(keys, LAYOUT)
    assert_hit(storage, result, keys, data, 8, {L1_TIER: 3, "mock": 5})
    assert result.temporary == frozenset() and result.miss_reason is None
    assert mock.status()["lookup_keys"] == mock.status()["load_keys"] == 5
    assert mock.status()["leases"] == 0
    storage.release(keys)
    assert all(storage.in_l1(k) for k in keys)  # retain_loaded: they stay
    again = storage.lookup(keys, LAYOUT)
    assert_hit(storage, again, keys, data, 8, {L1_TIER: 8})
    storage.release(keys)
    status = prefetch_status(storage)
    assert status["hit_objects.L1"] == 11 and status["hit_objects.mock"] == 5
    assert status["loaded_objects.mock"] == 5
    assert_settled(storage)


def test_cascade_takes_each_object_from_the_first_adapter_that_has_it(stack: Stack) -> None:
    storage = stack.build({"type": "mock", "name": "a"}, {"type": "mock", "name": "b"})
    a, b = the_mock(storage, "a"), the_mock(storage, "b")
    both, only_b, only_a = make_key(0), make_key(1), make_key(2)
    data = seed_l2(storage, [both])
    a.faults.fail_store_rate = 1.0
    data |= seed_l2(storage, [only_b], seeds=[1])
    a.faults.fail_store_rate = 0.0
    b.faults.fail_store_rate = 1.0
    data |= seed_l2(storage, [only_a], seeds=[2])
    b.faults.fail_store_rate = 0.0
    assert set(a.keys()) == {both, only_a} and set(b.keys()) == {both, only_b}
    keys = [both, only_b, only_a]
    result = storage.lookup(keys, LAYOUT)
    assert_hit(storage, result, keys, data, 3, {"a": 2, "b": 1})
    assert a.status()["load_keys"] == 2  # both and only_a
    assert b.status()["load_keys"] == 1  # only_b: b's copy of `both` was not loaded
    assert a.status()["leases"] == b.status()["leases"] == 0
    storage.release(keys)
    assert_settled(storage)


def test_cascade_from_mock_to_fs(stack: Stack) -> None:
    storage = stack.build({"type": "mock"}, stack.fs())
    mock, fs = the_mock(storage), adapter(storage, "fs")
    both, only_fs = make_key(0), make_key(1)
    data = seed_l2(storage, [both])
    mock.faults.fail_store_rate = 1.0
    data |= seed_l2(storage, [only_fs], seeds=[1])
    mock.faults.fail_store_rate = 0.0
    assert mock.keys() == [both] and fs.status()["objects"] == 2
    keys = [only_fs, both]
    result = storage.lookup(keys, LAYOUT)
    assert_hit(storage, result, keys, data, 2, {"fs": 1, "mock": 1})
    assert mock.status()["load_keys"] == fs.status()["load_keys"] == 1
    storage.release(keys)
    assert_settled(storage)


def test_an_object_nobody_has_ends_the_prefix(stack: Stack) -> None:
    storage = stack.build({"type": "mock"}, stack.fs())
    mock, fs = the_mock(storage), adapter(storage, "fs")
    keys = [make_key(i) for i in range(6)]
    stored = [k for i, k in enumerate(keys) if i != 3]
    data = seed_l2(storage, stored, keep=[keys[4]], seeds=[0, 1, 2, 4, 5])
    result = storage.lookup(keys, LAYOUT)
    assert_hit(storage, result, keys, data, 3, {"mock": 3})
    assert result.miss_reason is MissReason.NOT_FOUND
    assert prefetch_status(storage)["miss_reasons.not_found"] == 1
    assert storage.l1_audit()["read_locks"] == 3  # keys[4] (in L1, past the gap) released
    assert mock.status()["load_keys"] == 3 and counters(fs.status(), "load_keys") == 0
    assert not storage.in_l1(keys[5])  # past the prefix: not loaded
    storage.release(keys[:3])
    assert_settled(storage)


def test_without_a_layout_only_objects_stored_without_one_hit(stack: Stack) -> None:
    """A lookup that names no layout proves none: L1's objects stored under
    one are misses to it (layout_mismatch), objects stored without one hit,
    and L2 is never asked (its loads need the object size and layout)."""
    storage = stack.build({"type": "mock"})
    mock = the_mock(storage)
    keys = [make_key(i) for i in range(4)]
    seed_l2(storage, keys, keep=keys[:2])  # under LAYOUT
    result = storage.lookup(keys)
    assert (result.hit_chunks, result.miss_reason) == (0, MissReason.LAYOUT_MISMATCH)
    bare = [make_key(i) for i in range(10, 14)]
    data = {k: payload(10 + i) for i, k in enumerate(bare)}
    assert storage.store(bare[:2], [data[k] for k in bare[:2]]) == [L1Result.SUCCESS] * 2
    result = storage.lookup(bare)
    assert_hit(storage, result, bare, data, 2, {L1_TIER: 2})
    assert result.miss_reason is MissReason.NOT_IN_L1
    storage.release(bare[:2])
    assert counters(mock.status(), "lookup_keys") == counters(mock.status(), "load_keys") == 0
    assert_settled(storage)


# ------------------------------------------------------------- warm restart


def test_warm_restart_hits_from_fs_with_the_same_bytes(stack: Stack) -> None:
    first = stack.build(stack.fs("shared"))
    keys = [make_key(i) for i in range(5)]
    data = {k: payload(100 + i) for i, k in enumerate(keys)}
    first.store(keys, list(data.values()), LAYOUT)
    assert first.flush(timeout=10)
    assert_settled(first)
    stack.close(first)

    second = stack.build(stack.fs("shared"))
    fs = adapter(second, "fs")
    assert fs.status()["objects"] == 5
    result = second.lookup(keys, LAYOUT)
    assert_hit(second, result, keys, data, 5, {"fs": 5})
    second.release(keys)
    assert_settled(second)


# ---------------------------------------------------------------- corruption


def corrupt_fs_file(fs: L2Adapter, key: ObjectKey, how: str) -> None:
    assert isinstance(fs, FSAdapter)
    path = fs.path_of(key)
    if how == "flip":
        path.write_bytes(flip_last_byte(path.read_bytes()))
    else:
        os.truncate(path, path.stat().st_size - 100)


@pytest.mark.parametrize(
    ("spec", "how", "reason"),
    [
        ("mock", "flip", "checksum"),
        ("fs", "flip", "checksum"),
        ("fs", "truncate", "short"),
    ],
)
def test_a_corrupt_copy_is_a_miss_at_that_chunk(
    stack: Stack, spec: str, how: str, reason: str
) -> None:
    storage = stack.build({"type": "mock"} if spec == "mock" else stack.fs())
    (store,) = storage_parts.adapters(storage)
    keys = [make_key(i) for i in range(4)]
    data = seed_l2(storage, keys)
    if isinstance(store, MockAdapter):
        store.tamper(keys[2], flip_last_byte)
    else:
        corrupt_fs_file(store, keys[2], how)
    result = storage.lookup(keys, LAYOUT)
    assert_hit(storage, result, keys, data, 2, {spec: 2})
    assert result.miss_reason is MissReason.CORRUPT
    assert not storage.in_l1(keys[2])
    assert store.status()["corrupt_objects"] == 1
    assert failures(store) == {f"corrupt_{reason}": 1}
    storage.release(keys[:2])
    if isinstance(store, MockAdapter):
        assert keys[2] not in set(store.keys())  # the bad copy is dropped
    else:
        assert isinstance(store, FSAdapter)
        assert not store.path_of(keys[2]).exists()
        assert store.status()["objects"] == 3
    storage.clear_l1()
    again = storage.lookup(keys, LAYOUT)
    assert_hit(storage, again, keys, data, 2, {spec: 2})
    assert again.miss_reason is MissReason.NOT_FOUND  # the bad copy is gone
    assert store.status()["corrupt_objects"] == 1  # nothing left to refuse
    storage.release(keys[:2])
    assert_settled(storage)


def test_a_copy_of_another_layout_is_a_miss(stack: Stack) -> None:
    storage = stack.build({"type": "mock"})
    mock = the_mock(storage)
    other = KVLayout(1, 2, 32, "float32", 16)  # same object size, different layout
    assert other.object_bytes() == OBJ and other.digest() != LAYOUT.digest()
    keys = [make_key(i) for i in range(2)]
    seed_l2(storage, keys)
    result = storage.lookup(keys, other)
    assert (result.hit_chunks, dict(result.objects_by_tier)) == (0, {})
    assert result.miss_reason is MissReason.LAYOUT_MISMATCH
    assert failures(mock) == {"corrupt_layout": 2}  # both copies were loaded and refused
    assert mock.keys() == []  # and dropped
    assert_settled(storage)


# -------------------------------------------------------------------- faults


def test_load_failures_end_the_prefix_at_the_first_failed_chunk(stack: Stack) -> None:
    storage = stack.build({"type": "mock"})
    mock = the_mock(storage)
    keys = [make_key(i) for i in range(5)]
    data = seed_l2(storage, keys, keep=[keys[0], keys[1], keys[3]])
    mock.faults.fail_load_rate = 1.0
    result = storage.lookup(keys, LAYOUT)
    assert_hit(storage, result, keys, data, 2, {L1_TIER: 2})
    assert result.miss_reason is MissReason.LOAD_FAILED
    assert storage.l1_audit()["read_locks"] == 2  # keys[3] (L1, past the failure) released
    assert prefetch_status(storage)["failed_loads.mock"] == 2  # keys 2 and 4
    assert failures(mock) == {"error": 2}
    assert not storage.in_l1(keys[2]) and not storage.in_l1(keys[4])
    storage.release(keys[:2])
    assert_settled(storage)

    mock.faults.fail_load_rate = 0.0
    result = storage.lookup(keys, LAYOUT)
    assert_hit(storage, result, keys, data, 5, {L1_TIER: 3, "mock": 2})
    storage.release(keys)
    assert_settled(storage)


def test_a_hang_past_the_deadline_gives_what_l1_had(stack: Stack) -> None:
    storage = stack.build({"type": "mock"})
    mock = the_mock(storage)
    keys = [make_key(i) for i in range(4)]
    data = seed_l2(storage, keys, keep=keys[:2])
    mock.faults.hang_s = 0.5  # every task: the lookup hangs
    result = storage.lookup(keys, LAYOUT, deadline_s=0.05)
    assert_hit(storage, result, keys, data, 2, {L1_TIER: 2})
    assert result.miss_reason is MissReason.DEADLINE
    assert prefetch_status(storage)["deadline_misses"] == 1
    storage.release(keys[:2])
    wait_until(lambda: failures(mock).get("timeout") == 2, "the hung lookup to end")
    mock.faults.hang_s = 0.0
    assert failures(mock) == {"timeout": 2}
    assert not storage.in_l1(keys[2]) and not storage.in_l1(keys[3])
    assert_settled(storage)


def test_a_load_that_hangs_past_the_deadline_is_dropped(stack: Stack) -> None:
    storage = stack.build({"type": "mock"})
    mock = the_mock(storage)
    keys = [make_key(i) for i in range(4)]
    data = seed_l2(storage, keys, keep=keys[:2])
    gate = stack.gate(mock, "_load")  # the lookup answers; the load is held...
    result = storage.lookup(keys, LAYOUT, deadline_s=0.3)
    assert_hit(storage, result, keys, data, 2, {L1_TIER: 2})
    assert prefetch_status(storage)["deadline_misses"] == 1
    storage.release(keys[:2])
    gate.wait_for(lambda g: g.calls >= 1, "the load to reach the adapter")
    mock.faults.hang_s = 0.01  # ...then hangs and fails as a timeout
    gate.open()
    wait_until(lambda: failures(mock).get("timeout") == 2, "the hung load to end")
    mock.faults.hang_s = 0.0
    wait_until(lambda: prefetch_idle(storage), "the late load to be dropped")
    assert not storage.in_l1(keys[2]) and not storage.in_l1(keys[3])
    assert prefetch_status(storage)["failed_loads.mock"] == 2
    assert_settled(storage)


def test_a_load_that_lands_after_the_deadline_is_admitted_unlocked(stack: Stack) -> None:
    storage = stack.build({"type": "mock"})
    mock = the_mock(storage)
    keys = [make_key(i) for i in range(4)]
    data = seed_l2(storage, keys, keep=keys[:2])
    gate = stack.gate(mock, "_load")
    result = storage.lookup(keys, LAYOUT, deadline_s=0.3)
    assert_hit(storage, result, keys, data, 2, {L1_TIER: 2})
    assert prefetch_status(storage)["deadline_misses"] == 1
    storage.release(keys[:2])
    gate.wait_for(lambda g: g.calls >= 1, "the load to reach the adapter")
    assert not storage.in_l1(keys[2])  # still held at the adapter
    gate.open()
    wait_until(
        lambda: prefetch_idle(storage) and storage.in_l1(keys[3]),
        "the late load to land",
    )
    assert storage.in_l1(keys[2])
    assert prefetch_status(storage)["loaded_objects.mock"] == 2
    assert_settled(storage)  # admitted without a lock; the leases are returned
    again = storage.lookup(keys, LAYOUT)
    assert_hit(storage, again, keys, data, 4, {L1_TIER: 4})
    storage.release(keys)
    assert_settled(storage)


def test_after_a_connection_failure_the_adapter_refuses_until_the_back_off_ends(
    stack: Stack,
) -> None:
    storage = stack.build({"type": "mock", "backoff_initial_s": 60.0, "backoff_max_s": 60.0})
    mock = the_mock(storage)
    keys = [make_key(i) for i in range(4)]
    data = seed_l2(storage, keys, keep=keys[:2])
    mock.faults.unreachable = True
    result = storage.lookup(keys, LAYOUT)
    assert_hit(storage, result, keys, data, 2, {L1_TIER: 2})
    assert result.miss_reason is MissReason.BACKEND_DOWN
    storage.release(keys[:2])
    assert failures(mock) == {"unreachable": 2}
    assert mock.status()["healthy"] is False
    mock.faults.unreachable = False  # back, but the back-off still runs for a minute
    result = storage.lookup(keys, LAYOUT)
    assert_hit(storage, result, keys, data, 2, {L1_TIER: 2})
    assert result.miss_reason is MissReason.BACKEND_DOWN  # refused: backing off
    storage.release(keys[:2])
    assert failures(mock) == {"unreachable": 2, "backoff": 2}
    extra = make_key(9)
    storage.store([extra], [payload(9)], LAYOUT)  # write-back is refused too, quietly
    assert storage.flush(timeout=10)
    assert storage.status()["store"]["failed_objects.mock"] == 1  # type: ignore[index]
    assert failures(mock) == {"unreachable": 2, "backoff": 3}
    assert extra not in set(mock.keys())
    assert counters(mock.status(), "load_keys") == 0
    assert_settled(storage)


def test_an_unreachable_backend_is_a_miss_until_it_comes_back(
    stack: Stack, clock: FakeClock
) -> None:
    storage = stack.build({"type": "mock", "backoff_initial_s": 10.0, "backoff_max_s": 10.0})
    mock = the_mock(storage)
    mock.clock = clock
    keys = [make_key(i) for i in range(4)]
    data = seed_l2(storage, keys, keep=keys[:2])
    mock.faults.unreachable = True
    result = storage.lookup(keys, LAYOUT)
    assert_hit(storage, result, keys, data, 2, {L1_TIER: 2})
    storage.release(keys[:2])
    assert failures(mock) == {"unreachable": 2}
    for _ in range(5):  # refused during the back-off, or unreachable again after it
        clock.advance(6.0)
        result = storage.lookup(keys, LAYOUT)
        assert_hit(storage, result, keys, data, 2, {L1_TIER: 2})
        storage.release(keys[:2])
    seen = failures(mock)
    assert set(seen) <= {"unreachable", "backoff"}
    assert sum(seen.values()) == 2 * 6
    assert counters(mock.status(), "load_keys") == 0

    mock.faults.unreachable = False
    result = storage.lookup(keys, LAYOUT)  # still backing off
    assert_hit(storage, result, keys, data, 2, {L1_TIER: 2})
    storage.release(keys[:2])
    clock.advance(60.0)  # the back-off is over
    result = storage.lookup(keys, LAYOUT)
    assert_hit(storage, result, keys, data, 4, {L1_TIER: 2, "mock": 2})
    assert mock.recoveries == 1
    storage.release(keys)
    assert_settled(storage)


# ------------------------------------------------------------------ layouts

# Another layout of the same object size: a reader of it must never get
# LAYOUT's bytes (its chunk hashes would differ if its client folded the
# layout into them; these tests are of a client that does not).
OTHER = KVLayout(1, 1, 64, "bfloat16", 32)


def test_an_l1_object_of_another_layout_is_a_miss_and_l2_is_not_asked_for_it(
    stack: Stack,
) -> None:
    assert OTHER.object_bytes() == OBJ and OTHER.digest() != LAYOUT.digest()
    storage = stack.build({"type": "mock"})
    mock = the_mock(storage)
    keys = [make_key(i) for i in range(3)]
    data = seed_l2(storage, keys, keep=keys)
    asked = counters(mock.status(), "lookup_keys")
    result = storage.lookup(keys, OTHER)
    assert (result.hit_chunks, result.miss_reason) == (0, MissReason.LAYOUT_MISMATCH)
    assert counters(mock.status(), "lookup_keys") == asked  # no copy of OTHER can land
    assert prefetch_status(storage)["miss_reasons.layout_mismatch"] == 1
    result = storage.lookup(keys, LAYOUT)
    assert_hit(storage, result, keys, data, 3, {L1_TIER: 3})
    storage.release(keys)
    assert_settled(storage)


def test_a_load_in_flight_under_another_layout_is_not_shared(stack: Stack) -> None:
    """Single flight shares a load only with a lookup of the same layout: a
    lookup of another layout for an object being loaded misses."""
    storage = stack.build({"type": "mock"})
    mock = the_mock(storage)
    keys = [make_key(i) for i in range(2)]
    data = seed_l2(storage, keys)
    gate = stack.gate(mock, "_load")
    first: list[LookupResult] = []
    thread = threading.Thread(target=lambda: first.append(storage.lookup(keys, LAYOUT)))
    thread.start()
    gate.wait_for(lambda g: g.calls >= 1, "the first lookup's load to reach the adapter")
    other = storage.lookup(keys, OTHER)
    assert (other.hit_chunks, other.miss_reason) == (0, MissReason.LAYOUT_MISMATCH)
    gate.open()
    thread.join(timeout=10)
    assert not thread.is_alive()
    assert_hit(storage, first[0], keys, data, 2, {"mock": 2})
    storage.release(keys)
    assert_settled(storage)


# --------------------------------------------------------------- concurrency


def test_concurrent_lookups_of_the_same_keys_share_one_load(stack: Stack) -> None:
    # More threads than load parts: the held load must leave one for the second lookup.
    storage = stack.build({"type": "mock", "io_threads": 8})
    mock = the_mock(storage)
    keys = [make_key(i) for i in range(4)]
    data = seed_l2(storage, keys)
    gate = stack.gate(mock, "_load")
    results: dict[int, tuple[LookupResult, list[bytes]]] = {}

    def look(slot: int) -> None:
        result = storage.lookup(keys, LAYOUT)
        results[slot] = (result, read_back(storage, keys[: result.hit_chunks]))
        storage.release(keys[: result.hit_chunks])

    threads = [threading.Thread(target=look, args=(slot,)) for slot in range(2)]
    for thread in threads:
        thread.start()
    # Both lookups have run at the adapter and the second request has given
    # back its leases (it subscribed to the first one's load) while that load
    # is still held.
    wait_until(
        lambda: counters(mock.status(), "lookup_keys") == 8 and mock.status()["leases"] == 4,
        "both requests to have planned",
    )
    gate.wait_for(lambda g: g.calls >= 1, "the shared load to reach the adapter")
    gate.open()
    for thread in threads:
        thread.join(timeout=10)
        assert not thread.is_alive()
    expected = [data[k].tobytes() for k in keys]
    for result, copies in results.values():
        assert result.hit_chunks == 4
        assert dict(result.objects_by_tier) == {"mock": 4}
        assert copies == expected
    assert mock.status()["load_keys"] == 4
    assert sorted(gate.keys, key=keys.index) == keys
    assert_settled(storage)


def test_eviction_racing_prefetch_never_evicts_a_reported_hit(stack: Stack) -> None:
    """A writer thread keeps storing other objects into a tiny L1 (evicting
    the hot ones between lookups) while lookups of the hot objects load them
    back from L2; every reported hit has the right bytes until it is released."""
    storage = stack.build({"type": "mock"}, l1_bytes=24 * PAGE)  # twelve objects
    hot = [make_key(i) for i in range(9)]
    data = seed_l2(storage, hot)
    filler = [payload(1000 + i) for i in range(8)]
    stored = [0]
    stop = threading.Event()
    errors: list[BaseException] = []

    def writer() -> None:
        try:
            while not stop.is_set() and stored[0] < 1000:
                i = stored[0]
                storage.store([make_key(1000 + i)], [filler[i % 8]], LAYOUT)
                stored[0] = i + 1
                time.sleep(0)  # let the lookups run in between
        except BaseException as exc:
            errors.append(exc)

    def look() -> int:
        result = storage.lookup(hot, LAYOUT)
        hit = hot[: result.hit_chunks]
        assert list(result.placements) == hit
        assert read_back(storage, hit) == [data[k].tobytes() for k in hit]  # before release
        storage.release(hit)
        return result.objects_by_tier.get("mock", 0)

    assert look() == 9  # before the race: everything from L2
    thread = threading.Thread(target=writer)
    thread.start()
    try:
        rounds = 0
        while rounds < 20 or stored[0] < 40:  # the writer runs all along
            look()
            rounds += 1
    finally:
        stop.set()
        thread.join()
    assert errors == []
    assert storage.l1_status()["evictions"] > 0
    assert_settled(storage)


def test_close_with_a_load_in_flight_releases_exactly_what_was_held(stack: Stack) -> None:
    storage = stack.build({"type": "mock"})
    mock = the_mock(storage)
    keys = [make_key(i) for i in range(4)]
    seed_l2(storage, keys, keep=keys[:2])
    held = storage.lookup(keys[:2], LAYOUT)  # collected and never released
    assert held.hit_chunks == 2
    gate = stack.gate(mock, "_load")
    handle = storage.submit_lookup([(k,) for k in keys], {0: LAYOUT}, deadline_s=60)
    gate.wait_for(lambda g: g.calls >= 1, "the load to reach the adapter")
    assert storage.l1_audit()["read_locks"] == 4  # two for `held`, two for the request

    ledger: list[dict[str, int] | BaseException] = []
    real_close = storage_parts.l1(storage).close

    def audited_close() -> None:  # the ledger just before L1 goes away
        try:
            ledger.append(assert_clean(storage))
        except BaseException as exc:
            ledger.append(exc)
        real_close()

    storage_parts.l1(storage).close = audited_close  # type: ignore[method-assign]
    errors: list[BaseException] = []

    def close() -> None:
        try:
            stack.close(storage)
        except BaseException as exc:
            errors.append(exc)

    closer = threading.Thread(target=close)
    closer.start()
    wait_until(lambda: handle.result() is not None, "close to answer the pending lookup")
    late = handle.result()
    assert late is not None and late.hit_chunks == 0 and dict(late.placements) == {}
    gate.open()
    closer.join(timeout=10)
    assert not closer.is_alive()
    assert errors == []
    assert len(ledger) == 1 and isinstance(ledger[0], dict), ledger
    assert mock.status()["leases"] == 0
    assert mock.status()["load_keys"] == 2


# ----------------------------------------------------- chunks of several ranks


def test_a_rank_missing_a_chunk_ends_the_prefix_and_frees_the_other_ranks(
    stack: Stack,
) -> None:
    storage = stack.build({"type": "mock"})
    chunks = [(make_key(i, rank=0), make_key(i, rank=1)) for i in range(4)]
    present = [k for chunk in chunks for k in chunk if k != chunks[2][1]]
    data = {k: payload(10 * k.chunk_hash[-1] + k.kv_rank) for k in present}
    storage.store(list(data), list(data.values()), LAYOUT)  # all of it in L1
    assert storage.flush(timeout=10)  # (and the write-back's locks are gone)
    result = storage.lookup_chunks(chunks, {0: LAYOUT})
    hit = [k for chunk in chunks[:2] for k in chunk]
    assert result.hit_chunks == 2
    assert dict(result.objects_by_tier) == {L1_TIER: 4}
    assert list(result.placements) == hit
    assert storage.l1_audit()["read_locks"] == 4  # rank 0 of chunks 2 and 3 released
    assert read_back(storage, hit) == [data[k].tobytes() for k in hit]
    storage.release(hit)
    assert_settled(storage)


def test_a_rank_missing_a_chunk_in_l2_ends_the_prefix(stack: Stack) -> None:
    storage = stack.build({"type": "mock"})
    mock = the_mock(storage)
    chunks = [(make_key(i, rank=0), make_key(i, rank=1)) for i in range(4)]
    present = [k for chunk in chunks for k in chunk if k != chunks[2][1]]
    data = seed_l2(storage, present, seeds=range(len(present)))
    result = storage.lookup_chunks(chunks, {0: LAYOUT})
    hit = [k for chunk in chunks[:2] for k in chunk]
    assert result.hit_chunks == 2
    assert dict(result.objects_by_tier) == {"mock": 4}
    assert list(result.placements) == hit
    assert read_back(storage, hit) == [data[k].tobytes() for k in hit]
    assert mock.status()["load_keys"] == 4  # nothing of chunks 2 and 3 was loaded
    assert not storage.in_l1(chunks[2][0])
    storage.release(hit)
    assert_settled(storage)


# ------------------------------------------------------------ retain_loaded


def test_without_retain_loaded_loaded_objects_leave_l1_at_their_last_release(
    stack: Stack,
) -> None:
    storage = stack.build({"type": "mock"}, prefetch=PrefetchConfig(retain_loaded=False))
    keys = [make_key(i) for i in range(4)]
    data = seed_l2(storage, keys, keep=keys[:2])
    first = storage.lookup(keys, LAYOUT)
    assert_hit(storage, first, keys, data, 4, {L1_TIER: 2, "mock": 2})
    assert first.temporary == frozenset(keys[2:])
    second = storage.lookup(keys, LAYOUT)  # a second holder of the same objects
    assert_hit(storage, second, keys, data, 4, {L1_TIER: 4})
    storage.release(keys)
    assert all(storage.in_l1(k) for k in keys)  # still held by the second lookup
    storage.release(keys)
    assert [storage.in_l1(k) for k in keys] == [True, True, False, False]
    assert_settled(storage)


# ----------------------------------------------------------------- bad input


def test_duplicate_keys_in_one_lookup_are_refused(stack: Stack) -> None:
    storage = stack.build({"type": "mock"})
    keys = [make_key(i) for i in range(2)]
    storage.store(keys, [payload(0), payload(1)], LAYOUT)
    with pytest.raises(ValueError, match="appears twice"):
        storage.lookup([keys[0], keys[1], keys[0]], LAYOUT)
    with pytest.raises(ValueError, match="appears twice"):
        storage.lookup_chunks([(keys[0], keys[1]), (keys[1],)], {0: LAYOUT})
    assert storage.flush(timeout=10)  # the store controller's locks go once written back
    assert storage.l1_audit()["read_locks"] == 0  # nothing was locked
    assert_settled(storage)


# ------------------------------------- leases when a request ends before its plan


def test_leases_of_a_fast_adapter_are_returned_when_close_gives_up(stack: Stack) -> None:
    storage = stack.build({"type": "mock", "name": "a"}, {"type": "mock", "name": "b"})
    a, b = the_mock(storage, "a"), the_mock(storage, "b")
    keys = [make_key(i) for i in range(3)]
    seed_l2(storage, keys)
    gate = stack.gate(b, "_lookup")
    handle = storage.submit_lookup([(k,) for k in keys], {0: LAYOUT}, deadline_s=60)
    wait_until(lambda: a.status().get("lookup_keys") == 3, "a's lookup to answer")
    gate.wait_for(lambda g: g.calls == 1, "b's lookup to be held")
    closer = threading.Thread(target=stack.close, args=(storage,))
    closer.start()  # a's answer is queued before close's stop: the worker records it first
    wait_until(lambda: handle.result() is not None, "close to answer the request")
    gate.open()
    closer.join(timeout=10)
    assert not closer.is_alive()
    assert b.status()["leases"] == 0
    assert a.status()["leases"] == 0  # 3: leaked


def test_leases_of_a_fast_adapter_are_returned_after_a_deadline(stack: Stack) -> None:
    storage = stack.build({"type": "mock", "name": "a"}, {"type": "mock", "name": "b"})
    a, b = the_mock(storage, "a"), the_mock(storage, "b")
    keys = [make_key(i) for i in range(3)]
    seed_l2(storage, keys)
    gate = stack.gate(b, "_lookup")
    result = storage.lookup(keys, LAYOUT, deadline_s=0.5)  # a answers at once, b is held
    assert result.hit_chunks == 0
    assert a.status()["lookup_keys"] == 3
    gate.open()
    wait_until(lambda: b.status().get("lookup_keys") == 3, "b's lookup to answer")
    wait_until(lambda: prefetch_idle(storage), "the prefetch controller to go idle")
    # b's late answer reaches the controller after b counted it: its leases go back then
    wait_until(lambda: b.status()["leases"] == 0, "b's leases to be returned")
    assert a.status()["leases"] == 0  # 3: leaked
    assert_settled(storage)


# ------------------------------------------------------------- robustness


def test_an_l2_object_larger_than_l1_is_a_miss(stack: Stack) -> None:
    """The adversarial run's finding: a server restarted with a smaller L1 over
    an fs L2 of large objects killed the prefetch worker (reserve_write raised
    on its thread). Now such an object is a miss, and the worker goes on."""
    big = KVLayout(4, 1, 64, "float32", 256)  # 512 KiB objects
    first = stack.build(stack.fs(), l1_bytes=4 * (1 << 20))
    keys = [make_key(i) for i in range(2)]
    data = [np.full(big.object_bytes(), i, np.uint8) for i in range(2)]
    first.store(keys, data, big)
    assert first.flush(timeout=10)
    stack.close(first)
    small = stack.build(stack.fs(), l1_bytes=64 * PAGE)  # 256 KiB: smaller than one object
    result = small.lookup(keys, big)
    assert (result.hit_chunks, dict(result.objects_by_tier)) == (0, {})
    assert result.miss_reason is MissReason.NO_ROOM
    assert counters(prefetch_status(small), "staging_out_of_memory") == 2  # per object
    assert small.l1_status()["too_large"] == 1
    assert "worker_errors" not in prefetch_status(small)
    seed = seed_l2(small, [make_key(10)])  # the worker still serves lookups
    result = small.lookup([make_key(10)], LAYOUT)
    assert_hit(small, result, [make_key(10)], seed, 1, {"fs": 1})
    small.release([make_key(10)])
    assert_settled(small)


def test_a_failing_worker_step_ends_only_its_request(
    stack: Stack, monkeypatch: pytest.MonkeyPatch
) -> None:
    storage = stack.build({"type": "mock"})
    keys = [make_key(i) for i in range(4)]
    data = seed_l2(storage, keys, keep=keys[:1])
    real = storage_parts.l1(storage).reserve_write
    failures_left = [1]

    def reserve_write(*args: object, **kwargs: object) -> object:
        if failures_left[0]:
            failures_left[0] -= 1
            raise RuntimeError("injected")
        return real(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(storage_parts.l1(storage), "reserve_write", reserve_write)
    result = storage.lookup(keys, LAYOUT)
    assert (result.hit_chunks, dict(result.objects_by_tier)) == (0, {})  # given up: a miss
    assert result.miss_reason is MissReason.ERROR
    assert counters(prefetch_status(storage), "worker_errors") == 1
    wait_until(lambda: prefetch_idle(storage), "the prefetch controller to go idle")
    assert_clean(storage)  # the L1 lock of the request was released
    assert the_mock(storage).status()["leases"] == 0
    result = storage.lookup(keys, LAYOUT)  # the worker goes on
    assert_hit(storage, result, keys, data, 4, {L1_TIER: 1, "mock": 3})
    storage.release(keys)
    assert_settled(storage)


def test_a_backlog_request_holds_no_l1_lock_while_it_waits(stack: Stack) -> None:
    storage = stack.build(
        {"type": "mock"},
        prefetch=PrefetchConfig(max_inflight_requests=1, max_backlog_requests=1),
    )
    mock = the_mock(storage)
    keys = [make_key(i) for i in range(6)]
    data = seed_l2(storage, keys, keep=[keys[0], keys[3]])
    gate = stack.gate(mock, "_load")
    first = storage.submit_lookup([[k] for k in keys[:3]], {0: LAYOUT})  # L1 has keys[0]
    gate.wait_for(lambda g: g.calls >= 1, "the first lookup to be loading")
    second = storage.submit_lookup([[k] for k in keys[3:]], {0: LAYOUT})  # L1 has keys[3]
    wait_until(lambda: prefetch_status(storage).get("backlog_requests") == 1, "a backlog")
    assert storage.l1_audit()["read_locks"] == 1  # the first request's; not the parked one's
    third = storage.submit_lookup([[keys[3]], [make_key(99)]], {0: LAYOUT})  # backlog full
    third_result = storage.collect(third, timeout=10)
    assert third_result is not None and third_result.hit_chunks == 1  # what L1 had, at once
    assert third_result.miss_reason is MissReason.OVERLOADED
    assert counters(prefetch_status(storage), "backlog_full") == 1
    storage.release([keys[3]])
    gate.open()
    for handle, chunk in ((first, keys[:3]), (second, keys[3:])):
        result = storage.collect(handle, timeout=10)
        assert result is not None
        assert_hit(storage, result, chunk, data, 3, {L1_TIER: 1, "mock": 2})
        storage.release(chunk)
    assert_settled(storage)


def test_an_abandoned_lookup_has_its_late_result_released(stack: Stack) -> None:
    storage = stack.build({"type": "mock"})
    mock = the_mock(storage)
    keys = [make_key(i) for i in range(3)]
    seed_l2(storage, keys, keep=keys[:1])
    gate = stack.gate(mock, "_load")
    handle = storage.submit_lookup([[k] for k in keys], {0: LAYOUT})
    gate.wait_for(lambda g: g.calls >= 1, "the load to reach the adapter")
    assert handle.abandon() is None
    gate.open()
    wait_until(lambda: "abandoned" in prefetch_status(storage), "the late result")
    assert storage.collect(handle, timeout=0) is None  # never delivered
    assert_settled(storage)


def test_lookups_racing_stop_are_all_answered(stack: Stack) -> None:
    storage = stack.build({"type": "mock", "latency_s": 0.001})
    keys = [make_key(i) for i in range(4)]
    seed_l2(storage, keys, keep=keys[:1])
    handles = []
    go = threading.Event()

    def submit() -> None:
        go.wait()
        for _ in range(200):
            handles.append(storage.submit_lookup([[k] for k in keys], {0: LAYOUT}))

    threads = [threading.Thread(target=submit) for _ in range(3)]
    for thread in threads:
        thread.start()
    go.set()
    storage_parts.prefetch(storage).stop()
    for thread in threads:
        thread.join()
    assert len(handles) == 600
    for handle in handles:
        result = handle.wait(timeout=10)
        assert result is not None, "a lookup that raced stop() was never answered"
        assert result.miss_reason in (None, MissReason.STOPPED), result.miss_reason
        storage.collect(handle, 0)
        storage.release(list(result.placements))
    assert storage.status()["held_lookup_locks"] == 0
    assert storage.flush(timeout=10)
    assert_clean(storage)


def test_a_lookup_the_worker_never_answers_is_a_miss_not_a_hang(
    stack: Stack, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``lookup_chunks`` used to wait with no timeout: a stuck worker hung the
    caller. Now it gives up past the deadline, and a late answer is released."""
    storage = stack.build({"type": "mock"})
    keys = [make_key(i) for i in range(3)]
    seed_l2(storage, keys, keep=keys[:1])
    stuck, entered = threading.Event(), threading.Event()
    admit = storage_parts.prefetch(storage)._admit

    def stuck_admit(request: object) -> None:
        entered.set()
        stuck.wait(timeout=30)
        admit(request)  # type: ignore[arg-type]

    monkeypatch.setattr(storage_parts.prefetch(storage), "_admit", stuck_admit)
    monkeypatch.setattr("kvtier.storage.manager.LOOKUP_GRACE_S", 0.05)
    result = storage.lookup(keys, LAYOUT, deadline_s=0.05)
    assert (result.hit_chunks, dict(result.placements)) == (0, {})
    assert result.miss_reason is MissReason.ERROR
    assert entered.is_set() and storage.status()["lookup_timeouts"] == 1
    stuck.set()
    wait_until(lambda: "abandoned" in prefetch_status(storage), "the late answer")
    assert_settled(storage)
