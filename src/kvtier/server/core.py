"""``CacheServer``: the operations of the shared cache server, without transport.

The transport (``kvtier.server.transport``) feeds it one decoded request at a
time from one thread, with the sender's identity; every method here runs on
that thread, so the tables below need no lock. Sessions::

    LOOKUP ──► pending ──QUERY/WAIT──► done(n) (consumed once) ──RETRIEVE──► copy
                                                   │                          │
                                                   └── RELEASE / FREE_LOCKS ◄─┘
    END_SESSION, or the session's or client's time-to-live, releases whatever
    the session still holds (locks, store reservations, a lookup in flight),
    exactly once.

A hit counts only chunks whose objects every rank has (the prefetch fold);
locks on the rest are released before the answer.
"""

from __future__ import annotations

import dataclasses
import hmac
import itertools
import logging
import secrets
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np
import numpy.typing as npt

from kvtier.controllers import LookupResult, PrefetchHandle
from kvtier.counters import Counters
from kvtier.keys import HASH_BYTES, ObjectKey, chunk_keys, model_label
from kvtier.l1 import IOFence, L1Result, WriterTag
from kvtier.layout import KVLayout
from kvtier.server import protocol as p
from kvtier.server.limits import (
    MAX_TEXT_CHARS,
    RequestError,
    ServerLimits,
    check_hello,
    check_layouts,
)
from kvtier.server.metrics import ServerMetrics
from kvtier.server.negotiation import ChunkSizeNegotiator
from kvtier.storage import StorageManager

log = logging.getLogger(__name__)

Frames = list[npt.NDArray[np.uint8]]
LAYOUTS_SEEN = 64  # namespaces whose layouts /status shows
Buffer = bytes | memoryview


@dataclass(eq=False)
class _Session:
    request_id: str
    keys: list[list[ObjectKey]]  # per chunk, per rank; cut to the hit once answered
    objects: int = 0  # objects in ``keys``, counted against the session limits
    handle: PrefetchHandle | None = None
    result: LookupResult | None = None
    answered: bool = False
    locked: list[bool] = field(default_factory=list)  # per hit chunk: lock still held
    reservations: set[int] = field(default_factory=set)
    touched: float = 0.0
    started: float = 0.0  # when the lookup was submitted


@dataclass(eq=False)
class _Reservation:
    client: _Client
    request_id: str
    tag: WriterTag
    fence: IOFence
    layout: KVLayout
    started: float
    already: int  # objects that were resident already (counted as stored, as the bytes path does)


@dataclass(eq=False)
class _Client:
    peer: bytes
    connection: str  # the transport's id of the connection that said hello
    client_id: str
    model: str
    salt: str
    layouts: dict[int, KVLayout]
    num_ranks: int
    shm: bool
    rank: int = -1  # -1: every rank's objects; r: rank r's only
    sessions: dict[str, _Session] = field(default_factory=dict)
    objects: int = 0  # objects named by its sessions
    reservations: int = 0
    last_seen: float = 0.0


def _shown(text: str) -> str:
    """A client's string in an error message, cut short: replies stay small."""
    return repr(text) if len(text) <= 80 else repr(text[:80]) + f"... ({len(text)} characters)"


def _check_request_id(request_id: str) -> None:
    if not request_id or len(request_id) > MAX_TEXT_CHARS:
        raise RequestError("bad_request", f"request_id must be 1-{MAX_TEXT_CHARS} characters")


