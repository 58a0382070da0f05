"""L1Manager under concurrent use: threads write, read, delete and touch a
small arena, so eviction and OUT_OF_MEMORY happen all the time.

Every object's bytes are a pattern derived from its key, written by its
writer before it publishes. A reader checks the bytes under its read lock,
and again just before it releases the lock; a writer checks its staged
bytes again just before it publishes. If the manager ever evicted, freed or
handed out locked or staged memory, another writer's pattern would show up
there. Each thread records the locks and reservations it holds and gives
back exactly those; at the end nothing may be locked, staged or leaked.

The clock is a FakeClock that never moves, so no lease expires: every lock
and reservation is released only by its holder, and results that depend on
the holder's own state are exact.
"""

from __future__ import annotations

import random
import sys
import threading
from collections import Counter
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TypeVar

import numpy as np
import numpy.typing as npt
import pytest

from kvtier.keys import ObjectKey
from kvtier.l1 import L1Config, L1Manager, Placement, WriterTag
from tests.conftest import LK, NF, NW, OOM, WS, FakeClock, KiB, MiB, S, make_key
from tests.ledger import assert_clean

T = TypeVar("T")
PAGE = 4096
THREADS = 6
ITERATIONS = 5000  # per thread
POOL = 40  # keys
MAX_SIZE = 16 * KiB
ARENA = 256 * KiB  # 64 pages; the threads together may hold far more
MAX_HELD_KEYS = 3  # read-locked keys a thread keeps across iterations
MAX_STAGED_KEYS = 3  # reservations a thread keeps across iterations

KEYS = [make_key(i) for i in range(POOL)]
INDEX = {key: i for i, key in enumerate(KEYS)}


def pattern(seed: int, size: int) -> npt.NDArray[np.uint8]:
    """``size`` bytes that differ at every position from any other seed's
    (for seeds that differ mod 256)."""
    return ((np.arange(size, dtype=np.uint32) * 7 + seed) % 256).astype(np.uint8)


PATTERNS = [pattern(5 * i + 1, MAX_SIZE) for i in range(POOL)]  # seeds 1..196


def stat(manager: L1Manager, name: str) -> int:
    value = manager.status()[name]
    assert isinstance(value, int), (name, value)
    return value


@pytest.fixture(autouse=True)
def frequent_thread_switches() -> Iterator[None]:
    """Switch threads every 20 µs instead of 5 ms, for more interleavings."""
    before = sys.getswitchinterval()
    sys.setswitchinterval(2e-5)
    yield
    sys.setswitchinterval(before)


@dataclass
class Tally:
    """What one thread saw, for the conservation checks at the end."""

    published: int = 0  # SUCCESS results of finish_write and finish_write_and_reserve_read
    deleted: int = 0  # SUCCESS results of delete
    cleared: int = 0  # sum of clear() results
    oom_calls: int = 0  # reserve_write calls that answered OUT_OF_MEMORY
    verified: int = 0  # byte checks of read-locked objects
    ops: Counter[str] = field(default_factory=Counter)


