"""``SessionTable``: who is registered with the cache server, their sessions and
store reservations, and what each of them holds.

::

    HELLO ──► Client (bound to one connection; a new HELLO on it replaces it)
                 │
    LOOKUP ──► Session: pending ──answered──► holds read locks on its hit chunks
                 │                             (its keys cut to the hit)
                 │  RELEASE [start, end) / END_SESSION / time-to-live
                 ▼
              ended: every lock and store reservation it still holds is
              released exactly once; a lookup still in flight is abandoned
              (the prefetch controller releases its result when it comes)

    STORE_RESERVE ──► Reservation (staged and fenced in L1) ──COMMIT/ABORT──► gone

Every count a client can grow is bounded by ``ServerLimits``: clients,
sessions and reservations per client, and the objects named by a client's
sessions and by all sessions; past a limit the request is refused with a
``busy`` error that names it. Time-to-live runs on the injected clock.

Single-threaded: only the server loop calls this (the storage it releases
into has its own locks).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from kvtier.controllers import LookupResult, PrefetchHandle
from kvtier.keys import NamespaceLabel, ObjectKey
from kvtier.l1 import IOFence, WriterTag
from kvtier.layout import KVLayout
from kvtier.server.limits import MAX_TEXT_CHARS, RequestError, ServerLimits
from kvtier.storage import StorageManager

Clock = Callable[[], float]


@dataclass(eq=False)
class Session:
    request_id: str
    keys: list[list[ObjectKey]]  # per chunk, per rank; cut to the hit once answered
    objects: int = 0  # objects in ``keys``, counted against the limits
    handle: PrefetchHandle | None = None
    result: LookupResult | None = None
    locked: list[bool] = field(default_factory=list)  # per hit chunk: lock still held
    reservations: set[int] = field(default_factory=set)
    touched: float = 0.0
    started: float = 0.0  # perf_counter when the lookup was submitted

    @property
    def answered(self) -> bool:
        return self.result is not None

    @property
    def ranks(self) -> int:
        return len(self.keys[0]) if self.keys else 1


@dataclass(eq=False)
class Client:
    peer: bytes
    connection: str  # the transport's id of the connection that said hello
    client_id: str
    model: str
    salt: str
    layouts: dict[int, KVLayout]
    num_ranks: int
    shm: bool
    rank: int = -1  # -1: every rank's objects; r: rank r's only
    tenant: str = ""  # whose token said hello (kvtier.tenancy.tenants)
    writable: bool = True  # False: a namespace the tenant may only read
    sessions: dict[str, Session] = field(default_factory=dict)
    objects: int = 0  # objects named by its sessions
    reservations: int = 0
    last_seen: float = 0.0
    # ``model@salt``, made once at HELLO (which checked both labels) for the
    # lookups, the ledger and the listings that name it.
    namespace: NamespaceLabel = field(init=False)

    def __post_init__(self) -> None:
        self.namespace = NamespaceLabel.of(self)


@dataclass(eq=False)
class Reservation:
    client: Client
    request_id: str
    tag: WriterTag
    fence: IOFence
    layout: KVLayout
    started: float  # perf_counter, for the store latency histogram
    already: int  # objects that were resident already (counted as stored)


def shown(text: str) -> str:
    """A client's string in an error message, cut short: replies stay small."""
    return repr(text) if len(text) <= 80 else repr(text[:80]) + f"... ({len(text)} characters)"


def check_request_id(request_id: str) -> None:
    if not request_id or len(request_id) > MAX_TEXT_CHARS:
        raise RequestError("bad_request", f"request_id must be 1-{MAX_TEXT_CHARS} characters")