class CacheServer:
    """Operations by name over one ``StorageManager``; see the module docstring."""

    def __init__(
        self,
        storage: StorageManager,
        chunk_size: int = 256,
        auth_token: str = "",
        limits: ServerLimits | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.storage = storage
        self.boot_id = secrets.token_hex(8)
        self.chunks = ChunkSizeNegotiator(chunk_size)
        self.limits = limits or ServerLimits()
        self._token = auth_token
        self._clock = clock
        self._clients: dict[bytes, _Client] = {}
        self._reservations: dict[int, _Reservation] = {}
        self._reservation_ids = itertools.count(1)
        self._session_objects = 0  # objects named by every client's sessions
        self.metrics = ServerMetrics()
        self.counters: dict[str, int] = {}
        self.transport_counters = Counters()  # counted by the transport's threads
        self._started = clock()
        # namespace -> its layouts, for /status (kvtier plan --from-server); the
        # most recent LAYOUTS_SEEN namespaces, whether or not still connected
        self._layouts_seen: OrderedDict[str, dict[str, object]] = OrderedDict()

    # ------------------------------------------------------------ dispatch

    def handle(
        self, peer: bytes, request: p.Request, frames: Sequence[Buffer], connection: str = ""
    ) -> tuple[p.Reply, Frames]:
        """Run one request from ``peer`` over ``connection`` (the transport's
        id of the connection it came on: registration is bound to it, never
        to the routing id a peer may choose); never raises for anything a
        client can send."""
        op = type(request).__name__
        try:
            if isinstance(request, p.Hello):
                return self._hello(peer, connection, request), []
            if isinstance(request, p.Ping):
                self._touch_client(peer, connection)
                return p.Pong(self.boot_id), []
            client = self._client(peer, connection)  # the rest needs a registered client
            if isinstance(request, p.Status):
                return p.StatusReply(self.status()), []
            handler = getattr(self, f"_op_{type(request).__name__.lower()}")
            return handler(client, request, frames)  # type: ignore[no-any-return]
        except RequestError as exc:
            self._count(f"errors.{exc.code}")
            return p.Error(exc.code, str(exc)), []
        except ValueError as exc:
            self._count("errors.bad_request")
            return p.Error("bad_request", f"{op}: {exc}"), []

    def error(self, code: str, message: str) -> p.Error:
        """An error reply for requests that could not be decoded."""
        self._count(f"errors.{code}")
        return p.Error(code, message)

    # ---------------------------------------------------------- operations

    def _hello(self, peer: bytes, connection: str, hello: p.Hello) -> p.Reply:
        if hello.version != p.PROTOCOL_VERSION:
            raise RequestError(
                "version", f"protocol {hello.version} is not {p.PROTOCOL_VERSION}; upgrade kvtier"
            )
        # Bytes: compare_digest refuses a str with non-ASCII characters.
        if self._token and not hmac.compare_digest(hello.token.encode(), self._token.encode()):
            raise RequestError("unauthorized", "wrong or missing auth token")
        check_hello(hello)
        if peer not in self._clients and len(self._clients) >= self.limits.max_clients:
            raise RequestError(
                "busy", f"the server has {len(self._clients)} clients, its limit; try again later"
            )
        chunk_size = self.chunks.propose(hello.block_alignment)
        layouts = {
            spec.group: KVLayout(
                spec.num_layers,
                spec.kv_heads,
                spec.head_dim,
                spec.dtype,
                chunk_size,
                kind=spec.kind,  # type: ignore[arg-type]
                num_ranks=hello.num_ranks,
                format=spec.format,
            )
            for spec in hello.layouts
        }
        check_layouts(layouts, chunk_size, self.storage.l1.capacity)
        label = model_label(hello.model)
        ObjectKey(bytes(HASH_BYTES), label, 0, 0, hello.salt)  # validates model and salt
        self.chunks.freeze(chunk_size)  # only a hello that is accepted fixes it
        old = self._clients.pop(peer, None)
        if old is not None:
            self._drop_client(old)
        client = _Client(
            peer,
            connection,
            hello.client_id,
            label,
            hello.salt,
            layouts,
            hello.num_ranks,
            hello.shm,
            hello.rank,
        )
        client.last_seen = self._clock()
        self._clients[peer] = client
        self._remember_layouts(client)
        self._count("hellos")
        arena = self.storage.l1.arena_name if hello.shm else None
        return p.Welcome(chunk_size, self.boot_id, arena)

    def _op_lookup(
        self, client: _Client, req: p.Lookup, frames: Sequence[Buffer]
    ) -> tuple[p.Reply, Frames]:
        layout = self._layout(client, req.group)
        _check_request_id(req.request_id)
        keys = self._keys(client, req.hashes, req.group)
        old = client.sessions.get(req.request_id)
        self._check_room(client, len(keys) * len(keys[0]) if keys else 0, old)
        handle = self.storage.submit_lookup(keys, {req.group: layout})  # may refuse the keys
        session = self._new_session(client, req.request_id, keys)
        session.handle = handle
        session.started = time.monotonic()
        self._count("lookups")
        return p.Ack(), []

    def _op_query(
        self, client: _Client, req: p.Query, frames: Sequence[Buffer]
    ) -> tuple[p.Reply, Frames]:
        return self._poll(client, self._session(client, req.request_id), 0.0), []

    def _op_wait(
        self, client: _Client, req: p.Wait, frames: Sequence[Buffer]
    ) -> tuple[p.Reply, Frames]:
        # The transport parks a WAIT until ``lookup_settled`` or its timeout, so
        # answering never blocks the loop: still pending at the deadline is None.
        return self._poll(client, self._session(client, req.request_id), 0.0), []

    def _op_retrieve(
        self, client: _Client, req: p.Retrieve, frames: Sequence[Buffer]
    ) -> tuple[p.Reply, Frames]:
        started = time.monotonic()
        session = self._session(client, req.request_id)
        self._check_range(session, req.start, req.end, "retrieve")
        keys = [k for chunk in session.keys[req.start : req.end] for k in chunk]
        views = self.storage.retrieve(keys)
        assert session.result is not None
        placements = [session.result.placements[k] for k in keys]
        offsets = [pl.offset if pl.offset is not None else -1 for pl in placements]
        sizes = [pl.size for pl in placements]
        self._count("retrieved_objects", len(keys))
        self.metrics.retrieve_seconds.observe(time.monotonic() - started)
        return p.Objects(offsets, sizes), [] if client.shm else views

    def _op_release(
        self, client: _Client, req: p.Release, frames: Sequence[Buffer]
    ) -> tuple[p.Reply, Frames]:
        session = self._session(client, req.request_id)
        if session.result is None or not session.answered:
            raise RequestError(
                "not_ready", f"request {_shown(req.request_id)} has no finished lookup"
            )
        end = min(req.end, len(session.locked))
        if not 0 <= req.start <= end:
            raise RequestError("bad_range", f"release range [{req.start}, {req.end}) is invalid")
        self._release(session, req.start, end)
        return p.Ack(), []

    def _op_storereserve(
        self, client: _Client, req: p.StoreReserve, frames: Sequence[Buffer]
    ) -> tuple[p.Reply, Frames]:
        layout = self._layout(client, req.group)
        keys = [k for chunk in self._keys(client, req.hashes, req.group) for k in chunk]
        if client.reservations >= self.limits.max_reservations_per_client:
            raise RequestError(
                "busy",
                f"{client.reservations} store reservations are open, the limit; commit or abort "
                "them first",
            )
        session = self._session_for_store(client, req.request_id)  # validates the id
        tag, placements, fence = self.storage.reserve_store(
            keys, [layout.object_bytes()] * len(keys), layout
        )
        rid = next(self._reservation_ids)
        already = sum(pl.result is L1Result.NOT_WRITABLE for pl in placements)
        self._reservations[rid] = _Reservation(
            client, req.request_id, tag, fence, layout, time.monotonic(), already
        )
        session.reservations.add(rid)
        client.reservations += 1
        offsets = [
            pl.offset if pl.result is L1Result.SUCCESS and pl.offset is not None else -1
            for pl in placements
        ]
        self._count("store_reserved_objects", len(fence.objects))
        return p.Reserved(rid, offsets, [layout.object_bytes()] * len(keys)), []

    def _op_storecommit(
        self, client: _Client, req: p.StoreCommit, frames: Sequence[Buffer]
    ) -> tuple[p.Reply, Frames]:
        res = self._take_reservation(client, req.reservation)
        stored = len(self.storage.commit_store(res.tag, res.fence, res.layout)) + res.already
        self.metrics.store_seconds.observe(time.monotonic() - res.started)
        self._count("stored_objects", stored)
        return p.Committed(stored), []

    def _op_storeabort(
        self, client: _Client, req: p.StoreAbort, frames: Sequence[Buffer]
    ) -> tuple[p.Reply, Frames]:
        res = self._take_reservation(client, req.reservation)
        self.storage.abort_store(res.tag, res.fence)
        return p.Ack(), []

    def _op_store(
        self, client: _Client, req: p.Store, frames: Sequence[Buffer]
    ) -> tuple[p.Reply, Frames]:
        layout = self._layout(client, req.group)
        keys = [k for chunk in self._keys(client, req.hashes, req.group) for k in chunk]
        if len(frames) != len(keys):
            raise RequestError(
                "bad_request", f"store of {len(keys)} objects came with {len(frames)} data frames"
            )
        with self.metrics.store_seconds.time():
            results = self.storage.store(keys, list(frames), layout)
        stored = sum(r is L1Result.SUCCESS for r in results)
        self._count("stored_objects", stored)
        return p.Committed(stored), []

    def _op_endsession(
        self, client: _Client, req: p.EndSession, frames: Sequence[Buffer]
    ) -> tuple[p.Reply, Frames]:
        session = client.sessions.pop(req.request_id, None)
        if session is None:
            raise RequestError("no_session", f"no session {_shown(req.request_id)}")
        self._end(client, session)
        return p.Ack(), []

    # ------------------------------------------------------------- upkeep

    def tick(self) -> None:
        """Expire silent clients and idle sessions."""
        now = self._clock()
        for client in list(self._clients.values()):
            if now - client.last_seen > self.limits.client_ttl_s:
                log.warning(
                    "server: client %s went silent; releasing its sessions", client.client_id
                )
                self._count("expired_clients")
                del self._clients[client.peer]
                self._drop_client(client)
                continue
            for session in list(client.sessions.values()):
                if now - session.touched > self.limits.session_ttl_s:
                    self._count("expired_sessions")
                    del client.sessions[session.request_id]
                    self._end(client, session)

    def lookup_settled(self, peer: bytes, request_id: str, connection: str = "") -> bool:
        """Whether a WAIT for this lookup can be answered now (done, or unknown:
        then the answer is an error). The transport parks WAITs until then."""
        client = self._clients.get(peer)
        if client is None or client.connection != connection:
            return True
        session = client.sessions.get(request_id)
        return session is None or session.handle is None or session.handle.result() is not None

    def status(self) -> dict[str, object]:
        return {
            "boot_id": self.boot_id,
            "protocol": p.PROTOCOL_VERSION,
            "hash_algorithm": p.HASH_ALGORITHM,
            "chunk_size": self.chunks.frozen or self.chunks.minimum,
            "chunk_size_frozen": self.chunks.frozen is not None,
            "clients": len(self._clients),
            "sessions": sum(len(c.sessions) for c in self._clients.values()),
            "session_objects": self._session_objects,
            "store_reservations": len(self._reservations),
            "uptime_s": self._clock() - self._started,
            "namespaces": sorted({f"{c.model}@{c.salt}" for c in self._clients.values()}),
            "layouts": dict(self._layouts_seen),
            "server": dict(self.counters),
            "transport": self.transport_counters.snapshot(),
            "storage": self.storage.status(),
        }

    def close(self) -> None:
        """End every session (releasing what it holds)."""
        for client in list(self._clients.values()):
            self._drop_client(client)
        self._clients.clear()

    # ---------------------------------------------------------- internals

    def _client(self, peer: bytes, connection: str) -> _Client:
        client = self._clients.get(peer)
        if client is None or client.connection != connection:
            raise RequestError("no_hello", "send hello first (or again, after a server restart)")
        client.last_seen = self._clock()
        return client

    def _remember_layouts(self, client: _Client) -> None:
        namespace = f"{client.model}@{client.salt}"
        self._layouts_seen.pop(namespace, None)
        self._layouts_seen[namespace] = {
            str(group): dataclasses.asdict(layout) for group, layout in client.layouts.items()
        }
        while len(self._layouts_seen) > LAYOUTS_SEEN:
            self._layouts_seen.popitem(last=False)

    def _touch_client(self, peer: bytes, connection: str) -> None:
        client = self._clients.get(peer)
        if client is not None and client.connection == connection:
            client.last_seen = self._clock()

    def _layout(self, client: _Client, group: int) -> KVLayout:
        layout = client.layouts.get(group)
        if layout is None:
            raise RequestError("bad_request", f"group {group} was not registered in hello")
        return layout

    def _keys(self, client: _Client, hashes: list[bytes], group: int) -> list[list[ObjectKey]]:
        ranks = client.num_ranks if client.rank < 0 else 1
        limit = self.limits.max_objects_per_request
        if len(hashes) * ranks > limit:
            raise RequestError(
                "bad_request",
                f"{len(hashes)} chunks x {ranks} ranks in one request; the limit is {limit} "
                "objects: split the request",
            )
        keys = chunk_keys(hashes, client.model, client.num_ranks, group, client.salt)
        return keys if client.rank < 0 else [[chunk[client.rank]] for chunk in keys]

    def _check_room(self, client: _Client, objects: int, replaced: _Session | None) -> None:
        """Refuse a new session past the session limits (``replaced``: the
        session of the same id that it would end)."""
        freed = 0 if replaced is None else replaced.objects
        sessions = len(client.sessions) - (replaced is not None)
        if sessions >= self.limits.max_sessions_per_client:
            raise RequestError(
                "busy", f"{sessions} sessions are open, the limit; end some (END_SESSION) first"
            )
        mine = client.objects - freed + objects
        total = self._session_objects - freed + objects
        if mine > self.limits.max_session_objects_per_client or total > (
            self.limits.max_session_objects
        ):
            raise RequestError(
                "busy",
                f"open sessions would name {mine} objects of this client and {total} in all; the "
                f"limits are {self.limits.max_session_objects_per_client} and "
                f"{self.limits.max_session_objects}: end sessions first",
            )

    def _new_session(
        self, client: _Client, request_id: str, keys: list[list[ObjectKey]]
    ) -> _Session:
        _check_request_id(request_id)
        old = client.sessions.pop(request_id, None)
        if old is not None:
            self._end(client, old)
        session = _Session(request_id, keys, touched=self._clock())
        client.sessions[request_id] = session
        self._hold(client, session, len(keys) * len(keys[0]) if keys else 0)
        return session

    def _hold(self, client: _Client, session: _Session, objects: int) -> None:
        """Count ``objects`` more (or fewer) named by ``session``."""
        session.objects += objects
        client.objects += objects
        self._session_objects += objects

    def _session_for_store(self, client: _Client, request_id: str) -> _Session:
        session = client.sessions.get(request_id)
        if session is None:
            self._check_room(client, 0, None)
            session = self._new_session(client, request_id, [])
        session.touched = self._clock()
        return session

    def _session(self, client: _Client, request_id: str) -> _Session:
        session = client.sessions.get(request_id)
        if session is None:
            raise RequestError("no_session", f"no session {_shown(request_id)}; send lookup first")
        session.touched = self._clock()
        return session

    def _poll(self, client: _Client, session: _Session, timeout: float) -> p.QueryResult:
        if session.answered:
            raise RequestError(
                "consumed", f"the lookup of {_shown(session.request_id)} was already answered"
            )
        if session.handle is None:
            raise RequestError("no_lookup", f"session {_shown(session.request_id)} has no lookup")
        result = self.storage.collect(session.handle, timeout)
        if result is None:
            return p.QueryResult(None)
        session.result = result
        session.answered = True
        session.locked = [True] * result.hit_chunks
        looked_up = len(session.keys)
        ranks = len(session.keys[0]) if session.keys else 1
        del session.keys[result.hit_chunks :]  # only the hit is named from now on
        self._hold(client, session, -(looked_up - result.hit_chunks) * ranks)
        self.metrics.lookup_seconds.observe(time.monotonic() - session.started)
        self._count("hit_chunks", result.hit_chunks)
        chunk = self.chunks.frozen or self.chunks.minimum
        tiers = {tier: objects // ranks for tier, objects in result.objects_by_tier.items()}
        for tier, chunks in tiers.items():
            self._count(f"hit_tokens.{tier}", chunks * chunk)
        self._count("lookup_tokens", looked_up * chunk)
        return p.QueryResult(result.hit_chunks, tiers)

    def _check_range(self, session: _Session, start: int, end: int, what: str) -> None:
        if session.result is None or not session.answered:
            raise RequestError("not_ready", f"{what}: the lookup has not been answered yet")
        if not 0 <= start < end <= len(session.locked):
            raise RequestError(
                "bad_range",
                f"{what} range [{start}, {end}) is outside the hit of {len(session.locked)}",
            )
        if not all(session.locked[start:end]):
            raise RequestError("released", f"{what}: part of [{start}, {end}) was released")

    def _release(self, session: _Session, start: int, end: int) -> None:
        keys = [k for i in range(start, end) if session.locked[i] for k in session.keys[i]]
        for i in range(start, end):
            session.locked[i] = False
        if keys:
            self.storage.release(keys)

    def _end(self, client: _Client, session: _Session) -> None:
        """Release whatever ``session`` holds (it is already out of ``client``'s table)."""
        self._hold(client, session, -session.objects)
        if session.answered:
            self._release(session, 0, len(session.locked))
        elif session.handle is not None:
            late = session.handle.abandon()  # a result that comes later is released for us
            if late is not None and self.storage.collect(session.handle, 0) is not None:
                self.storage.release(list(late.placements))
        for rid in list(session.reservations):
            res = self._reservations.pop(rid, None)
            if res is not None:
                client.reservations -= 1
                self.storage.abort_store(res.tag, res.fence)
        session.reservations.clear()

    def _drop_client(self, client: _Client) -> None:
        for session in list(client.sessions.values()):
            self._end(client, session)
        client.sessions.clear()

    def _take_reservation(self, client: _Client, rid: int) -> _Reservation:
        res = self._reservations.get(rid)
        if res is None or res.client is not client:
            raise RequestError("no_reservation", f"no store reservation {rid}")
        del self._reservations[rid]
        client.reservations -= 1
        session = client.sessions.get(res.request_id)
        if session is not None:
            session.reservations.discard(rid)
        return res

    def _count(self, name: str, n: int = 1) -> None:
        if n:
            self.counters[name] = self.counters.get(name, 0) + n
