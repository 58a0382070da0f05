"""``Residency``: which chunks each tier of this node holds, as KV events.

Tiers report *objects* (one per chunk, rank and group) as they arrive and
leave: L1 from its admission and removal paths, an L2 adapter when a store
completes, when it evicts or deletes, and when a lookup finds an object gone.
They only append to a log (cheap, safe under their own locks); the event
publisher's thread drains the log (``drain``) and owns every table here.

Events are per *chunk hash*, the name a router indexes (``ChunkIndex``), but
a tier holds *objects*, and objects of different namespaces (model and salt
labels of ``ObjectKey``) may carry the same raw chunk hash: a client names its
own keys, so two tenants can store one hash each under their own salt. So a
chunk's residency is counted per holder, the (model, salt) pair: the chunk is
announced stored when its first object of any holder arrives in a tier and
removed when the last object of the last holder leaves (a node-local tier
keeps one bit per rank and group of a chunk and holder); purging one tenant
never announces the removal of a chunk another tenant still holds.

A shared tier (``SHARED``: other nodes write and evict it too) cannot count
objects: a chunk is announced once when this node stores it for its first
holder and removed when lookups here have found it gone for every holder
that stored it; what other nodes or the store's own eviction remove unseen
stays claimed until then, which costs a misrouted request a miss, never
wrong KV (the engine's lookup decides).

``snapshot()`` is the state after the last drain as one batch of events
(``AllBlocksCleared`` then the chunks of every tier), what a subscriber gets
when it asks to replay history the publisher no longer buffers.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from kvtier.events.wire import (
    LOCAL,
    MEDIUM_CPU,
    MEDIUM_STORAGE,
    OWNER_PREFIX,
    SHARED,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    Event,
)
from kvtier.keys import ObjectKey

HASHES_PER_EVENT = 4096
OBJECT_BITS = 1024  # per chunk: ranks x groups beyond this share bits (a stale claim, never KV)
SHARED_REMEMBERED = 1 << 20  # chunks of a shared tier announced by this node, for snapshots

Holder = tuple[str, str]  # an ObjectKey's (model, salt) labels: the namespace holding a copy


@dataclass(slots=True)
class _TierTable:
    """One tier's residency. ``objects``: per holder, chunk -> its objects
    there (one bit per rank and group; 1 in a shared tier). ``holders``:
    chunk -> how many holders have any object of it, so its keys are the
    chunks the tier is announced to hold (in announcement order when shared).
    Flat tables, not one dict per chunk: a tier may hold millions of chunks."""

    objects: dict[Holder, dict[bytes, int]]
    holders: dict[bytes, int]


@dataclass(frozen=True, slots=True)
class Tier:
    """One tier as events name it: ``name`` is ``L1`` or an adapter's name."""

    name: str
    shared: bool = False

    @property
    def medium(self) -> str:
        return MEDIUM_CPU if self.name == "L1" else MEDIUM_STORAGE

    @property
    def ownership(self) -> str:
        return OWNER_PREFIX + self.name

    @property
    def locality(self) -> str:
        return SHARED if self.shared else LOCAL


L1_TIER = Tier("L1")