class Worker:
    """One thread's random workload; it owns ``locks`` and ``staged``."""

    def __init__(self, manager: L1Manager, number: int, seed: int, costs: bool) -> None:
        self.manager = manager
        self.tag = WriterTag(f"w{number}")
        self.rng = random.Random(seed)
        self.costs = costs
        self.locks: Counter[ObjectKey] = Counter()  # read locks this thread holds
        self.locked_at: dict[ObjectKey, Placement] = {}  # where each locked key lives
        self.staged: dict[ObjectKey, Placement] = {}  # this thread's reservations
        self.tally = Tally()

    # ------------------------------------------------------------ checks

    def check_bytes(self, key: ObjectKey, placement: Placement) -> None:
        view = self.manager.view(placement)
        expected = PATTERNS[INDEX[key]][: placement.size]
        assert np.array_equal(view, expected), f"{key} holds another object's bytes"

    def hold(self, key: ObjectKey, placement: Placement, n: int) -> None:
        """Record n read locks on ``key`` taken at ``placement``."""
        assert placement.result is S
        if key in self.locked_at:  # still locked by us, so it cannot have moved
            assert placement == self.locked_at[key]
        self.locked_at[key] = placement
        self.locks[key] += n
        self.check_bytes(key, placement)
        self.tally.verified += 1

    def pick(self, count: int) -> list[ObjectKey]:
        """Distinct keys: batches never repeat a key."""
        return self.rng.sample(KEYS, count)

    # -------------------------------------------------------- operations

    def write(self) -> None:
        keys = self.pick(self.rng.randint(1, 3))
        sizes = [self.rng.randint(1, MAX_SIZE) for _ in keys]
        costs = [self.rng.uniform(0.1, 10.0) for _ in keys] if self.costs else None
        placements = self.manager.reserve_write(keys, sizes, self.tag, costs)
        wanted = []
        for key, size, placement in zip(keys, sizes, placements, strict=True):
            if key in self.locks:  # we hold it read-locked, so it is resident
                assert placement.result is NW
            elif key in self.staged:  # NOT_WRITABLE if another writer published it
                assert placement.result in (WS, NW)
            elif placement.result is not NW:
                wanted.append((key, size, placement))
        outcomes = {p.result for _, _, p in wanted}
        assert outcomes in ({S}, {OOM}, set()), placements  # all or nothing
        if outcomes == {OOM}:
            self.tally.oom_calls += 1
            return
        for key, size, placement in wanted:
            assert placement.size == size
            self.manager.view(placement)[:] = PATTERNS[INDEX[key]][:size]
            self.staged[key] = placement
        self.resolve_staged(keep=MAX_STAGED_KEYS)

    def resolve_staged(self, keep: int) -> None:
        """Publish or abort reservations until at most ``keep`` remain."""
        while len(self.staged) > keep:
            keys = list(self.staged)[: self.rng.randint(1, len(self.staged) - keep)]
            for key in keys:  # nobody wrote into our staged memory
                self.check_bytes(key, self.staged.pop(key))
            action = self.rng.choice(("finish", "finish", "finish_and_read", "abort"))
            self.tally.ops[action] += 1
            if action == "abort":
                assert self.manager.abort_write(keys, self.tag) == [S] * len(keys)
            elif action == "finish":
                assert self.manager.finish_write(keys, self.tag) == [S] * len(keys)
                self.tally.published += len(keys)
            else:
                n = self.rng.randint(1, 2)
                placements = self.manager.finish_write_and_reserve_read(keys, self.tag, n)
                self.tally.published += len(keys)
                for key, placement in zip(keys, placements, strict=True):
                    self.hold(key, placement, n)

    def read(self) -> None:
        keys = self.pick(self.rng.randint(1, 3))
        n = self.rng.randint(1, 2)
        placements = self.manager.reserve_read(keys, n)
        for key, placement in zip(keys, placements, strict=True):
            if key in self.locks:
                assert placement.result is S  # our lock keeps it resident
            if placement.result is S:
                self.hold(key, placement, n)
            else:
                assert placement.result is NF

    def release_one(self) -> None:
        """Drop all of one key's read locks, or just one of them."""
        key = self.rng.choice(sorted(self.locks, key=INDEX.__getitem__))
        self.check_bytes(key, self.locked_at[key])  # still where it was, still intact
        self.tally.verified += 1
        n = self.locks[key] if self.rng.random() < 0.7 else 1
        assert self.manager.finish_read([key], n) == [S]
        self.locks[key] -= n
        if not self.locks[key]:
            del self.locks[key], self.locked_at[key]

    def release(self, keep: int) -> None:
        while len(self.locks) > keep:
            self.release_one()

    def release_some(self) -> None:
        if self.locks:
            self.release_one()

    def delete(self) -> None:
        keys = self.pick(self.rng.randint(1, 3))
        for key, result in zip(keys, self.manager.delete(keys), strict=True):
            if key in self.locks:
                assert result is LK
            else:
                assert result in (S, NF, LK)
            self.tally.deleted += result is S

    def touch(self) -> None:
        keys = self.pick(self.rng.randint(1, 3))
        for key, result in zip(keys, self.manager.touch(keys), strict=True):
            assert result is S if key in self.locks else result in (S, NF)

    def clear(self) -> None:
        self.tally.cleared += self.manager.clear()
        assert all(self.manager.contains(key) for key in self.locks)

    def run(self, iterations: int) -> Tally:
        operations = [
            (self.write, 5),
            (self.read, 4),
            (self.release_some, 3),
            (self.delete, 1),
            (self.touch, 2),
            (self.clear, 0.05),
        ]
        actions, weights = zip(*operations, strict=True)
        for _ in range(iterations):
            self.rng.choices(actions, weights)[0]()
            self.release(MAX_HELD_KEYS)
        # Give back exactly what this thread holds.
        self.resolve_staged(keep=0)
        self.release(keep=0)
        assert not self.locks and not self.staged
        return self.tally


