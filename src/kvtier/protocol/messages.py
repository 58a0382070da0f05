"""The cache server's wire protocol: msgspec-typed messages over ZeroMQ.

A request is one or more ZeroMQ frames from a DEALER: a MessagePack body,
then (for ``Store`` from clients without shared memory) one data frame per
object. Each body is a struct tagged with its operation name in the ``op``
field; the names are stable. The server answers every request with exactly
one reply body (plus data frames for a bytes ``Retrieve``), or ``Error``,
carrying the request's ``seq``: replies may come out of order (a parked
``Wait``, a bytes ``Store`` copied off the server's loop), and a client with
several requests in flight matches them by ``seq``. ``Query`` is ``Wait``
with no wait. No pickle anywhere. ``Hello`` carries ``PROTOCOL_VERSION``; a
mismatch is refused.

Keys on the wire are chunk hashes (32 bytes) plus ranks; the server builds
the ``ObjectKey``s from the session's registered namespace, so a client can
name only its own model's and tenant's objects.
"""

from __future__ import annotations

import msgspec

from kvtier.layout import KVLayout

PROTOCOL_VERSION = 3  # 2: seq on every message; 3: usage reports carry a prefill sample
HASH_ALGORITHM = "blake3-chain-v1"


class Message(
    msgspec.Struct, tag_field="op", forbid_unknown_fields=True, kw_only=True, omit_defaults=True
):
    """Base of every request and reply. ``seq``: chosen by the client, echoed
    in the reply (keyword-only: it comes after every operation's own fields)."""

    seq: int = 0


class LayoutSpec(msgspec.Struct, forbid_unknown_fields=True):
    """One object group's layout (``kvtier.layout.KVLayout`` fields, per rank)."""

    group: int
    num_layers: int
    kv_heads: int
    head_dim: int
    dtype: str
    kind: str = "kv"
    format: str = ""  # KVLayout.format
    lossy_codec: str = ""  # KVLayout.lossy_codec
    window_layers: int = 0  # KVLayout.window_layers
    window_tokens: int = 0  # KVLayout.window_tokens, before the server's chunk size caps it

    @classmethod
    def of(
        cls, layout: KVLayout, group: int = 0, window_layers: int = 0, window_tokens: int = 0
    ) -> LayoutSpec:
        """The one conversion from an engine's ``KVLayout`` (the server sets
        the chunk size and the ranks come with HELLO; ``window_layers`` keep
        ``window_tokens`` of a chunk whatever its size)."""
        return cls(
            group,
            layout.num_layers,
            layout.kv_heads,
            layout.head_dim,
            layout.dtype,
            layout.kind,
            layout.format,
            layout.lossy_codec,
            window_layers or layout.window_layers,
            window_tokens or layout.window_tokens,
        )


# ------------------------------------------------------------------ requests


class Hello(Message, tag="hello"):
    version: int
    client_id: str
    model: str
    layouts: list[LayoutSpec]
    num_ranks: int = 1
    block_alignment: int = 1
    revision: str = ""
    lora: str = ""
    salt: str = ""
    token: str = ""
    shm: bool = True
    rank: int = -1  # -1: the client speaks for every rank; r: it stores and loads rank r only
    # The model name in the client's chunk-hash namespace (docs/hashing.md) when
    # ``model`` is its label: a router hashes prompts with it (/status).
    hash_model: str = ""


class Lookup(Message, tag="lookup"):
    request_id: str
    hashes: list[bytes]
    group: int = 0


class Query(Message, tag="query"):
    request_id: str


class Wait(Message, tag="wait"):
    request_id: str
    timeout_s: float


class Retrieve(Message, tag="retrieve"):
    request_id: str
    start: int
    end: int


class Release(Message, tag="release"):
    """Drop the locks of chunks [start, end): after RETRIEVE's copy, or for
    chunks the engine computes itself (FREE_LOCKS)."""

    request_id: str
    start: int
    end: int


class StoreReserve(Message, tag="store_reserve"):
    request_id: str
    hashes: list[bytes]
    group: int = 0


class StoreCommit(Message, tag="store_commit"):
    reservation: int


class StoreAbort(Message, tag="store_abort"):
    reservation: int


class Store(Message, tag="store"):
    """Bytes path: one data frame per (chunk, rank) object, chunk-major."""

    request_id: str
    hashes: list[bytes]
    group: int = 0


class EndSession(Message, tag="end_session"):
    request_id: str


class Ping(Message, tag="ping"):
    pass


class Status(Message, tag="status"):
    pass


class ShadowReport(Message, tag="shadow_report"):
    """An engine's shadow-check results since its last report
    (``kvtier.engine.shadow``): the server counts them for the node."""

    checked: int
    mismatched: int
    unavailable: int = 0


MAX_REPORTED_KL = 1000.0  # nats: an engine reports a larger KL (or NaN logits) as this


class QualityReport(Message, tag="quality_report"):
    """One quality-gate sample of a lossy path (``kvtier.engine.quality_gate``):
    ``path`` ("blend", "codec:int8"...), whether full prefill's next token
    agreed, ``kl`` (nats), and whether the engine's gate is now off for it."""

    path: str
    agreed: bool
    kl: float
    off: bool = False


class Pin(Message, tag="pin"):
    """Keep these chunks (every rank's object, in the client's namespace) in
    L1 for ``ttl_s`` (within the tenant's pin cap); ``ttl_s`` 0 unpins."""

    hashes: list[bytes]
    ttl_s: float
    group: int = 0


