"""``Warmup``: start L2 -> L1 loads for a request that is on its way.

A router that sends a request to this node, planning to load some of its
chunks from an L2, posts them here (``POST /prefetch`` on the admin port)
before the engine asks: the lookup the engine's connector makes then finds
them in L1, or already on their way. The chunks are named as the router
hashed them (docs/hashing.md) in a namespace some engine registered here
(model and salt labels); their layouts are what that engine said at HELLO.

A warm-up is a lookup whose locks are let go as soon as it settles: the
loaded objects stay in L1 (``retain_loaded``) and are evictable like any
other. It never blocks the caller, and at most ``MAX_PENDING`` run at once
(more are refused and counted, a hint is never worth a queue).
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor

from kvtier.controllers import PrefetchHandle
from kvtier.counters import Counters
from kvtier.keys import HASH_BYTES, NamespaceLabel, ObjectKey, chunk_keys
from kvtier.layout import KVLayout
from kvtier.storage import StorageManager

log = logging.getLogger(__name__)
NAMESPACES = 256  # registered namespaces remembered (most recent)
MAX_PENDING = 64
MAX_CHUNKS = 4096


class Warmup:
    """See the module docstring. ``register`` from the server loop; ``start``
    from any thread."""

    def __init__(self, storage: StorageManager) -> None:
        self._storage = storage
        self._lock = threading.Lock()
        self._namespaces: OrderedDict[NamespaceLabel, tuple[int, KVLayout, int]] = OrderedDict()
        self._pool = ThreadPoolExecutor(2, thread_name_prefix="kvtier-warmup")
        self._pending = 0
        self.counters = Counters()

    def register(self, namespace: NamespaceLabel, layouts: dict[int, KVLayout], ranks: int) -> None:
        group = min(layouts)
        with self._lock:
            self._namespaces.pop(namespace, None)
            self._namespaces[namespace] = (group, layouts[group], ranks)
            while len(self._namespaces) > NAMESPACES:
                self._namespaces.popitem(last=False)

    def keys(self, namespace: NamespaceLabel, hashes: list[bytes]) -> list[ObjectKey]:
        """Every rank's object of these chunks in a registered namespace (its
        first object group); ValueError for bad hashes or too many,
        LookupError for a namespace no engine registered here."""
        return [k for chunk in self._chunk_keys(namespace, hashes)[0] for k in chunk]

    def _chunk_keys(
        self, namespace: NamespaceLabel, hashes: list[bytes]
    ) -> tuple[list[list[ObjectKey]], int, KVLayout]:
        if not 0 < len(hashes) <= MAX_CHUNKS:
            raise ValueError(f"give 1 to {MAX_CHUNKS} chunk hashes, got {len(hashes)}")
        if any(len(h) != HASH_BYTES for h in hashes) or len(set(hashes)) != len(hashes):
            raise ValueError(f"chunk hashes are {HASH_BYTES} distinct bytes (64 hex digits) each")
        with self._lock:
            known = self._namespaces.get(namespace)
        if known is None:
            self.counters.add("unknown_namespace")
            raise LookupError(
                f"no engine registered model {namespace.model!r} with salt {namespace.salt!r} here"
            )
        group, layout, ranks = known
        keys = chunk_keys(hashes, namespace.model, ranks, group, namespace.salt)
        return keys, group, layout

    def start(self, namespace: NamespaceLabel, hashes: list[bytes]) -> int:
        """Start loading these chunks; how many were asked for. ValueError
        (the message says what to change) for bad hashes or too many,
        LookupError for a namespace no engine registered here."""
        keys, group, layout = self._chunk_keys(namespace, hashes)
        with self._lock:
            if self._pending >= MAX_PENDING:
                self.counters.add("refused_busy")
                raise OverflowError(f"{MAX_PENDING} warm-ups are running; try later")
            self._pending += 1
        try:
            handle = self._storage.submit_lookup(keys, {group: layout})
            self._pool.submit(self._settle, handle)
        except BaseException:
            with self._lock:
                self._pending -= 1
            raise
        self.counters.add("started")
        self.counters.add("chunks_asked", len(hashes))
        return len(hashes)

    def _settle(self, handle: PrefetchHandle) -> None:
        try:
            result = self._storage.collect_or_abandon(handle)
            if result is None:
                self.counters.add("unanswered")
                return
            locked: list[ObjectKey] = list(result.placements)
            self._storage.release(locked)
            self.counters.add("chunks_ready", result.hit_chunks)
        except Exception:
            self.counters.add("errors")
            log.exception("warmup: a routing-time prefetch failed")
        finally:
            with self._lock:
                self._pending -= 1

    def status(self) -> dict[str, object]:
        return {"pending": self._pending, **self.counters.snapshot()}

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)


__all__ = ["Warmup"]
