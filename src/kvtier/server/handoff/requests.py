"""``HandoffRequests``: the cache server's HANDOFF_OFFER, HANDOFF_TAKE and
HANDOFF_DONE handlers, over the hand-off table (``kvtier.server.handoff.table``,
which holds the states and the reasons).

A take that converts (another TP size or block size) re-shards off the loop
thread (``Deferred``); a take that finds a hand-off offered on another
server looks its chunks up in this server's tiers and is answered when the
lookup settles (``Awaiting``); the lookups of consumers that stopped asking
are dropped on the server's tick.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from kvtier.keys import ObjectKey
from kvtier.protocol import messages as p
from kvtier.protocol.handoff import HandoffOutcome
from kvtier.server.handoff.table import HandoffTable
from kvtier.server.requests import (
    Answer,
    Awaiting,
    Buffer,
    Deferred,
    Outcome,
    group_layout,
    request_keys,
)
from kvtier.server.sessions import Client
from kvtier.storage import StorageManager

FIND_WAIT_S = 1.0  # a find take's lookup settles by then: well within a client's timeout


class HandoffRequests:
    """See the module docstring. ``check_writable`` refuses a client that may
    not store (only a writer offers); ``max_objects`` bounds a request."""

    def __init__(
        self,
        storage: StorageManager,
        table: HandoffTable,
        check_writable: Callable[[Client], None],
        max_objects: int,
    ) -> None:
        self.storage = storage
        self.table = table
        self._check_writable = check_writable
        self._max_objects = max_objects

    def offer(self, client: Client, req: p.HandoffOffer, frames: Sequence[Buffer]) -> Outcome:
        """A producer publishes its committed chunks for one consumer (a writer only)."""
        self._check_writable(client)
        group_layout(client, req.group)
        keys = [k for chunk in self._keys(client, req.hashes, req.group) for k in chunk]
        outcome, why = self.table.offer(
            client,
            req.handoff_id,
            req.hashes,
            keys,
            req.lease_s,
            req.consumer,
            req.group,
            max(req.kv_heads, 0),
        )
        return p.HandoffState(outcome, why), []

    def take(self, client: Client, req: p.HandoffTake, frames: Sequence[Buffer]) -> Outcome:
        keys = self._keys(client, req.hashes, req.group)  # the same checks as any request's
        outcome, why = self.table.take(
            client,
            req.handoff_id,
            req.hashes,
            req.consumer,
            req.source_hashes,
            req.kv_heads,
            req.find,
            req.taker,
        )
        if outcome is HandoffOutcome.FINDING:
            return self._find(client, req, keys)
        if outcome is not HandoffOutcome.CONVERTING:
            return p.HandoffState(outcome, why), []
        conversion = self.table.conversion(
            client, req.handoff_id, [k for chunk in keys for k in chunk]
        )

        def finish(result: tuple[list[bool], str]) -> Answer:
            return p.HandoffState(*self.table.converted(conversion, *result)), []

        return Deferred(lambda: conversion.run(self.storage), finish)

    def done(self, client: Client, req: p.HandoffDone, frames: Sequence[Buffer]) -> Outcome:
        outcome = self.table.done(client, req.handoff_id, req.consumer, req.taker)
        return p.HandoffState(outcome), []

    def drop_stale_lookups(self) -> None:
        """Abandon the lookups of hand-offs whose consumer stopped asking."""
        for lookup in self.table.stale_lookups():
            if lookup.abandon() is not None:  # it came back already: release what it locked
                result = self.storage.collect(lookup, 0.0)
                if result is not None:
                    self.storage.release(list(result.placements))

    def _find(self, client: Client, req: p.HandoffTake, keys: list[list[ObjectKey]]) -> Outcome:
        """Look a hand-off offered on another server up in this server's
        tiers (its chunks come by the shared L2), answered when the lookup
        settles (within ``FIND_WAIT_S``: what has not come by then is looked
        for again by the consumer's next take)."""
        lookup = self.table.lookup_of(req.handoff_id)
        if lookup is None:
            layouts = {req.group: group_layout(client, req.group)}
            lookup = self.storage.submit_lookup(keys, layouts, deadline_s=FIND_WAIT_S)
            self.table.looking(req.handoff_id, lookup)

        def finish() -> Answer:
            if self.table.lookup_of(req.handoff_id) is not lookup:  # another take's answer
                outcome, why = self.table.take(
                    client, req.handoff_id, req.hashes, req.consumer, token=req.taker
                )
                return p.HandoffState(outcome, why), []
            result = self.storage.collect(lookup, 0.0)
            assert result is not None  # settled: this runs once it is
            self.table.looked(req.handoff_id)
            try:
                flat = [k for chunk in keys for k in chunk]
                outcome, why = self.table.found(
                    client,
                    req.handoff_id,
                    req.hashes,
                    flat,
                    req.consumer,
                    req.group,
                    result.hit_chunks,
                    req.taker,
                )
            finally:
                self.storage.release(list(result.placements))  # the hand-off holds its own
            return p.HandoffState(outcome, why), []

        return Awaiting(lookup, finish)

    def _keys(self, client: Client, hashes: list[bytes], group: int) -> list[list[ObjectKey]]:
        return request_keys(client, hashes, group, self._max_objects)


__all__ = ["FIND_WAIT_S", "HandoffRequests"]
