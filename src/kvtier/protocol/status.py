"""The cache server's status document, typed: what ``GET /status`` serves as
JSON, the admin port's ``/metrics`` exports, and STATUS answers.

``ServerStatus`` is built by the server (``kvtier.server.status``) and
decoded by every reader with ``msgspec.json.decode(body, type=ServerStatus)``
(``decode``): a document that does not fit is refused with a message naming
the field (``Expected `int`, got `str` - at `$.storage.l1.used_bytes```).
Fields a reader does not know are ignored, so a newer server can add some.

Numbers carry what ``/metrics`` makes of them, in their type:

- ``Count`` / ``CountS``: counted since the server started, exported as a
  Prometheus counter (``..._total``);
- ``Level`` / ``Reading`` / ``Flag``: a value as it stands now, a gauge;
- a family (``ByTier``, ``ByAdapter``, ...): a dict whose key becomes a
  label (``tier``, ``adapter``, ``reason``, ``tenant``...);
- ``TenantName`` / ``NamespaceName`` / ``PathName``: a string field that
  labels its struct's numbers (the ledger's and the quality gate's rows).

A number without one of these marks is data, not a metric (a layout's
``num_layers``). The metric's name is ``kvtier_`` and the field path joined
by ``_``: ``storage.l2["fs"].store_keys`` is
``kvtier_storage_l2_store_keys_total{adapter="fs"}``.
"""

from __future__ import annotations

from typing import Annotated

import msgspec
from msgspec import Meta

COUNTER = "counter"
GAUGE = "gauge"
# A reader refuses a longer document: a server's is a few hundred bytes per
# registered namespace (about 0.5 MB with 2,000), so this leaves 100 times that.
MAX_STATUS_BYTES = 64 << 20

# Marks (see the module docstring)
Count = Annotated[int, Meta(extra={"metric": COUNTER})]
CountS = Annotated[float, Meta(extra={"metric": COUNTER})]  # seconds (or bytes) summed
Level = Annotated[int, Meta(extra={"metric": GAUGE})]
Reading = Annotated[float, Meta(extra={"metric": GAUGE})]
Flag = Annotated[bool, Meta(extra={"metric": GAUGE})]
TenantName = Annotated[str, Meta(extra={"label": "tenant"})]
NamespaceName = Annotated[str, Meta(extra={"label": "namespace"})]
PathName = Annotated[str, Meta(extra={"label": "path"})]

# Families: one number per label value
ByTier = Annotated[dict[str, Count], Meta(extra={"label": "tier"})]
ByAdapter = Annotated[dict[str, Count], Meta(extra={"label": "adapter"})]
ByReason = Annotated[dict[str, Count], Meta(extra={"label": "reason"})]
ByPlace = Annotated[dict[str, Count], Meta(extra={"label": "where"})]
ByJob = Annotated[dict[str, Count], Meta(extra={"label": "job"})]
LevelByTenant = Annotated[dict[str, Level], Meta(extra={"label": "tenant"})]
LevelByAdapter = Annotated[dict[str, Level], Meta(extra={"label": "adapter"})]
LevelByTier = Annotated[dict[str, Level], Meta(extra={"label": "tier"})]
LevelByState = Annotated[dict[str, Level], Meta(extra={"label": "state"})]
ReadingByAdapter = Annotated[dict[str, Reading], Meta(extra={"label": "adapter"})]
LevelByTenantAdapter = Annotated[dict[str, LevelByAdapter], Meta(extra={"label": "tenant"})]


class Section(msgspec.Struct, kw_only=True):
    """Base of every part of the document."""


# ------------------------------------------------------------------ storage


class L1Status(Section):
    """``L1Manager.status()``: the arena and its objects, eviction and refusals."""

    capacity_bytes: Level = 0
    used_bytes: Level = 0
    staging_bytes: Level = 0
    locked_bytes: Level = 0
    resident_objects: Level = 0
    staging_objects: Level = 0
    doomed_objects: Level = 0
    locked_objects: Level = 0
    fenced_objects: Level = 0
    fragmentation: Reading = 0.0
    eviction_policy: str = ""
    evictions: Count = 0
    evicted_bytes: Count = 0
    eviction_failures: Count = 0
    expired_write_leases: Count = 0
    expired_read_leases: Count = 0
    out_of_memory: Count = 0
    too_large: Count = 0
    watermark_unreachable: Count = 0
    duplicate_writes: Count = 0
    wrong_layout: Count = 0  # reads and writes refused: the object is another layout's
    over_quota: Count = 0
    quota_evictions: Count = 0
    tenant_bytes: LevelByTenant = msgspec.field(default_factory=dict)  # resident + staging
    tenant_pinned_bytes: LevelByTenant = msgspec.field(default_factory=dict)


