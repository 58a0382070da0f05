"""Owners in L1: a hard limit refuses writes, a soft limit evicts the owner's
own least recently used objects (never another's), a lower limit evicts down
now, pins keep objects within a pin cap and expire, and the ledger stays
exact through all of it."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from kvtier.keys import ObjectKey
from kvtier.l1 import L1Manager, L1Result, WriterTag
from kvtier.l1.quotas import OwnerLimit
from tests.conftest import FakeClock, make_key
from tests.ledger import assert_clean

PAGE = 4096
A = WriterTag("a")
S, NF, OQ = L1Result.SUCCESS, L1Result.NOT_FOUND, L1Result.OVER_QUOTA
MakeL1 = Callable[..., L1Manager]
OWNERS = {"acme-salt": "acme", "globex-salt": "globex"}


def keys(tenant: str, *ids: int) -> list[ObjectKey]:
    return [make_key(i, salt=f"{tenant}-salt") for i in ids]


def put(l1: L1Manager, ks: list[ObjectKey]) -> list[L1Result]:
    placements = l1.reserve_write(ks, [PAGE] * len(ks), A)
    done = [k for k, p in zip(ks, placements, strict=True) if p.result is S]
    l1.finish_write(done, A)
    return [p.result for p in placements]


def owned(make_l1: MakeL1, **limits: OwnerLimit) -> L1Manager:
    l1 = make_l1(size_bytes=64 * PAGE)
    l1.set_owners(lambda salt: OWNERS.get(salt, ""), dict(limits))
    return l1


def test_a_hard_limit_refuses_the_write_that_would_pass_it(make_l1: MakeL1) -> None:
    l1 = owned(make_l1, acme=OwnerLimit(hard=3 * PAGE))
    assert put(l1, keys("acme", 1, 2)) == [S, S]
    assert put(l1, keys("acme", 3, 4)) == [S, OQ]  # the second would make four pages
    assert put(l1, keys("globex", 5, 6, 7, 8)) == [S] * 4  # another owner is not limited
    assert l1.status()["over_quota"] == 1
    assert l1.owner_usage()["acme"]["bytes"] == 3 * PAGE
    # staging counts too: a reservation not yet published holds its bytes
    l1.delete(keys("acme", 3))
    placements = l1.reserve_write(keys("acme", 9), [PAGE], A)
    assert placements[0].result is S
    assert l1.reserve_write(keys("acme", 10), [PAGE], WriterTag("b"))[0].result is OQ
    l1.abort_write(keys("acme", 9), A)
    assert_clean(l1)


def test_over_a_soft_limit_the_owner_loses_its_own_oldest_objects(
    make_l1: MakeL1, clock: FakeClock
) -> None:
    l1 = owned(make_l1, acme=OwnerLimit(soft=3 * PAGE))
    put(l1, keys("globex", 100))  # the oldest object of all: never acme's victim
    for i in (1, 2, 3):
        put(l1, keys("acme", i))
    l1.touch(keys("acme", 1))  # 2 is now acme's least recently used
    put(l1, keys("acme", 4))
    present = [l1.contains(k) for k in keys("acme", 1, 2, 3, 4)]
    assert present == [True, False, True, True]
    assert l1.contains(keys("globex", 100)[0])
    assert l1.status()["quota_evictions"] == 1
    assert l1.owner_usage()["acme"]["bytes"] == 3 * PAGE
    assert_clean(l1)


def test_recency_is_kept_only_under_a_soft_limit(make_l1: MakeL1) -> None:
    """A hit on an owner without a soft limit costs no bookkeeping: a soft
    limit set later evicts from the admission order of what it holds."""
    l1 = owned(make_l1)
    for i in (1, 2, 3):
        put(l1, keys("acme", i))
    l1.touch(keys("acme", 1))  # not recorded: acme has no soft limit yet
    assert l1.set_limit("acme", OwnerLimit(soft=2 * PAGE)) == PAGE
    assert [l1.contains(k) for k in keys("acme", 1, 2, 3)] == [False, True, True]
    l1.touch(keys("acme", 2))  # recorded now: 3 is acme's least recently used
    put(l1, keys("acme", 4))
    assert [l1.contains(k) for k in keys("acme", 2, 3, 4)] == [True, False, True]
    assert_clean(l1)


def test_a_locked_object_is_not_a_quota_victim(make_l1: MakeL1) -> None:
    l1 = owned(make_l1, acme=OwnerLimit(soft=2 * PAGE))
    put(l1, keys("acme", 1, 2))
    l1.reserve_read(keys("acme", 1))
    put(l1, keys("acme", 3))
    assert [l1.contains(k) for k in keys("acme", 1, 2, 3)] == [True, False, True]
    l1.finish_read(keys("acme", 1))
    assert_clean(l1)


def test_lowering_a_limit_evicts_down_now(make_l1: MakeL1) -> None:
    l1 = owned(make_l1)
    put(l1, keys("acme", 1, 2, 3, 4))  # a batch is admitted in reverse: 1 is the most recent
    put(l1, keys("globex", 5, 6))
    assert l1.set_limit("acme", OwnerLimit(soft=PAGE)) == 3 * PAGE
    assert [l1.contains(k) for k in keys("acme", 1, 2, 3, 4)] == [True, False, False, False]
    assert l1.owner_usage()["globex"]["bytes"] == 2 * PAGE
    assert_clean(l1)


def test_pins_hold_within_the_cap_and_expire(make_l1: MakeL1, clock: FakeClock) -> None:
    l1 = owned(make_l1, acme=OwnerLimit(pins=2 * PAGE))
    put(l1, keys("acme", 1, 2, 3))
    assert l1.pin(keys("acme", 1, 2, 3, 99), ttl_s=60) == [S, S, OQ, NF]  # the cap is 2 pages
    assert l1.pin(keys("acme", 1), ttl_s=120) == [S]  # renewing is not a second pin
    assert l1.owner_usage()["acme"]["pinned_bytes"] == 2 * PAGE
    assert l1.clear() == 1  # only the unpinned one goes
    assert [l1.contains(k) for k in keys("acme", 1, 2, 3)] == [True, True, False]
    clock.now += 61  # 2's pin is over, 1's (renewed) is not
    assert l1.clear() == 1
    assert [l1.contains(k) for k in keys("acme", 1, 2)] == [True, False]
    assert l1.unpin(keys("acme", 1, 2)) == [S, NF]
    assert l1.delete(keys("acme", 1)) == [S]
    assert l1.owner_usage()["acme"] == {"bytes": 0, "pinned_bytes": 0}
    assert_clean(l1)


def test_a_pin_protects_from_eviction_but_not_from_delete(make_l1: MakeL1) -> None:
    l1 = owned(make_l1)
    put(l1, keys("acme", 1))
    assert l1.pin(keys("acme", 1), ttl_s=60) == [S]
    assert l1.delete(keys("acme", 1)) == [S]
    assert l1.owner_usage()["acme"]["pinned_bytes"] == 0
    with pytest.raises(ValueError, match="ttl_s"):
        l1.pin(keys("acme", 1), ttl_s=-1)


def test_all_pins_together_stay_under_the_arenas_share(make_l1: MakeL1) -> None:
    l1 = make_l1(size_bytes=8 * PAGE, max_pinned_fraction=0.25)
    put(l1, [make_key(i) for i in range(4)])
    assert l1.pin([make_key(i) for i in range(4)], ttl_s=60) == [S, S, OQ, OQ]
    assert_clean(l1)


# ------------------------------------------- isolation under pressure (issue 41)


def test_an_over_quota_store_keeps_its_head_and_evicts_no_other_tenant(make_l1: MakeL1) -> None:
    """Issue 41 #6: L1 of 64, globex holds 30, acme (soft 8) stores 24 in one
    request. Had acme kept to its quota, L1 would be under its watermark: the
    batch's part past acme's soft limit is refused, globex loses nothing."""
    l1 = owned(make_l1, acme=OwnerLimit(soft=8 * PAGE))
    theirs = keys("globex", *range(100, 130))
    assert put(l1, theirs) == [S] * 30
    mine = keys("acme", *range(24))
    assert put(l1, mine) == [S] * 8 + [OQ] * 16  # the head is kept: the tail is useless alone
    assert all(l1.contains(k) for k in theirs)
    assert [l1.contains(k) for k in mine] == [True] * 8 + [False] * 16
    assert l1.owner_usage()["acme"]["bytes"] == 8 * PAGE
    assert l1.status()["evictions"] == 0
    assert_clean(l1)


def test_an_owners_own_objects_make_room_for_its_write_before_anyone_elses(
    make_l1: MakeL1,
) -> None:
    l1 = make_l1(size_bytes=16 * PAGE, high_watermark=1.0, low_watermark=0.9)
    l1.set_owners(lambda salt: OWNERS.get(salt, ""), {"acme": OwnerLimit(soft=4 * PAGE)})
    put(l1, keys("globex", *range(100, 112)))  # older than any of acme's
    put(l1, keys("acme", 1, 2, 3, 4))  # L1 is full; acme is at its quota
    assert put(l1, keys("acme", 5, 6)) == [S, S]
    assert all(l1.contains(k) for k in keys("globex", *range(100, 112)))
    kept = [l1.contains(k) for k in keys("acme", 1, 2, 3, 4, 5, 6)]
    assert kept == [True, True, False, False, True, True]  # a batch: 1 is more recent than 4
    assert l1.status()["evictions"] == 0 and l1.status()["quota_evictions"] == 2
    assert_clean(l1)


def test_an_owners_locked_excess_never_makes_room_at_anothers_expense(make_l1: MakeL1) -> None:
    l1 = make_l1(size_bytes=16 * PAGE, high_watermark=1.0, low_watermark=0.9)
    l1.set_owners(lambda salt: OWNERS.get(salt, ""), {"acme": OwnerLimit(soft=4 * PAGE)})
    put(l1, keys("globex", *range(100, 112)))
    put(l1, keys("acme", 1, 2, 3, 4))
    assert all(p.result is S for p in l1.reserve_read(keys("acme", 1, 2, 3, 4)))
    # acme's own objects are all held by a reader: its write has no room of its own
    assert put(l1, keys("acme", 5)) == [L1Result.OUT_OF_MEMORY]
    assert all(l1.contains(k) for k in keys("globex", *range(100, 112)))
    l1.finish_read(keys("acme", 1, 2, 3, 4))
    assert put(l1, keys("acme", 5)) == [S]  # now acme's oldest goes for it
    assert [l1.contains(k) for k in keys("acme", 1, 2, 3, 4, 5)] == [True] * 3 + [False, True]
    assert all(l1.contains(k) for k in keys("globex", *range(100, 112)))
    assert_clean(l1)


def test_excess_held_by_readers_does_not_start_the_watermark_round(make_l1: MakeL1) -> None:
    """Bytes an owner holds past its soft limit are its own to carry: they do
    not push others past the watermark, and they go first once released."""
    l1 = owned(make_l1, acme=OwnerLimit(soft=8 * PAGE))  # 64 pages, watermarks 0.8 / 0.6
    theirs = keys("globex", *range(100, 130))
    put(l1, theirs)
    mine = keys("acme", *range(8))
    put(l1, mine)
    l1.reserve_read(mine)
    more = keys("acme", *range(8, 16))
    tag = WriterTag("b")
    assert all(p.result is S for p in l1.reserve_write(more, [PAGE] * 8, tag))
    assert all(p.result is S for p in l1.finish_write_and_reserve_read(more, tag))
    assert l1.owner_usage()["acme"]["bytes"] == 16 * PAGE  # every one of them is held
    later = keys("globex", *range(130, 140))
    put(l1, later)  # 56 of 64 pages in use, 8 of them acme's excess
    assert all(l1.contains(k) for k in theirs + later)
    l1.finish_read(mine + more)
    put(l1, keys("globex", 140))  # the next admission trims acme's excess, no one else's
    assert l1.owner_usage()["acme"]["bytes"] == 8 * PAGE
    assert all(l1.contains(k) for k in theirs + later)
    assert l1.status()["evictions"] == 0
    assert_clean(l1)


def test_lowering_a_pin_limit_unpins_down_to_it_now(make_l1: MakeL1, clock: FakeClock) -> None:
    """A pin limit lowered at run time holds at once, not when the pins past it
    end: the pins that end soonest go first, and the objects become evictable."""
    l1 = owned(make_l1, acme=OwnerLimit(pins=3 * PAGE))
    mine = keys("acme", 1, 2, 3)
    put(l1, mine)
    for i, key in enumerate(mine):
        assert l1.pin([key], ttl_s=60 * (3 - i)) == [S]  # 3 ends first, then 2
    assert l1.set_limit("acme", OwnerLimit(pins=PAGE)) == 0
    assert l1.owner_usage()["acme"]["pinned_bytes"] == PAGE
    assert l1.clear() == 2
    assert [l1.contains(k) for k in mine] == [True, False, False]
    assert l1.pin(keys("acme", 1), ttl_s=60) == [S]  # a renewal is not a second pin
    assert_clean(l1)
