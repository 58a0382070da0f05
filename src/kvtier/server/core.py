"""``CacheServer``: the operations of the shared cache server, without transport.

The transport (``kvtier.server.transport``) feeds it one decoded request at a
time from one thread, with the sender's identity and connection; the session
bookkeeping (``kvtier.server.sessions``) lives on that thread too. Each
operation is one entry of a table from request type to handler::

    LOOKUP ──► pending ──WAIT/QUERY──► done(n) (answered once) ──RETRIEVE──► copy
                                                  │                          │
                                                  └── RELEASE / FREE_LOCKS ◄─┘
    END_SESSION, or the session's or client's time-to-live, releases whatever
    the session still holds (locks, store reservations, a lookup in flight),
    exactly once.

A hit counts only chunks whose objects every rank has (the prefetch fold);
locks on the rest are released before the answer.

Two kinds of failure, kept apart in replies and metrics: a request the
server refuses (``RequestError``: a client's mistake or a limit, counted as
``errors.<code>``), and a fault of the server itself (any other exception:
the transport answers ``internal`` and counts it in ``faults``). A bytes
``Store`` of at least ``offload_bytes`` comes back as ``Deferred``: its copy
into L1 runs on the transport's pool, off the loop thread.

Around it: the checks of what a request names and the outcome types
(``kvtier.server.requests``), the hand-off handlers (``HandoffRequests``,
``kvtier.server.handoff.requests``), the engines' shadow and usage reports
(``EngineReports``, ``kvtier.server.reports``), what ``/status`` remembers of
registered clients (``Registrations``) and the status document itself
(``kvtier.server.status``).
"""

from __future__ import annotations

import logging
import math
import secrets
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import msgspec

from kvtier.counters import Counters
from kvtier.keys import NamespaceLabel, ObjectKey, model_label
from kvtier.l1 import L1Result
from kvtier.protocol import messages as p
from kvtier.protocol.negotiation import ChunkSizeNegotiator
from kvtier.protocol.status import ServerStatus
from kvtier.server.handoff.requests import HandoffRequests
from kvtier.server.handoff.table import HandoffTable
from kvtier.server.limits import RequestError, ServerLimits, check_hello, check_layouts
from kvtier.server.metrics import ServerMetrics
from kvtier.server.quality import QualityBoard
from kvtier.server.registrations import Registrations
from kvtier.server.reports import EngineReports
from kvtier.server.requests import (
    Answer,
    Buffer,
    Deferred,
    Handler,
    Outcome,
    check_range,
    chunk_offsets,
    group_layout,
    hello_layout,
    request_keys,
)
from kvtier.server.sessions import Client, Reservation, SessionTable, shown
from kvtier.server.status import server_status
from kvtier.server.upkeep import Upkeep
from kvtier.server.warmup import Warmup
from kvtier.storage import StorageManager
from kvtier.tenancy.ledger import SavingsLedger
from kvtier.tenancy.purge import PurgeConfig, Purger
from kvtier.tenancy.retention import Retention
from kvtier.tenancy.tenants import TenantTable
from kvtier.tenancy.usage import L2Usage

log = logging.getLogger(__name__)


