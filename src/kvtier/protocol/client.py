"""``CacheClient``: an engine's connection to the node's cache server.

Lookups (LOOKUP, then WAIT or QUERY until the answer), retrieves of hit
chunks, stores and the management calls, over one ``Connection``
(``kvtier.protocol.connection``): any number of calls can be on the wire at
once, a caller does its own socket I/O when the socket is free, and a
background thread keeps the registration (heartbeat, reconnect, restarts).

Never raises into the engine's request path for anything the server or the
network does. A request not answered within its timeout makes the client
degraded: every call then answers at once (lookups miss, stores are
skipped) while the connection tries HELLO again after ``retry_s``, doubling
up to ``max_retry_s`` (1 s by default: a server that comes back is in use
again within about a second). A restart is seen through the boot id or a
``no_hello`` reply; the client registers again and sends the refused request
once more. Local clients copy KV through the shared-memory arena (one copy
each way); others, or ``shm=False``, send bytes in frames.

Thread safety: any thread may call any method.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import msgspec
import numpy as np
import numpy.typing as npt

from kvtier.protocol import messages as p
from kvtier.protocol.connection import Call, ClientConfig, Connection
from kvtier.protocol.status import ServerStatus

log = logging.getLogger(__name__)

ObjectBytes = npt.NDArray[np.uint8]
Consume = Callable[[int, ObjectBytes], None]  # read object i (a view valid during the call)
Fill = Callable[[int, ObjectBytes], None]  # write object i into the given bytes
PIPELINE_BYTES = 32 << 20  # bytes-path stores are sent in messages of about this size


PendingReply = Call  # a request sent without waiting, answered once ``ready``


@dataclass(slots=True)
class LookupState:
    """One request's lookup: submitted -> acked -> pending -> done(n).
    ``hit_chunks`` is None until done; 0 is a miss. Once done it never
    changes, so polling again never counts a hit twice. ``miss_reason`` says
    why the hit ends where it does: the server's ``MissReason`` value, or
    ``refused`` (the server answered with an error), ``no_server`` (no
    answer) or ``over_budget`` (still pending when the caller stopped asking);
    "" for a full hit or while pending."""

    request_id: str
    acked: bool = False
    hit_chunks: int | None = None
    polls: int = 0
    chunks_by_tier: dict[str, int] = field(default_factory=dict)
    miss_reason: str = ""
    _ack: Call | None = None
    _answer: Call | None = None  # the WAIT or QUERY whose reply is awaited

    def settle(self, reply: p.Reply | None) -> None:
        """Take a QUERY/WAIT answer; anything but a result is a miss."""
        if isinstance(reply, p.QueryResult):
            self.hit_chunks, self.chunks_by_tier = reply.hit_chunks, reply.chunks_by_tier
            self.miss_reason = reply.miss_reason
        else:  # an error or no server: a miss, never wait forever
            self.give_up("refused" if isinstance(reply, p.Error) else "no_server")

    def give_up(self, reason: str) -> None:
        """End the lookup as a miss, for ``reason``."""
        self.hit_chunks, self.miss_reason = 0, reason

    @property
    def done(self) -> bool:
        return self.hit_chunks is not None


class CacheClient:
    """Talks to one cache server; see the module docstring."""

    def __init__(self, config: ClientConfig, connect_wait_s: float | None = None) -> None:
        """Connect, waiting up to ``connect_wait_s`` (default: the request
        timeout) for the first HELLO; until it is answered the client is
        degraded."""
        self.config = config
        self._connection = Connection(config, connect_wait_s)
        self.stats = self._connection.stats

    @property
    def chunk_size(self) -> int | None:
        """The server's chunk size; None while unregistered (degraded)."""
        return self._connection.chunk_size

    @property
    def boot_id(self) -> str | None:
        """The id of the server process last registered with (a restart changes it)."""
        return self._connection.boot_id

    @property
    def degraded(self) -> bool:
        return self.chunk_size is None

    @property
    def registering(self) -> bool:
        """Whether its first HELLO is still out: degraded only until the answer."""
        return self._connection.registering

    @property
    def shared_memory(self) -> bool:
        """Whether KV goes through the server's mapped arena (else bytes in frames)."""
        return self._connection.region is not None

    # ---------------------------------------------------------------- lookup

    def lookup(
        self,
        request_id: str,
        hashes: Sequence[bytes],
        group: int = 0,
        wait_s: float = 0.0,
        block_s: float | None = None,
    ) -> LookupState:
        """Start a lookup. With ``wait_s`` a WAIT goes out right behind the
        LOOKUP (one round trip instead of two). Blocks up to ``block_s``
        (default: until the answer, or the ack when there is no WAIT); a
        state not done by then is finished later by ``poll``/``query``. An
        unreachable server makes it a finished miss."""
        state = LookupState(request_id)
        state._ack = self._connection.submit(p.Lookup(request_id, list(hashes), group))
        if wait_s > 0:
            state.polls = 1
            state._answer = self._connection.submit(
                p.Wait(request_id, wait_s), timeout_s=wait_s + self.config.request_timeout_s
            )
        awaited = state._answer or state._ack
        awaited.wait(block_s)
        self._take(state)
        return state

    def poll(self, state: LookupState, wait_s: float = 0.0) -> int | None:
        """The lookup's answer if it has come; never blocks. While pending, a
        WAIT of ``wait_s`` (or a QUERY) is kept in flight so that a later
        poll finds the answer. None while pending; 0 is a miss."""
        self._ask(state, wait_s, self._connection.post)
        return state.hit_chunks

    def query(self, state: LookupState, timeout_s: float = 0.0) -> int | None:
        """The lookup's answer, waiting up to ``timeout_s`` for it (plus one
        round trip); None if still pending then, 0 is a miss."""
        answer = self._ask(state, timeout_s, self._connection.submit)
        if answer is not None:
            answer.wait()
            self._take(state)
        return state.hit_chunks

    def retrieve_with(self, request_id: str, start: int, end: int, consume: Consume) -> bool:
        """Hand each object of hit chunks [start, end) (chunk-major, rank-minor)
        to ``consume(i, view)``, then release their locks. The view is only
        valid during the call: copy out of it. False if anything failed (the
        server refused, or an object has an unexpected size): the engine then
        recomputes those chunks."""
        call = self._connection.submit(p.Retrieve(request_id, start, end))
        reply = call.wait()
        ok = False
        views: list[ObjectBytes] = []
        if isinstance(reply, p.Objects):
            if call.region is not None:
                arena = call.region.array
                views = [arena[o : o + s] for o, s in zip(reply.offsets, reply.sizes, strict=True)]
            else:
                views = [np.frombuffer(f.buffer, np.uint8) for f in call.data]
            ok = len(views) == len(reply.sizes)
        try:
            for i, view in enumerate(views if ok else ()):
                consume(i, view)
        finally:
            self._connection.post(p.Release(request_id, start, end))  # nothing waits for its ack
        return ok

    def retrieve_into(
        self, request_id: str, start: int, end: int, out: Sequence[ObjectBytes]
    ) -> bool:
        """``retrieve_with`` into caller buffers, one per object; False also
        when the objects do not match ``out`` in number or size."""
        targets = [b.reshape(-1).view(np.uint8) for b in out]
        copied = 0

        def copy(i: int, view: ObjectBytes) -> None:
            nonlocal copied
            if i == copied < len(targets) and targets[i].nbytes == view.nbytes:
                np.copyto(targets[i], view)
                copied += 1

        ok = self.retrieve_with(request_id, start, end, copy)
        return ok and copied == len(targets)

    def release(self, request_id: str, start: int, end: int, wait: bool = True) -> None:
        """Drop locks on hit chunks [start, end) the engine will compute itself
        (``wait=False``: send it and go on)."""
        message = p.Release(request_id, start, end)
        if wait:
            self._connection.submit(message).wait()
        else:
            self._connection.post(message)

    def end_session(self, request_id: str, wait: bool = True) -> None:
        message = p.EndSession(request_id)
        if wait:
            self._connection.submit(message).wait()
        else:
            self._connection.post(message)

    def report_usage(
        self, prefill_s: float, computed_tokens: int, load_s: float, loaded_tokens: int
    ) -> None:
        """Tell the server's savings ledger what prefill and loads cost here
        (``UsageReport``); sent without waiting for the ack."""
        self._connection.post(p.UsageReport(prefill_s, computed_tokens, load_s, loaded_tokens))

    def report_shadow(self, checked: int, mismatched: int, unavailable: int = 0) -> None:
        """Tell the server about shadow checks (``kvtier.engine.shadow``);
        sent without waiting for the ack."""
        self._connection.post(p.ShadowReport(checked, mismatched, unavailable))

    def report_quality(self, path: str, agreed: bool, kl: float, off: bool) -> None:
        """Tell the server about one quality-gate sample of a lossy path
        (``kvtier.engine.quality_gate``); sent without waiting for the ack."""
        self._connection.post(p.QualityReport(path, agreed, min(kl, p.MAX_REPORTED_KL), off))

    # ----------------------------------------------------------------- store

    def store(
        self,
        request_id: str,
        hashes: Sequence[bytes],
        buffers: Sequence[ObjectBytes],
        group: int = 0,
    ) -> int:
        """Store one buffer per (chunk, rank), chunk-major; return objects stored
        (0 when degraded: the store is skipped)."""
        if self._connection.region is None:
            return self._send(request_id, hashes, buffers, group)
        sources = [b.reshape(-1).view(np.uint8) for b in buffers]
        return self.store_with(
            request_id,
            hashes,
            [s.nbytes for s in sources],
            lambda i, dst: np.copyto(dst, sources[i]),
            group,
        )

    def store_with(
        self,
        request_id: str,
        hashes: Sequence[bytes],
        sizes: Sequence[int],
        fill: Fill,
        group: int = 0,
    ) -> int:
        """Store one object per (chunk, rank), chunk-major, each written by
        ``fill(i, dst)`` straight into its arena slot (into a buffer on the
        bytes path); objects the server has already are never filled. Returns
        objects stored; 0 when degraded, when the server's object sizes differ
        from ``sizes``, or when ``fill`` raises (the reservation is aborted and
        the exception goes on)."""
        if self._connection.region is None:
            buffers = [np.empty(size, np.uint8) for size in sizes]
            for i, buffer in enumerate(buffers):
                fill(i, buffer)
            return self._send(request_id, hashes, buffers, group)
        call = self._connection.submit(p.StoreReserve(request_id, list(hashes), group))
        reply = call.wait()
        if not isinstance(reply, p.Reserved) or call.region is None:
            return 0
        if list(reply.sizes) != list(sizes):
            log.warning("client: the server's object sizes differ from ours; store skipped")
            self._connection.post(p.StoreAbort(reply.reservation))
            return 0
        arena = call.region.array
        try:
            for i, (offset, size) in enumerate(zip(reply.offsets, reply.sizes, strict=True)):
                if offset >= 0:
                    fill(i, arena[offset : offset + size])
        except BaseException:
            self._connection.post(p.StoreAbort(reply.reservation))
            raise
        done = self._connection.submit(p.StoreCommit(reply.reservation)).wait()
        return done.stored if isinstance(done, p.Committed) else 0

    def _send(
        self, request_id: str, hashes: Sequence[bytes], buffers: Sequence[ObjectBytes], group: int
    ) -> int:
        # Bytes path: several messages in flight, so the server copies one into
        # L1 while the next is still on the wire.
        ranks = max(1, len(buffers) // max(1, len(hashes)))
        per_chunk = sum(b.nbytes for b in buffers[:ranks]) or 1
        step = max(1, PIPELINE_BYTES // per_chunk)
        calls = [
            self._connection.submit(
                p.Store(request_id, list(hashes[i : i + step]), group),
                buffers[i * ranks : (i + step) * ranks],
            )
            for i in range(0, len(hashes), step)
        ]
        replies = [call.wait() for call in calls]
        return sum(r.stored for r in replies if isinstance(r, p.Committed))

    # ------------------------------------------------------------ management

    def ping(self) -> bool:
        """True if the server answered (a restart is noticed and handled by the
        I/O thread)."""
        return isinstance(self._connection.submit(p.Ping()).wait(), p.Pong)

    def status(self) -> ServerStatus | None:
        """The server's status as its tables stand now (not the admin port's
        snapshot); None when it did not answer or refused (STATUS is for admin
        tenants). ``msgspec.ValidationError`` names a field of the server's
        document that does not fit this client's ``ServerStatus``."""
        reply = self._connection.submit(p.Status()).wait()
        if not isinstance(reply, p.StatusReply):
            return None
        return msgspec.convert(reply.status, ServerStatus)

    def pin(
        self, hashes: Sequence[bytes], ttl_s: float, group: int = 0, wait: bool = True
    ) -> p.Pinned | None:
        """Keep these chunks in L1 for ``ttl_s`` (0: unpin them); None when the
        server did not answer or refused (``stats.errors`` says why), or
        without waiting (``wait`` False: the answer is not read)."""
        message = p.Pin(list(hashes), ttl_s, group)
        if not wait:
            self._connection.post(message)
            return None
        reply = self._connection.submit(message).wait()
        return reply if isinstance(reply, p.Pinned) else None

    def handoff(
        self, message: p.HandoffOffer | p.HandoffTake | p.HandoffDone, hold_s: float = 0.0
    ) -> PendingReply:
        """Send a hand-off operation without waiting (``kvtier.server.handoff.table``);
        the answer is the returned call's ``reply`` once it is ``ready``: a
        ``HandoffState``, an ``Error``, or None (no server). ``hold_s``: while
        the connection is down (or drops with it on the wire), keep it that
        long and send it once the server is back (an offer: the server
        answers one sent twice with its state)."""
        return self._connection.post(message, hold_s=hold_s)

    def close(self) -> None:
        """Stop the client's thread and free its descriptors; a second close does nothing."""
        self._connection.close()

    # ------------------------------------------------------ lookup helpers

    def _ask(self, state: LookupState, wait_s: float, send: Callable[..., Call]) -> Call | None:
        """Take the replies that came in; while the lookup is pending, have a
        WAIT of ``wait_s`` (or a QUERY) out for it (``send``: queue it, or
        queue it and wake the socket's holder). The call awaited, if any."""
        self._take(state)
        if state.done:
            return None
        if state._answer is None:
            if state.polls >= self.config.max_polls:
                log.warning(
                    "client: lookup %s still pending after %d polls; a miss",
                    state.request_id,
                    state.polls,
                )
                state.give_up("over_budget")
                return None
            state.polls += 1
            asking = p.Wait(state.request_id, wait_s) if wait_s > 0 else p.Query(state.request_id)
            state._answer = send(asking, timeout_s=wait_s + self.config.request_timeout_s)
        return state._answer

    @staticmethod
    def _take(state: LookupState) -> None:
        """Fold the replies that came in into the state (never blocks)."""
        if state._ack is not None and state._ack.done.is_set():
            if isinstance(state._ack.reply, p.Ack):
                state.acked = True
            else:
                state.settle(state._ack.reply)  # refused, or no server: a miss
            state._ack = None
        answer = state._answer
        if state.done or answer is None or not answer.done.is_set():
            return
        state._answer = None
        if not isinstance(answer.reply, p.QueryResult) or answer.reply.hit_chunks is not None:
            state.settle(answer.reply)


__all__ = [
    "PIPELINE_BYTES",
    "CacheClient",
    "ClientConfig",
    "Consume",
    "Fill",
    "LookupState",
    "ObjectBytes",
    "PendingReply",
]
