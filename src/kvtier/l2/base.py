"""The L2 adapter contract (prose and rationale in ``docs/l2-contract.md``).

An adapter is non-blocking and batch-shaped, so no backend can stall a
controller loop::

    submit_store(keys, buffers, layout) -> TaskId   result: per-key stored bitmap + bytes written
    submit_lookup(keys)                 -> TaskId   result: per-key found bitmap
    submit_load(keys, buffers, layout)  -> TaskId   result: per-key loaded bitmap + bytes read
    unlock(keys)                        fire-and-forget; drops leases a lookup took; never fails
    close()                             waits for in-flight I/O, then releases the backend

- Completion: each task's ``TaskResult`` is handed exactly once to the
  ``on_complete`` callback given at construction: from an adapter thread, or
  on the submitting thread during ``submit_*`` when the answer is known at
  once (an in-memory lookup, a task refused while closed or backing off).
  The callback must not block or take a lock the submitter may hold. A
  controller points the callbacks of all its adapters at one
  ``CompletionQueue`` and waits on that.
- Buffer ownership: a buffer passed to a task belongs to the adapter until
  that task's result is delivered. The result is delivered only after the
  adapter has stopped touching the buffers (timeouts are enforced inside
  the backend client, so every task does complete). ``close()`` waits for
  in-flight tasks. Callers keep L1 memory fenced until the result arrives.
- Failures are misses: an error, a timeout, an unreachable backend or a
  corrupt copy sets that key's bit to False and counts the reason in
  ``status()["failures"]``; nothing raises into the caller. The result
  says why a key missed: ``failure`` when a part failed as a whole,
  ``corrupt`` for each refused copy (the caller's "why miss"). After a
  connection failure the adapter backs off (doubling, capped) and answers
  submits at once as misses until the back-off ends, then reconnects (one
  thread reconnects; parts that come meanwhile are misses, "reconnecting").
  ``recoveries`` counts the times the backend answered again after failing:
  a store that restarted may have come back empty, so the store controller
  re-seeds it from L1.
- A store does not rewrite what the backend holds (``skip_present``): keys
  this adapter stored before (it remembers the last ``remembered_keys``) are
  looked up first and skipped if present; other keys are written directly,
  so new objects pay no extra round trip.
- Corrupt copies (``kvtier.l2.format``) are misses and are deleted or
  quarantined by the adapter, counted as ``corrupt_objects``. With a
  cluster secret (``seal_with``, ``kvtier.l2.seal``) every object written
  is sealed, and one whose tag does not verify is a corrupt copy.
- ``purge(selector, cursor, limit)`` is the operator's path, not the
  engines': it deletes up to about ``limit`` objects a ``KeySelector``
  matches, from ``cursor`` (None: the start), blocking, and returns a
  ``PurgeStep`` (deleted, the cursor to go on from, None when done); a
  backend failure raises (the purger retries). A read in flight either
  finishes or misses: stores never free what a reader holds.

``kvtier.l2.blocking.BlockingAdapter`` implements all of this over three
blocking batch methods run on a small thread pool; most adapters only write
those.
"""

from __future__ import annotations

import enum
import logging
import queue
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import ClassVar, NewType

import numpy as np
import numpy.typing as npt

from kvtier.keys import KeySelector, ObjectKey
from kvtier.l2.codecs import codec_named
from kvtier.l2.seal import Sealer
from kvtier.layout import KVLayout

log = logging.getLogger(__name__)

TaskId = NewType("TaskId", int)
Buffer = npt.NDArray[np.uint8]


class TaskKind(enum.Enum):
    STORE = "store"
    LOOKUP = "lookup"
    LOAD = "load"


@dataclass(frozen=True, slots=True)
class TaskResult:
    """The outcome of one task, delivered once. ``ok[i]`` is for ``keys[i]``."""

    adapter: str
    task: TaskId
    kind: TaskKind
    keys: tuple[ObjectKey, ...]
    ok: tuple[bool, ...]
    nbytes: int = 0  # bytes really written (store) or read (load)
    # Why a whole part failed ("backoff", "unreachable", "timeout", ...): the
    # backend could not answer for its keys. Empty when it answered.
    failure: str = ""
    # Copies this task refused (``kvtier.l2.format``): key -> ``Corruption`` value.
    corrupt: Mapping[ObjectKey, str] = field(default_factory=dict)

    @property
    def count(self) -> int:
        return sum(self.ok)

    @property
    def backend_down(self) -> bool:
        """A part could not reach the backend (down, backing off, reconnecting,
        closed), as opposed to failing on its own ("error")."""
        return self.failure not in ("", "error")


@dataclass(frozen=True, slots=True)
class PurgeStep:
    """One batch of a purge: objects deleted, and where to go on (None: done)."""

    deleted: int
    cursor: str | None


CompletionCallback = Callable[[TaskResult], None]


class CompletionQueue:
    """One queue for the results of several adapters; ``put`` is the callback."""

    def __init__(self) -> None:
        self._queue: queue.SimpleQueue[TaskResult] = queue.SimpleQueue()

    def put(self, result: TaskResult) -> None:
        self._queue.put(result)

    def get(self, timeout: float | None = None) -> TaskResult | None:
        """The next result, or None after ``timeout`` seconds."""
        try:
            return self._queue.get(timeout=timeout)
        except queue.Empty:
            return None


