"""The ``probation`` eviction policy: admission that adapts between recency
and frequency, chosen by miniature simulations of the live traffic.

Most of what a KV cache stores is never read again: on the Mooncake
conversation trace, three blocks in four are used once. LRU gives each of
them a full trip through the cache, pushing out the blocks that a session's
next turn would have read. Keeping them out (admitting only on a second
sighting) keeps 1.5-1.9x what LRU keeps in a small cache there, and loses
badly in a large one, where the first reuse is most of what there is. So the policy has one knob
and turns it by measurement:

- **Probation and protected.** A new object goes on probation; a hit, or a
  *second sighting* (its key was evicted from probation lately and is
  remembered in the *ghost*: Bloom filters of the fingerprints of the last
  ``ghost`` to 2 x ``ghost`` times as many keys as are resident), makes it
  protected. Each segment is kept in recency order.
- **The knob, ``share``.** The victim is probation's oldest while
  probation holds more than ``share`` of the bytes; otherwise the older of
  the two segments' oldest. ``share`` 1 is exactly LRU (the ghost changes
  nothing then); ``share`` 0 keeps a new object only until the next
  eviction, so in effect admits on the second sighting.
- **Miniature simulations** (Waldspurger et al., "Cache Modeling and
  Optimization using Miniature Simulations", USENIX ATC '17). A fixed
  1-in-``rate`` sample of the keys (by fingerprint, so the same keys in
  every process) drives one small cache per candidate (``share``, ghost) at
  1/``rate`` of the capacity, about ``MINIATURE_OBJECTS`` objects each.
  Each counts its hits with an exponential decay; every
  ``DECIDE_EVERY`` samples the live cache takes the best candidate's knob
  (ties to the larger share, the LRU side). Capacities up to the
  miniature's size simulate every key exactly.

Hits are counted per object, as the cache sees them: the reuse of a prefix
is a run of hits from its first chunk, and a chunk kept past its parent is
not read (``touch`` order puts a prefix's head last, so within a segment
its tail goes first).

Cost: O(1) per operation for the live cache; a sampled key also updates
each miniature, about ``len(CANDIDATES) * MINIATURE_OBJECTS / capacity``
updates per operation on average (nothing measurable at a million objects).
Metadata: a recency stamp and the fingerprint per object, and the ghost's
2 x 40 bits per fingerprint it remembers (at most 2 x ``ghost`` x 40 bits per
resident object).
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from collections.abc import Iterable, Iterator
from typing import cast

from kvtier.keys import ObjectKey
from kvtier.l1.eviction import Evictable, EvictionPolicy

# (share, ghost multiple) the miniatures try; share 1.0 is LRU whatever the ghost
CANDIDATES = (
    (0.0, 0.5),
    (0.0, 2.0),
    (0.02, 0.5),
    (0.02, 2.0),
    (0.1, 0.5),
    (0.1, 2.0),
    (0.3, 2.0),
    (1.0, 2.0),
)
MINIATURE_OBJECTS = 1024  # each miniature's capacity, in objects of the first size seen
DECAY = 0.9998  # a miniature hit's weight after one more sample
DECIDE_EVERY = 64  # samples between choices of the knob
_MASK = (1 << 64) - 1


def fingerprint(key: ObjectKey | int) -> int:
    """A key's 64 bits, the same in every process: its chunk hash's four
    64-bit words folded together (a trace's block id as it is), its rank and
    group mixed in."""
    if isinstance(key, int):
        return key & _MASK
    words = int.from_bytes(key.chunk_hash, "little")
    folded = (words ^ (words >> 64) ^ (words >> 128) ^ (words >> 192)) & _MASK
    return folded ^ ((key.kv_rank * 0x9E3779B97F4A7C15 + key.group) & _MASK)


def _mixed(value: int) -> int:
    """SplitMix64's finaliser: a fingerprint's bits spread, to sample by."""
    value = ((value ^ (value >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    value = ((value ^ (value >> 27)) * 0x94D049BB133111EB) & _MASK
    return value ^ (value >> 31)


_Entry = tuple[int, int, int]  # an object's size, recency stamp and fingerprint


class _Ghost:
    """Fingerprints of keys evicted from probation lately, as two Bloom
    filters: the one filling and the one before it. A filter takes
    ``limit`` fingerprints (the limit when it was started), then the older
    one is dropped and a new one started, so a fingerprint is remembered for
    between one and two fills. Fixed memory (``BITS`` bits a fingerprint,
    two filters); a false "seen" about 1 time in 3,000, never a false "not
    seen"; a key re-admitted is not forgotten (Bloom filters do not delete)."""

    BITS = 40  # per fingerprint of the limit
    PROBES = 3

    def __init__(self) -> None:
        self._filling = bytearray(1)
        self._filled = bytearray(1)
        self._count = 0  # fingerprints in the filling filter
        self._limit = 0  # how many it takes

    def add(self, fp: int, limit: int) -> None:
        if self._count >= self._limit:
            self._filled = self._filling
            self._limit = max(limit, 1)
            self._filling = bytearray((self._limit * self.BITS + 7) // 8)
            self._count = 0
        bits = len(self._filling) * 8
        for probe in _probes(fp, bits):
            self._filling[probe >> 3] |= 1 << (probe & 7)
        self._count += 1

    def take(self, fp: int) -> bool:
        """Whether ``fp`` was added in the last one to two fills."""
        return any(
            all(table[probe >> 3] >> (probe & 7) & 1 for probe in _probes(fp, len(table) * 8))
            for table in (self._filling, self._filled)
        )

    @property
    def nbytes(self) -> int:
        return len(self._filling) + len(self._filled)


def _probes(fp: int, bits: int) -> tuple[int, int, int]:
    mixed = _mixed(fp)
    return mixed % bits, (mixed >> 21) % bits, (mixed >> 42) % bits


class ProbationCache:
    """The two segments, the ghost and the knob: the live cache's order and
    each miniature's (see the module docstring)."""

    def __init__(self, share: float, ghost: float) -> None:
        self.share = share
        self.ghost = ghost
        self._probation: OrderedDict[ObjectKey, _Entry] = OrderedDict()
        self._protected: OrderedDict[ObjectKey, _Entry] = OrderedDict()
        self._probation_bytes = 0
        self._protected_bytes = 0
        self._ghost = _Ghost()
        self._stamp = itertools.count()

    @property
    def bytes(self) -> int:
        return self._probation_bytes + self._protected_bytes

    def __contains__(self, key: ObjectKey) -> bool:
        return key in self._protected or key in self._probation

    def __len__(self) -> int:
        return len(self._probation) + len(self._protected)

    def admit(self, key: ObjectKey, size: int, fp: int) -> None:
        """``key`` (of fingerprint ``fp``) becomes resident."""
        self.remove(key)
        if self._ghost.take(fp):
            self._protected[key] = (size, next(self._stamp), fp)
            self._protected_bytes += size
        else:
            self._probation[key] = (size, next(self._stamp), fp)
            self._probation_bytes += size

    def touch(self, key: ObjectKey) -> _Entry | None:
        """A hit: ``key`` becomes the most recent protected object; its
        entry, or None if it is not here."""
        entry = self._probation.pop(key, None)
        if entry is not None:
            self._probation_bytes -= entry[0]
            self._protected_bytes += entry[0]
        else:
            entry = self._protected.get(key)
            if entry is None:
                return None
        entry = (entry[0], next(self._stamp), entry[2])
        self._protected[key] = entry
        self._protected.move_to_end(key)
        return entry

    def remove(self, key: ObjectKey) -> None:
        entry = self._probation.pop(key, None)
        if entry is not None:
            self._probation_bytes -= entry[0]
            return
        entry = self._protected.pop(key, None)
        if entry is not None:
            self._protected_bytes -= entry[0]

    def evict_one(self) -> None:
        """Forget the next victim, every object evictable (a miniature's way)."""
        probation, protected = self._probation, self._protected
        if probation and (
            not protected
            or self._probation_bytes > self.share * self.bytes
            or next(iter(probation.values()))[1] < next(iter(protected.values()))[1]
        ):
            _, (size, _, fp) = probation.popitem(last=False)
            self._probation_bytes -= size
            self._ghost.add(fp, round(self.ghost * max(len(self), 1)))
        else:
            _, (size, _, _) = protected.popitem(last=False)
            self._protected_bytes -= size

    def victims(self, need_bytes: int, evictable: Evictable) -> list[ObjectKey]:
        """Evictable keys in eviction order, at least ``need_bytes`` of them
        (or every evictable key); they are forgotten, the probation ones
        remembered in the ghost."""
        probation = _Heads(self._probation, evictable)
        protected = _Heads(self._protected, evictable)
        on_probation, total = self._probation_bytes, self.bytes
        chosen: list[tuple[ObjectKey, int | None]] = []  # (key, fingerprint if on probation)
        freed = 0
        while freed < need_bytes:
            first, second = probation.head, protected.head
            if first is None and second is None:
                break
            over = on_probation > self.share * total
            take_probation = second is None or (
                first is not None and (over or first[1][1] < second[1][1])
            )
            key, (size, _, fp) = probation.pop() if take_probation else protected.pop()
            chosen.append((key, fp if take_probation else None))
            freed += size
            total -= size
            on_probation -= size if take_probation else 0
        limit = round(self.ghost * max(len(self) - len(chosen), 1))
        for key, fp_on_probation in chosen:
            self.remove(key)
            if fp_on_probation is not None:
                self._ghost.add(fp_on_probation, limit)
        return [key for key, _ in chosen]


class _Heads:
    """A segment's evictable entries, oldest first, one looked at ahead."""

    def __init__(self, segment: OrderedDict[ObjectKey, _Entry], evictable: Evictable):
        self._entries: Iterator[tuple[ObjectKey, _Entry]] = (
            item for item in segment.items() if evictable(item[0])
        )
        self.head = next(self._entries, None)

    def pop(self) -> tuple[ObjectKey, _Entry]:
        assert self.head is not None
        head, self.head = self.head, next(self._entries, None)
        return head


class ProbationPolicy(EvictionPolicy):
    """The live cache plus its miniatures; see the module docstring."""

    name = "probation"

    def __init__(self, capacity_bytes: int | None = None) -> None:
        self.capacity_bytes = capacity_bytes
        self._cache = ProbationCache(1.0, 2.0)  # LRU until the miniatures have a say
        self._miniatures: list[ProbationCache] = []
        self._scores = [0.0] * len(CANDIDATES)  # decayed hits, in units of ``_weight``
        self._weight = 1.0  # a hit's weight now: grows by 1/DECAY a sample (a lazy decay)
        self._rate = 0  # 1-in-rate keys sampled; 0: not set up yet (the first admit)
        self._mini_bytes = 0
        self._samples = 0

    @property
    def knob(self) -> tuple[float, float]:
        """The live cache's (share, ghost multiple)."""
        return self._cache.share, self._cache.ghost

    def admit(self, key: ObjectKey, size: int, cost: float | None = None) -> None:
        if not self._rate:
            self._set_up(size)
        fp = fingerprint(key)
        self._sample(fp, size)
        self._cache.admit(key, size, fp)

    def touch(self, keys: Iterable[ObjectKey]) -> None:
        for key in keys:
            entry = self._cache.touch(key)
            if entry is not None:
                self._sample(entry[2], entry[0])

    def remove(self, key: ObjectKey) -> None:
        self._cache.remove(key)

    def select(self, need_bytes: int, evictable: Evictable) -> list[ObjectKey]:
        return self._cache.victims(need_bytes, evictable)

    def __len__(self) -> int:
        return len(self._cache)

    def _set_up(self, size: int) -> None:
        capacity = self.capacity_bytes or size * MINIATURE_OBJECTS
        self._rate = max(1, capacity // (size * MINIATURE_OBJECTS))
        self._mini_bytes = max(size, capacity // self._rate)
        self._miniatures = [ProbationCache(share, ghost) for share, ghost in CANDIDATES]

    def _sample(self, fp: int, size: int) -> None:
        """A key the miniatures see (1 in ``rate``, by fingerprint): a hit in
        each that holds it, an admission (and evictions to its size) in each
        that does not."""
        if _mixed(fp) % self._rate:
            return
        self._weight /= DECAY
        if self._weight > 1e100:  # rescale before it overflows
            self._scores = [score / self._weight for score in self._scores]
            self._weight = 1.0
        stand_in = cast(ObjectKey, fp)  # a miniature keys by fingerprint (its own, an int)
        for index, mini in enumerate(self._miniatures):
            if mini.touch(stand_in) is not None:
                self._scores[index] += self._weight
                continue
            mini.admit(stand_in, size, fp)
            while mini.bytes > self._mini_bytes:
                mini.evict_one()
        self._samples += 1
        if self._samples % DECIDE_EVERY == 0:
            best = max(range(len(CANDIDATES)), key=lambda i: (self._scores[i], CANDIDATES[i]))
            self._cache.share, self._cache.ghost = CANDIDATES[best]


__all__ = ["CANDIDATES", "ProbationCache", "ProbationPolicy", "fingerprint"]