def run_threads(target: Callable[[int], T], count: int) -> list[T]:
    """Run ``target(0) ... target(count - 1)`` on their own threads, wait for
    all, and re-raise a failure (the root cause rather than the broken
    barrier it left the other threads at)."""
    with ThreadPoolExecutor(count) as pool:
        futures = [pool.submit(target, number) for number in range(count)]
    errors = [f.exception() for f in futures]
    for error in sorted(
        (e for e in errors if e is not None),
        key=lambda e: isinstance(e, threading.BrokenBarrierError),
    ):
        raise error
    return [future.result() for future in futures]


@pytest.mark.parametrize("policy", ["lru", "gdsf"])
def test_concurrent_mixed_workload(policy: str) -> None:
    """Six threads write, read, release, delete, touch and now and then clear
    one small arena; see the module docstring for what each thread checks."""
    manager = L1Manager(
        L1Config(size_bytes=ARENA, populate=False, eviction_policy=policy), clock=FakeClock()
    )
    try:
        workers = [
            Worker(manager, number, seed=1000 * number + 7, costs=policy == "gdsf")
            for number in range(THREADS)
        ]
        tallies = run_threads(lambda number: workers[number].run(ITERATIONS), THREADS)

        assert_clean(manager)  # no lock, reservation or byte left behind
        status = manager.status()
        assert status["locked_objects"] == status["staging_objects"] == 0
        assert status["out_of_memory"] == sum(t.oom_calls for t in tallies)
        assert status["expired_write_leases"] == status["expired_read_leases"] == 0
        assert status["eviction_failures"] == 0
        # Every admission is still resident or was evicted, deleted or cleared.
        admitted = sum(t.published for t in tallies) - stat(manager, "duplicate_writes")
        gone = stat(manager, "evictions") + sum(t.deleted + t.cleared for t in tallies)
        assert status["resident_objects"] == admitted - gone
        assert sum(manager.contains(key) for key in KEYS) == status["resident_objects"]
        # The run exercised what it is meant to.
        assert stat(manager, "evictions") > 0
        assert stat(manager, "out_of_memory") > 0
        assert sum(t.verified for t in tallies) >= ITERATIONS
        ops = sum((t.ops for t in tallies), Counter[str]())
        assert min(ops[action] for action in ("finish", "finish_and_read", "abort")) > 0, ops
    finally:
        manager.close()


