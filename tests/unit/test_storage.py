from __future__ import annotations

import dataclasses
import logging
import threading
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from kvtier.keys import KeySelector, ObjectKey
from kvtier.l1 import L1Config, L1Result
from kvtier.l1.quotas import OwnerLimit
from kvtier.l2 import TaskResult
from kvtier.l2.seal import Sealer
from kvtier.storage import L1, Owners, StorageConfig, StorageManager, byte_view
from tests.conftest import FakeClock, make_key
from tests.ledger import assert_clean

PAGE = 4096


@pytest.fixture
def storage() -> Iterator[StorageManager]:
    manager = StorageManager(StorageConfig(l1=L1Config(size_bytes=64 * PAGE, populate=False)))
    yield manager
    manager.close()


def payload(i: int, size: int = 3 * PAGE + 17) -> np.ndarray:
    return np.random.default_rng(i).integers(0, 256, size, dtype=np.uint8)


def test_store_lookup_retrieve_release(storage: StorageManager) -> None:
    keys = [make_key(i) for i in range(4)]
    data = [payload(i) for i in range(4)]
    assert storage.store(keys, data) == [L1Result.SUCCESS] * 4
    assert storage.lookup(keys).hit_chunks == 4
    views = storage.retrieve(keys)
    assert all(np.array_equal(v, d) for v, d in zip(views, data, strict=True))
    storage.release(keys)
    assert storage.status()["held_lookup_locks"] == 0
    assert_clean(storage)


def test_lookup_locks_only_the_longest_prefix(storage: StorageManager) -> None:
    keys = [make_key(i) for i in range(5)]
    storage.store([keys[0], keys[1], keys[3], keys[4]], [payload(i) for i in (0, 1, 3, 4)])
    assert storage.lookup(keys).hit_chunks == 2  # keys[2] is missing: 3 and 4 do not count
    assert storage.l1_audit()["read_locks"] == 2
    with pytest.raises(ValueError, match="not locked by a lookup"):
        storage.retrieve(keys[:3])
    storage.release(keys[:2])
    assert storage.lookup([make_key(99), *keys]).hit_chunks == 0
    assert_clean(storage)


def test_release_is_exactly_once(storage: StorageManager) -> None:
    keys = [make_key(i) for i in range(2)]
    storage.store(keys, [payload(0), payload(1)])
    assert storage.lookup(keys).hit_chunks == 2
    assert storage.lookup(keys[:1]).hit_chunks == 1  # a second lookup holds its own lock
    storage.release(keys)
    assert storage.l1_audit()["read_locks"] == 1
    with pytest.raises(ValueError, match="holds no"):
        storage.release(keys[1:])  # already released
    with pytest.raises(ValueError, match="too few"):
        storage.release([keys[0], keys[0]])  # only one lock left
    storage.release(keys[:1])
    assert_clean(storage)


def test_storing_again_is_success_and_keeps_the_first_copy(storage: StorageManager) -> None:
    key = make_key(0)
    storage.store([key], [payload(1)])
    assert storage.store([key], [payload(2)]) == [L1Result.SUCCESS]
    storage.lookup([key])
    assert np.array_equal(storage.retrieve([key])[0], payload(1))
    storage.release([key])
    assert_clean(storage)


def test_out_of_memory_while_everything_is_locked(storage: StorageManager) -> None:
    keys = [make_key(i) for i in range(12)]  # 48 of 64 pages: under the 80 % watermark
    storage.store(keys, [payload(i, 4 * PAGE) for i in range(12)])
    assert storage.lookup(keys).hit_chunks == 12
    more = [make_key(100 + i) for i in range(5)]  # 20 pages, 16 free, the rest locked
    big = [payload(100 + i, 4 * PAGE) for i in range(5)]
    assert storage.store(more, big) == [L1Result.OUT_OF_MEMORY] * 5
    storage.release(keys)
    assert storage.store(more, big) == [L1Result.SUCCESS] * 5
    assert_clean(storage)


def test_a_batch_past_the_watermark_keeps_the_prefix_head(storage: StorageManager) -> None:
    keys = [make_key(i) for i in range(15)]  # 60 of 64 pages: never its own victims
    storage.store(keys, [payload(i, 4 * PAGE) for i in range(15)])
    assert storage.lookup(keys).hit_chunks == 15
    storage.release(keys)
    storage.store([make_key(99)], [payload(99, PAGE)])  # 61 pages: evict down to 60 %
    assert storage.lookup(keys).hit_chunks == 9  # the batch's tail went first
    storage.release(keys[:9])
    assert_clean(storage)


