"""``StorageManager``: the in-process facade over L1, the L2 adapters and the
controllers between them.

- ``store(keys, buffers, layout)`` copies buffers into L1; the
  ``StoreController`` then writes them to L2 under the store policy.
- ``lookup(keys, layout)`` (or ``lookup_chunks`` for chunks of several
  objects) read-locks the longest prefix that L1 has or that the
  ``PrefetchController`` can bring from L2 in time, and reports how many
  objects came from each tier. ``submit_lookup`` is the non-blocking form.
- ``retrieve(keys)`` returns views of objects this manager holds locked.
- ``release(keys)`` drops those locks, exactly once per lookup: a second
  release of the same lock raises ValueError instead of stealing someone
  else's lock. Objects loaded for one request only (``retain_loaded=False``)
  are dropped from L1 at their last release.
- What acts on one tier (L1's pins and locks a caller keeps, owners'
  limits, retention, purges) comes from its base, ``StorageTiers``
  (``kvtier.storage.tiers``). Owners (the cache server's tenants) are given
  at construction, with the two hooks that keep their caps on shared
  stores: ``store_gate`` and ``on_stored``.

Callers use these operations, never L1, the adapters or the controllers
themselves: their locks and leases are this manager's to keep consistent.

Thread safety: ``_held`` and ``_temporary`` are guarded by ``_lock``; L1 and
the controllers have their own.
"""

from __future__ import annotations

import functools
import itertools
import logging
import threading
import time
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import numpy.typing as npt

from kvtier.controllers import (
    LookupResult,
    MissReason,
    PrefetchConfig,
    PrefetchController,
    PrefetchHandle,
    StoreConfig,
    StoreController,
    StoreGate,
)
from kvtier.events.residency import Residency
from kvtier.keys import ObjectKey
from kvtier.l1 import IOFence, L1Config, L1Result, Placement, WriterTag
from kvtier.l2 import TaskKind, TaskResult
from kvtier.l2.seal import Sealer
from kvtier.layout import KVLayout
from kvtier.storage.tiers import Owners, StorageTiers

Buffer = npt.NDArray[np.generic] | bytes | bytearray | memoryview
LOOKUP_GRACE_S = 5.0  # past a lookup's deadline before lookup_chunks gives up on it
log = logging.getLogger(__name__)


def byte_view(buffer: Buffer, what: str = "buffer") -> npt.NDArray[np.uint8]:
    """A flat uint8 view of a contiguous buffer (no copy)."""
    if isinstance(buffer, np.ndarray):
        if not buffer.flags.c_contiguous:
            raise ValueError(f"{what} is not C-contiguous; pass np.ascontiguousarray(...)")
        return buffer.reshape(-1).view(np.uint8)
    return np.frombuffer(buffer, dtype=np.uint8)


@dataclass(frozen=True, slots=True)
class StorageConfig:
    """Settings of the storage stack. ``l2`` lists adapter specs (dicts with a
    ``type``) fastest first: that order is the lookup cascade."""

    l1: L1Config = field(default_factory=L1Config)
    l2: tuple[Mapping[str, Any], ...] = ()
    store: StoreConfig = field(default_factory=StoreConfig)
    prefetch: PrefetchConfig = field(default_factory=PrefetchConfig)
    seal: Sealer | None = None  # every L2 object sealed (kvtier.l2.seal); None: unsealed


@dataclass(slots=True)
class _Held:
    placement: Placement
    locks: int


