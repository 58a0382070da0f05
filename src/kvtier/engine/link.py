"""An engine's link to kvtier: the node's cache server, or a ``StorageManager``
in the engine's own process. Engines see one interface either way.

A request goes ``lookup`` -> ``load`` (the hit chunks it will use; their
locks are released by the load) -> ``release`` (hit chunks it will not use)
-> ``store`` (new chunks) -> ``end``. Objects are read and written in place
through callbacks (``Consume``, ``Fill``), so KV is copied once each way:
between the engine's tensors and the L1 arena. Nothing here raises for a
missing or failing cache: that is a miss (or a skipped store).
"""

from __future__ import annotations

import itertools
import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

from kvtier.engine.identity import ModelIdentity
from kvtier.keys import ObjectKey, chunk_keys, model_label
from kvtier.l1 import L1Result
from kvtier.layout import KVLayout
from kvtier.protocol import messages as p
from kvtier.protocol.client import CacheClient, ClientConfig, Consume, Fill
from kvtier.storage import StorageManager

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Hit:
    """A finished lookup: the first ``chunks`` chunks are locked for the caller.
    ``miss_reason`` says why the hit ends there ("" when it covers every
    chunk): see ``LookupState.miss_reason``."""

    chunks: int
    chunks_by_tier: dict[str, int] = field(default_factory=dict)
    miss_reason: str = ""


class CacheLink(Protocol):
    """See the module docstring. One rank, one object group."""

    @property
    def chunk_size(self) -> int | None:
        """Tokens per chunk; None while the cache is unreachable (skip it)."""
        ...

    def lookup(self, request_id: str, hashes: Sequence[bytes]) -> Hit: ...

    def load(self, request_id: str, start: int, end: int, consume: Consume) -> bool:
        """Hand hit chunks [start, end) to ``consume(i, view)`` and release them;
        False if anything failed (the engine recomputes them)."""
        ...

    def release(self, request_id: str, start: int, end: int) -> None: ...

    def store(self, request_id: str, hashes: Sequence[bytes], object_bytes: int, fill: Fill) -> int:
        """Store one object per hash, written by ``fill(i, dst)``; objects stored."""
        ...

    def end(self, request_id: str) -> None: ...

    def report_shadow(self, checked: int, mismatched: int) -> None:
        """Shadow-check results (``kvtier.engine.shadow``), for the cache's metrics."""
        ...

    def report_quality(self, path: str, agreed: bool, kl: float, off: bool) -> None:
        """One quality-gate sample of a lossy path (``kvtier.engine.quality_gate``)."""
        ...

    def pin(self, hashes: Sequence[bytes], ttl_s: float) -> int:
        """Keep these chunks in L1 for ``ttl_s`` (0: unpin); chunks pinned."""
        ...

    def report_usage(
        self, prefill_s: float, computed_tokens: int, load_s: float, loaded_tokens: int
    ) -> None:
        """A forward the engine ran (its seconds and computed tokens; 0 tokens:
        none) and the KV it loaded, for the cache's savings ledger."""
        ...

    def close(self) -> None: ...


_request_ids = itertools.count()


def new_request_id(prefix: str = "req") -> str:
    """Unique within this process and among processes on one node."""
    return f"{prefix}-{os.getpid()}-{next(_request_ids)}"


class ServerLink:
    """A ``CacheLink`` through ``CacheClient`` to the node's cache server."""

    def __init__(
        self,
        address: str,
        identity: ModelIdentity,
        layout: KVLayout,
        *,
        auth_token: str = "",
        lookup_timeout_s: float = 5.0,
        **client_options: object,
    ) -> None:
        config = ClientConfig(
            address=address,
            model=model_label(identity.model),
            hash_model=identity.model,
            layouts=(p.LayoutSpec.of(layout),),
            revision=identity.revision,
            lora=identity.lora,
            salt=identity.label.salt,  # any tenant name: the server takes labels
            auth_token=auth_token,
            **client_options,  # type: ignore[arg-type]
        )
        self.client = CacheClient(config)
        self.lookup_timeout_s = lookup_timeout_s

    @property
    def chunk_size(self) -> int | None:
        return self.client.chunk_size  # None while the server is away (the client reconnects)

    def lookup(self, request_id: str, hashes: Sequence[bytes]) -> Hit:
        state = self.client.lookup(request_id, hashes, wait_s=self.lookup_timeout_s)
        if not state.done:
            log.warning(
                "link: lookup %s still pending after %.1fs; a miss",
                request_id,
                self.lookup_timeout_s,
            )
            return Hit(0, miss_reason="over_budget")
        return Hit(state.hit_chunks or 0, dict(state.chunks_by_tier), state.miss_reason)

    def load(self, request_id: str, start: int, end: int, consume: Consume) -> bool:
        return self.client.retrieve_with(request_id, start, end, consume)

    def release(self, request_id: str, start: int, end: int) -> None:
        self.client.release(request_id, start, end)

    def store(self, request_id: str, hashes: Sequence[bytes], object_bytes: int, fill: Fill) -> int:
        return self.client.store_with(request_id, hashes, [object_bytes] * len(hashes), fill)

    def end(self, request_id: str) -> None:
        self.client.end_session(request_id)

    def report_shadow(self, checked: int, mismatched: int) -> None:
        self.client.report_shadow(checked, mismatched)

    def report_quality(self, path: str, agreed: bool, kl: float, off: bool) -> None:
        self.client.report_quality(path, agreed, kl, off)

    def pin(self, hashes: Sequence[bytes], ttl_s: float) -> int:
        reply = self.client.pin(hashes, ttl_s)
        return reply.pinned if reply is not None else 0

    def report_usage(
        self, prefill_s: float, computed_tokens: int, load_s: float, loaded_tokens: int
    ) -> None:
        self.client.report_usage(prefill_s, computed_tokens, load_s, loaded_tokens)

    def close(self) -> None:
        self.client.close()