@dataclass(frozen=True, slots=True, kw_only=True)
class AdapterConfig:
    """Options every adapter has. Durations in seconds."""

    name: str = ""  # instance name in metrics and plans; defaults to the type
    write: bool = True  # whether the store controller writes objects to this adapter
    io_threads: int = 4
    timeout_s: float = 5.0
    backoff_initial_s: float = 0.5
    # Short: a store that comes back (and may need re-seeding) is seen within
    # this, and each try costs one part a reconnect (refused at once when the
    # server is down; ``timeout_s`` when its host does not answer).
    backoff_max_s: float = 2.0
    # Whether other nodes read and write this store too (KV events mark its
    # chunks SHARED; a router lets every node load them). None: the type's default.
    shared: bool | None = None
    skip_present: bool = True  # a store of a key stored before asks whether it is still there
    remembered_keys: int = 1 << 16  # keys stored lately, for skip_present (~150 bytes each)
    # What payloads are stored as (``kvtier.l2.codecs``): none, zstd (lossless),
    # int8 or int4 (lossy, only for layouts whose lossy_codec asks for it).
    codec: str = "none"

    def __post_init__(self) -> None:
        if self.io_threads <= 0:
            raise ValueError(f"option 'io_threads' must be positive, got {self.io_threads}")
        if self.remembered_keys < 0:
            raise ValueError(f"option 'remembered_keys' must be >= 0, got {self.remembered_keys}")
        if self.timeout_s <= 0:
            raise ValueError(f"option 'timeout_s' must be positive, got {self.timeout_s}")
        if not 0 < self.backoff_initial_s <= self.backoff_max_s:
            raise ValueError(
                "options must satisfy 0 < backoff_initial_s <= backoff_max_s, got "
                f"{self.backoff_initial_s} and {self.backoff_max_s}"
            )
        try:
            codec_named(self.codec)
        except (ValueError, RuntimeError) as exc:
            raise ValueError(f"option 'codec': {exc}") from None


class L2Adapter(ABC):
    """The contract; see the module docstring."""

    type_name: ClassVar[str]
    config_class: ClassVar[type[AdapterConfig]]
    shared_by_default: ClassVar[bool] = True  # a remote store; a node-local one says False

    name: str
    writable: bool
    shared: bool
    # Told of objects the adapter itself removed (evicted, deleted as corrupt),
    # from its I/O threads: it must only record (KV events).
    on_removed: Callable[[Sequence[ObjectKey]], None] | None = None

    @abstractmethod
    def submit_store(
        self, keys: Sequence[ObjectKey], buffers: Sequence[Buffer], layout: str = ""
    ) -> TaskId: ...

    @abstractmethod
    def submit_lookup(self, keys: Sequence[ObjectKey]) -> TaskId: ...

    @abstractmethod
    def submit_load(
        self, keys: Sequence[ObjectKey], buffers: Sequence[Buffer], layout: str = ""
    ) -> TaskId: ...

    def register_memory(self, buffer: Buffer) -> None:
        """Memory that payload buffers will live in (the L1 arena), offered once
        for backends that transfer without copying from registered memory."""
        return None

    def share_layouts(self, layouts: Mapping[str, KVLayout]) -> None:
        """The layouts by digest that the storage manager has seen (lossy
        codecs need a payload's shape, and the adapter is told only digests)."""
        return None

    @abstractmethod
    def seal_with(self, seal: Sealer | None) -> None:
        """Seal every object written from now on, and take only objects
        whose tag verifies (None: unsealed, checksums only)."""

    @property
    def recoveries(self) -> int:
        """How often the backend answered again after failing (0 for adapters
        that cannot fail that way)."""
        return 0

    def set_owners(self, owner_of: Callable[[str], str], caps: Mapping[str, int]) -> bool:
        """Keep each owner's bytes here (``owner_of(key.salt)``, a tenant)
        within ``caps`` as each store lands: past its cap an owner loses its
        own oldest objects, never another's. True if this adapter does so; a
        remote store says False, and the store controller's gate keeps its
        caps by what this server wrote there."""
        return False

    def held_keys(self) -> list[ObjectKey]:
        """Every object a node-local adapter holds now (what a restarted server
        announces); a remote store cannot list cheaply and says nothing."""
        return []

    def held_sizes(self) -> list[tuple[ObjectKey, int]]:
        """``held_keys`` with the bytes each takes, oldest first."""
        return []

    def older_than(self, age_s: float) -> list[ObjectKey]:
        """Objects a node-local adapter stored more than ``age_s`` seconds ago
        (for retention; [] where ages are unknown)."""
        return []

    def delete(self, keys: Sequence[ObjectKey]) -> int:
        """Remove these objects from a node-local adapter (blocking); how many
        it held."""
        raise NotImplementedError(f"L2 {self.name}: {self.type_name} adapters cannot delete")

    def purge(self, selector: KeySelector, cursor: str | None, limit: int) -> PurgeStep:
        """See the module docstring; an adapter that cannot says so."""
        raise NotImplementedError(f"L2 {self.name}: {self.type_name} adapters cannot purge")

    @abstractmethod
    def unlock(self, keys: Sequence[ObjectKey]) -> None: ...

    @abstractmethod
    def close(self) -> None: ...

    @abstractmethod
    def status(self) -> dict[str, object]: ...
