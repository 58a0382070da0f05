"""Prefill-to-decode hand-offs: one request's KV, published by the engine that
prefilled it and held for the engine that decodes it.

::

    OFFER (producer; its stores committed) ──► held: every object read-locked in L1
        │
        ├── TAKE (the expected consumer, once) ──► taken ──DONE──► released ("consumed")
        └── the lease ends first ──────────────────────────────► released ("expired")

A TAKE before the OFFER answers ``pending``: the consumer asks again, and its
own deadline decides when the producer is dead. An OFFER may come twice (the
producer's client sends it again when its connection dropped while the first
was out): the second is answered with the hand-off's state, never held twice.
The taker is the connection its take came on, or the token the take names
(``taker_of``): a consumer's request names one, so that its take sent again
over a new connection (the answer lost with the old one) is still its own.
A taker loads the objects through an ordinary lookup of the same chunks (the
hold keeps them in L1 until then) and sends DONE once its copy is in; a taker
that dies is reclaimed by the lease like any other holder. Each ended
hand-off leaves its outcome behind (the last ``REMEMBERED``), so a late
consumer learns what happened (expired, consumed, taken by another,
incomplete) instead of waiting.

A take names the chunks it expects (its prompt's, under its own namespace):
another model or tenant, another layout (TP size, block size, page format)
or another prompt is refused, never loaded. A consumer whose TP size (or
vLLM CPU block size) alone differs from the producer's may be given its own
rank split and pages instead: its take also names the prompt's chunks under
the producer's layout (its hashes must be the offer's) and the model's KV
heads (the offer's). The server re-shards each chunk by KV heads, re-paging
it if the block sizes differ (``kvtier.layout.reshard``), into objects
under the consumer's keys, off the loop thread
(``kvtier.server.handoff.conversion``), holds them with the hand-off, and
grants it; the taker then loads its own objects. The converted objects are
ordinary cache entries afterwards: engines of the consumer's TP size reuse
them.

Across nodes the producer's server is not the consumer's: the producer's
chunks reach the shared L2 by write-back, and a take that says ``find``
(its producer offered on another server) and names a hand-off this server
never heard of makes this server look the chunks up in its own tiers, L2
included (``FINDING``: the lookup runs like any other, and the take is
answered when it settles). All found: they are
held in L1 as a hand-off of this server's own for this taker (``found``),
which goes on as any other (DONE, the lease). Not all yet (the write-back is
still on its way): ``pending``, and the next take looks again, until the
consumer's wait ends. A single take
holds per server: consumers on two nodes could each load the same prompt
(correct KV either way).

Single-threaded: the server loop calls it, like ``SessionTable``.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from kvtier.controllers import PrefetchHandle
from kvtier.counters import Counters
from kvtier.keys import ObjectKey
from kvtier.l1 import Placement
from kvtier.layout import KVLayout
from kvtier.layout.reshard import check_convertible
from kvtier.protocol.handoff import HandoffOutcome
from kvtier.server.handoff.conversion import Conversion
from kvtier.server.limits import RequestError
from kvtier.server.sessions import Client, shown
from kvtier.storage import StorageManager

REMEMBERED = 4096  # ended hand-offs whose outcome a late taker is told
Taker = tuple[bytes, str, str]  # (peer, connection, consumer name) or (b"", token, consumer name)
MAX_HELD = 4096  # hand-offs held at once


@dataclass(eq=False, slots=True)
class Handoff:
    handoff_id: str
    namespace: tuple[str, str, str]  # tenant, model, salt
    layout: tuple[object, ...]  # the producer's layouts and ranks
    hashes: list[bytes]
    keys: list[ObjectKey]
    consumer: str  # "" for any
    expires: float
    held_bytes: int
    group: int  # the offered objects' group
    source: KVLayout  # the producer's layout of it
    kv_heads: int  # the model's KV heads (0: unknown; no conversion)
    taker: Taker | None = None
    refused: str = ""  # the last take it refused, and why (for the operator's and proxy's view)
    converting: bool = False  # its objects are being re-sharded for the taker
    converted: int = 0  # objects of the taker's layout it holds (the last of ``keys``)


class HandoffTable:
    def __init__(
        self,
        storage: StorageManager,
        counters: Counters,
        clock: Callable[[], float],
        max_lease_s: float,
    ) -> None:
        self._storage = storage
        self._counters = counters
        self._clock = clock
        self.max_lease_s = max_lease_s  # within L1's read lease: the hold never lapses first
        self._held: dict[str, Handoff] = {}
        self._ended: OrderedDict[str, HandoffOutcome] = OrderedDict()
        # Unknown hand-offs being looked for in the tiers: their lookup and its start.
        self._finding: dict[str, tuple[PrefetchHandle, float]] = {}

    def offer(
        self,
        client: Client,
        handoff_id: str,
        hashes: list[bytes],
        keys: Sequence[ObjectKey],
        lease_s: float,
        consumer: str,
        group: int = 0,
        kv_heads: int = 0,
    ) -> tuple[HandoffOutcome, str]:
        self.expire()
        _check_id(handoff_id)
        if not (math.isfinite(lease_s) and 0 < lease_s <= self.max_lease_s):
            raise RequestError(
                "bad_request", f"hand-off lease_s must be in (0, {self.max_lease_s}] seconds"
            )
        again = self._offered_again(client, handoff_id, hashes)
        if again is not None:
            return again
        if len(self._held) >= MAX_HELD:
            raise RequestError("busy", f"{MAX_HELD} hand-offs are held: take or expire some first")
        placements, missing = self._storage.reserve_read_all(keys, client.layouts[group])
        if missing:
            self._end(handoff_id, HandoffOutcome.INCOMPLETE)
            return HandoffOutcome.INCOMPLETE, f"{missing} of {len(keys)} objects are not in L1"
        self._hold(handoff_id, client, hashes, keys, placements, consumer, lease_s, group, kv_heads)
        self._counters.add("handoffs.offered")
        return HandoffOutcome.OFFERED, ""

    def _offered_again(
        self, client: Client, handoff_id: str, hashes: list[bytes]
    ) -> tuple[HandoffOutcome, str] | None:
        """An offer of a known hand-off: the same one sent again (its
        producer's connection dropped while the first was out) is answered
        with the hand-off's state, and one that ended with how it ended (what
        it held is not remembered); another offer under a held one's id is
        refused. None: a new one."""
        held = self._held.get(handoff_id)
        ended = self._ended.get(handoff_id)
        if held is None and ended is None:
            return None
        namespace = (client.tenant, client.model, client.salt)
        if held is not None and (held.namespace, held.hashes) == (namespace, hashes):
            self._counters.add("handoffs.offered_again")
            return HandoffOutcome.OFFERED, "offered already"
        if ended is not None:
            self._counters.add("handoffs.offered_again")
            return ended, "it ended already"
        raise RequestError("bad_request", f"hand-off {shown(handoff_id)} was offered already")

    def take(
        self,
        client: Client,
        handoff_id: str,
        hashes: list[bytes],
        consumer: str,
        source_hashes: Sequence[bytes] = (),
        kv_heads: int = 0,
        find: bool = False,
        token: str = "",
    ) -> tuple[HandoffOutcome, str]:
        """GRANTED to its taker (``token``: see ``taker_of``), CONVERTING
        when the taker's rank split must be made first (``conversion``, then
        ``converted``), FINDING when an unknown hand-off must be looked for in
        the tiers first (then ``found``), else why not."""
        self.expire()
        _check_id(handoff_id)
        handoff = self._held.get(handoff_id)
        if handoff is None:
            ended = self._ended.get(handoff_id)
            if ended is not None:
                return ended, ""
            if not find:
                return HandoffOutcome.PENDING, ""
            if source_hashes:
                return HandoffOutcome.LAYOUT_MISMATCH, (
                    "a hand-off found in a shared tier is not re-sharded: run prefill and "
                    "decode engines on other nodes with the same TP size"
                )
            return HandoffOutcome.FINDING, ""
        refusal = self._refusal(handoff, client, hashes, consumer, source_hashes, kv_heads)
        if refusal is not None:
            self._counters.add(f"handoffs.refused.{refusal[0]}")
            handoff.refused = f"{refusal[0]}: {refusal[1]}"
            return refusal
        taker = taker_of(client, consumer, token)
        if handoff.taker is not None and handoff.taker != taker:
            self._counters.add("handoffs.refused.taken")
            return HandoffOutcome.TAKEN, "another consumer took it"
        if handoff.converting:
            return HandoffOutcome.PENDING, "its objects are being re-sharded"
        first = handoff.taker is None
        if first:
            handoff.taker = taker
            self._counters.add("handoffs.taken")
        if _layout_of(client) != handoff.layout and (first or not handoff.converted):
            handoff.converting = True
            return HandoffOutcome.CONVERTING, ""
        return HandoffOutcome.GRANTED, ""

    def conversion(self, client: Client, handoff_id: str, keys: list[ObjectKey]) -> Conversion:
        """What a CONVERTING take needs done: ``keys`` are the taker's
        objects (chunk-major), the same chunks as the offer's."""
        handoff = self._held[handoff_id]
        target = client.layouts[handoff.group]
        return Conversion(
            handoff_id, list(handoff.keys), handoff.source, keys, target, handoff.kv_heads
        )

    def converted(
        self, conversion: Conversion, stored: Sequence[bool], why: str
    ) -> tuple[HandoffOutcome, str]:
        """The re-sharded objects are stored (``stored``: each in L1, else
        ``why`` not): hold them with the hand-off and grant it, or say why
        not (its taker's policy then decides)."""
        handoff = self._held.get(conversion.handoff_id)
        if handoff is None:
            outcome = self._ended.get(conversion.handoff_id, HandoffOutcome.EXPIRED)
            return outcome, "it ended while its objects were re-sharded"
        handoff.converting = False
        if not all(stored):
            self._counters.add("handoffs.reshard_failed")
            return HandoffOutcome.INCOMPLETE, why
        placements, missing = self._storage.reserve_read_all(conversion.keys, conversion.target)
        if missing:
            self._counters.add("handoffs.reshard_failed")
            return HandoffOutcome.INCOMPLETE, "re-sharded objects were evicted before the take"
        handoff.keys += conversion.keys
        handoff.converted = len(conversion.keys)
        handoff.held_bytes += sum(pl.size for pl in placements)
        self._counters.add("handoffs.resharded")
        return HandoffOutcome.GRANTED, ""

    def found(
        self,
        client: Client,
        handoff_id: str,
        hashes: list[bytes],
        keys: list[ObjectKey],
        consumer: str,
        group: int,
        hit_chunks: int,
        token: str = "",
    ) -> tuple[HandoffOutcome, str]:
        """A FINDING take's lookup came back with ``hit_chunks`` of the
        prompt's chunks locked (the caller releases that lookup after
        this): all of them become a hand-off held here for this taker."""
        if handoff_id in self._held or handoff_id in self._ended:
            return HandoffOutcome.PENDING, "offered here meanwhile: ask again"
        if hit_chunks < len(hashes):
            return HandoffOutcome.PENDING, (
                f"{hit_chunks} of {len(hashes)} chunks are in this server's tiers so far"
            )
        if len(self._held) >= MAX_HELD:
            return HandoffOutcome.PENDING, f"{MAX_HELD} hand-offs are held here: ask again"
        # The lookup's locks keep them.
        placements, missing = self._storage.reserve_read_all(keys, client.layouts[group])
        if missing:
            return HandoffOutcome.PENDING, "its chunks left L1 as soon as they were found"
        lease_s, taker = self.max_lease_s, taker_of(client, consumer, token)
        self._hold(handoff_id, client, hashes, keys, placements, consumer, lease_s, group, 0, taker)
        self._counters.add("handoffs.found")
        return HandoffOutcome.GRANTED, ""

    def _hold(
        self,
        handoff_id: str,
        client: Client,
        hashes: Sequence[bytes],
        keys: Sequence[ObjectKey],
        placements: Sequence[Placement],
        consumer: str,
        lease_s: float,
        group: int,
        kv_heads: int,
        taker: Taker | None = None,
    ) -> None:
        """Hold ``keys`` (read-locked at ``placements``) as hand-off
        ``handoff_id`` of ``client``'s namespace, for ``lease_s`` from now."""
        self._held[handoff_id] = Handoff(
            handoff_id,
            (client.tenant, client.model, client.salt),
            _layout_of(client),
            list(hashes),
            list(keys),
            consumer,
            self._clock() + lease_s,
            sum(p.size for p in placements),
            group,
            client.layouts[group],
            kv_heads,
            taker=taker,
        )

    def lookup_of(self, handoff_id: str) -> PrefetchHandle | None:
        """The lookup a FINDING take started for ``handoff_id`` (None: none yet)."""
        entry = self._finding.get(handoff_id)
        return None if entry is None else entry[0]

    def looking(self, handoff_id: str, lookup: PrefetchHandle) -> None:
        """A FINDING take started ``lookup``; the next takes ask how it went."""
        if len(self._finding) >= MAX_HELD:
            raise RequestError("busy", f"{MAX_HELD} hand-offs are looked for: ask again")
        self._finding[handoff_id] = (lookup, self._clock())

    def looked(self, handoff_id: str) -> None:
        """Its lookup came back (its result taken)."""
        self._finding.pop(handoff_id, None)

    def stale_lookups(self) -> list[PrefetchHandle]:
        """Lookups no take has asked after within the lease (their consumer
        is gone): dropped here, for the caller to abandon."""
        due = self._clock() - self.max_lease_s
        stale = [h for h, (_, started) in self._finding.items() if started <= due]
        return [self._finding.pop(h)[0] for h in stale]

    def done(
        self, client: Client, handoff_id: str, consumer: str, token: str = ""
    ) -> HandoffOutcome:
        """The taker has its copy: drop the hold."""
        self.expire()
        _check_id(handoff_id)
        handoff = self._held.get(handoff_id)
        if handoff is None:
            return self._ended.get(handoff_id, HandoffOutcome.PENDING)
        if handoff.taker != taker_of(client, consumer, token):
            return HandoffOutcome.WRONG_CONSUMER
        self._release(handoff, HandoffOutcome.CONSUMED)
        return HandoffOutcome.RELEASED

    def expire(self) -> int:
        """Release the hand-offs whose lease has ended; how many."""
        now = self._clock()
        due = [h for h in self._held.values() if h.expires <= now]
        for handoff in due:
            self._release(handoff, HandoffOutcome.EXPIRED)
        return len(due)

    def fate(self, handoff_id: str) -> dict[str, object]:
        """What became of a hand-off: held (taken or not, the last take it
        refused), ended (how), or unknown (never offered, or long ago). The
        admin thread calls it: single dict lookups only."""
        handoff = self._held.get(handoff_id)
        if handoff is not None:
            taken = handoff.taker is not None
            return {"state": "held", "taken": taken, "refused": handoff.refused}
        outcome = self._ended.get(handoff_id)
        if outcome is not None:
            return {"state": "ended", "outcome": str(outcome)}
        return {"state": "unknown"}

    def status(self) -> dict[str, object]:
        return {
            "held": len(self._held),
            "held_bytes": sum(h.held_bytes for h in self._held.values()),
            "taken": sum(h.taker is not None for h in self._held.values()),
        }

    def close(self) -> None:
        """Drop every hold (the server is stopping)."""
        for handoff in list(self._held.values()):
            self._release(handoff, HandoffOutcome.EXPIRED)

    # ------------------------------------------------------------ internals

    def _refusal(
        self,
        handoff: Handoff,
        client: Client,
        hashes: list[bytes],
        consumer: str,
        source_hashes: Sequence[bytes],
        kv_heads: int,
    ) -> tuple[HandoffOutcome, str] | None:
        if handoff.consumer and consumer != handoff.consumer:
            return HandoffOutcome.WRONG_CONSUMER, f"it is held for {shown(handoff.consumer)}"
        if (client.tenant, client.model, client.salt) != handoff.namespace:
            return HandoffOutcome.NAMESPACE_MISMATCH, "it was published under another namespace"
        if _layout_of(client) == handoff.layout:
            if hashes != handoff.hashes:
                return HandoffOutcome.PROMPT_MISMATCH, "its chunks are not the consumer's prompt"
            return None
        why = self._not_convertible(handoff, client, source_hashes, kv_heads)
        if why is not None:
            return HandoffOutcome.LAYOUT_MISMATCH, why
        if list(source_hashes) != handoff.hashes or len(hashes) != len(source_hashes):
            return HandoffOutcome.PROMPT_MISMATCH, "its chunks are not the consumer's prompt"
        return None

    @staticmethod
    def _not_convertible(
        handoff: Handoff, client: Client, source_hashes: Sequence[bytes], kv_heads: int
    ) -> str | None:
        """Why the producer's objects cannot be re-sharded for this taker."""
        base = (
            "the producer's layout (TP size, block size or page format) differs from the consumer's"
        )
        if not source_hashes or not kv_heads or kv_heads != handoff.kv_heads:
            return f"{base}; it cannot be loaded as it is"
        if client.rank >= 0:
            return f"{base}, and the taker speaks for one rank only: re-sharding needs all"
        if not client.writable:
            return f"{base}, and re-sharding stores objects the consumer's tenant may not write"
        target = client.layouts.get(handoff.group)
        try:
            if target is None:
                raise ValueError("the consumer registered no layout for the offered group")
            check_convertible(handoff.source, target, kv_heads)
        except ValueError as error:
            return f"{base}: {error}"
        return None

    def _release(self, handoff: Handoff, outcome: HandoffOutcome) -> None:
        del self._held[handoff.handoff_id]
        self._storage.finish_read(handoff.keys)
        self._end(handoff.handoff_id, outcome)

    def _end(self, handoff_id: str, outcome: HandoffOutcome) -> None:
        self._ended[handoff_id] = outcome
        while len(self._ended) > REMEMBERED:
            self._ended.popitem(last=False)
        self._counters.add(f"handoffs.{outcome}")


def taker_of(client: Client, consumer: str, token: str) -> Taker:
    """Who takes: the consumer's token for its request when its take names
    one (the same over the consumer's new connection after a dropped one),
    else the connection it came on."""
    if len(token) > 256:
        raise RequestError("bad_request", "a take's taker token has at most 256 characters")
    return (b"", token, consumer) if token else (client.peer, client.connection, consumer)


def _check_id(handoff_id: str) -> None:
    if not 0 < len(handoff_id) <= 256:
        raise RequestError("bad_request", "a hand-off id has 1 to 256 characters")


def _layout_of(client: Client) -> tuple[object, ...]:
    return (client.num_ranks, client.rank, tuple(sorted(client.layouts.items())))