def test_concurrent_duplicate_writers_publish_exactly_one_copy() -> None:
    """Writers stage the same keys under their own tags; once all have staged,
    they publish at once, in different orders and batches. Every writer gets
    SUCCESS, each key ends up resident exactly once, as one writer's complete
    copy at that writer's offset, and the other copies' memory is freed."""
    writers, keys_per_round, rounds = 8, 12, 40
    manager = L1Manager(L1Config(size_bytes=4 * MiB, populate=False), clock=FakeClock())

    def seed(position: int, writer: int) -> int:
        return position * writers + writer + 1  # distinct for all (key, writer) pairs

    try:
        for round_ in range(rounds):
            keys = [make_key(1000 * round_ + i, salt="dup") for i in range(keys_per_round)]
            all_staged = threading.Barrier(writers)
            staged: dict[int, dict[ObjectKey, Placement]] = {}
            seen: list[tuple[ObjectKey, Placement, bytes]] = []  # read under a lock

            def write(
                number: int,
                round_: int = round_,
                keys: list[ObjectKey] = keys,
                all_staged: threading.Barrier = all_staged,
                staged: dict[int, dict[ObjectKey, Placement]] = staged,
                seen: list[tuple[ObjectKey, Placement, bytes]] = seen,
            ) -> None:
                rng = random.Random(1000 * round_ + number)
                tag = WriterTag(f"r{round_}w{number}")
                order = rng.sample(keys, len(keys))
                sizes = [rng.randint(1, 3 * PAGE) for _ in order]
                try:
                    placements = manager.reserve_write(order, sizes, tag)
                    assert [p.result for p in placements] == [S] * len(order)
                    for key, placement in zip(order, placements, strict=True):
                        manager.view(placement)[:] = pattern(
                            seed(keys.index(key), number), placement.size
                        )
                    staged[number] = dict(zip(order, placements, strict=True))
                except BaseException:
                    all_staged.abort()  # let the others fail instead of waiting forever
                    raise
                all_staged.wait()  # nothing is resident before every writer has staged
                rng.shuffle(order)
                while order:
                    take = rng.randint(1, 4)
                    batch, order = order[:take], order[take:]
                    if rng.random() < 0.5:
                        assert manager.finish_write(batch, tag) == [S] * len(batch)
                        continue
                    winners = manager.finish_write_and_reserve_read(batch, tag)
                    for key, placement in zip(batch, winners, strict=True):
                        assert placement.result is S
                        seen.append((key, placement, manager.view(placement).tobytes()))
                    assert manager.finish_read(batch) == [S] * len(batch)

            duplicates_before = stat(manager, "duplicate_writes")
            run_threads(write, writers)

            assert seen  # some writers read what they published
            status = manager.status()
            assert status["duplicate_writes"] == duplicates_before + (writers - 1) * keys_per_round
            assert status["resident_objects"] == keys_per_round
            resident = manager.reserve_read(keys)
            used = 0
            for position, (key, placement) in enumerate(zip(keys, resident, strict=True)):
                assert placement.result is S
                owners = [w for w in range(writers) if staged[w][key] == placement]
                assert len(owners) == 1, f"{key} is at no writer's (or several) offset"
                data = manager.view(placement)
                assert np.array_equal(data, pattern(seed(position, owners[0]), placement.size))
                for seen_key, seen_placement, seen_bytes in seen:
                    if seen_key == key:  # every reader got the winner's copy
                        assert seen_placement == placement
                        assert seen_bytes == data.tobytes()
                used += -(-placement.size // PAGE) * PAGE
            assert manager.finish_read(keys) == [S] * keys_per_round
            assert_clean(manager)
            assert manager.status()["used_bytes"] == used  # the losing copies were freed
            assert manager.delete(keys) == [S] * keys_per_round
        status = manager.status()
        assert status["evictions"] == status["out_of_memory"] == 0
        assert status["used_bytes"] == 0
        assert_clean(manager)
    finally:
        manager.close()


def test_concurrent_lock_counts_on_hot_keys_are_exact() -> None:
    """Many threads lock and unlock the same few objects at once. Every
    reserve_read must succeed (nothing may evict or delete a locked object),
    every finish_read of the locks a thread holds must succeed, and at the end
    the counts must be back to exactly zero: no lock update may get lost."""
    readers, rounds = 8, 4000
    manager = L1Manager(L1Config(size_bytes=1 * MiB, populate=False), clock=FakeClock())
    hot = KEYS[:4]
    try:
        placements = manager.reserve_write(hot, [PAGE] * len(hot), WriterTag("setup"))
        for key, placement in zip(hot, placements, strict=True):
            manager.view(placement)[:] = PATTERNS[INDEX[key]][:PAGE]
        assert manager.finish_write(hot, WriterTag("setup")) == [S] * len(hot)

        def read(number: int) -> None:
            rng = random.Random(number)
            held: Counter[ObjectKey] = Counter()
            for _ in range(rounds):
                key = rng.choice(hot)
                if held[key] and rng.random() < 0.5:
                    n = rng.randint(1, held[key])
                    assert manager.finish_read([key], n) == [S]
                    held[key] -= n
                    continue
                n = rng.randint(1, 3)
                [placement] = manager.reserve_read([key], n)
                assert placement.result is S
                held[key] += n
                assert np.array_equal(manager.view(placement), PATTERNS[INDEX[key]][:PAGE])
                if rng.random() < 0.1:
                    assert manager.delete([key]) == [LK]
            for key, n in held.items():
                if n:
                    assert manager.finish_read([key], n) == [S]

        run_threads(read, readers)

        assert_clean(manager)
        assert all(manager.contains(key) for key in hot)
        assert manager.delete(hot) == [S] * len(hot)
        assert manager.status()["used_bytes"] == 0
    finally:
        manager.close()