class LocalLink:
    """A ``CacheLink`` to a ``StorageManager`` in this process (no server)."""

    def __init__(self, storage: StorageManager, identity: ModelIdentity, layout: KVLayout) -> None:
        self.storage = storage
        self.layout = layout
        self._label = model_label(identity.model)
        self._salt = identity.label.salt
        self._locked: dict[str, list[ObjectKey | None]] = {}  # request -> its hit chunks' keys

    @property
    def chunk_size(self) -> int:
        return self.layout.tokens_per_chunk

    def lookup(self, request_id: str, hashes: Sequence[bytes]) -> Hit:
        result = self.storage.lookup(self._keys(hashes), self.layout)
        self._locked[request_id] = list(result.placements)
        return Hit(result.hit_chunks, result.chunks_by_tier(), result.why)

    def load(self, request_id: str, start: int, end: int, consume: Consume) -> bool:
        keys = self._take(request_id, start, end)
        try:
            for i, view in enumerate(self.storage.retrieve(keys)):
                consume(i, view)
        finally:
            self.storage.release(keys)
        return True

    def release(self, request_id: str, start: int, end: int) -> None:
        self.storage.release(self._take(request_id, start, end))

    def store(self, request_id: str, hashes: Sequence[bytes], object_bytes: int, fill: Fill) -> int:
        keys = self._keys(hashes)
        tag, placements, fence = self.storage.reserve_store(
            keys, [object_bytes] * len(keys), self.layout
        )
        try:
            for i, placement in enumerate(placements):
                if placement.result is L1Result.SUCCESS:
                    fill(i, self.storage.view(placement))
        except BaseException:
            self.storage.abort_store(tag, fence)
            raise
        admitted = self.storage.commit_store(tag, fence, self.layout)
        return len(admitted) + sum(pl.result is L1Result.NOT_WRITABLE for pl in placements)

    def end(self, request_id: str) -> None:
        keys = [k for k in self._locked.pop(request_id, []) if k is not None]
        if keys:
            self.storage.release(keys)

    def report_shadow(self, checked: int, mismatched: int) -> None:
        return None  # no server to tell: the caller's ShadowCheck holds the counts

    def report_quality(self, path: str, agreed: bool, kl: float, off: bool) -> None:
        return None  # no server to tell: the caller's QualityGate holds the verdicts

    def pin(self, hashes: Sequence[bytes], ttl_s: float) -> int:
        results = self.storage.pin(self._keys(hashes), ttl_s)
        return sum(r is L1Result.SUCCESS for r in results)

    def report_usage(
        self, prefill_s: float, computed_tokens: int, load_s: float, loaded_tokens: int
    ) -> None:
        return None  # no server, no ledger

    def close(self) -> None:
        for request_id in list(self._locked):
            self.end(request_id)

    def _keys(self, hashes: Sequence[bytes]) -> list[ObjectKey]:
        return [row[0] for row in chunk_keys(hashes, self._label, ranks=1, salt=self._salt)]

    def _take(self, request_id: str, start: int, end: int) -> list[ObjectKey]:
        """The keys of hit chunks [start, end), handed over by the request."""
        locked = self._locked.get(request_id, [])
        keys = locked[start:end]
        if not 0 <= start <= end <= len(locked) or None in keys:
            raise ValueError(f"chunks [{start}, {end}) of {request_id!r} are not held")
        locked[start:end] = [None] * (end - start)
        return [k for k in keys if k is not None]