class L2AdapterStatus(Section):
    """One L2 adapter's ``status()``: health, work by kind (lookup, load,
    store), misses by reason, its codec's measurements and its backend's
    own numbers (those of another backend stay None)."""

    type: str = ""
    name: str = ""
    codec: str = ""
    sealed_with: str = ""  # the key id its objects are sealed with ("" unsealed)
    healthy: Flag = True
    closed: Flag = False
    recoveries: Count = 0
    failures: ByReason = msgspec.field(default_factory=dict)  # misses by reason
    lookup_keys: Count = 0
    lookup_ok: Count = 0
    lookup_bytes: Count = 0
    load_keys: Count = 0
    load_ok: Count = 0
    load_bytes: Count = 0
    store_keys: Count = 0
    store_ok: Count = 0
    store_bytes: Count = 0
    store_present: Count = 0
    corrupt_objects: Count = 0
    callback_failures: Count = 0
    evictions: Count = 0
    quota_evictions: Count = 0
    codec_plain_stores: CountS = 0.0
    codec_link_bytes_per_s: Reading | None = None
    codec_decode_bytes_per_s: Reading | None = None
    codec_ratio: Reading | None = None
    codec_pays: Reading | None = None
    codec_coded_load_bytes_per_s: Reading | None = None
    codec_plain_load_bytes_per_s: Reading | None = None
    # the backend's own (fs, mock, redis, s3, mooncake)
    objects: Level | None = None
    used_bytes: Level | None = None
    capacity_bytes: Level | None = None
    leases: Level | None = None
    path: str | None = None
    url: str | None = None
    cluster: bool | None = None
    endpoint: str | None = None
    bucket: str | None = None
    prefix: str | None = None
    master: str | None = None
    protocol: str | None = None
    replicas: int | None = None


class StoreStatus(Section):
    """The L1 -> L2 write-back controller: its queue, and objects per adapter."""

    policy: str = ""
    queued_objects: Level = 0
    inflight_bytes: Level = 0
    pinned_bytes: Level = 0
    candidates: Level = 0
    reseed_objects: Level = 0
    dropped_at_stop: Count = 0
    unpinned_over_bound: Count = 0
    dropped_queue_full: Count = 0
    skipped_evicted: Count = 0
    worker_errors: Count = 0
    stored_objects: ByAdapter = msgspec.field(default_factory=dict)
    stored_bytes: ByAdapter = msgspec.field(default_factory=dict)
    failed_objects: ByAdapter = msgspec.field(default_factory=dict)
    over_quota: ByAdapter = msgspec.field(default_factory=dict)
    reseeds: ByAdapter = msgspec.field(default_factory=dict)
    reseeded_objects: ByAdapter = msgspec.field(default_factory=dict)


class PrefetchStatus(Section):
    """The lookup/prefetch controller: hits by tier, misses by reason, L2 loads."""

    lookups: Count = 0
    hit_chunks: Count = 0
    hit_objects: ByTier = msgspec.field(default_factory=dict)
    miss_reasons: ByReason = msgspec.field(default_factory=dict)
    loaded_objects: ByAdapter = msgspec.field(default_factory=dict)
    loaded_bytes: ByAdapter = msgspec.field(default_factory=dict)
    failed_loads: ByAdapter = msgspec.field(default_factory=dict)
    recompute_cheaper_chunks: Count = 0
    # chunks a tier would have served (a chunk may span tiers: no sum to the above)
    recompute_cheaper_chunks_by_tier: ByTier = msgspec.field(default_factory=dict)
    backlog_full: Count = 0
    staging_out_of_memory: Count = 0
    deadline_misses: Count = 0
    abandoned: Count = 0
    worker_errors: Count = 0
    active_requests: Level = 0
    backlog_requests: Level = 0
    inflight_bytes: Level = 0
    inflight_objects: Level = 0
    link_latency_s: ReadingByAdapter = msgspec.field(default_factory=dict)
    link_bytes_per_s: ReadingByAdapter = msgspec.field(default_factory=dict)


