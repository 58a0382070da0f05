from __future__ import annotations

import itertools
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtier.l1.allocator import PAGE_BYTES, FreeListAllocator


def overlaps(extents: dict[int, int]) -> bool:
    spans = sorted(extents.items())
    return any(a + n > b for (a, n), (b, _) in itertools.pairwise(spans))


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), pages=st.integers(1, 64))
def test_random_allocate_free_until_full_never_overlaps(seed: int, pages: int) -> None:
    rng = random.Random(seed)
    alloc = FreeListAllocator(pages * PAGE_BYTES)
    live: dict[int, int] = {}  # offset -> reserved bytes
    for _ in range(300):
        if live and rng.random() < 0.4:
            offset = rng.choice(sorted(live))
            alloc.free([offset])
            del live[offset]
        else:
            top = min(3, pages) * PAGE_BYTES
            sizes = [rng.randint(1, top) for _ in range(rng.randint(1, 3))]
            offsets = alloc.allocate(sizes)
            if offsets is None:
                continue
            for offset, size in zip(offsets, sizes, strict=True):
                assert offset % PAGE_BYTES == 0
                assert offset + size <= alloc.capacity
                live[offset] = alloc.size_of(offset)
                assert live[offset] == -(-size // PAGE_BYTES) * PAGE_BYTES
        assert not overlaps(live)
        assert alloc.used_bytes == sum(live.values())
        assert 0.0 <= alloc.fragmentation() <= 1.0
    alloc.free(list(live))
    assert alloc.used_bytes == 0
    assert alloc.stats()["free_extents"] == 1  # fully coalesced
    assert alloc.largest_free_bytes == alloc.capacity


def test_fills_exactly_and_then_fails() -> None:
    alloc = FreeListAllocator(8 * PAGE_BYTES)
    offsets = alloc.allocate([PAGE_BYTES] * 8)
    assert offsets == [i * PAGE_BYTES for i in range(8)]
    assert alloc.allocate([1]) is None
    assert alloc.free_bytes == 0


def test_batch_is_all_or_nothing() -> None:
    alloc = FreeListAllocator(4 * PAGE_BYTES)
    assert alloc.allocate([2 * PAGE_BYTES, 2 * PAGE_BYTES + 1]) is None
    assert alloc.used_bytes == 0
    assert alloc.stats()["free_extents"] == 1


def test_best_fit_and_fragmentation_reported() -> None:
    alloc = FreeListAllocator(10 * PAGE_BYTES)
    a, b, c, d = alloc.allocate([PAGE_BYTES, 3 * PAGE_BYTES, PAGE_BYTES, 2 * PAGE_BYTES]) or []
    alloc.free([a, c])  # holes of 1 page each, plus 3 free pages at the end
    stats = alloc.stats()
    assert stats["free_extents"] == 3
    assert stats["largest_free_bytes"] == 3 * PAGE_BYTES
    assert alloc.fragmentation() == pytest.approx(1 - 3 / 5)
    # A one-page request takes the smallest hole that fits (best fit), not the tail.
    (small,) = alloc.allocate([100]) or []
    assert small == a
    alloc.free([b])  # coalesces with the neighbouring 1-page hole at c
    assert alloc.largest_free_bytes == 4 * PAGE_BYTES
    alloc.free([small, d])
    assert alloc.stats()["free_extents"] == 1


def test_larger_than_capacity_is_no_room_not_an_error() -> None:
    alloc = FreeListAllocator(4 * PAGE_BYTES)
    assert alloc.allocate([PAGE_BYTES, 5 * PAGE_BYTES]) is None
    assert alloc.used_bytes == 0  # all or nothing


def test_bad_requests_raise() -> None:
    alloc = FreeListAllocator(4 * PAGE_BYTES)
    with pytest.raises(ValueError, match="positive int"):
        alloc.allocate([0])
    with pytest.raises(ValueError, match="not allocated"):
        alloc.free([PAGE_BYTES])
    (offset,) = alloc.allocate([1]) or []
    alloc.free([offset])
    with pytest.raises(ValueError, match="not allocated"):
        alloc.free([offset])  # double free
    with pytest.raises(ValueError, match="smaller than one"):
        FreeListAllocator(100)
    with pytest.raises(ValueError, match="power of two"):
        FreeListAllocator(1 << 20, alignment=3000)