def test_buffers_of_any_dtype_are_stored_as_bytes(storage: StorageManager) -> None:
    kv = np.arange(2 * 4 * 64, dtype=np.float16).reshape(2, 4, 64)
    storage.store([make_key(0), make_key(1)], [kv, kv.tobytes()])
    storage.lookup([make_key(0), make_key(1)])
    first, second = storage.retrieve([make_key(0), make_key(1)])
    assert np.array_equal(first.view(np.float16).reshape(kv.shape), kv)
    assert first.tobytes() == second.tobytes()
    storage.release([make_key(0), make_key(1)])
    with pytest.raises(ValueError, match="not C-contiguous"):
        storage.store([make_key(2)], [kv.transpose()])
    with pytest.raises(ValueError, match="same length"):
        storage.store([make_key(2)], [])
    assert_clean(storage)


def test_byte_view_does_not_copy() -> None:
    data = np.zeros(16, dtype=np.float32)
    view = byte_view(data)
    view[0] = 1
    assert data.view(np.uint8)[0] == 1 and view.nbytes == 64


# ------------------------------------------- owners, hooks and tiers by name


def two_tiers(tmp_path: Path) -> StorageConfig:
    """A node-local fs L2 (keeps its owners' caps) and a shared mock one (cannot)."""
    return StorageConfig(
        l1=L1Config(size_bytes=64 * PAGE, populate=False),
        l2=(
            {"type": "fs", "path": str(tmp_path / "fs")},
            {"type": "mock", "name": "shared", "shared": True},
        ),
    )


def test_owners_given_at_construction_reach_l1_and_the_node_local_adapter(
    tmp_path: Path,
) -> None:
    limit = OwnerLimit(soft=8 * PAGE, hard=16 * PAGE, pins=0)
    owners = Owners(lambda salt: salt.upper(), {"A": limit}, {"fs": {"A": 4 * PAGE}})
    with StorageManager(two_tiers(tmp_path), owners=owners) as storage:
        assert storage.self_capped_tiers() == {"fs"}  # the shared store cannot keep caps
        assert storage.owner_limit("A") == limit and storage.owner_limit("B") == OwnerLimit()
        storage.store([make_key(0, salt="a"), make_key(1, salt="b")], [payload(0), payload(1)])
        usage = storage.owner_usage()
        assert usage["A"]["bytes"] == usage["B"]["bytes"] == 4 * PAGE  # 3 pages + 17 bytes
        assert storage.pin([make_key(0, salt="a")], 60) == [L1Result.OVER_QUOTA]  # pins: 0
        assert storage.flush(10)  # written back: L1 no longer holds them for the write-back
        assert storage.set_owner_limit("A", OwnerLimit(soft=0)) == 4 * PAGE  # evicted now
        assert not storage.in_l1(make_key(0, salt="a")) and storage.in_l1(make_key(1, salt="b"))


def test_the_store_gate_and_on_stored_see_only_the_adapters_that_keep_no_caps(
    tmp_path: Path,
) -> None:
    asked: list[tuple[str, ObjectKey]] = []
    stored: list[TaskResult] = []
    lock = threading.Lock()

    def gate(adapter: str, key: ObjectKey, nbytes: int) -> bool:
        with lock:
            asked.append((adapter, key))
        return key.salt != "no"

    def on_stored(result: TaskResult) -> None:
        with lock:
            stored.append(result)

    owners = Owners(lambda salt: salt)
    config = two_tiers(tmp_path)
    with StorageManager(config, owners=owners, store_gate=gate, on_stored=on_stored) as storage:
        keys = [make_key(0, salt="yes"), make_key(1, salt="no")]
        storage.store(keys, [payload(0), payload(1)])
        assert storage.flush(10)
        assert sorted(asked, key=str) == [("shared", k) for k in keys]  # never the fs tier
        assert {r.adapter for r in stored} == {"shared"}
        assert [k for r in stored for k in r.keys] == keys[:1]  # the gate kept the other
        assert {k for k, _ in storage.held_sizes("shared")} == set(keys[:1])
        assert {k for k, _ in storage.held_sizes("fs")} == set(keys)


