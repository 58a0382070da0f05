"""L1Manager driven by hypothesis against a pure-Python reference model.

The model predicts every per-key result code, which keys are resident, the
read-lock counts, the staging (key, tag) pairs, the leases, the counters and
the exact LRU order. The one thing it does not model is the allocator's
layout, so for ``reserve_write`` it cannot say in advance whether a batch
fits; there it checks what any layout must satisfy and then adopts the
manager's answer:

- eviction only takes unlocked resident objects, in exact LRU order (a
  prefix of the evictable keys, oldest first), never locked or staging ones;
- a batch that fits in the largest free extent is placed with no eviction,
  and a batch that exceeds the free bytes is never placed without eviction;
- OUT_OF_MEMORY comes only after every evictable object was evicted and when
  the largest free extent left is smaller than the batch (so never on an
  empty arena).

Watermark eviction after a publish is predicted exactly. Per-key lock counts,
the staging pairs and the LRU order are not in the public API; the invariant
reads them from the manager's tables (``_resident``, ``_staging``, and the
LRU policy's ``_order``).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import pytest
from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from kvtier.keys import ObjectKey
from kvtier.l1 import L1Config, L1Manager, L1Result, Placement, WriterTag
from kvtier.l1.eviction import LRUPolicy
from kvtier.l1.tables import COUNTERS
from tests.conftest import LK, NF, NW, OOM, WS, FakeClock, KiB, S, make_key
from tests.ledger import assert_clean

PAGE = 4096
CONFIG = L1Config(
    size_bytes=64 * KiB,
    populate=False,
    eviction_policy="lru",
    high_watermark=0.7,  # low marks, so that publishing often evicts
    low_watermark=0.4,
    write_lease_s=8.0,
    read_lease_s=4.0,
)
CAPACITY = CONFIG.size_bytes
KEYS = [make_key(i) for i in range(8)]
TAGS = [WriterTag("a"), WriterTag("b"), WriterTag("c")]

# 1 B to 12 KiB, spread evenly over 1-3 pages (plain integers would favour tiny sizes).
sizes = st.builds(
    lambda pages, slack: pages * PAGE - slack,
    st.sampled_from([3, 2, 1]),
    st.one_of(st.sampled_from([0, 1, PAGE - 1]), st.integers(0, PAGE - 1)),
)
counts = st.integers(1, 2)
tags = st.sampled_from(TAGS)


def reserved(size: int) -> int:
    return -(-size // PAGE) * PAGE


def largest_free_extent(manager: L1Manager) -> int:
    """The largest free extent, from the public status (fragmentation is
    ``1 - largest / free``)."""
    status = manager.status()
    capacity, used, fragmentation = (
        status["capacity_bytes"],
        status["used_bytes"],
        status["fragmentation"],
    )
    assert isinstance(capacity, int) and isinstance(used, int)
    assert isinstance(fragmentation, float)
    return round((capacity - used) * (1.0 - fragmentation))


@dataclass
class Resident:
    offset: int
    size: int
    locks: int = 0
    lock_expiry: float | None = None

    @property
    def reserved(self) -> int:
        return reserved(self.size)


@dataclass
class Staged:
    offset: int
    size: int
    expiry: float

    @property
    def reserved(self) -> int:
        return reserved(self.size)


F = TypeVar("F", bound=Callable[..., None])


def step(fn: F) -> F:
    """Mark the model out of sync while a step runs, so that teardown after a
    failure closes the manager without piling a second error on the first."""

    @functools.wraps(fn)
    def wrapper(self: L1ManagerMachine, *args: Any, **kwargs: Any) -> None:
        self.in_sync = False
        fn(self, *args, **kwargs)
        self.in_sync = True

    return wrapper  # type: ignore[return-value]


class L1ManagerMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.clock = FakeClock()
        self.manager = L1Manager(CONFIG, clock=self.clock)
        self.resident: dict[ObjectKey, Resident] = {}
        self.staging: dict[tuple[ObjectKey, WriterTag], Staged] = {}
        self.lru: list[ObjectKey] = []  # resident keys, least recently used first
        self.counters = dict.fromkeys(COUNTERS, 0)
        self.in_sync = True

    # ----------------------------------------------------------- the model

    def reap(self) -> None:
        """What every reaping manager method does first: expire due leases."""
        now = self.clock.now
        for pair, staged in list(self.staging.items()):
            if staged.expiry <= now:
                del self.staging[pair]
                self.counters["expired_write_leases"] += 1
        for obj in self.resident.values():
            if obj.locks and obj.lock_expiry is not None and obj.lock_expiry <= now:
                obj.locks, obj.lock_expiry = 0, None
                self.counters["expired_read_leases"] += 1

    def used(self) -> int:
        return sum(o.reserved for o in self.resident.values()) + sum(
            s.reserved for s in self.staging.values()
        )

    def pinned(self) -> int:
        """Bytes no eviction can free: staging copies and read-locked objects."""
        return sum(o.reserved for o in self.resident.values() if o.locks) + sum(
            s.reserved for s in self.staging.values()
        )

    def evictable_in_order(self) -> list[ObjectKey]:
        return [k for k in self.lru if self.resident[k].locks == 0]

    def drop(self, keys: list[ObjectKey] | set[ObjectKey]) -> int:
        freed = 0
        for key in keys:
            freed += self.resident.pop(key).reserved
            self.lru.remove(key)
        return freed

    def evicted(self, keys: list[ObjectKey] | set[ObjectKey]) -> None:
        self.counters["evictions"] += len(keys)
        self.counters["evicted_bytes"] += self.drop(keys)

    def lru_select(self, need: int) -> list[ObjectKey]:
        chosen, freed = [], 0
        for key in self.evictable_in_order():
            if freed >= need:
                break
            chosen.append(key)
            freed += self.resident[key].reserved
        return chosen

    def lock(self, key: ObjectKey, n: int) -> None:
        obj = self.resident[key]
        obj.locks += n
        obj.lock_expiry = self.clock.now + CONFIG.read_lease_s

    def real_resident(self) -> set[ObjectKey]:
        return {k for k in KEYS if self.manager.contains(k)}

    def draw_keys(self, data: st.DataObject, preferred: list[ObjectKey]) -> list[ObjectKey]:
        """1-3 distinct keys, two thirds of them from ``preferred`` if any.

        (Batches never repeat a key: the manager's docstring calls duplicate
        keys a caller mistake, though only the write methods reject them.)
        """
        key: st.SearchStrategy[ObjectKey] = st.sampled_from(KEYS)
        if preferred:
            favoured = st.sampled_from(sorted(set(preferred), key=KEYS.index))
            key = st.one_of(favoured, favoured, key)
        return data.draw(st.lists(key, min_size=1, max_size=3, unique=True))

    def draw_writer(self, data: st.DataObject) -> tuple[WriterTag, list[ObjectKey]]:
        """A tag (half the time one that stages something) and 1-3 keys,
        biased towards what that tag stages."""
        staging_tags = sorted({t for _, t in self.staging})
        tag = data.draw(st.one_of(st.sampled_from(staging_tags), tags) if staging_tags else tags)
        return tag, self.draw_keys(data, [k for k, t in self.staging if t == tag])

    # --------------------------------------------------------------- rules

    @initialize(
        items=st.lists(
            st.tuples(st.integers(0, len(KEYS) - 1), sizes),
            min_size=1,
            max_size=6,
            unique_by=lambda item: item[0],
        ),
        tag=tags,
    )
    @step
    def populate(self, items: list[tuple[int, int]], tag: WriterTag) -> None:
        """Start from some resident objects (hypothesis switches random rules
        off per example, which may include the writing ones)."""
        keys = [KEYS[i] for i, _ in items]
        self.check_reserve_write(keys, [size for _, size in items], tag)
        expected = self.publish(keys, tag, 0)
        assert self.manager.finish_write(keys, tag) == [p.result for p in expected]

    @rule(
        items=st.lists(
            st.tuples(st.integers(0, len(KEYS) - 1), sizes),
            min_size=1,
            max_size=3,
            unique_by=lambda item: item[0],
        ),
        tag=tags,
    )
    @step
    def reserve_write(self, items: list[tuple[int, int]], tag: WriterTag) -> None:
        self.check_reserve_write([KEYS[i] for i, _ in items], [size for _, size in items], tag)

    @rule(data=st.data(), tag=tags)
    @step
    def reserve_write_contended(self, data: st.DataObject, tag: WriterTag) -> None:
        """Keys another tag stages or that are resident: duplicates and NOT_WRITABLE."""
        others = {k for k, t in self.staging if t != tag} | set(self.resident)
        keys = self.draw_keys(data, list(others))
        self.check_reserve_write(keys, [data.draw(sizes) for _ in keys], tag)

    def check_reserve_write(self, keys: list[ObjectKey], sizes_: list[int], tag: WriterTag) -> None:
        # Reaping an expired reservation frees memory and changes the layout;
        # the largest free extent seen now predicts the call only if it won't.
        memory_reaped = any(s.expiry <= self.clock.now for s in self.staging.values())
        largest_before = None if memory_reaped else largest_free_extent(self.manager)
        self.reap()
        expected: list[L1Result | None] = []
        wanted = []
        for key, size in zip(keys, sizes_, strict=True):
            if key in self.resident:
                expected.append(NW)
            elif (key, tag) in self.staging:
                expected.append(WS)
            else:
                expected.append(None)
                wanted.append((key, size))
        need = sum(reserved(size) for _, size in wanted)
        used_before = self.used()
        evictable = self.evictable_in_order()
        pinned = self.pinned()

        placements = self.manager.reserve_write(keys, sizes_, tag)

        assert len(placements) == len(keys)
        for placement, want in zip(placements, expected, strict=True):
            if want is not None:
                assert placement == Placement(want)
        outcomes = {p.result for p, want in zip(placements, expected, strict=True) if want is None}
        assert outcomes <= {S, OOM} and len(outcomes) <= 1, placements  # all or nothing

        now_resident = self.real_resident()
        assert now_resident <= set(self.resident), "reserve_write made a key resident"
        gone = set(self.resident) - now_resident
        assert gone == set(evictable[: len(gone)]), (
            f"evicted {gone}, but the unlocked keys in LRU order are {evictable}"
        )
        freed = sum(self.resident[k].reserved for k in gone)
        self.evicted(gone)
        if not wanted:
            assert not gone
            return
        if need > CAPACITY - pinned:  # cannot fit beside locked and staged objects
            assert outcomes == {OOM} and not gone, "evicted for a batch that can never fit"
            self.counters["out_of_memory"] += 1
            self.counters["too_large"] += any(size > CAPACITY for _, size in wanted)
            return
        if outcomes == {OOM}:
            self.counters["out_of_memory"] += 1
            assert gone == set(evictable), "OUT_OF_MEMORY while unlocked objects remained"
            used_after = used_before - freed
            assert used_after > 0 or need > CAPACITY, "OUT_OF_MEMORY on an empty arena"
            largest_after = largest_free_extent(self.manager)
            assert largest_after < need, (
                f"OUT_OF_MEMORY for {need} bytes with a free extent of {largest_after}"
            )
            return
        if gone:
            event("reserve_write evicted, then fit")
        if largest_before is not None and largest_before >= need:
            assert not gone, f"evicted {gone} though {need} bytes fit in {largest_before}"
        if not gone:
            assert used_before + need <= CAPACITY
        expiry = self.clock.now + CONFIG.write_lease_s
        for (key, size), placement in zip(
            wanted, [p for p, w in zip(placements, expected, strict=True) if w is None], strict=True
        ):
            assert placement.size == size
            assert placement.offset is not None and placement.offset % PAGE == 0
            self.staging[(key, tag)] = Staged(placement.offset, size, expiry)

    def publish(self, keys: list[ObjectKey], tag: WriterTag, n: int) -> list[Placement]:
        """The model of finish_write (n == 0) and finish_write_and_reserve_read."""
        self.reap()
        expected = []
        admitted = []
        for key in keys:
            staged = self.staging.pop((key, tag), None)
            if staged is None:
                expected.append(Placement(NF))
                continue
            winner = self.resident.get(key)
            if winner is None:
                winner = self.resident[key] = Resident(staged.offset, staged.size)
                admitted.append(key)
            else:
                self.counters["duplicate_writes"] += 1
            if n:
                self.lock(key, n)
            expected.append(Placement(S, winner.offset, winner.size))
        used = self.used()
        if used > CONFIG.high_watermark * CAPACITY:
            event("publish crossed the high watermark")
            fresh = sum(self.resident[k].reserved for k in admitted if not self.resident[k].locks)
            if self.pinned() + fresh > CONFIG.low_watermark * CAPACITY:
                event("the low watermark was out of reach")
                self.counters["watermark_unreachable"] += 1
            else:  # before the new keys join the LRU order: never their own victims
                self.evicted(self.lru_select(int(used - CONFIG.low_watermark * CAPACITY)))
        for key in reversed(admitted):  # the batch's first key ends up most recent
            self.lru.append(key)
        return expected

    @rule()
    @step
    def admit_all_staged(self) -> None:
        """finish_write, as one batch, every reservation of the first tag that has any.

        Hypothesis picks the first rule in its order (argument-less rules
        first, then by name) more often than the others; this name puts a
        rule that fills the arena there, ahead of ``clear``, which empties it.
        """
        tag = min((t for _, t in self.staging), default=TAGS[0])
        keys = sorted((k for k, t in self.staging if t == tag), key=KEYS.index) or KEYS[:1]
        expected = self.publish(keys, tag, 0)
        assert self.manager.finish_write(keys, tag) == [p.result for p in expected]

    @rule(data=st.data())
    @step
    def finish_write(self, data: st.DataObject) -> None:
        tag, keys = self.draw_writer(data)
        expected = self.publish(keys, tag, 0)
        assert self.manager.finish_write(keys, tag) == [p.result for p in expected]

    @rule(data=st.data(), n=counts)
    @step
    def finish_write_and_reserve_read(self, data: st.DataObject, n: int) -> None:
        tag, keys = self.draw_writer(data)
        expected = self.publish(keys, tag, n)
        assert self.manager.finish_write_and_reserve_read(keys, tag, n) == expected

    @rule(data=st.data())
    @step
    def abort_write(self, data: st.DataObject) -> None:
        tag, keys = self.draw_writer(data)
        self.reap()
        expected = [S if self.staging.pop((k, tag), None) else NF for k in keys]
        assert self.manager.abort_write(keys, tag) == expected

    @rule(data=st.data(), n=counts)
    @step
    def reserve_read(self, data: st.DataObject, n: int) -> None:
        keys = self.draw_keys(data, list(self.resident))
        self.reap()
        expected = []
        for key in keys:
            obj = self.resident.get(key)
            if obj is None:
                expected.append(Placement(NF))
            else:
                self.lock(key, n)  # locking is not use: the LRU order stays
                expected.append(Placement(S, obj.offset, obj.size))
        assert self.manager.reserve_read(keys, n) == expected

    @rule(data=st.data(), n=counts)
    @step
    def finish_read(self, data: st.DataObject, n: int) -> None:
        keys = self.draw_keys(data, [k for k, o in self.resident.items() if o.locks])
        self.reap()
        expected = []
        for key in keys:
            obj = self.resident.get(key)
            if obj is None:
                expected.append(NF)
            elif obj.locks < n:
                expected.append(WS)
            else:
                obj.locks -= n
                if obj.locks == 0:
                    obj.lock_expiry = None
                expected.append(S)
        assert self.manager.finish_read(keys, n) == expected

    @rule(data=st.data())
    @step
    def delete(self, data: st.DataObject) -> None:
        keys = self.draw_keys(data, list(self.resident))
        self.reap()
        expected = []
        for key in keys:
            obj = self.resident.get(key)
            if obj is None:
                expected.append(NF)
            elif obj.locks:
                expected.append(LK)
            else:
                self.drop([key])
                expected.append(S)
        assert self.manager.delete(keys) == expected

    @rule(data=st.data())
    @step
    def touch(self, data: st.DataObject) -> None:
        keys = self.draw_keys(data, list(self.resident))
        # touch does not reap; expired locks stay counted until the next call that does
        expected = [S if k in self.resident else NF for k in keys]
        for key in reversed(keys):  # the first key ends up most recent
            if key in self.resident:
                self.lru.remove(key)
                self.lru.append(key)
        assert self.manager.touch(keys) == expected

    @rule()
    @step
    def clear(self) -> None:
        self.reap()
        victims = self.evictable_in_order()
        self.drop(victims)
        assert self.manager.clear() == len(victims)

    @rule(
        seconds=st.sampled_from(
            [
                0.5,
                1.0,
                2.0,
                3.0,
                CONFIG.read_lease_s,
                CONFIG.read_lease_s + 0.5,
                CONFIG.write_lease_s,
            ]
        ),
        reap=st.booleans(),
    )
    @step
    def advance_clock(self, seconds: float, reap: bool) -> None:
        """Move time; leases that fall due expire at the next call that reaps."""
        self.clock.advance(seconds)
        if reap:
            self.reap()
            self.manager.reap_expired()

    # ---------------------------------------------------------- invariants

    @invariant()
    @step
    def manager_matches_model(self) -> None:
        audit = self.manager.audit()
        assert audit["object_bytes"] == audit["arena_used_bytes"] == self.used(), audit
        assert audit["policy_entries"] == audit["resident_objects"] == len(self.resident), audit
        assert audit["read_locks"] == sum(o.locks for o in self.resident.values()), audit
        assert audit["staging_objects"] == len(self.staging), audit
        assert audit["io_fences"] == 0 and audit["zombies"] == 0, audit

        status = self.manager.status()
        locked = [o for o in self.resident.values() if o.locks]
        assert status["locked_objects"] == len(locked), status
        assert status["locked_bytes"] == sum(o.reserved for o in locked), status
        assert status["staging_bytes"] == sum(s.reserved for s in self.staging.values()), status
        assert {c: status[c] for c in COUNTERS} == self.counters

        assert self.real_resident() == set(self.resident)
        # Per-key counts are not in the public API; peek at the manager's tables.
        real_locks = {k: o.read_locks for k, o in self.manager._resident.items()}
        assert real_locks == {k: o.locks for k, o in self.resident.items()}
        assert set(self.manager._staging) == set(self.staging)
        policy = self.manager._policy
        assert isinstance(policy, LRUPolicy)
        assert list(policy._order) == self.lru, "LRU order differs from the model's"

        # Live objects sit in disjoint page runs inside the arena.
        extents = sorted(
            [(o.offset, o.reserved) for o in self.resident.values()]
            + [(s.offset, s.reserved) for s in self.staging.values()]
        )
        end = 0
        for offset, length in extents:
            assert offset >= end, extents
            end = offset + length
        assert end <= CAPACITY

    def teardown(self) -> None:
        for name, value in self.counters.items():
            if value:
                event(f"saw {name}")
        try:
            if self.in_sync:
                # Give back every lock and reservation the model knows of; then
                # nothing may be left locked, staged or leaked.
                self.reap()
                self.manager.reap_expired()
                for key, obj in self.resident.items():
                    if obj.locks:
                        assert self.manager.finish_read([key], obj.locks) == [S]
                for key, tag in self.staging:
                    assert self.manager.abort_write([key], tag) == [S]
                assert_clean(self.manager)
                assert self.manager.status()["used_bytes"] == sum(
                    o.reserved for o in self.resident.values()
                )
        finally:
            self.manager.close()


L1ManagerMachine.TestCase.settings = settings(
    max_examples=200,
    stateful_step_count=60,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestL1ManagerStateful = L1ManagerMachine.TestCase
# 200 programs of 60 steps take about 20 s: the full run's, not the quick one's.
pytestmark = pytest.mark.slow