class StorageStatus(Section, kw_only=True):
    held_lookup_locks: Level = 0
    lookup_timeouts: Count = 0
    l1: L1Status
    l2: Annotated[dict[str, L2AdapterStatus], Meta(extra={"label": "adapter"})]
    store: StoreStatus
    prefetch: PrefetchStatus


# ------------------------------------------------------------------- server


class ShadowChunks(Section):
    """Engines' shadow checks of served KV against their recomputation."""

    checked: Count = 0
    mismatched: Count = 0
    unavailable: Count = 0


class HandoffCounts(Section):
    """Prefill/decode hand-offs: offers, takes, and how each ended."""

    offered: Count = 0
    offered_again: Count = 0
    taken: Count = 0
    found: Count = 0
    resharded: Count = 0
    reshard_failed: Count = 0
    consumed: Count = 0
    expired: Count = 0
    incomplete: Count = 0
    refused: ByReason = msgspec.field(default_factory=dict)


class ServerCounts(Section):
    """What the server did (any thread counts): requests, refusals, faults."""

    hellos: Count = 0
    lookups: Count = 0
    hit_chunks: Count = 0
    hit_tokens: ByTier = msgspec.field(default_factory=dict)
    lookup_tokens: Count = 0
    retrieved_objects: Count = 0
    retrieved_bytes: Count = 0
    store_reserved_objects: Count = 0
    stored_objects: Count = 0
    stored_bytes: Count = 0
    pinned_chunks: Count = 0
    unpinned_chunks: Count = 0
    pins_refused: Count = 0
    expired_clients: Count = 0
    expired_sessions: Count = 0
    errors: ByReason = msgspec.field(default_factory=dict)  # refused requests, by code
    faults: ByPlace = msgspec.field(default_factory=dict)  # the server's own failures
    shadow_chunks: ShadowChunks = msgspec.field(default_factory=ShadowChunks)
    handoffs: HandoffCounts = msgspec.field(default_factory=HandoffCounts)


class TransportCounts(Section):
    connections: Count = 0
    disconnects: Count = 0
    dropped_replies: Count = 0
    loop_errors: Count = 0
    zap_errors: Count = 0


class HandoffHolds(Section):
    """Hand-offs held in L1 now."""

    held: Level = 0
    held_bytes: Level = 0
    taken: Level = 0


class WarmupStatus(Section):
    """Routing-time prefetches (the admin port's ``POST /prefetch``)."""

    pending: Level = 0
    started: Count = 0
    chunks_asked: Count = 0
    chunks_ready: Count = 0
    unknown_namespace: Count = 0
    refused_busy: Count = 0
    unanswered: Count = 0
    errors: Count = 0


class EventsStatus(Section):
    """The KV event publisher."""

    endpoint: str = ""
    replay_endpoint: str = ""
    epoch: int = 0
    next_seq: Level = 0
    buffered: Level = 0
    pending_reports: Level = 0
    chunks: LevelByTier = msgspec.field(default_factory=dict)  # as of the last batch
    batches: Count = 0
    events: Count = 0
    dropped_batches: Count = 0
    replays: Count = 0
    snapshots: Count = 0
    bad_replay_requests: Count = 0
    errors: Count = 0


class PurgeCounts(Section):
    jobs: LevelByState = msgspec.field(default_factory=dict)  # running, done, failed
    deleted_objects: Level = 0  # by the jobs the purger keeps


class LedgerEntry(Section):
    """One (tenant, namespace) of the savings ledger."""

    tenant: TenantName
    namespace: NamespaceName  # model@salt
    served_tokens: ByTier = msgspec.field(default_factory=dict)
    loaded_tokens: Count = 0  # what engines reported they loaded
    load_seconds: CountS = 0.0
    saved_seconds: Reading | None = None  # None: no prefill rate known yet
    net_seconds: Reading | None = None
    # what prices the loads: the per-token part of a fit over the engines' forwards
    prefill_seconds_per_token: Reading | None = None
    prefill_fixed_seconds: Reading | None = None  # each forward's own time (not a saving)
    forwards: Count = 0  # the forwards the fit learned from