class Residency:
    """See the module docstring. ``added``/``removed`` from any thread (a
    deque's append is atomic); everything else from the publisher's thread.
    ``on_report``, when set (by the publisher), is called after each report is
    logged, on the reporting thread: it must be cheap and never raise."""

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self._log: deque[tuple[bool, Tier, Sequence[ObjectKey]]] = deque()
        self._tiers: dict[Tier, _TierTable] = {}
        self.on_report: Callable[[], None] | None = None

    # ----------------------------------------------------------- from tiers

    def added(self, tier: Tier, keys: Sequence[ObjectKey]) -> None:
        if keys:
            self._log.append((True, tier, keys))
            self._reported()

    def removed(self, tier: Tier, keys: Sequence[ObjectKey]) -> None:
        if keys:
            self._log.append((False, tier, keys))
            self._reported()

    def _reported(self) -> None:
        notify = self.on_report
        if notify is not None:
            notify()

    # ---------------------------------------------------- publisher's thread

    def drain(self, limit: int = 1 << 16) -> list[Event]:
        """Apply up to ``limit`` logged reports; the chunk events they make,
        consecutive ones of the same kind and tier merged, in order."""
        events: list[Event] = []
        run: tuple[bool, Tier] | None = None
        hashes: list[bytes] = []
        for _ in range(limit):
            try:
                stored, tier, keys = self._log.popleft()
            except IndexError:
                break
            changed = self._apply(stored, tier, keys)
            if changed and run != (stored, tier):
                self._flush(events, run, hashes)
                run, hashes = (stored, tier), []
            hashes.extend(changed)
        self._flush(events, run, hashes)
        return events

    def _flush(
        self, events: list[Event], run: tuple[bool, Tier] | None, hashes: list[bytes]
    ) -> None:
        if run is None:
            return
        for start in range(0, len(hashes), HASHES_PER_EVENT):
            events.append(self._event(run[0], run[1], hashes[start : start + HASHES_PER_EVENT]))

    def pending(self) -> int:
        return len(self._log)

    def snapshot(self) -> list[Event]:
        events: list[Event] = [AllBlocksCleared()]
        for tier, table in self._tiers.items():
            self._flush(events, (True, tier), list(table.holders))
        return events

    def chunks(self, tier: Tier) -> int:
        table = self._tiers.get(tier)
        return len(table.holders) if table is not None else 0

    def tiers(self) -> Iterable[Tier]:
        return self._tiers.keys()

    # ------------------------------------------------------------ internals

    def _apply(self, stored: bool, tier: Tier, keys: Sequence[ObjectKey]) -> list[bytes]:
        """Update the tier's table; the chunks whose presence changed (first
        holder in, last holder out). A node-local tier keeps one bit per
        (rank, group) object of a chunk and holder, so a repeated report
        changes nothing; a shared tier keeps the holders only."""
        table = self._tiers.get(tier)
        if table is None:
            table = self._tiers[tier] = _TierTable({}, OrderedDict() if tier.shared else {})
        changed: list[bytes] = []
        for key in keys:
            chunk, holder = key.chunk_hash, (key.model, key.salt)
            objects = table.objects.get(holder)
            before = objects.get(chunk, 0) if objects is not None else 0
            bit = 1 if tier.shared else _object_bit(key)
            after = before | bit if stored else before & ~bit
            if after == before:
                continue
            if objects is None:
                objects = table.objects[holder] = {}
            if after:
                objects[chunk] = after
            else:
                del objects[chunk]
                if not objects:
                    del table.objects[holder]  # a purged tenant leaves nothing behind
            if before and after:
                continue
            count = table.holders.get(chunk, 0) + (1 if after else -1)
            if count == 1 and after:
                changed.append(chunk)
                table.holders[chunk] = count
                if tier.shared and len(table.holders) > SHARED_REMEMBERED:
                    self._forget_oldest(table)
            elif count:
                table.holders[chunk] = count
            else:
                del table.holders[chunk]
                changed.append(chunk)
        return changed

    @staticmethod
    def _forget_oldest(table: _TierTable) -> None:
        """A shared tier past ``SHARED_REMEMBERED``: its oldest chunk is
        forgotten, unannounced (snapshots leave it out; a removal reported
        later announces nothing)."""
        chunk, _ = table.holders.popitem(last=False)  # type: ignore[call-arg]
        for holder in list(table.objects):
            objects = table.objects[holder]
            if objects.pop(chunk, 0) and not objects:
                del table.objects[holder]

    def _event(self, stored: bool, tier: Tier, hashes: list[bytes]) -> Event:
        blocks: list[bytes | int] = list(hashes)
        if stored:
            return BlockStored(
                blocks,
                None,
                [],
                self.block_size,
                None,
                tier.medium,
                None,
                locality=tier.locality,
                ownership=tier.ownership,
            )
        return BlockRemoved(blocks, tier.medium, locality=tier.locality, ownership=tier.ownership)


def _object_bit(key: ObjectKey) -> int:
    index = key.group * 64 + key.kv_rank if key.kv_rank < 64 and key.group < 16 else None
    return 1 << (index if index is not None else (key.kv_rank * 31 + key.group) % OBJECT_BITS)


__all__ = ["HASHES_PER_EVENT", "L1_TIER", "Residency", "Tier"]
