"""``StorageManager``: the in-process facade over the cache tiers.

For now it fronts L1 only (L2 adapters and the controllers come next). The
read path is lookup → retrieve → release:

- ``lookup(keys)`` read-locks the longest prefix of ``keys`` that is resident
  and returns its length; locks past the first miss are dropped at once.
- ``retrieve(keys)`` returns views of objects this manager holds locked.
- ``release(keys)`` drops those locks, exactly once per lookup: a second
  release of the same lock raises ValueError instead of stealing someone
  else's lock.

Thread safety: ``_held`` is guarded by ``_lock``; L1 has its own lock.
"""

from __future__ import annotations

import itertools
import threading
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import numpy.typing as npt

from kvtier.keys import ObjectKey
from kvtier.l1 import L1Config, L1Manager, L1Result, Placement, WriterTag

Buffer = npt.NDArray[np.generic] | bytes | bytearray | memoryview


def byte_view(buffer: Buffer, what: str = "buffer") -> npt.NDArray[np.uint8]:
    """A flat uint8 view of a contiguous buffer (no copy)."""
    if isinstance(buffer, np.ndarray):
        if not buffer.flags.c_contiguous:
            raise ValueError(f"{what} is not C-contiguous; pass np.ascontiguousarray(...)")
        return buffer.reshape(-1).view(np.uint8)
    return np.frombuffer(buffer, dtype=np.uint8)


@dataclass(frozen=True, slots=True)
class StorageConfig:
    """Settings of the storage stack."""

    l1: L1Config = field(default_factory=L1Config)


@dataclass(slots=True)
class _Held:
    placement: Placement
    locks: int


class StorageManager:
    """Store, look up and read chunk objects; see the module docstring."""

    def __init__(self, config: StorageConfig | None = None) -> None:
        self.config = config or StorageConfig()
        self.l1 = L1Manager(self.config.l1)
        self._lock = threading.Lock()
        self._held: dict[ObjectKey, _Held] = {}
        self._tags = itertools.count()

    def store(self, keys: Sequence[ObjectKey], buffers: Sequence[Buffer]) -> list[L1Result]:
        """Copy ``buffers`` into L1 under ``keys``. Per key: SUCCESS (stored, or
        already resident), or OUT_OF_MEMORY."""
        if len(keys) != len(buffers):
            raise ValueError("store: keys and buffers must have the same length")
        sources = [byte_view(b, f"store: buffer {i}") for i, b in enumerate(buffers)]
        tag = WriterTag(f"store-{next(self._tags)}")
        placements = self.l1.reserve_write(keys, [s.nbytes for s in sources], tag)
        staged = [i for i, p in enumerate(placements) if p.result is L1Result.SUCCESS]
        staged_keys = [keys[i] for i in staged]
        fenced, fence = self.l1.fence(staged_keys, tag)
        try:
            for i, ok in zip(staged, fenced, strict=True):
                if ok is L1Result.SUCCESS:
                    np.copyto(self.l1.view(placements[i]), sources[i])
        finally:
            self.l1.unfence(fence)
        published = dict(zip(staged_keys, self.l1.finish_write(staged_keys, tag), strict=True))
        results = []
        for key, placement in zip(keys, placements, strict=True):
            if placement.result is L1Result.NOT_WRITABLE:
                results.append(L1Result.SUCCESS)  # someone stored it already
            else:
                results.append(published.get(key, placement.result))
        return results

    def lookup(self, keys: Sequence[ObjectKey]) -> int:
        """Lock and return the length of the longest resident prefix of ``keys``."""
        placements = self.l1.reserve_read(keys)
        hit = next(
            (i for i, p in enumerate(placements) if p.result is not L1Result.SUCCESS), len(keys)
        )
        beyond = [
            k
            for k, p in zip(keys[hit:], placements[hit:], strict=True)
            if p.result is L1Result.SUCCESS
        ]
        if beyond:
            self.l1.finish_read(beyond)
        if hit:
            self.l1.touch(keys[:hit])
            with self._lock:
                for key, placement in zip(keys[:hit], placements[:hit], strict=True):
                    held = self._held.get(key)
                    if held is None:
                        self._held[key] = _Held(placement, 1)
                    else:
                        held.locks += 1
        return hit

    def retrieve(self, keys: Sequence[ObjectKey]) -> list[npt.NDArray[np.uint8]]:
        """Views of objects locked by ``lookup``; valid until ``release``."""
        with self._lock:
            missing = [k for k in keys if k not in self._held]
            if missing:
                raise ValueError(f"retrieve: {missing[0]} is not locked by a lookup")
            placements = [self._held[k].placement for k in keys]
        return [self.l1.view(p) for p in placements]

    def release(self, keys: Sequence[ObjectKey]) -> None:
        """Drop one lookup lock per key; ValueError if none is held."""
        with self._lock:
            short = [k for k, n in Counter(keys).items() if self._held_locks(k) < n]
            if short:
                raise ValueError(f"release: {short[0]} holds no (or too few) lookup locks")
            for key in keys:
                held = self._held[key]
                held.locks -= 1
                if held.locks == 0:
                    del self._held[key]
        self.l1.finish_read(keys)

    def _held_locks(self, key: ObjectKey) -> int:
        held = self._held.get(key)
        return 0 if held is None else held.locks

    def status(self) -> dict[str, object]:
        with self._lock:
            held = sum(h.locks for h in self._held.values())
        return {"held_lookup_locks": held, "l1": self.l1.status()}

    def close(self) -> None:
        with self._lock:
            self._held.clear()
        self.l1.close()

    def __enter__(self) -> StorageManager:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