class QualityEntry(Section):
    """Quality-gate samples of one lossy path ("blend", "codec:int8") of one
    (tenant, namespace), as its engines reported them
    (``kvtier.engine.quality_gate``); ``off``: an engine turned the path off."""

    tenant: TenantName
    namespace: NamespaceName  # model@salt
    path: PathName
    samples: Count = 0
    agreed: Count = 0  # samples whose next token agreed with full prefill's
    kl_sum: CountS = 0.0  # KL(full || lossy) summed, nats
    off: Flag = False


class L2Usage(Section):
    tenant_bytes: LevelByTenantAdapter = msgspec.field(default_factory=dict)
    over_quota: ByAdapter = msgspec.field(default_factory=dict)  # stores refused


class RetentionCounts(Section):
    removed: ByTier = msgspec.field(default_factory=dict)  # objects past their retention


class UpkeepCounts(Section):
    """The server's periodic jobs (``kvtier.server.upkeep``), by job."""

    runs: ByJob = msgspec.field(default_factory=dict)
    errors: ByJob = msgspec.field(default_factory=dict)
    overran: ByJob = msgspec.field(default_factory=dict)  # due again while still running


class RegisteredLayout(Section):
    """A registered group's layout (``kvtier.layout.KVLayout`` fields, per rank)."""

    num_layers: int
    kv_heads: int
    head_dim: int
    dtype: str
    tokens_per_chunk: int
    kind: str = "kv"
    num_ranks: int = 1
    format: str = ""
    lossy_codec: str = ""


class HashNamespace(Section, kw_only=True):
    """What a router needs to hash prompts as the clients do (salt aside)."""

    model: str
    revision: str = ""
    lora: str = ""
    kv_dtype: str
    layout: str
    chunk_size: int


class ServerStatus(Section, kw_only=True):
    """The whole document (see the module docstring)."""

    boot_id: str
    protocol: Level
    hash_algorithm: str
    chunk_size: Level
    chunk_size_frozen: Flag
    uptime_s: Reading
    draining: Flag = False
    clients: Level = 0
    sessions: Level = 0
    session_objects: Level = 0
    store_reservations: Level = 0
    namespaces: list[str] = msgspec.field(default_factory=list)  # model@salt, registered now
    layouts: dict[str, dict[str, RegisteredLayout]] = msgspec.field(default_factory=dict)
    hash_namespaces: list[HashNamespace] = msgspec.field(default_factory=list)
    events: EventsStatus | None = None
    warmup: WarmupStatus = msgspec.field(default_factory=WarmupStatus)
    purges: PurgeCounts = msgspec.field(default_factory=PurgeCounts)
    ledger: list[LedgerEntry] = msgspec.field(default_factory=list)
    quality: list[QualityEntry] = msgspec.field(default_factory=list)
    l2_usage: L2Usage = msgspec.field(default_factory=L2Usage)
    retention: RetentionCounts = msgspec.field(default_factory=RetentionCounts)
    upkeep: UpkeepCounts = msgspec.field(default_factory=UpkeepCounts)
    handoffs: HandoffHolds = msgspec.field(default_factory=HandoffHolds)
    server: ServerCounts
    transport: TransportCounts = msgspec.field(default_factory=TransportCounts)
    storage: StorageStatus


def decode(body: bytes | str) -> ServerStatus:
    """A ``/status`` body; ``msgspec.ValidationError`` names a field that does
    not fit; ``msgspec.DecodeError``: not JSON, longer than
    ``MAX_STATUS_BYTES``, or nested deeper than msgspec decodes."""
    if len(body) > MAX_STATUS_BYTES:
        raise msgspec.DecodeError(f"a /status document is over {MAX_STATUS_BYTES} bytes")
    try:
        return msgspec.json.decode(body, type=ServerStatus)
    except RecursionError:  # an unknown field is skipped, but its nesting still recurses
        raise msgspec.DecodeError("a /status document nests deeper than it can be read") from None


__all__ = [
    "MAX_STATUS_BYTES",
    "Count",
    "CountS",
    "Flag",
    "HashNamespace",
    "L1Status",
    "L2AdapterStatus",
    "LedgerEntry",
    "Level",
    "Reading",
    "RegisteredLayout",
    "ServerCounts",
    "ServerStatus",
    "StorageStatus",
    "decode",
]
