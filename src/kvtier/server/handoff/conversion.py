"""``Conversion``: a granted hand-off re-sharded for a taker of another TP
size or block size (``kvtier.server.handoff.table`` decides when). The
producer's objects are read under their own read locks, each chunk is split
by KV heads and re-paged (``kvtier.layout.reshard``), and the taker's objects
are stored in L1 as ordinary cache entries. It touches storage only, so the
server runs it off its loop thread.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvtier.keys import ObjectKey
from kvtier.l1 import L1Result
from kvtier.layout import KVLayout
from kvtier.layout.reshard import reshard
from kvtier.storage import StorageManager


@dataclass(frozen=True, slots=True)
class Conversion:
    """A granted take's re-sharding: the producer's objects (chunk-major,
    ``source.num_ranks`` per chunk, held by the hand-off) become the
    consumer's (``target.num_ranks`` per chunk) under ``keys``."""

    handoff_id: str
    objects: list[ObjectKey]
    source: KVLayout
    keys: list[ObjectKey]
    target: KVLayout
    kv_heads: int

    def run(self, storage: StorageManager) -> tuple[list[bool], str]:
        """Re-shard every chunk and store the taker's objects: per object
        whether it is in L1, and why not if none is. Thread-safe (storage
        only): the server runs it off its loop. Its own read locks keep the
        sources while it reads them; one no longer in L1 (the hand-off ended
        first) fails it, never reads other bytes."""
        placements, missing = storage.reserve_read_all(self.objects, self.source)
        if missing:
            return [False] * len(self.keys), "its objects left L1 before they were re-sharded"
        try:
            ranks, converted = self.source.num_ranks, []
            views = [storage.view(pl) for pl in placements]
            for start in range(0, len(views), ranks):
                chunk = views[start : start + ranks]
                converted += reshard(chunk, self.source, self.target, self.kv_heads)
        except ValueError as error:  # replicas that disagree: the source is inconsistent
            return [False] * len(self.keys), str(error)
        finally:
            storage.finish_read(self.objects)
        results = storage.store(self.keys, converted, self.target)
        stored = [r is L1Result.SUCCESS for r in results]
        missing = len(stored) - sum(stored)
        return stored, f"{missing} re-sharded objects did not fit in L1" if missing else ""


__all__ = ["Conversion"]
