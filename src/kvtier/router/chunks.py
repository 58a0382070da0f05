"""``ChunkIndex``: which node holds which kvtier chunk in which tier.

Fed by the cache servers' KV events (``kvtier.events``): a chunk hash maps to
one Python int of bits, ``bit(tier slot, node)``. Node-local tiers (L1 and
each node-local L2, by name) get a slot each (``LOCAL_SLOTS`` at most: names
past that share the last slot); shared stores (by name: every node that
announces a store of that name reads the same store) get a bit each in the
last field. So a lookup of a request's chunks is one dict read per chunk,
and a node's view of a chunk is a few shifts and masks.

The index is a hint (ARCHITECTURE §8): it may claim a chunk a node lost
without telling (then the engine's lookup misses), but once a node announces
a removal the bit is gone, and a node's restart (``AllBlocksCleared``) drops
everything it owned. Shared stores are not cleared by one node's restart.

Routed, not yet stored: ``note_routed`` credits the chunks the router just
sent a node to that node's L1 until its cache server announces them (stored
or removed there) or ``pending_ttl_s`` passes, so a second request for a
prefix still being prefilled sees where the first went (on the conversation
trace this is most of the repeats within a minute, docs/routing.md). While a
node's event stream is silent (``approximate``) its credits last
``approx_ttl_s`` instead, as nothing else will tell.

Thread safety: one lock; event threads apply batches, request handlers read.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence

from kvtier.events.wire import (
    OWNER_PREFIX,
    SHARED,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    DecodedBatch,
)

LOCAL_SLOTS = 3  # L1, then node-local L2s by name
L1_SLOT = 0
MAX_NODES = 64  # a field of 64 bits per slot
MAX_STORES = 64


class ChunkIndex:
    """See the module docstring."""

    def __init__(
        self,
        max_nodes: int = MAX_NODES,
        approx_ttl_s: float = 60.0,
        pending_ttl_s: float = 30.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if not 0 < max_nodes <= MAX_NODES:
            raise ValueError(
                f"a router indexes 1 to {MAX_NODES} engines, got {max_nodes}; "
                "split a larger pool by model or region, one router group each"
            )
        self.max_nodes = max_nodes
        self.approx_ttl_s = approx_ttl_s
        self.pending_ttl_s = pending_ttl_s
        self._stride = MAX_NODES
        self._lock = threading.Lock()
        self._chunks: dict[bytes, int] = {}
        self._local_slots: dict[str, int] = {"L1": L1_SLOT}
        self._stores: dict[str, int] = {}  # shared store name -> its bit
        self.store_readers: dict[int, int] = {}  # shared store -> mask of nodes that announced it
        self._pending: dict[bytes, dict[int, float]] = {}  # chunk -> node -> expiry
        self.approximate: set[int] = set()  # nodes whose events are silent
        self._clock = clock
        self.malformed = 0  # events this index could not place

    # -------------------------------------------------------------- events

    def apply(self, node: int, batch: DecodedBatch) -> None:
        """One batch of node ``node``'s cache-server events."""
        self._check_node(node)
        with self._lock:
            for event in batch.events:
                if isinstance(event, AllBlocksCleared):
                    self._clear_node(node)
                    continue
                slot = self._placement(node, event.ownership, event.locality)
                if slot is None:
                    self.malformed += 1
                    continue
                blocks = [b for b in event.block_hashes if isinstance(b, bytes)]
                if isinstance(event, BlockStored):
                    for block in blocks:
                        self._chunks[block] = self._chunks.get(block, 0) | slot
                elif isinstance(event, BlockRemoved):
                    for block in blocks:
                        self._remove(block, slot)
                if event.locality != SHARED:  # the node has spoken for these chunks
                    self._settle(node, blocks)

    def note_routed(self, node: int, hashes: Sequence[bytes]) -> None:
        """The router sent these chunks to ``node``: credit them there until
        the node announces them or the credit's TTL passes."""
        with self._lock:
            ttl = self.approx_ttl_s if node in self.approximate else self.pending_ttl_s
            if ttl <= 0:
                return
            expiry = self._clock() + ttl
            for chunk in hashes:
                self._pending.setdefault(chunk, {})[node] = expiry

    def expire(self) -> int:
        """Drop credits past their time; how many went."""
        now = self._clock()
        dropped = 0
        with self._lock:
            for chunk in list(self._pending):
                nodes = self._pending[chunk]
                for node in [n for n, t in nodes.items() if t <= now]:
                    del nodes[node]
                    dropped += 1
                if not nodes:
                    del self._pending[chunk]
        return dropped

    # -------------------------------------------------------------- lookup

    def view(self, hashes: Sequence[bytes]) -> list[int]:
        """The request's chunks, up to the first that no node has (in any tier,
        or credited as routed there): one int each, ``bit(slot, node)`` for
        local slots (64 bits a slot, credits in L1's) and the shared stores'
        bits above them."""
        found: list[int] = []
        now = self._clock()
        with self._lock:
            for chunk in hashes:
                mask = self._chunks.get(chunk, 0)
                pending = self._pending.get(chunk)
                if pending:
                    for node, expiry in pending.items():
                        if expiry > now:
                            mask |= 1 << (L1_SLOT * self._stride + node)
                if not mask:
                    break
                found.append(mask)
        return found

    def store_names(self) -> dict[int, str]:
        """Shared store bit -> its name."""
        with self._lock:
            return {bit: name for name, bit in self._stores.items()}

    def slot_names(self) -> dict[int, str]:
        """Local slot -> its tier's name (the first name, where names share the last slot)."""
        with self._lock:
            out: dict[int, str] = {}
            for name, slot in self._local_slots.items():
                out.setdefault(slot, name)
            return out

    def __len__(self) -> int:
        return len(self._chunks)

    def holds(self, node: int, chunk: bytes, tier: str) -> bool:
        """Whether the index claims ``chunk`` at ``node`` in ``tier`` (a local
        tier's name, or a shared store's when the node reads it)."""
        with self._lock:
            mask = self._chunks.get(chunk, 0)
            if tier in self._stores:
                store = self._stores[tier]
                return bool(mask >> (LOCAL_SLOTS * self._stride + store) & 1) and bool(
                    self.store_readers.get(store, 0) >> node & 1
                )
            slot = self._local_slots.get(tier)
            return slot is not None and bool(mask >> (slot * self._stride + node) & 1)

    def status(self) -> dict[str, object]:
        with self._lock:
            return {
                "chunks": len(self._chunks),
                "pending_chunks": len(self._pending),
                "approximate_nodes": sorted(self.approximate),
                "local_tiers": dict(self._local_slots),
                "shared_stores": dict(self._stores),
                "malformed_events": self.malformed,
            }

    # ------------------------------------------------------------ internals

    def _check_node(self, node: int) -> None:
        if not 0 <= node < self.max_nodes:
            raise ValueError(f"node {node} is outside [0, {self.max_nodes}); raise max_nodes")

    def _placement(self, node: int, ownership: str | None, locality: str | None) -> int | None:
        """The bit of this node (or shared store) in the event's tier."""
        if not ownership or not ownership.startswith(OWNER_PREFIX):
            return None
        name = ownership[len(OWNER_PREFIX) :]
        if locality == SHARED:
            store = self._stores.get(name)
            if store is None:
                if len(self._stores) >= MAX_STORES:
                    return None
                store = self._stores[name] = len(self._stores)
            self.store_readers[store] = self.store_readers.get(store, 0) | (1 << node)
            return 1 << (LOCAL_SLOTS * self._stride + store)
        slot = self._local_slots.get(name)
        if slot is None:
            slot = self._local_slots[name] = min(len(self._local_slots), LOCAL_SLOTS - 1)
        return 1 << (slot * self._stride + node)

    def _remove(self, chunk: bytes, bit: int) -> None:
        mask = self._chunks.get(chunk)
        if mask is None:
            return
        mask &= ~bit
        if mask:
            self._chunks[chunk] = mask
        else:
            del self._chunks[chunk]

    def _clear_node(self, node: int) -> None:
        """Everything the node owned (its local slots); shared stores stay."""
        keep = ~sum(1 << (t * self._stride + node) for t in range(LOCAL_SLOTS))
        for chunk in list(self._chunks):
            mask = self._chunks[chunk] & keep
            if mask:
                self._chunks[chunk] = mask
            else:
                del self._chunks[chunk]
        for nodes in self._pending.values():
            nodes.pop(node, None)

    def _settle(self, node: int, chunks: Sequence[bytes]) -> None:
        """``node`` announced ``chunks``: its events speak for them now."""
        for chunk in chunks:
            nodes = self._pending.get(chunk)
            if nodes and nodes.pop(node, None) is not None and not nodes:
                del self._pending[chunk]


__all__ = ["L1_SLOT", "LOCAL_SLOTS", "MAX_NODES", "ChunkIndex"]
