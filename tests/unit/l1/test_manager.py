"""Every L1 transition and result code, leases, fences and eviction order."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest

from kvtier.keys import ObjectKey
from kvtier.l1 import L1Config, L1Manager, WriterTag
from kvtier.l1.eviction import LRUPolicy
from kvtier.l1.policies import EVICTION_POLICIES
from kvtier.l1.quotas import OwnerLimit
from tests.conftest import LK, NF, NW, OOM, WS, FakeClock, S, make_key
from tests.ledger import assert_clean

A, B = WriterTag("a"), WriterTag("b")
PAGE = 4096
MakeL1 = Callable[..., L1Manager]


def put(l1: L1Manager, keys: list[ObjectKey], size: int = PAGE, tag: WriterTag = A) -> None:
    placements = l1.reserve_write(keys, [size] * len(keys), tag)
    assert [p.result for p in placements] == [S] * len(keys)
    for key, placement in zip(keys, placements, strict=True):
        l1.view(placement)[:] = key.chunk_hash[-1]
    assert l1.finish_write(keys, tag) == [S] * len(keys)


def resident(l1: L1Manager, keys: list[ObjectKey]) -> list[bool]:
    return [l1.contains(k) for k in keys]


# ---------------------------------------------------------------- writes


def test_write_publish_read_cycle(make_l1: MakeL1) -> None:
    l1 = make_l1()
    k = [make_key(i) for i in range(3)]
    placements = l1.reserve_write(k, [100, 5000, PAGE], A)
    assert [p.result for p in placements] == [S, S, S]
    assert [p.size for p in placements] == [100, 5000, PAGE]
    assert l1.status()["staging_bytes"] == PAGE + 2 * PAGE + PAGE
    assert l1.reserve_read(k)[0].result is NF  # staging is invisible to readers
    for i, p in enumerate(placements):
        l1.view(p)[:] = i + 1
    assert l1.finish_write(k, A) == [S, S, S]
    reads = l1.reserve_read(k, n=2)
    assert [r.result for r in reads] == [S, S, S]
    assert [r.offset for r in reads] == [p.offset for p in placements]
    assert all((l1.view(r) == i + 1).all() for i, r in enumerate(reads))
    assert l1.status()["locked_objects"] == 3
    assert l1.finish_read(k, n=2) == [S, S, S]
    assert_clean(l1)


def test_reserve_write_codes(make_l1: MakeL1) -> None:
    l1 = make_l1()
    k0, k1, k2 = (make_key(i) for i in range(3))
    put(l1, [k0])
    l1.reserve_write([k1], [10], A)
    codes = [p.result for p in l1.reserve_write([k0, k1, k2], [10, 10, 10], A)]
    assert codes == [NW, WS, S]  # resident / already staged by this tag / new
    assert [p.result for p in l1.reserve_write([k1], [10], B)] == [S]  # another tag may
    assert l1.abort_write([k1, k2], A) == [S, S]
    assert l1.abort_write([k1], B) == [S]
    assert l1.abort_write([k1], B) == [NF]
    assert_clean(l1)


def test_two_tags_race_first_publisher_wins(make_l1: MakeL1) -> None:
    l1 = make_l1()
    key = make_key(7)
    (pa,) = l1.reserve_write([key], [PAGE], A)
    (pb,) = l1.reserve_write([key], [PAGE], B)
    assert pa.offset != pb.offset
    l1.view(pa)[:] = 1
    l1.view(pb)[:] = 2
    assert l1.finish_write([key], B) == [S]  # B publishes first
    assert l1.finish_write([key], A) == [S]  # A still succeeds; its copy is dropped
    (read,) = l1.reserve_read([key])
    assert read.offset == pb.offset and (l1.view(read) == 2).all()
    l1.finish_read([key])
    assert l1.status()["duplicate_writes"] == 1
    assert_clean(l1)


def test_finish_write_and_reserve_read_returns_the_winner_locked(make_l1: MakeL1) -> None:
    l1 = make_l1()
    key = make_key(1)
    (pa,) = l1.reserve_write([key], [PAGE], A)
    l1.reserve_write([key], [PAGE], B)
    assert l1.finish_write([key], A) == [S]
    (placement,) = l1.finish_write_and_reserve_read([key], B, n=3)
    assert placement.result is S and placement.offset == pa.offset
    assert l1.delete([key]) == [LK]
    assert l1.finish_read([key], n=3) == [S]
    assert l1.delete([key]) == [S]
    assert_clean(l1)


def test_finish_and_abort_of_unknown_reservations(make_l1: MakeL1) -> None:
    l1 = make_l1()
    key = make_key(1)
    assert l1.finish_write([key], A) == [NF]
    assert [p.result for p in l1.finish_write_and_reserve_read([key], A)] == [NF]
    assert l1.abort_write([key], A) == [NF]
    l1.reserve_write([key], [10], A)
    assert l1.finish_write([key], B) == [NF]  # the tag is part of the reservation
    assert l1.abort_write([key], A) == [S]
    assert_clean(l1)


# ----------------------------------------------------------------- reads


def test_read_lock_codes(make_l1: MakeL1) -> None:
    l1 = make_l1()
    k0, k1 = make_key(0), make_key(1)
    put(l1, [k0])
    assert [p.result for p in l1.reserve_read([k0, k1])] == [S, NF]
    assert l1.finish_read([k0, k1]) == [S, NF]
    assert l1.finish_read([k0]) == [WS]  # not locked any more
    l1.reserve_read([k0])
    assert l1.finish_read([k0], n=2) == [WS]  # holds 1, asked to drop 2: no change
    assert l1.finish_read([k0]) == [S]
    assert_clean(l1)


def test_reserve_read_all_locks_every_key_or_none(make_l1: MakeL1) -> None:
    l1 = make_l1()
    k0, k1, k2 = make_key(0), make_key(1), make_key(2)
    put(l1, [k0, k1])
    assert l1.reserve_read_all([k0, k2, k1, k2]) == ([], 2)
    assert l1.status()["locked_objects"] == 0  # nothing was locked
    placements, missing = l1.reserve_read_all([k0, k1])
    assert missing == 0 and [p.result for p in placements] == [S, S]
    assert [p.size for p in placements] == [PAGE, PAGE]
    assert l1.status()["locked_objects"] == 2
    assert l1.finish_read([k0, k1]) == [S, S]
    assert l1.finish_read([k0]) == [WS]  # locked once each
    assert_clean(l1)


def test_locks_are_counted(make_l1: MakeL1) -> None:
    l1 = make_l1()
    key = make_key(0)
    put(l1, [key])
    l1.reserve_read([key])
    l1.reserve_read([key], n=2)
    assert l1.audit()["read_locks"] == 3
    assert l1.finish_read([key]) == [S]
    assert l1.delete([key]) == [LK]
    assert l1.finish_read([key], n=2) == [S]
    assert l1.delete([key]) == [S]
    assert_clean(l1)


def test_delete_touch_clear(make_l1: MakeL1) -> None:
    l1 = make_l1()
    k = [make_key(i) for i in range(4)]
    put(l1, k[:3])
    l1.reserve_write([k[3]], [PAGE], A)
    l1.reserve_read([k[0]])
    assert l1.touch([k[1], k[3]]) == [S, NF]  # staging objects are not resident
    assert l1.delete([k[0], k[1], k[3]]) == [LK, S, NF]
    assert l1.clear() == 1  # k2 only: k0 is locked, k3 is staging
    assert resident(l1, k) == [True, False, False, False]
    l1.finish_read([k[0]])
    assert l1.finish_write([k[3]], A) == [S]
    assert l1.clear() == 2
    assert_clean(l1)


def test_bad_arguments_raise(make_l1: MakeL1) -> None:
    l1 = make_l1()
    k = make_key(0)
    with pytest.raises(ValueError, match="same length"):
        l1.reserve_write([k], [1, 2], A)
    with pytest.raises(ValueError, match="distinct"):
        l1.reserve_write([k, k], [1, 1], A)
    with pytest.raises(ValueError, match="positive int"):
        l1.reserve_write([k], [0], A)
    with pytest.raises(ValueError, match="n must be a positive int"):
        l1.reserve_read([k], n=0)
    with pytest.raises(ValueError, match="did not succeed"):
        l1.view(l1.reserve_read([k])[0])
    assert_clean(l1)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"eviction_policy": "fifo"}, "eviction_policy 'fifo' is not one of"),
        ({"high_watermark": 0.5, "low_watermark": 0.6}, "watermarks"),
        ({"high_watermark": 1.5}, "watermarks"),
        ({"read_lease_s": 0}, "read_lease_s must be > 0"),
        ({"size_bytes": 100}, "at least 4096"),
    ],
)
def test_config_validation(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        L1Config(**kwargs)  # type: ignore[arg-type]


# ---------------------------------------------------------------- leases


def test_expired_write_lease_is_reclaimed(make_l1: MakeL1, clock: FakeClock) -> None:
    l1 = make_l1(write_lease_s=10)
    key = make_key(0)
    l1.reserve_write([key], [PAGE], A)
    clock.advance(9.9)
    l1.reap_expired()
    assert l1.status()["staging_objects"] == 1
    clock.advance(0.2)
    assert l1.finish_write([key], A) == [NF]
    status = l1.status()
    assert status["expired_write_leases"] == 1 and status["used_bytes"] == 0
    assert [p.result for p in l1.reserve_write([key], [PAGE], A)] == [S]  # writable again
    l1.abort_write([key], A)
    assert_clean(l1)


def test_expired_read_lock_drops_to_zero(make_l1: MakeL1, clock: FakeClock) -> None:
    l1 = make_l1(read_lease_s=5)
    key = make_key(0)
    put(l1, [key])
    l1.reserve_read([key], n=2)
    clock.advance(4)
    l1.reserve_read([key])  # extends the lease to t+9
    clock.advance(4)
    l1.reap_expired()
    assert l1.audit()["read_locks"] == 3
    clock.advance(1.5)
    assert l1.finish_read([key]) == [WS]  # the vanished holder's locks are gone
    assert l1.status()["expired_read_leases"] == 1
    assert l1.delete([key]) == [S]
    assert_clean(l1)


def test_lease_heap_holds_one_entry_per_object(make_l1: MakeL1) -> None:
    l1 = make_l1()
    key = make_key(0)
    put(l1, [key])
    for _ in range(1000):
        l1.reserve_read([key])
        l1.finish_read([key])
    assert len(l1._leases) <= 2  # the write lease's entry and one read entry at most
    assert_clean(l1)


def test_fence_keeps_expired_staging_memory_until_io_completes(
    make_l1: MakeL1, clock: FakeClock
) -> None:
    l1 = make_l1(size_bytes=4 * PAGE, write_lease_s=10, high_watermark=1.0, low_watermark=0.5)
    key = make_key(0)
    (placement,) = l1.reserve_write([key], [4 * PAGE], A)
    placements, fence = l1.fence([key], A)
    assert [p.result for p in placements] == [S]
    clock.advance(11)  # the writer looks dead, but its I/O is still in flight
    l1.reap_expired()
    assert l1.finish_write([key], A) == [NF]
    other = make_key(1)
    # The memory is still the I/O's: a new reservation cannot reuse it.
    assert [p.result for p in l1.reserve_write([other], [PAGE], B)] == [OOM]
    l1.view(placement)[:] = 9  # the late I/O lands in memory nobody else owns
    l1.unfence(fence)
    assert l1.status()["used_bytes"] == 0
    assert [p.result for p in l1.reserve_write([other], [PAGE], B)] == [S]
    l1.abort_write([other], B)
    with pytest.raises(ValueError, match="already lifted"):
        l1.unfence(fence)
    assert_clean(l1)


def test_fenced_resident_object_is_not_evicted_after_its_read_lease_expires(
    make_l1: MakeL1, clock: FakeClock
) -> None:
    l1 = make_l1(size_bytes=2 * PAGE, read_lease_s=5)
    k0, k1 = make_key(0), make_key(1)
    put(l1, [k0])
    l1.reserve_read([k0])
    placements, fence = l1.fence([k0])
    assert [p.result for p in placements] == [S]
    clock.advance(6)
    assert l1.finish_read([k0]) == [WS]  # the lock expired...
    assert l1.delete([k0]) == [LK]  # ...but the fence still protects the bytes
    assert [p.result for p in l1.reserve_write([k1], [2 * PAGE], A)] == [OOM]
    l1.unfence(fence)
    assert [p.result for p in l1.reserve_write([k1], [2 * PAGE], A)] == [S]  # evicts k0
    assert not l1.contains(k0)
    l1.abort_write([k1], A)
    assert_clean(l1)


def test_fence_of_missing_objects(make_l1: MakeL1) -> None:
    l1 = make_l1()
    placements, fence = l1.fence([make_key(0)], A)
    assert [p.result for p in placements] == [NF] and fence.objects == []
    l1.unfence(fence)
    assert_clean(l1)


# -------------------------------------------------------------- eviction


def test_lru_order_is_exact(make_l1: MakeL1) -> None:
    l1 = make_l1(size_bytes=4 * PAGE, high_watermark=1.0, low_watermark=0.5)
    k = [make_key(i) for i in range(6)]
    for key in k[:4]:
        put(l1, [key])  # admitted oldest first: k0 k1 k2 k3
    l1.touch([k[0]])  # order now k1 k2 k3 k0
    l1.reserve_read([k[1]])  # locked: skipped, and locking is not use
    l1.finish_read([k[1]])
    put(l1, [k[4]])  # evicts exactly one: k1
    assert resident(l1, k) == [True, False, True, True, True, False]
    l1.reserve_read([k[2]])  # lock the oldest
    put(l1, [k[5]])  # k2 is locked, so k3 goes
    assert resident(l1, k) == [True, False, True, False, True, True]
    l1.finish_read([k[2]])
    assert l1.status()["evictions"] == 2
    assert_clean(l1)


def test_batch_recency_protects_the_prefix_head(make_l1: MakeL1) -> None:
    l1 = make_l1(size_bytes=4 * PAGE, high_watermark=1.0, low_watermark=0.5)
    chain = [make_key(i) for i in range(4)]
    put(l1, chain)  # one batch: chain[0] ends up most recent
    put(l1, [make_key(9)])
    assert resident(l1, chain) == [True, True, True, False]  # the tail goes first
    l1.touch(chain[:3])
    put(l1, [make_key(10)])
    assert not l1.contains(make_key(9))
    assert_clean(l1)


def test_watermarks(make_l1: MakeL1) -> None:
    l1 = make_l1(size_bytes=10 * PAGE, high_watermark=0.8, low_watermark=0.6)
    k = [make_key(i) for i in range(9)]
    for key in k[:8]:
        put(l1, [key])
    assert l1.status()["evictions"] == 0  # 8/10 used is not above 80 %
    put(l1, [k[8]])  # 9/10 > 80 %: evict down to 6/10
    assert l1.status()["used_bytes"] == 6 * PAGE
    assert resident(l1, k) == [False] * 3 + [True] * 6
    assert_clean(l1)


def test_an_admission_never_evicts_what_it_publishes(make_l1: MakeL1) -> None:
    """The adversarial run's finding: with most of L1 read-locked by others, a
    new store used to be evicted by its own watermark round (the policy,
    unable to reach the low mark, returned every evictable key: the new one).
    Now the round is skipped while locked bytes alone exceed the low mark, and
    stores pile up until reserve_write needs room and evicts the oldest."""
    l1 = make_l1(size_bytes=16 * PAGE, high_watermark=0.8, low_watermark=0.6)
    held = [make_key(i) for i in range(12)]  # 12/16 locked by other readers
    put(l1, held)
    l1.reserve_read(held)
    new = [make_key(100 + i) for i in range(5)]
    for key in new[:4]:
        put(l1, [key])  # 13..16 of 16 used, above the high mark each time
        assert l1.contains(key)
    assert resident(l1, new[:4]) == [True] * 4
    assert l1.status()["evictions"] == 0
    assert l1.status()["watermark_unreachable"] == 4
    put(l1, [new[4]])  # full: reserve_write evicts the least recent unlocked one
    assert resident(l1, new) == [False, True, True, True, True]
    l1.finish_read(held)
    assert_clean(l1)


def test_watermark_round_spares_the_batch_it_follows(make_l1: MakeL1) -> None:
    l1 = make_l1(size_bytes=10 * PAGE, high_watermark=0.8, low_watermark=0.5)
    old = [make_key(i) for i in range(5)]
    put(l1, old)
    new = [make_key(10 + i) for i in range(4)]
    put(l1, new)  # 9/10 > 80 %: down to 5/10 from the old objects only
    assert resident(l1, old) == [True] + [False] * 4  # a batch's first key is most recent
    assert resident(l1, new) == [True] * 4
    assert_clean(l1)


def test_object_larger_than_l1_is_out_of_memory(make_l1: MakeL1) -> None:
    l1 = make_l1(size_bytes=4 * PAGE)
    put(l1, [make_key(0)])
    k = [make_key(1), make_key(2)]
    assert [p.result for p in l1.reserve_write(k, [PAGE, 5 * PAGE], A)] == [OOM, OOM]
    assert l1.status()["too_large"] == 1
    assert l1.status()["evictions"] == 0  # nothing evicted for a batch that can never fit
    assert l1.contains(make_key(0))
    assert_clean(l1)


def test_resident_objects_keep_their_layout(make_l1: MakeL1) -> None:
    l1 = make_l1()
    k = [make_key(i) for i in range(3)]
    l1.reserve_write(k[:2], [PAGE, PAGE], A, layout="digest-a")
    l1.finish_write(k[:2], A)
    put(l1, k[2:])
    assert l1.resident_objects() == [(k[2], ""), (k[1], "digest-a"), (k[0], "digest-a")]
    assert_clean(l1)


def test_locked_and_staging_objects_are_never_evicted(make_l1: MakeL1) -> None:
    l1 = make_l1(size_bytes=4 * PAGE, high_watermark=1.0, low_watermark=0.5)
    k = [make_key(i) for i in range(5)]
    put(l1, k[:2])
    l1.reserve_read(k[:2])
    l1.reserve_write(k[2:4], [PAGE, PAGE], A)
    # Full of locked and staging objects: nothing can make room.
    assert [p.result for p in l1.reserve_write([k[4]], [PAGE], B)] == [OOM]
    assert resident(l1, k[:2]) == [True, True]
    assert l1.status()["out_of_memory"] == 1
    l1.finish_read(k[:2])
    l1.abort_write(k[2:4], A)
    assert_clean(l1)


def test_out_of_memory_is_all_or_nothing(make_l1: MakeL1) -> None:
    l1 = make_l1(size_bytes=4 * PAGE)
    k = [make_key(i) for i in range(3)]
    codes = [p.result for p in l1.reserve_write(k, [2 * PAGE, 2 * PAGE, PAGE], A)]
    assert codes == [OOM, OOM, OOM]
    assert l1.status()["used_bytes"] == 0
    assert_clean(l1)


def test_policy_exception_is_counted_and_eviction_recovers(
    make_l1: MakeL1, monkeypatch: pytest.MonkeyPatch
) -> None:
    l1 = make_l1(size_bytes=2 * PAGE, high_watermark=1.0, low_watermark=0.5)
    k = [make_key(i) for i in range(3)]
    put(l1, k[:2])
    broken = True
    real_select = LRUPolicy.select

    def flaky(self: LRUPolicy, need: int, evictable: Callable[[ObjectKey], bool]) -> list:
        if broken:
            raise RuntimeError("policy bug")
        return real_select(self, need, evictable)

    monkeypatch.setattr(LRUPolicy, "select", flaky)
    assert [p.result for p in l1.reserve_write([k[2]], [PAGE], A)] == [OOM]
    assert l1.status()["eviction_failures"] == 1
    broken = False
    assert [p.result for p in l1.reserve_write([k[2]], [PAGE], A)] == [S]
    l1.abort_write([k[2]], A)
    assert_clean(l1)


def test_gdsf_prefers_evicting_cheap_per_byte_objects(make_l1: MakeL1) -> None:
    l1 = make_l1(size_bytes=3 * PAGE, eviction_policy="gdsf", high_watermark=1.0, low_watermark=0.5)
    cheap, costly, big = make_key(0), make_key(1), make_key(2)
    for key, cost in ((cheap, 1.0), (costly, 50.0)):
        l1.reserve_write([key], [PAGE], A, costs=[cost])
        l1.finish_write([key], A)
    l1.reserve_write([big], [PAGE], A, costs=[10.0])
    l1.finish_write([big], A)
    l1.reserve_write([make_key(3)], [PAGE], A, costs=[20.0])  # full: one must go
    l1.abort_write([make_key(3)], A)
    assert resident(l1, [cheap, costly, big]) == [False, True, True]
    # Inflation L is now cheap's priority; touching raises the hit count.
    l1.touch([big])
    l1.reserve_write([make_key(4)], [2 * PAGE], A, costs=[1.0])
    assert resident(l1, [costly, big]) == [False, False]  # needs 2 pages: both go
    l1.abort_write([make_key(4)], A)
    assert_clean(l1)


def test_gdsf_recency_ages_untouched_objects(make_l1: MakeL1) -> None:
    l1 = make_l1(size_bytes=2 * PAGE, eviction_policy="gdsf", high_watermark=1.0, low_watermark=0.5)
    # old is worth 3 per byte (H = 3); the others 1 per byte. The arena holds two.
    old = make_key(0)
    l1.reserve_write([old], [PAGE], A, costs=[3.0 * PAGE])
    l1.finish_write([old], A)
    for i in range(2, 8):
        key = make_key(i)
        l1.reserve_write([key], [PAGE], A, costs=[1.0 * PAGE])
        l1.finish_write([key], A)
    # Victims and the inflation L after each: k2 (L=1), k3 (L=2); then old and k4
    # tie at H=3 and the older, old, goes (L=3); k4 (H=3), k5 (H=4, older than k6).
    # An untouched valuable object is outlived by newer cheap ones once L catches up.
    everything = [old] + [make_key(i) for i in range(2, 8)]
    assert resident(l1, everything) == [False] * 5 + [True, True]
    assert l1.status()["evictions"] == 5
    assert_clean(l1)


@pytest.mark.parametrize("policy", sorted(EVICTION_POLICIES))
def test_policies_keep_bytes_consistent(make_l1: MakeL1, policy: str) -> None:
    l1 = make_l1(size_bytes=16 * PAGE, eviction_policy=policy)
    rng = np.random.default_rng(1)
    for i in range(200):
        key = make_key(int(rng.integers(0, 40)))
        size = int(rng.integers(1, 3 * PAGE))
        if l1.reserve_write([key], [size], A)[0].result is S:
            l1.finish_write([key], A)
        if i % 7 == 0:
            l1.touch([make_key(int(rng.integers(0, 40)))])
    assert l1.status()["evictions"] > 0
    assert_clean(l1)


def test_lease_heap_forgets_published_writes(make_l1: MakeL1, clock: FakeClock) -> None:
    l1 = make_l1(size_bytes=64 * PAGE)
    for i in range(5000):
        key = make_key(i)
        put(l1, [key])
        assert l1.delete([key]) == [S]
    # Without compaction every published write would keep its heap entry for
    # write_lease_s (600 s); the heap stays bounded instead.
    assert len(l1._leases) <= 1024 + 2
    l1.reserve_write([make_key(1)], [PAGE], A)
    clock.advance(601)
    assert l1.finish_write([make_key(1)], A) == [NF]  # compaction kept the live lease
    assert l1.status()["expired_write_leases"] == 1
    assert_clean(l1)


def test_a_batch_that_can_never_fit_evicts_nothing(make_l1: MakeL1) -> None:
    l1 = make_l1(size_bytes=16 * PAGE, high_watermark=1.0, low_watermark=0.9)
    big, small = make_key(0), [make_key(i) for i in range(1, 7)]
    put(l1, [big], size=8 * PAGE)
    l1.reserve_read([big])
    put(l1, small)
    assert [p.result for p in l1.reserve_write([make_key(9)], [9 * PAGE], B)] == [OOM]
    assert resident(l1, small) == [True] * 6  # 9 pages never fit beside 8 locked ones
    assert l1.status()["evictions"] == 0
    assert [p.result for p in l1.reserve_write([make_key(9)], [7 * PAGE], B)] == [S]
    assert sum(resident(l1, small)) == 1  # now eviction makes room
    l1.finish_read([big])
    l1.abort_write([make_key(9)], B)
    assert_clean(l1)


# ----------------------------------------------------------------- purge


def test_a_purged_object_a_reader_holds_is_unreachable_and_freed_on_release(
    make_l1: MakeL1,
) -> None:
    l1 = make_l1()
    removed: list[ObjectKey] = []
    l1.on_residency = lambda admitted, keys: None if admitted else removed.extend(keys)
    k = [make_key(i) for i in range(3)]
    put(l1, k)
    (held,) = l1.reserve_read([k[0]], n=2)
    used = l1.status()["used_bytes"]
    assert l1.purge(k) == [LK, S, S]  # k0 held: doomed, the others freed now
    assert removed == k  # all three announced gone
    assert l1.contains(k[0]) is False
    assert [p.result for p in l1.reserve_read([k[0]])] == [NF]  # never served again
    assert l1.reserve_read_all([k[0]]) == ([], 1)
    assert l1.resident_objects() == []
    assert [p.result for p in l1.reserve_write([k[0]], [PAGE], B)] == [NW]  # until freed
    assert l1.delete([k[0]]) == l1.purge([k[0]]) == [NF]
    assert l1.doomed_objects() == [(k[0], 0)]
    assert (l1.view(held) == k[0].chunk_hash[-1]).all()  # the reader's bytes are intact
    assert l1.status()["used_bytes"] == used - 2 * PAGE
    assert l1.finish_read([k[0]]) == [S]
    assert l1.doomed_objects() == [(k[0], 0)]  # one lock left
    assert l1.finish_read([k[0]]) == [S]
    assert l1.doomed_objects() == [] and l1.status()["used_bytes"] == 0
    assert l1.finish_read([k[0]]) == [NF]
    put(l1, [k[0]])  # written again: a new object
    assert l1.delete([k[0]]) == [S]
    assert_clean(l1)


def test_a_purged_object_under_io_is_freed_when_the_fence_lifts(make_l1: MakeL1) -> None:
    l1 = make_l1()
    key = make_key(0)
    put(l1, [key])
    l1.reserve_read([key])
    _, fence = l1.fence([key])  # a write-back reads it
    assert l1.purge([key]) == [LK]
    assert l1.doomed_objects() == [(key, 1)]
    assert l1.finish_read([key]) == [S]
    assert l1.doomed_objects() == [(key, 1)]  # the I/O still reads it
    l1.unfence(fence)
    assert l1.doomed_objects() == [] and l1.status()["used_bytes"] == 0
    assert_clean(l1)


def test_a_doomed_objects_expired_read_lease_frees_it(make_l1: MakeL1, clock: FakeClock) -> None:
    l1 = make_l1(read_lease_s=5)
    key = make_key(0)
    put(l1, [key])
    l1.reserve_read([key])
    assert l1.purge([key]) == [LK]
    clock.advance(6)  # the reader vanished
    l1.reap_expired()
    assert l1.doomed_objects() == [] and l1.status()["used_bytes"] == 0
    assert l1.finish_read([key]) == [NF]
    assert_clean(l1)


def test_a_copy_staged_before_a_purge_is_not_published_while_doomed(make_l1: MakeL1) -> None:
    l1 = make_l1()
    key = make_key(0)
    assert [p.result for p in l1.reserve_write([key], [PAGE], B)] == [S]  # a load begins
    put(l1, [key])  # ...while another copy is published, and read
    l1.reserve_read([key])
    assert l1.purge([key]) == [LK]
    assert [p.result for p in l1.finish_write_and_reserve_read([key], B)] == [NF]
    assert not l1.contains(key)
    assert l1.finish_read([key]) == [S]
    assert l1.status()["used_bytes"] == 0
    assert_clean(l1)


def test_an_object_trimmed_at_its_own_admission_is_announced_then_removed(
    make_l1: MakeL1,
) -> None:
    """An owner over its soft limit loses its own objects at the admission, the
    admitted ones included when its older ones are held: KV events see the
    admission before the removal, never a removal of an unannounced key."""
    l1 = make_l1()
    l1.set_owners(lambda salt: salt, {"acme": OwnerLimit(soft=2 * PAGE)})
    events: list[tuple[bool, list[ObjectKey]]] = []
    l1.on_residency = lambda admitted, keys: events.append((admitted, list(keys)))
    old = [make_key(i, salt="acme") for i in range(2)]
    put(l1, old)
    l1.reserve_read(old)  # acme's quota is all held by a reader
    new = make_key(2, salt="acme")
    put(l1, [new])
    assert resident(l1, [*old, new]) == [True, True, False]
    assert events[-2:] == [(True, [new]), (False, [new])]
    assert l1.status()["quota_evictions"] == 1
    l1.finish_read(old)
    assert_clean(l1)