class SessionTable:
    """See the module docstring."""

    def __init__(self, storage: StorageManager, limits: ServerLimits, clock: Clock) -> None:
        self._storage = storage
        self.limits = limits
        self._clock = clock
        self._clients: dict[bytes, Client] = {}
        self._reservations: dict[int, Reservation] = {}
        self._reservation_ids = itertools.count(1)
        self.objects = 0  # objects named by every client's sessions

    # ------------------------------------------------------------- clients

    def register(self, client: Client) -> None:
        """Make ``client`` the registration of its peer, ending the old one's sessions."""
        old = self._clients.get(client.peer)
        if old is None and len(self._clients) >= self.limits.max_clients:
            raise RequestError(
                "busy", f"the server has {len(self._clients)} clients, its limit; try again later"
            )
        if old is not None:
            self._drop(old)
        client.last_seen = self._clock()
        self._clients[client.peer] = client

    def client(self, peer: bytes, connection: str) -> Client:
        """The registered client of this peer on this connection (it is seen now)."""
        client = self._clients.get(peer)
        if client is None or client.connection != connection:
            raise RequestError("no_hello", "send hello first (or again, after a server restart)")
        client.last_seen = self._clock()
        return client

    def touch(self, peer: bytes, connection: str) -> None:
        client = self._clients.get(peer)
        if client is not None and client.connection == connection:
            client.last_seen = self._clock()

    def clients(self) -> Iterator[Client]:
        return iter(list(self._clients.values()))

    # ------------------------------------------------------------ sessions

    def open_lookup(self, client: Client, request_id: str, keys: list[list[ObjectKey]]) -> Session:
        """A new session for a lookup of ``keys`` (replacing one of the same id)."""
        check_request_id(request_id)
        old = client.sessions.get(request_id)
        self._check_room(client, len(keys) * (len(keys[0]) if keys else 0), old)
        return self._open(client, request_id, keys)

    def store_session(self, client: Client, request_id: str) -> Session:
        """The session a store belongs to, opened if it does not exist."""
        session = client.sessions.get(request_id)
        if session is None:
            check_request_id(request_id)
            self._check_room(client, 0, None)
            session = self._open(client, request_id, [])
        session.touched = self._clock()
        return session

    def session(self, client: Client, request_id: str) -> Session:
        session = client.sessions.get(request_id)
        if session is None:
            raise RequestError("no_session", f"no session {shown(request_id)}; send lookup first")
        session.touched = self._clock()
        return session

    def answer(self, client: Client, session: Session, result: LookupResult) -> None:
        """The lookup is done: the session holds its hit chunks' locks and names
        only those chunks from now on."""
        session.result = result
        session.locked = [True] * result.hit_chunks
        dropped = (len(session.keys) - result.hit_chunks) * session.ranks
        del session.keys[result.hit_chunks :]
        self._hold(client, session, -dropped)

    def release(self, session: Session, start: int, end: int) -> None:
        """Drop the locks of hit chunks [start, end) still held (once each)."""
        keys = [k for i in range(start, end) if session.locked[i] for k in session.keys[i]]
        for i in range(start, end):
            session.locked[i] = False
        if keys:
            self._storage.release(keys)

    def end(self, client: Client, request_id: str) -> None:
        session = client.sessions.pop(request_id, None)
        if session is None:
            raise RequestError("no_session", f"no session {shown(request_id)}")
        self._end(client, session)

    def lookup_settled(self, peer: bytes, request_id: str, connection: str) -> bool:
        """Whether a WAIT for this lookup can be answered now (done, or not
        this peer's: then the answer is an error)."""
        client = self._clients.get(peer)
        if client is None or client.connection != connection:
            return True
        session = client.sessions.get(request_id)
        return session is None or session.handle is None or session.handle.result() is not None

    # --------------------------------------------------------- reservations

    def room_for_reservation(self, client: Client) -> None:
        """Refuse a store reservation past the client's limit (before staging it)."""
        if client.reservations >= self.limits.max_reservations_per_client:
            raise RequestError(
                "busy",
                f"{client.reservations} store reservations are open, the limit; commit or abort "
                "them first",
            )

    def reserve(self, client: Client, session: Session, reservation: Reservation) -> int:
        """Record a store reservation (``room_for_reservation`` came first); its id."""
        rid = next(self._reservation_ids)
        self._reservations[rid] = reservation
        session.reservations.add(rid)
        client.reservations += 1
        return rid

    def take(self, client: Client, rid: int) -> Reservation:
        """Remove and return ``client``'s reservation ``rid`` (to commit or abort)."""
        res = self._reservations.get(rid)
        if res is None or res.client is not client:
            raise RequestError("no_reservation", f"no store reservation {rid}")
        del self._reservations[rid]
        client.reservations -= 1
        session = client.sessions.get(res.request_id)
        if session is not None:
            session.reservations.discard(rid)
        return res

    # -------------------------------------------------------------- upkeep

    def expire(self) -> tuple[int, int]:
        """End silent clients and idle sessions; how many of each."""
        now = self._clock()
        clients = sessions = 0
        for client in list(self._clients.values()):
            if now - client.last_seen > self.limits.client_ttl_s:
                del self._clients[client.peer]
                self._drop(client)
                clients += 1
                continue
            for session in list(client.sessions.values()):
                if now - session.touched > self.limits.session_ttl_s:
                    del client.sessions[session.request_id]
                    self._end(client, session)
                    sessions += 1
        return clients, sessions

    def status(self) -> dict[str, int]:
        return {
            "clients": len(self._clients),
            "sessions": sum(len(c.sessions) for c in self._clients.values()),
            "session_objects": self.objects,
            "store_reservations": len(self._reservations),
        }

    def close(self) -> None:
        """End every session of every client (releasing what they hold)."""
        for client in list(self._clients.values()):
            self._drop(client)
        self._clients.clear()

    # ----------------------------------------------------------- internals

    def _open(self, client: Client, request_id: str, keys: list[list[ObjectKey]]) -> Session:
        old = client.sessions.pop(request_id, None)
        if old is not None:
            self._end(client, old)
        session = Session(request_id, keys, touched=self._clock())
        client.sessions[request_id] = session
        self._hold(client, session, len(keys) * session.ranks if keys else 0)
        return session

    def _check_room(self, client: Client, objects: int, replaced: Session | None) -> None:
        """Refuse a new session past the limits (``replaced``: the session of the
        same id that it would end)."""
        freed = 0 if replaced is None else replaced.objects
        sessions = len(client.sessions) - (replaced is not None)
        if sessions >= self.limits.max_sessions_per_client:
            raise RequestError(
                "busy", f"{sessions} sessions are open, the limit; end some (END_SESSION) first"
            )
        mine = client.objects - freed + objects
        total = self.objects - freed + objects
        if mine > self.limits.max_session_objects_per_client or total > (
            self.limits.max_session_objects
        ):
            raise RequestError(
                "busy",
                f"open sessions would name {mine} objects of this client and {total} in all; the "
                f"limits are {self.limits.max_session_objects_per_client} and "
                f"{self.limits.max_session_objects}: end sessions first",
            )

    def _hold(self, client: Client, session: Session, objects: int) -> None:
        """Count ``objects`` more (or fewer) named by ``session``."""
        session.objects += objects
        client.objects += objects
        self.objects += objects

    def _end(self, client: Client, session: Session) -> None:
        """Release whatever ``session`` holds (it is already out of ``client``'s table)."""
        self._hold(client, session, -session.objects)
        if session.answered:
            self.release(session, 0, len(session.locked))
        elif session.handle is not None:
            late = session.handle.abandon()  # a result that comes later is released for us
            if late is not None and self._storage.collect(session.handle, 0) is not None:
                self._storage.release(list(late.placements))
        for rid in list(session.reservations):
            res = self._reservations.pop(rid, None)
            if res is not None:
                client.reservations -= 1
                self._storage.abort_store(res.tag, res.fence)
        session.reservations.clear()

    def _drop(self, client: Client) -> None:
        for session in list(client.sessions.values()):
            self._end(client, session)
        client.sessions.clear()
