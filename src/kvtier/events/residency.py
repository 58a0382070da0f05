"""``Residency``: which chunks each tier of this node holds, as KV events.

Tiers report *objects* (one per chunk, rank and group) as they arrive and
leave: L1 from its admission and removal paths, an L2 adapter when a store
completes, when it evicts or deletes, and when a lookup finds an object gone.
They only append to a log (cheap, safe under their own locks); the event
publisher's thread drains the log (``drain``) and owns every table here.

Events are per *chunk*: a chunk is announced stored when its first object
arrives in a tier and removed when its last one leaves (a node-local tier
keeps one bit per rank and group of a chunk). A shared tier (``SHARED``: other nodes write and
evict it too) cannot count: a chunk is announced once when this node stores
it and removed when a lookup here finds it gone; what other nodes or the
store's own eviction remove unseen stays claimed until then, which costs a
misrouted request a miss, never wrong KV (the engine's lookup decides).

``snapshot()`` is the state after the last drain as one batch of events
(``AllBlocksCleared`` then the chunks of every tier), what a subscriber gets
when it asks to replay history the publisher no longer buffers.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Iterable, Sequence
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
    deque's append is atomic); everything else from the publisher's thread."""

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self._log: deque[tuple[bool, Tier, Sequence[ObjectKey]]] = deque()
        self._tiers: dict[Tier, dict[bytes, int]] = {}  # tier -> chunk -> objects (1 if shared)

    # ----------------------------------------------------------- from tiers

    def added(self, tier: Tier, keys: Sequence[ObjectKey]) -> None:
        if keys:
            self._log.append((True, tier, keys))

    def removed(self, tier: Tier, keys: Sequence[ObjectKey]) -> None:
        if keys:
            self._log.append((False, tier, keys))

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
        for tier, chunks in self._tiers.items():
            self._flush(events, (True, tier), list(chunks))
        return events

    def chunks(self, tier: Tier) -> int:
        return len(self._tiers.get(tier, ()))

    def tiers(self) -> Iterable[Tier]:
        return self._tiers.keys()

    # ------------------------------------------------------------ internals

    def _apply(self, stored: bool, tier: Tier, keys: Sequence[ObjectKey]) -> list[bytes]:
        """Update the tier's table; the chunks whose presence changed. A
        node-local tier keeps one bit per (rank, group) object of a chunk, so
        a repeated report changes nothing; a shared tier keeps the chunk only."""
        table = self._tiers.get(tier)
        if table is None:
            table = self._tiers[tier] = OrderedDict() if tier.shared else {}
        changed: list[bytes] = []
        for key in keys:
            chunk = key.chunk_hash
            before = table.get(chunk, 0)
            bit = 1 if tier.shared else _object_bit(key)
            after = before | bit if stored else before & ~bit
            if after == before:
                continue
            if after:
                table[chunk] = after
                if tier.shared and len(table) > SHARED_REMEMBERED:
                    table.popitem(last=False)  # type: ignore[call-arg]
            else:
                del table[chunk]
            if not before or not after:
                changed.append(chunk)
        return changed

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
