from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest

from kvtier.l1 import L1Config, L1Result
from kvtier.storage import StorageConfig, StorageManager, byte_view
from tests.conftest import make_key
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
    assert_clean(storage.l1)


def test_lookup_locks_only_the_longest_prefix(storage: StorageManager) -> None:
    keys = [make_key(i) for i in range(5)]
    storage.store([keys[0], keys[1], keys[3], keys[4]], [payload(i) for i in (0, 1, 3, 4)])
    assert storage.lookup(keys).hit_chunks == 2  # keys[2] is missing: 3 and 4 do not count
    assert storage.l1.audit()["read_locks"] == 2
    with pytest.raises(ValueError, match="not locked by a lookup"):
        storage.retrieve(keys[:3])
    storage.release(keys[:2])
    assert storage.lookup([make_key(99), *keys]).hit_chunks == 0
    assert_clean(storage.l1)


def test_release_is_exactly_once(storage: StorageManager) -> None:
    keys = [make_key(i) for i in range(2)]
    storage.store(keys, [payload(0), payload(1)])
    assert storage.lookup(keys).hit_chunks == 2
    assert storage.lookup(keys[:1]).hit_chunks == 1  # a second lookup holds its own lock
    storage.release(keys)
    assert storage.l1.audit()["read_locks"] == 1
    with pytest.raises(ValueError, match="holds no"):
        storage.release(keys[1:])  # already released
    with pytest.raises(ValueError, match="too few"):
        storage.release([keys[0], keys[0]])  # only one lock left
    storage.release(keys[:1])
    assert_clean(storage.l1)


def test_storing_again_is_success_and_keeps_the_first_copy(storage: StorageManager) -> None:
    key = make_key(0)
    storage.store([key], [payload(1)])
    assert storage.store([key], [payload(2)]) == [L1Result.SUCCESS]
    storage.lookup([key])
    assert np.array_equal(storage.retrieve([key])[0], payload(1))
    storage.release([key])
    assert_clean(storage.l1)


def test_out_of_memory_while_everything_is_locked(storage: StorageManager) -> None:
    keys = [make_key(i) for i in range(12)]  # 48 of 64 pages: under the 80 % watermark
    storage.store(keys, [payload(i, 4 * PAGE) for i in range(12)])
    assert storage.lookup(keys).hit_chunks == 12
    more = [make_key(100 + i) for i in range(5)]  # 20 pages, 16 free, the rest locked
    big = [payload(100 + i, 4 * PAGE) for i in range(5)]
    assert storage.store(more, big) == [L1Result.OUT_OF_MEMORY] * 5
    storage.release(keys)
    assert storage.store(more, big) == [L1Result.SUCCESS] * 5
    assert_clean(storage.l1)


def test_a_batch_past_the_watermark_keeps_the_prefix_head(storage: StorageManager) -> None:
    keys = [make_key(i) for i in range(15)]  # 60 of 64 pages: never its own victims
    storage.store(keys, [payload(i, 4 * PAGE) for i in range(15)])
    assert storage.lookup(keys).hit_chunks == 15
    storage.release(keys)
    storage.store([make_key(99)], [payload(99, PAGE)])  # 61 pages: evict down to 60 %
    assert storage.lookup(keys).hit_chunks == 9  # the batch's tail went first
    storage.release(keys[:9])
    assert_clean(storage.l1)


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
    assert_clean(storage.l1)


def test_byte_view_does_not_copy() -> None:
    data = np.zeros(16, dtype=np.float32)
    view = byte_view(data)
    view[0] = 1
    assert data.view(np.uint8)[0] == 1 and view.nbytes == 64