class CacheServer:
    """Operations over one ``StorageManager``; see the module docstring."""

    def __init__(
        self,
        storage: StorageManager,
        chunk_size: int = 256,
        tenants: TenantTable | None = None,
        limits: ServerLimits | None = None,
        clock: Callable[[], float] = time.monotonic,
        offload_bytes: int = 0,  # 0: every bytes store is copied inline
        purge_state: Path | None = None,  # where purge jobs are kept (resumed after a restart)
        purge: PurgeConfig | None = None,
        default_prefill_s_per_token: float | None = None,  # the ledger's, without reports
        l2_usage: L2Usage | None = None,  # the one whose hooks built the storage, if any
    ) -> None:
        """``storage`` is built with the tenants' ``owners()``; where a tenant
        has an L2 cap, with ``l2_usage``'s hooks too (``kvtier serve`` does
        both)."""
        self.storage = storage
        self.boot_id = secrets.token_hex(8)
        self.chunks = ChunkSizeNegotiator(chunk_size)
        self.limits = limits or ServerLimits()
        self.sessions = SessionTable(storage, self.limits, clock)
        self.offload_bytes = offload_bytes
        self.tenants = tenants or TenantTable.single()
        self._clock = clock  # time-to-live and uptime; latencies use perf_counter
        self.metrics = ServerMetrics()
        self.counters = Counters()  # client errors, faults and work done (any thread)
        self.transport_counters = Counters()  # counted by the transport's threads
        self.on_lookup_done: Callable[[bytes, str], None] | None = None  # (peer, request_id)
        self.publisher_status: Callable[[], dict[str, object]] | None = None  # KV events
        self.warmup = Warmup(storage)  # routing-time prefetch (the admin port's /prefetch)
        self.draining = False  # the admin's drain: stores refused, lookups served
        self.purger = Purger(storage, purge_state, purge)
        self.ledger = SavingsLedger(default_prefill_s_per_token, self.limits.max_namespace_rows)
        self.l2_usage = l2_usage or L2Usage(self.tenants)
        self.l2_usage.watch(storage)
        self.retention = Retention(storage, self.tenants)
        self.upkeep = Upkeep(clock)  # periodic jobs: the transport's tick runs them
        retention, usage = self.retention, self.l2_usage
        if retention.active:  # off the loop: a sweep deletes files, a count lists a disk
            self.upkeep.every("retention", retention.check_s, retention.sweep, on_loop=False)
        if usage.active:
            self.upkeep.every("l2_usage", usage.refresh_s, usage.refresh, on_loop=False)
        self.handoffs = HandoffTable(storage, self.counters, clock, storage.read_lease_s)
        self._handoff_requests = handoff_requests = HandoffRequests(
            storage, self.handoffs, self._check_writable, self.limits.max_objects_per_request
        )
        self._started = clock()
        self.registrations = Registrations()  # what /status shows of registered clients
        self.quality = QualityBoard(self.limits.max_namespace_rows)
        reports = EngineReports(self.counters, self.ledger, self.quality)
        self._handlers: dict[type[p.Message], Handler] = {
            p.Lookup: self._lookup,
            p.Query: self._answer_lookup,
            p.Wait: self._answer_lookup,  # WAIT is QUERY that the transport may park
            p.Retrieve: self._retrieve,
            p.Release: self._release,
            p.StoreReserve: self._store_reserve,
            p.StoreCommit: self._store_commit,
            p.StoreAbort: self._store_abort,
            p.Store: self._store,
            p.EndSession: self._end_session,
            p.Status: self._status,
            p.ShadowReport: reports.shadow,
            p.QualityReport: reports.quality,
            p.Pin: self._pin,
            p.UsageReport: reports.usage,
            p.HandoffOffer: handoff_requests.offer,
            p.HandoffTake: handoff_requests.take,
            p.HandoffDone: handoff_requests.done,
        }

    # ------------------------------------------------------------ dispatch

    def handle(
        self, peer: bytes, request: p.Request, frames: Sequence[Buffer], connection: str = ""
    ) -> Outcome:
        """Run one request from ``peer`` over ``connection`` (the transport's
        id of the connection it came on: registration is bound to it, never to
        the routing id a peer may choose). A refused request is an ``Error``
        reply; anything else that raises is a server fault for the caller."""
        try:
            if isinstance(request, p.Hello):
                return self._hello(peer, connection, request), []
            if isinstance(request, p.Ping):
                self.sessions.touch(peer, connection)
                return p.Pong(self.boot_id), []
            client = self.sessions.client(peer, connection)  # the rest needs a registration
            return self._handlers[type(request)](client, request, frames)
        except RequestError as exc:
            return self.error(exc.code, str(exc)), []

    def error(self, code: str, message: str) -> p.Error:
        """A refusal: an error reply for something a client sent."""
        self.counters.add(f"errors.{code}")
        return p.Error(code, message)

    def fault(self, where: str) -> p.Error:
        """The server failed on a request (the caller logged it): ``internal``."""
        self.counters.add(f"faults.{where}")
        return p.Error("internal", "the server failed on this request")

    # ---------------------------------------------------------- operations

    def _hello(self, peer: bytes, connection: str, hello: p.Hello) -> p.Reply:
        if hello.version != p.PROTOCOL_VERSION:
            raise RequestError(
                "version", f"protocol {hello.version} is not {p.PROTOCOL_VERSION}; upgrade kvtier"
            )
        tenant = self.tenants.authenticate(hello.token)
        if tenant is None:
            raise RequestError("unauthorized", "wrong or missing auth token")
        check_hello(hello)
        access = self.tenants.access(tenant, hello.salt)
        if access is None:
            raise RequestError(
                "forbidden",
                f"tenant {tenant.name!r} may not use salt {shown(hello.salt)}: it owns "
                f"{', '.join(repr(s) for s in tenant.salts)} and may read "
                f"{', '.join(repr(s) for s in tenant.read) or 'nothing else'}",
            )
        try:
            chunk_size = self.chunks.propose(hello.block_alignment)
        except ValueError as exc:  # an alignment that does not fit the frozen size
            raise RequestError("bad_request", str(exc)) from None
        layouts = {
            spec.group: hello_layout(spec, chunk_size, hello.num_ranks) for spec in hello.layouts
        }
        check_layouts(layouts, chunk_size, self.storage.l1_capacity)
        label = model_label(hello.model)
        try:
            namespace = NamespaceLabel(label, access.salt)  # validates model and salt
        except (ValueError, TypeError) as exc:
            raise RequestError("bad_request", str(exc)) from None
        client = Client(
            peer,
            connection,
            hello.client_id,
            label,
            access.salt,
            layouts,
            hello.num_ranks,
            hello.shm,
            hello.rank,
            tenant=tenant.name,
            writable=access.writable,
        )
        self.sessions.register(client)
        self.chunks.freeze(chunk_size)  # only a hello that is accepted fixes it
        self.registrations.registered(client, hello, layouts, chunk_size)
        self.warmup.register(namespace, layouts, hello.num_ranks)
        self.counters.add("hellos")
        arena = self.storage.arena_name if hello.shm else None
        return p.Welcome(
            chunk_size, self.boot_id, arena, salt=access.salt, writable=access.writable
        )

    def _lookup(self, client: Client, req: p.Lookup, frames: Sequence[Buffer]) -> Outcome:
        layout = group_layout(client, req.group)
        keys = self._keys(client, req.hashes, req.group)
        session = self.sessions.open_lookup(client, req.request_id, keys)
        rate = self.ledger.measured_rate(client.tenant, client.namespace)
        per_chunk = None if rate is None else rate * layout.tokens_per_chunk
        try:
            session.handle = self.storage.submit_lookup(
                keys, {req.group: layout}, recompute_s_per_chunk=per_chunk
            )
        except BaseException:
            self.sessions.end(client, req.request_id)
            raise
        session.started = time.perf_counter()
        peer, rid = client.peer, req.request_id
        session.handle.add_done_callback(lambda: self._lookup_done(peer, rid))
        self.counters.add("lookups")
        return p.Ack(), []

    def _lookup_done(self, peer: bytes, request_id: str) -> None:
        notify = self.on_lookup_done  # read now: the transport unsets it when it stops
        if notify is not None:
            notify(peer, request_id)

    def _answer_lookup(
        self, client: Client, req: p.Query | p.Wait, frames: Sequence[Buffer]
    ) -> Outcome:
        """QUERY and WAIT: the lookup's answer, once; None while pending (the
        transport parks a WAIT until the lookup settles or its time is up)."""
        session = self.sessions.session(client, req.request_id)
        if session.answered:
            raise RequestError(
                "consumed", f"the lookup of {shown(session.request_id)} was already answered"
            )
        if session.handle is None:
            raise RequestError("no_lookup", f"session {shown(session.request_id)} has no lookup")
        result = self.storage.collect(session.handle, 0.0)
        if result is None:
            return p.QueryResult(None), []
        looked_up = len(session.keys)
        self.sessions.answer(client, session, result)
        self.metrics.lookup_seconds.observe(time.perf_counter() - session.started)
        chunk = self.chunks.frozen or self.chunks.minimum
        by_tier = result.chunks_by_tier()
        self.counters.add("hit_chunks", result.hit_chunks)
        for tier, chunks in by_tier.items():
            self.counters.add(f"hit_tokens.{tier}", chunks * chunk)
            self.ledger.served(client.tenant, client.namespace, tier, chunks * chunk)
        self.counters.add("lookup_tokens", looked_up * chunk)
        return p.QueryResult(result.hit_chunks, by_tier, result.why), []

    def _retrieve(self, client: Client, req: p.Retrieve, frames: Sequence[Buffer]) -> Outcome:
        started = time.perf_counter()
        session = self.sessions.session(client, req.request_id)
        check_range(session, req.start, req.end, "retrieve")
        keys = [k for chunk in session.keys[req.start : req.end] for k in chunk]
        views = self.storage.retrieve(keys)
        assert session.result is not None  # _check_range: answered
        placements = [session.result.placements[k] for k in keys]
        offsets = [pl.offset if pl.offset is not None else -1 for pl in placements]
        sizes = [pl.size for pl in placements]
        self.counters.add("retrieved_objects", len(keys))
        self.counters.add("retrieved_bytes", sum(sizes))
        self.metrics.retrieve_seconds.observe(time.perf_counter() - started)
        return p.Objects(offsets, sizes), [] if client.shm else views

    def _release(self, client: Client, req: p.Release, frames: Sequence[Buffer]) -> Outcome:
        session = self.sessions.session(client, req.request_id)
        if not session.answered:
            message = f"request {shown(req.request_id)} has no finished lookup"
            raise RequestError("not_ready", message)
        end = min(req.end, len(session.locked))
        if not 0 <= req.start <= end:
            raise RequestError("bad_range", f"release range [{req.start}, {req.end}) is invalid")
        self.sessions.release(session, req.start, end)
        return p.Ack(), []

    def _store_reserve(
        self, client: Client, req: p.StoreReserve, frames: Sequence[Buffer]
    ) -> Outcome:
        self._check_writable(client)
        layout = group_layout(client, req.group)
        keys = [k for chunk in self._keys(client, req.hashes, req.group) for k in chunk]
        self.sessions.room_for_reservation(client)
        session = self.sessions.store_session(client, req.request_id)
        size = layout.object_bytes()
        tag, placements, fence = self.storage.reserve_store(keys, [size] * len(keys), layout)
        already = sum(pl.result is L1Result.NOT_WRITABLE for pl in placements)
        reservation = Reservation(
            client, req.request_id, tag, fence, layout, time.perf_counter(), already
        )
        rid = self.sessions.reserve(client, session, reservation)
        offsets = [
            pl.offset if pl.result is L1Result.SUCCESS and pl.offset is not None else -1
            for pl in placements
        ]
        self.counters.add("store_reserved_objects", len(fence.objects))
        return p.Reserved(rid, offsets, [size] * len(keys)), []

    def _store_commit(
        self, client: Client, req: p.StoreCommit, frames: Sequence[Buffer]
    ) -> Outcome:
        res = self.sessions.take(client, req.reservation)
        stored = len(self.storage.commit_store(res.tag, res.fence, res.layout)) + res.already
        self.metrics.store_seconds.observe(time.perf_counter() - res.started)
        self.counters.add("stored_objects", stored)
        self.counters.add("stored_bytes", stored * res.layout.object_bytes())
        return p.Committed(stored), []

    def _store_abort(self, client: Client, req: p.StoreAbort, frames: Sequence[Buffer]) -> Outcome:
        res = self.sessions.take(client, req.reservation)
        self.storage.abort_store(res.tag, res.fence)
        return p.Ack(), []

    def _store(self, client: Client, req: p.Store, frames: Sequence[Buffer]) -> Outcome:
        self._check_writable(client)
        layout = group_layout(client, req.group)
        keys = [k for chunk in self._keys(client, req.hashes, req.group) for k in chunk]
        if len(frames) != len(keys):
            raise RequestError(
                "bad_request", f"store of {len(keys)} objects came with {len(frames)} data frames"
            )
        size = layout.object_bytes()
        wrong = [i for i, f in enumerate(frames) if memoryview(f).nbytes != size]
        if wrong:
            raise RequestError(
                "bad_request",
                f"data frame {wrong[0]} has {memoryview(frames[wrong[0]]).nbytes} bytes; the "
                f"layout of group {req.group} says {size}",
            )
        started = time.perf_counter()
        data = list(frames)

        def work() -> list[L1Result]:
            return self.storage.store(keys, data, layout)  # thread-safe: storage only

        def finish(results: list[L1Result]) -> Answer:
            stored = sum(r is L1Result.SUCCESS for r in results)
            self.metrics.store_seconds.observe(time.perf_counter() - started)
            self.counters.add("stored_objects", stored)
            self.counters.add("stored_bytes", stored * size)
            return p.Committed(stored), []

        if self.offload_bytes and size * len(keys) >= self.offload_bytes:
            return Deferred(work, finish)
        return finish(work())

    def _pin(self, client: Client, req: p.Pin, frames: Sequence[Buffer]) -> Outcome:
        """Pins count against the namespace owner's cap: only a writer pins."""
        self._check_writable(client)
        if not (math.isfinite(req.ttl_s) and 0 <= req.ttl_s <= self.limits.max_pin_ttl_s):
            raise RequestError(
                "bad_request", f"pin ttl_s must be in [0, {self.limits.max_pin_ttl_s}] seconds"
            )
        keys = self._keys(client, req.hashes, req.group)
        flat = [k for chunk in keys for k in chunk]
        results = self.storage.pin(flat, req.ttl_s)
        per_chunk = [results[i : i + len(c)] for i, c in chunk_offsets(keys)]
        pinned = sum(all(r is L1Result.SUCCESS for r in rs) for rs in per_chunk)
        refused = sum(any(r is L1Result.OVER_QUOTA for r in rs) for rs in per_chunk)
        self.counters.add("pinned_chunks" if req.ttl_s else "unpinned_chunks", pinned)
        self.counters.add("pins_refused", refused)
        return p.Pinned(pinned, len(keys) - pinned - refused, refused), []

    def _end_session(self, client: Client, req: p.EndSession, frames: Sequence[Buffer]) -> Outcome:
        self.sessions.end(client, req.request_id)
        return p.Ack(), []

    def _status(self, client: Client, req: p.Status, frames: Sequence[Buffer]) -> Outcome:
        tenant = self.tenants.tenants.get(client.tenant)
        if tenant is None or not tenant.admin:  # it names every tenant's namespaces
            raise RequestError("forbidden", "STATUS is for admin tenants (tenants file: admin)")
        return p.StatusReply(msgspec.to_builtins(self.status())), []

    # ------------------------------------------------------------- upkeep

    def tick(self) -> None:
        """Expire silent clients, idle sessions and hand-offs past their lease."""
        self.handoffs.expire()
        self._handoff_requests.drop_stale_lookups()
        clients, sessions = self.sessions.expire()
        if clients:
            log.warning("server: %d client(s) went silent; their sessions were released", clients)
        self.counters.add("expired_clients", clients)
        self.counters.add("expired_sessions", sessions)

    def lookup_settled(self, peer: bytes, request_id: str, connection: str = "") -> bool:
        """Whether a WAIT for this lookup can be answered now (done, or unknown:
        then the answer is an error). The transport parks WAITs until then."""
        return self.sessions.lookup_settled(peer, request_id, connection)

    def status(self) -> ServerStatus:
        """What ``/status`` shows (gathered by ``kvtier.server.status``)."""
        return server_status(self, self._clock() - self._started)

    def close(self) -> None:
        """End every session (releasing what it holds); stop purges and usage counts."""
        self.warmup.close()
        self.purger.close()
        self.upkeep.close()
        self.handoffs.close()
        self.sessions.close()

    # ---------------------------------------------------------- internals

    def _check_writable(self, client: Client) -> None:
        """Stores (and pins) need a writable namespace, no drain, no purge of it."""
        if not client.writable:
            raise RequestError(
                "read_only",
                f"tenant {client.tenant!r} may read namespace {client.salt!r} but not store in it",
            )
        if self.draining:
            raise RequestError("draining", "the server is draining: it takes no stores now")
        if self.purger.purging(client.model, client.salt):
            raise RequestError(
                "purging", f"namespace {client.namespace} is being purged; store later"
            )

    def _keys(self, client: Client, hashes: list[bytes], group: int) -> list[list[ObjectKey]]:
        return request_keys(client, hashes, group, self.limits.max_objects_per_request)