def test_tiers_by_name(tmp_path: Path) -> None:
    with StorageManager(two_tiers(tmp_path)) as storage:
        assert storage.tiers() == [L1, "fs", "shared"]  # the lookup order
        storage.store([make_key(0)], [payload(0)])
        assert storage.held_sizes(L1) == [(make_key(0), 4 * PAGE)]
        with pytest.raises(ValueError, match=r"no L2 tier 'nope'; the tiers are \['L1', 'fs'"):
            storage.held_sizes("nope")
        assert storage.flush(10)


def test_a_cluster_secret_seals_the_shared_stores_and_leaves_the_local_disk(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    seal = Sealer([b"s" * 32])
    config = dataclasses.replace(two_tiers(tmp_path), seal=seal)
    with caplog.at_level(logging.INFO), StorageManager(config) as storage:
        adapters = storage.status()["l2"]
        assert isinstance(adapters, dict)
        assert adapters["fs"]["sealed_with"] == ""  # written by this server alone
        assert adapters["shared"]["sealed_with"] == seal.key_id.hex()
    assert f"L2 shared: objects sealed (key {seal.key_ids[0]})" in caplog.text


def test_the_storage_says_at_start_whether_shared_objects_are_sealed(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    local = StorageConfig(l1=L1Config(size_bytes=64 * PAGE, populate=False))
    with caplog.at_level(logging.INFO), StorageManager(local):
        pass
    assert "sealed" not in caplog.text  # no shared store: nothing to seal
    with caplog.at_level(logging.INFO), StorageManager(two_tiers(tmp_path)):
        pass
    assert "L2 shared: objects not sealed (no cluster secret)" in caplog.text


def test_remove_older_than_takes_the_picked_old_objects_and_spares_a_held_one(
    clock: FakeClock,
) -> None:
    config = StorageConfig(l1=L1Config(size_bytes=64 * PAGE, populate=False))
    with StorageManager(config, clock=clock) as storage:
        mine = [make_key(i, salt="mine") for i in range(3)]
        theirs = make_key(9, salt="theirs")
        storage.store([*mine[:2], theirs], [payload(i) for i in range(3)])
        clock.advance(61)
        storage.store(mine[2:], [payload(3)])  # young
        _, missing = storage.reserve_read_all(mine[:1])  # a reader holds one
        assert missing == 0

        def picked(key: ObjectKey) -> bool:
            return key.salt == "mine"

        assert storage.remove_older_than(60, picked) == {L1: 1}  # held, young, theirs stay
        assert [storage.in_l1(k) for k in [*mine, theirs]] == [True, False, True, True]
        assert storage.finish_read(mine[:1]) == [L1Result.SUCCESS]
        assert storage.remove_older_than(60, picked) == {L1: 1}
        assert_clean(storage)


def test_the_steps_of_a_purge(storage: StorageManager) -> None:
    acme = KeySelector(salt="acme")
    keys = [make_key(i, salt="acme") for i in range(3)]
    storage.store([*keys[:2], make_key(7)], [payload(i) for i in range(3)])
    tag, placements, fence = storage.reserve_store(keys[2:], [PAGE])  # a store in flight
    assert placements[0].result is L1Result.SUCCESS and storage.staging_count(acme) == 1
    assert storage.resident_keys(acme) == keys[1::-1]  # newest first
    assert storage.reserve_read_all(keys[:1])[1] == 0  # a reader holds one
    assert storage.purge_l1(keys[:2]) == [L1Result.LOCKED, L1Result.SUCCESS]
    assert storage.resident_keys(acme) == [] and storage.in_l1(make_key(7))
    assert storage.purged_in_io_count(acme) == 0  # held by a reader, not by an I/O
    storage.finish_read(keys[:1])  # its last holder lets go: freed
    storage.abort_store(tag, fence)
    assert storage.staging_count(acme) == 0
    with pytest.raises(ValueError, match="no L2 tier 'fs'"):
        storage.purge_l2("fs", acme, None, 10)
    assert_clean(storage)


def test_a_lookup_collected_by_its_deadline(storage: StorageManager) -> None:
    storage.store([make_key(0)], [payload(0)])
    result = storage.collect_or_abandon(storage.submit_lookup([[make_key(0)]]))
    assert result is not None and result.hit_chunks == 1
    assert storage.retrieve([make_key(0)])[0].tobytes() == payload(0).tobytes()
    storage.release([make_key(0)])
    assert_clean(storage)