class StorageManager(StorageTiers):
    """Store, look up and read chunk objects across tiers; see the module docstring."""

    def __init__(
        self,
        config: StorageConfig | None = None,
        residency: Residency | None = None,
        clock: Callable[[], float] = time.monotonic,
        *,
        owners: Owners | None = None,
        store_gate: StoreGate | None = None,
        on_stored: Callable[[TaskResult], None] | None = None,
    ) -> None:
        """``clock``: L1's (leases, and the ages that retention reads).
        ``owners``: see ``Owners`` (None: one owner, no limits). For each
        adapter that does not keep its owners' caps itself, ``store_gate``
        says whether an object may be written to it (on the store
        controller's thread) and ``on_stored`` is told of each finished
        store task (on the adapters' threads: it must only record)."""
        self.config = config or StorageConfig()
        self._on_stored = on_stored  # before the adapters exist: they call _on_complete
        self._store_gate = store_gate
        super().__init__(
            self.config.l1,
            self.config.l2,
            self._on_complete,
            residency=residency,
            clock=clock,
            owners=owners,
            seal=self.config.seal,
        )
        self._store_controller = StoreController(
            self.config.store,
            self._l1,
            [a for a in self._adapters if a.writable],
            gate=None if store_gate is None else functools.partial(self._gate, store_gate),
        )
        self._prefetch = PrefetchController(self.config.prefetch, self._l1, self._adapters)
        self._lock = threading.Lock()
        self._held: dict[ObjectKey, _Held] = {}
        self._temporary: set[ObjectKey] = set()
        self._tags = itertools.count()
        self._lookup_timeouts = 0

    # ---------------------------------------------------------------- write

    def store(
        self,
        keys: Sequence[ObjectKey],
        buffers: Sequence[Buffer],
        layout: KVLayout | None = None,
    ) -> list[L1Result]:
        """Copy ``buffers`` into L1 under ``keys`` and queue them for L2.
        Per key: SUCCESS (stored, or already resident under ``layout``),
        WRONG_LAYOUT (resident under another layout: not stored),
        OUT_OF_MEMORY or OVER_QUOTA, or NOT_FOUND (staged, not admitted: its
        write lease ran out, or another layout published the key meanwhile)."""
        if len(keys) != len(buffers):
            raise ValueError("store: keys and buffers must have the same length")
        sources = [byte_view(b, f"store: buffer {i}") for i, b in enumerate(buffers)]
        if layout is not None:
            expected = layout.object_bytes()
            wrong = [i for i, s in enumerate(sources) if s.nbytes != expected]
            if wrong:
                raise ValueError(
                    f"store: buffer {wrong[0]} has {sources[wrong[0]].nbytes} bytes; "
                    f"the layout says {expected}"
                )
        tag, placements, fence = self.reserve_store(keys, [s.nbytes for s in sources], layout)
        try:
            for placement, source in zip(placements, sources, strict=True):
                if placement.result is L1Result.SUCCESS:
                    np.copyto(self._l1.view(placement), source)
        except BaseException:
            self.abort_store(tag, fence)
            raise
        admitted = set(self.commit_store(tag, fence, layout))
        results = []
        for key, placement in zip(keys, placements, strict=True):
            if placement.result is L1Result.NOT_WRITABLE or key in admitted:
                results.append(L1Result.SUCCESS)  # stored now, or by someone before
            elif placement.result is L1Result.SUCCESS:
                results.append(L1Result.NOT_FOUND)  # staged, not admitted (see above)
            else:
                results.append(placement.result)
        return results

    def reserve_store(
        self, keys: Sequence[ObjectKey], sizes: Sequence[int], layout: KVLayout | None = None
    ) -> tuple[WriterTag, list[Placement], IOFence]:
        """First half of a store whose bytes another process writes into the
        arena: stage ``keys`` and fence their memory. Per key the placement is
        SUCCESS (write there), NOT_WRITABLE (resident already: skip) or
        OUT_OF_MEMORY. Finish with ``commit_store`` or ``abort_store``."""
        tag = WriterTag(f"store-{next(self._tags)}")
        digest = self._remember(layout) if layout else ""
        placements = self._l1.reserve_write(keys, sizes, tag, layout=digest)
        staged = [k for k, p in zip(keys, placements, strict=True) if p.result is L1Result.SUCCESS]
        _, fence = self._l1.fence(staged, tag)
        return tag, placements, fence

    def commit_store(
        self, tag: WriterTag, fence: IOFence, layout: KVLayout | None = None
    ) -> list[ObjectKey]:
        """Publish what ``reserve_store`` staged (its bytes are written), queue
        it for L2, and return the keys this call admitted. Objects the store
        controller will write back are published with a read lock it owns, so
        L1 cannot evict them before they are in L2."""
        self._l1.unfence(fence)
        staged = [obj.key for obj in fence.objects]
        pin = self._store_controller.pins_admissions
        if pin:
            results = [p.result for p in self._l1.finish_write_and_reserve_read(staged, tag)]
        else:
            results = self._l1.finish_write(staged, tag)
        admitted = [k for k, r in zip(staged, results, strict=True) if r is L1Result.SUCCESS]
        nbytes = fence.objects[0].size if fence.objects else 0
        digest = self._remember(layout) if layout else ""
        self._store_controller.on_admitted(admitted, digest, nbytes, pinned=pin)
        return admitted

    def abort_store(self, tag: WriterTag, fence: IOFence) -> None:
        """Drop what ``reserve_store`` staged."""
        self._l1.unfence(fence)
        self._l1.abort_write([obj.key for obj in fence.objects], tag)

    # ----------------------------------------------------------------- read

    def submit_lookup(
        self,
        chunks: Sequence[Sequence[ObjectKey]],
        layouts: Mapping[int, KVLayout] | None = None,
        deadline_s: float | None = None,
        recompute_s_per_chunk: float | None = None,
    ) -> PrefetchHandle:
        """Start a lookup; take its result with ``collect``. With
        ``recompute_s_per_chunk`` (the engine's prefill seconds for a chunk)
        L2 chunks are loaded only as far as that beats recomputing them."""
        if self._adapters:  # only their codecs need the book
            for layout in (layouts or {}).values():
                self._remember(layout)
        return self._prefetch.submit(chunks, layouts, deadline_s, recompute_s_per_chunk)

    def collect(self, handle: PrefetchHandle, timeout: float | None = None) -> LookupResult | None:
        """Wait for a lookup and take over its locks (for retrieve/release).
        None if it is still pending after ``timeout``. Call once per handle."""
        result = handle.wait(timeout)
        if result is None:
            return None
        with self._lock:
            for key, placement in result.placements.items():
                held = self._held.get(key)
                if held is None:
                    self._held[key] = _Held(placement, 1)
                else:
                    held.locks += 1
            self._temporary.update(result.temporary)
        hits = list(result.placements)  # prompt order: the prefix head ends most recent
        self._l1.touch(hits)
        self._store_controller.on_hits(hits)
        return result

    def lookup_chunks(
        self,
        chunks: Sequence[Sequence[ObjectKey]],
        layouts: Mapping[int, KVLayout] | None = None,
        deadline_s: float | None = None,
    ) -> LookupResult:
        """Lock the longest prefix of chunks whose every object L1 has or can
        load. The prefetch controller answers by the deadline; should it not
        (a bug), the lookup is a miss ``LOOKUP_GRACE_S`` later, never a hang."""
        result = self.collect_or_abandon(
            self.submit_lookup(chunks, layouts, deadline_s), deadline_s
        )
        if result is None:
            with self._lock:
                self._lookup_timeouts += 1
            log.error(
                "storage: a lookup was not answered %.1f s after its deadline", LOOKUP_GRACE_S
            )
            return LookupResult(0, {}, {}, miss_reason=MissReason.ERROR)
        return result

    def collect_or_abandon(
        self, handle: PrefetchHandle, deadline_s: float | None = None
    ) -> LookupResult | None:
        """``collect``, waiting until ``LOOKUP_GRACE_S`` past the lookup's
        deadline (``deadline_s`` as given to ``submit_lookup``); None if it
        is unanswered by then: the handle is abandoned, and a result that
        comes later is released for the caller."""
        wait = (deadline_s or self.config.prefetch.deadline_s) + LOOKUP_GRACE_S
        result = self.collect(handle, wait)
        if result is None and handle.abandon() is not None:  # answered just now
            result = self.collect(handle, 0)
        return result

    def lookup(
        self,
        keys: Sequence[ObjectKey],
        layout: KVLayout | None = None,
        deadline_s: float | None = None,
    ) -> LookupResult:
        """``lookup_chunks`` for one object per chunk. Without ``layout`` only
        L1 can hit (L2 loads need the object size and layout)."""
        layouts = {} if layout is None else {key.group: layout for key in keys}
        return self.lookup_chunks([(key,) for key in keys], layouts, deadline_s)

    def retrieve(self, keys: Sequence[ObjectKey]) -> list[npt.NDArray[np.uint8]]:
        """Views of objects locked by a lookup; valid until ``release``."""
        with self._lock:
            missing = [k for k in keys if k not in self._held]
            if missing:
                raise ValueError(f"retrieve: {missing[0]} is not locked by a lookup")
            placements = [self._held[k].placement for k in keys]
        return [self._l1.view(p) for p in placements]

    def release(self, keys: Sequence[ObjectKey]) -> None:
        """Drop one lookup lock per key; ValueError if none is held."""
        drop: list[ObjectKey] = []
        with self._lock:
            short = [k for k, n in Counter(keys).items() if self._held_locks(k) < n]
            if short:
                raise ValueError(f"release: {short[0]} holds no (or too few) lookup locks")
            for key in keys:
                held = self._held[key]
                held.locks -= 1
                if held.locks == 0:
                    del self._held[key]
                    if key in self._temporary:
                        self._temporary.discard(key)
                        drop.append(key)
        self._l1.finish_read(keys)
        if drop:
            self._l1.delete(drop)  # LOCKED if another reader holds it: it stays

    # ---------------------------------------------------------- management

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every queued L2 store has finished."""
        return self._store_controller.flush(timeout)

    def has_store_hooks(
        self, store_gate: StoreGate, on_stored: Callable[[TaskResult], None]
    ) -> bool:
        """Whether this manager was built with these ``store_gate`` and
        ``on_stored`` hooks (which keep owners' caps on the other adapters)."""
        return self._store_gate == store_gate and self._on_stored == on_stored

    def held_locks(self) -> int:
        """Lookup locks this manager holds for callers (0 once all are released)."""
        with self._lock:
            return sum(h.locks for h in self._held.values())

    def status(self) -> dict[str, object]:
        return {
            "held_lookup_locks": self.held_locks(),
            "lookup_timeouts": self._lookup_timeouts,
            "l1": self._l1.status(),
            "l2": {a.name: a.status() for a in self._adapters},
            "store": self._store_controller.status(),
            "prefetch": self._prefetch.status(),
        }

    def close(self) -> None:
        """Stop the controllers (waiting for I/O in flight), close the adapters,
        release every lock still held, and free L1."""
        self._prefetch.stop()
        self._store_controller.stop()
        self._close_adapters()
        with self._lock:
            leftover = [k for k, h in self._held.items() for _ in range(h.locks)]
            self._held.clear()
        if leftover:
            self._l1.finish_read(leftover)
        self._l1.close()

    def __enter__(self) -> StorageManager:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------ internals

    def _on_complete(self, result: TaskResult) -> None:
        self._note_residency(result)
        if result.kind is TaskKind.STORE:
            if self._on_stored is not None and result.adapter not in self._self_capped:
                self._on_stored(result)
            self._store_controller.on_result(result)
        else:
            self._prefetch.on_result(result)

    def _held_locks(self, key: ObjectKey) -> int:
        held = self._held.get(key)
        return 0 if held is None else held.locks

    def _gate(self, gate: StoreGate, adapter: str, key: ObjectKey, nbytes: int) -> bool:
        """``gate``, for the adapters that do not keep their owners' caps themselves."""
        return adapter in self._self_capped or gate(adapter, key, nbytes)


__all__ = [
    "LOOKUP_GRACE_S",
    "Buffer",
    "StorageConfig",
    "StorageManager",
    "byte_view",
]
