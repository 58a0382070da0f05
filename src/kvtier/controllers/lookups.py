"""What a lookup through the prefetch path gives its caller: a
``PrefetchHandle`` at once, a ``LookupResult`` when it is done, and with it
why the hit ends where it does (``MissReason``).
"""

from __future__ import annotations

import enum
import logging
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from kvtier.keys import ObjectKey
from kvtier.l1 import Placement
from kvtier.l2.base import TaskResult
from kvtier.l2.format import Corruption

log = logging.getLogger(__name__)

L1_TIER = "L1"  # the tier name of objects L1 had (the others are adapter names)


class MissReason(enum.Enum):
    """Why a lookup's hit ends where it does: the fate of the first chunk it
    does not cover (one of that chunk's objects)."""

    NOT_IN_L1 = "not_in_l1"  # no L2 tier to ask (none configured, or its layout unknown)
    NOT_FOUND = "not_found"  # no tier holds it
    BACKEND_DOWN = "backend_down"  # a tier that may hold it could not answer
    CORRUPT = "corrupt"  # the copy failed its checks (kvtier.l2.format)
    LAYOUT_MISMATCH = "layout_mismatch"  # the copy was written for another layout
    LOAD_FAILED = "load_failed"  # found, then gone or unreadable when loaded
    NO_ROOM = "no_room"  # L1 could not stage it (larger than L1, or all of it pinned)
    DEADLINE = "deadline"  # still loading when the prefetch deadline passed
    RECOMPUTE_CHEAPER = "recompute_cheaper"  # loading it would take longer than recomputing
    OVERLOADED = "overloaded"  # the prefetch backlog was full: L1 only
    STOPPED = "stopped"  # the server was shutting down
    ERROR = "error"  # a fault of the server's own (logged)


@dataclass(frozen=True, slots=True)
class LookupResult:
    """A finished lookup. The caller holds one read lock on every object of the
    first ``hit_chunks`` chunks (``placements``) and must release them.
    ``miss_reason`` is None when every chunk hit."""

    hit_chunks: int
    placements: Mapping[ObjectKey, Placement]
    objects_by_tier: Mapping[str, int]  # "L1" or adapter name -> objects in the hit
    temporary: frozenset[ObjectKey] = frozenset()  # loaded for this request only
    miss_reason: MissReason | None = None

    @property
    def why(self) -> str:
        """``miss_reason`` as wire text: "" when every chunk hit."""
        return self.miss_reason.value if self.miss_reason is not None else ""

    def chunks_by_tier(self) -> dict[str, int]:
        """Hit chunks per tier: objects over the objects of one chunk (every
        chunk of the hit has all of them)."""
        per_chunk = len(self.placements) // self.hit_chunks if self.hit_chunks else 1
        return {tier: n // per_chunk for tier, n in self.objects_by_tier.items()}


class PrefetchHandle:
    """The caller's view of one request: pending until ``result()`` is set."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._done = threading.Event()
        self._result: LookupResult | None = None
        self._abandoned = False
        self._callbacks: list[Callable[[], None]] = []

    def result(self) -> LookupResult | None:
        """The result, or None while the lookup is pending."""
        return self._result if self._done.is_set() else None

    def wait(self, timeout: float | None = None) -> LookupResult | None:
        self._done.wait(timeout)
        return self.result()

    def abandon(self) -> LookupResult | None:
        """Stop waiting. Returns the result if it came meanwhile (the caller
        owns its locks); else None, and a result that comes later has its
        locks released by the controller."""
        with self._lock:
            if self._done.is_set():
                return self._result
            self._abandoned = True
            return None

    def add_done_callback(self, callback: Callable[[], None]) -> None:
        """Call ``callback()`` once the result is set (at once if it is): from
        the thread that sets it. It must not block, and it may not raise."""
        with self._lock:
            if not self._done.is_set():
                self._callbacks.append(callback)
                return
        callback()

    def deliver(self, result: LookupResult) -> bool:
        """Set the result (the prefetch controller's, once); False, nothing
        delivered, if the caller abandoned it."""
        with self._lock:
            if self._abandoned:
                return False
            self._result = result
            self._done.set()
            callbacks, self._callbacks = self._callbacks, []
        for callback in callbacks:
            try:
                callback()
            except Exception:  # a caller's bug must not cost the worker its step
                log.exception("prefetch: a lookup's done-callback failed")
        return True


def load_miss(result: TaskResult, key: ObjectKey) -> MissReason:
    """Why ``key`` failed to load in ``result``."""
    refused = result.corrupt.get(key)
    if refused == Corruption.LAYOUT.value:
        return MissReason.LAYOUT_MISMATCH
    if refused is not None:
        return MissReason.CORRUPT
    return MissReason.BACKEND_DOWN if result.backend_down else MissReason.LOAD_FAILED


__all__ = ["L1_TIER", "LookupResult", "MissReason", "PrefetchHandle", "load_miss"]
