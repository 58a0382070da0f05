"""What a subscriber believes a node holds, tier by tier, from its KV events."""

from __future__ import annotations

import threading

from kvtier.events.wire import AllBlocksCleared, BlockStored, DecodedBatch


class Mirror:
    """``ownership`` (tier) -> chunks; every ``BlockStored`` seen, too."""

    def __init__(self) -> None:
        self.tiers: dict[str, set[bytes | int]] = {}
        self.stored_events: list[BlockStored] = []
        self.lock = threading.Lock()

    def apply(self, batch: DecodedBatch) -> None:
        with self.lock:
            for event in batch.events:
                if isinstance(event, AllBlocksCleared):
                    self.tiers.clear()
                elif isinstance(event, BlockStored):
                    self.stored_events.append(event)
                    self.tiers.setdefault(event.ownership or "", set()).update(event.block_hashes)
                else:
                    chunks = self.tiers.get(event.ownership or "", set())
                    chunks.difference_update(event.block_hashes)

    def view(self) -> dict[str, set[bytes | int]]:
        with self.lock:
            return {k: set(v) for k, v in self.tiers.items() if v}
