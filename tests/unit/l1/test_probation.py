"""The probation eviction policy: its order on its own (share 1 is LRU, a
second sighting is protected, the ghost is bounded), the miniatures' choice
on traffic whose best policy is known, and L1's guarantees with it in
charge (capacity, read locks, pins, the same decisions for the same inputs)."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from kvtier.keys import ObjectKey
from kvtier.l1 import L1Config, L1Manager, L1Result, WriterTag
from kvtier.l1.eviction import EvictionPolicy, LRUPolicy
from kvtier.l1.probation import ProbationCache, ProbationPolicy, fingerprint
from tests.conftest import make_key
from tests.ledger import assert_clean

PAGE = 4096

# (op, key, size): admit, touch, remove, or select `size` bytes (odd keys held)
operations = st.lists(
    st.tuples(
        st.sampled_from(["admit", "touch", "remove", "select"]),
        st.integers(0, 30),
        st.integers(1, 4),
    ),
    max_size=300,
)


@settings(max_examples=200, deadline=None)
@given(operations)
def test_share_one_evicts_exactly_as_lru(ops: list[tuple[str, int, int]]) -> None:
    probation, lru = ProbationCache(1.0, 4), LRUPolicy()
    keys = [make_key(i) for i in range(31)]
    resident: set[int] = set()
    for op, index, size in ops:
        key = keys[index]
        if op == "admit" and index not in resident:
            probation.admit(key, size, fingerprint(key))
            lru.admit(key, size)
            resident.add(index)
        elif op == "touch":
            probation.touch(key)
            lru.touch([key])
        elif op == "remove":
            probation.remove(key)
            lru.remove(key)
            resident.discard(index)
        elif op == "select":

            def evictable(k: ObjectKey) -> bool:
                return k.chunk_hash[-1] % 2 == 0

            victims = probation.victims(size, evictable)
            assert victims == lru.select(size, evictable)
            resident -= {keys.index(k) for k in victims}
    assert len(probation) == len(lru) == len(resident)


def test_a_second_sighting_is_protected() -> None:
    cache = ProbationCache(0.0, 4)
    a, b, c = make_key(1), make_key(2), make_key(3)
    cache.admit(a, 1, fingerprint(a))
    assert cache.victims(1, lambda _k: True) == [a]  # into the ghost
    cache.admit(b, 1, fingerprint(b))
    cache.admit(a, 1, fingerprint(a))  # seen again: protected, though b is older
    cache.admit(c, 1, fingerprint(c))
    assert cache.victims(1, lambda _k: True) == [b]
    assert cache.victims(1, lambda _k: True) == [c]  # probation before protected at share 0
    assert cache.victims(1, lambda _k: True) == [a]


def test_a_hit_on_probation_protects() -> None:
    cache = ProbationCache(0.0, 4)
    a, b = make_key(1), make_key(2)
    cache.admit(a, 1, fingerprint(a))
    cache.admit(b, 1, fingerprint(b))
    assert cache.touch(a) is not None
    assert cache.victims(1, lambda _k: True) == [b]


def test_the_ghost_stays_within_its_multiple_of_the_resident_keys() -> None:
    cache = ProbationCache(0.0, 4)
    for i in range(5000):
        cache.admit(make_key(i), 1, fingerprint(make_key(i)))
        if len(cache) > 10:
            cache.victims(1, lambda _k: True)
    assert len(cache) == 10
    assert cache._ghost.nbytes <= 2 * (4 * 10 * 40 + 7) // 8  # two filters of 40 bits a key
    recent = make_key(4999 - 10)  # evicted last: still remembered
    assert cache._ghost.take(fingerprint(recent))


def test_fingerprints_are_the_chunk_hash_and_the_same_everywhere() -> None:
    key = ObjectKey((7).to_bytes(8, "little") + bytes(24), "m", 0)
    assert fingerprint(key) == 7 == fingerprint(7)  # a trace's block id, as a replay names it
    assert fingerprint(ObjectKey(key.chunk_hash, "m", 1)) != 7  # another rank's object
    assert len({fingerprint(make_key(i)) for i in range(1000)}) == 1000


def _replay(policy: EvictionPolicy, accesses: list[int], capacity: int) -> int:
    """Per-object hits of ``policy`` over ``accesses`` of one-slot objects."""
    resident: set[int] = set()
    hits = 0
    for block in accesses:
        key: ObjectKey = block  # type: ignore[assignment]  # the policy fingerprints ints as they are
        if block in resident:
            hits += 1
            policy.touch([key])
            continue
        if len(resident) >= capacity:
            resident -= set(policy.select(1, lambda _k: True))  # type: ignore[arg-type]
        resident.add(block)
        policy.admit(key, 1)
    return hits


def test_the_miniatures_keep_a_hot_set_through_a_scan() -> None:
    """200 hot objects read again and again between 400 one-off ones: LRU
    loses the hot set to every scan, admission on a second sighting keeps it."""
    accesses, fresh = [], 10**6
    for _ in range(60):
        accesses += list(range(200))
        accesses += list(range(fresh, fresh + 400))
        fresh += 400
    policy = ProbationPolicy(capacity_bytes=300)
    hits = _replay(policy, accesses, 300)
    assert policy.knob[0] < 1.0  # probation kept from pushing the hot set out
    lru_hits = _replay(LRUPolicy(), accesses, 300)
    assert hits > 5 * max(lru_hits, 1)


def test_the_miniatures_choose_lru_where_every_object_is_read_once_more() -> None:
    """Each object read twice, 200 objects apart, in a cache of 300: LRU hits
    every second read; admission on a second sighting would hit none."""
    accesses = []
    for start in range(0, 20000, 200):
        accesses += list(range(start, start + 200)) * 2
    policy = ProbationPolicy(capacity_bytes=300)
    hits = _replay(policy, accesses, 300)
    assert policy.knob[0] == 1.0
    assert hits >= 0.95 * len(accesses) / 2


@st.composite
def l1_scenarios(draw: st.DrawFn) -> list[tuple[str, int, int]]:
    return draw(
        st.lists(
            st.tuples(
                st.sampled_from(["write", "write", "write", "read", "release", "pin", "touch"]),
                st.integers(0, 60),
                st.integers(1, 8),
            ),
            min_size=1,
            max_size=120,
        )
    )


def _drive(ops: list[tuple[str, int, int]]) -> list[list[ObjectKey]]:
    """Run ``ops`` on an L1 of 24 pages under the probation policy, checking
    its guarantees after each; the resident keys after each step."""
    l1 = L1Manager(L1Config(size_bytes=24 * PAGE, populate=False, eviction_policy="probation"))
    held: dict[ObjectKey, int] = {}
    pinned: set[ObjectKey] = set()
    snapshots = []
    try:
        for step, (op, first, count) in enumerate(ops):
            keys = [make_key(first + i) for i in range(count)]
            if op == "write":
                tag = WriterTag(f"w{step}")
                placed = l1.reserve_write(keys, [PAGE] * count, tag)
                l1.finish_write(
                    [k for k, p in zip(keys, placed, strict=True) if p.result is L1Result.SUCCESS],
                    tag,
                )
            elif op == "read":
                got = l1.reserve_read(keys)
                for key, placement in zip(keys, got, strict=True):
                    if placement.result is L1Result.SUCCESS:
                        held[key] = held.get(key, 0) + 1
            elif op == "release" and held:
                key = sorted(held, key=lambda k: k.chunk_hash)[first % len(held)]
                l1.finish_read([key])
                held[key] -= 1
                if not held[key]:
                    del held[key]
            elif op == "pin":
                for key, result in zip(keys[:2], l1.pin(keys[:2], 3600.0), strict=True):
                    if result is L1Result.SUCCESS:
                        pinned.add(key)
            elif op == "touch":
                l1.touch(keys)
            status = l1.status()
            assert status["used_bytes"] <= status["capacity_bytes"]
            for key in held:
                assert l1.contains(key), (step, "a read-locked object was evicted")
            for key in pinned:
                assert l1.contains(key), (step, "a pinned object was evicted")
            snapshots.append(
                sorted((k for k, _ in l1.resident_objects()), key=lambda k: k.chunk_hash)
            )
        for key, n in held.items():
            l1.finish_read([key], n)
        assert_clean(l1)
    finally:
        l1.close()
    return snapshots


@settings(max_examples=150, deadline=None)
@given(l1_scenarios())
def test_l1_under_probation_keeps_capacity_locks_and_pins_and_decides_alike(
    ops: list[tuple[str, int, int]],
) -> None:
    assert _drive(ops) == _drive(ops)