class UsageReport(Message, tag="usage_report"):
    """An engine's measurements for the savings ledger: one forward it ran
    since its last report (``prefill_s`` seconds for ``computed_tokens``
    tokens it computed; 0 tokens: none), from which the ledger learns what a
    computed token costs there (``kvtier.costfit``), and the seconds and
    tokens it spent loading KV into its cache since its last report (not
    tokens its own prefix cache held)."""

    prefill_s: float
    computed_tokens: int
    load_s: float
    loaded_tokens: int


class HandoffOffer(Message, tag="handoff_offer"):
    """Publish a request's KV for the engine that decodes it
    (``kvtier.server.handoff.table``): chunks ``hashes`` (the prompt's full chunks,
    then its tail), every rank's object, held in L1 for ``lease_s`` or until
    its consumer is done with it. ``consumer``: the only consumer name that
    may take it ("" for any). ``kv_heads``: the model's KV heads over all
    ranks, so that a consumer with another TP size can be given its own
    rank split (0: unknown, no conversion)."""

    handoff_id: str
    hashes: list[bytes]
    lease_s: float
    consumer: str = ""
    group: int = 0
    kv_heads: int = 0


class HandoffTake(Message, tag="handoff_take"):
    """Take a hand-off for ``consumer``, naming the chunks it expects. A
    consumer with another TP size than the producer's also names the same
    prompt's chunks under the producer's layout (``source_hashes``) and the
    model's KV heads: the server re-shards the objects into its layout.
    ``find``: the producer offered it on another cache server: find the
    chunks in this server's tiers (a shared L2) and hold them here.
    ``taker``: a token the consumer keeps for its request, so that its take
    sent again over a new connection (the first one's answer lost with the
    old) is still its own ("": the connection is the taker)."""

    handoff_id: str
    hashes: list[bytes]
    consumer: str = ""
    group: int = 0
    source_hashes: list[bytes] = msgspec.field(default_factory=list)
    kv_heads: int = 0
    find: bool = False
    taker: str = ""


class HandoffDone(Message, tag="handoff_done"):
    """The consumer has its copy: the hand-off's hold is dropped (``taker``:
    its take's)."""

    handoff_id: str
    consumer: str = ""
    taker: str = ""


Request = (
    Hello
    | Lookup
    | Query
    | Wait
    | Retrieve
    | Release
    | StoreReserve
    | StoreCommit
    | StoreAbort
    | Store
    | EndSession
    | Ping
    | Status
    | ShadowReport
    | QualityReport
    | Pin
    | UsageReport
    | HandoffOffer
    | HandoffTake
    | HandoffDone
)

# ------------------------------------------------------------------- replies


class Welcome(Message, tag="welcome"):
    chunk_size: int
    boot_id: str
    arena: str | None
    hash_algorithm: str = HASH_ALGORITHM
    version: int = PROTOCOL_VERSION
    salt: str = ""  # the salt label the client's keys carry (its tenant's first, if it named none)
    writable: bool = True  # False: the tenant may read this namespace, not store in it


class Ack(Message, tag="ack"):
    pass


class QueryResult(Message, tag="query_result"):
    hit_chunks: int | None  # None: still pending; 0: done, a miss
    chunks_by_tier: dict[str, int] = {}  # hit chunks per tier ("L1", an L2 adapter's name)
    # Why the hit ends before the last chunk (a ``MissReason`` value); "" for a full hit.
    miss_reason: str = ""


class Objects(Message, tag="objects"):
    """Arena offsets and sizes, chunk-major (chunk 0 rank 0, chunk 0 rank 1, ...);
    for bytes clients the data frames follow in the same order."""

    offsets: list[int]
    sizes: list[int]


class Reserved(Message, tag="reserved"):
    reservation: int
    offsets: list[int]  # -1: this object needs no write (resident already, or no room)
    sizes: list[int]


class Committed(Message, tag="committed"):
    stored: int  # objects of the request now in the cache (stored now, or resident already)


class Pinned(Message, tag="pinned"):
    """Chunks pinned (or unpinned), missing from L1, and refused by a cap."""

    pinned: int
    missing: int = 0
    refused: int = 0


class HandoffState(Message, tag="handoff_state"):
    """A hand-off operation's outcome (a ``HandoffOutcome`` value) and why."""

    outcome: str
    message: str = ""


class Pong(Message, tag="pong"):
    boot_id: str


class StatusReply(Message, tag="status_reply"):
    status: dict[str, object]


class Error(Message, tag="error"):
    code: str  # "bad_request", "unknown_op", "unauthorized", "version", "no_session", ...
    message: str


Reply = (
    Welcome
    | Ack
    | QueryResult
    | Objects
    | Reserved
    | Committed
    | Pinned
    | HandoffState
    | Pong
    | StatusReply
    | Error
)

_encoder = msgspec.msgpack.Encoder()
_requests = msgspec.msgpack.Decoder(Request)
_replies = msgspec.msgpack.Decoder(Reply)


def encode(message: Message) -> bytes:
    return _encoder.encode(message)


def decode_request(body: bytes | memoryview) -> Request:
    """Raises msgspec.DecodeError / ValidationError for anything malformed."""
    return _requests.decode(body)


def decode_reply(body: bytes | memoryview) -> Reply:
    return _replies.decode(body)
