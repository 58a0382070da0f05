"""``server_status``: the cache server's ``ServerStatus`` (``kvtier.protocol.status``),
gathered from its components.

Components count with ``Counters`` under flat names, a family's member after
a dot (``hit_tokens.L1``, ``errors.forbidden``, ``handoffs.refused.taken``);
``fold`` puts each name where the typed document has it: a plain name in
the field of that name, ``family.member`` in the family's dict (or, when the
field is a section, in that section's fields, recursively). A name the
document has no field for is dropped from ``/status`` and ``/metrics``:
logged once, and kept in ``unmapped()``, which the tests check is empty.

Runs on the server's loop thread (the transport builds its snapshot when a
reader finds the last one older than a tick, never for nobody); every
component's ``status()`` is thread-safe.
"""

from __future__ import annotations

import functools
import logging
import threading
from collections.abc import Callable, Mapping
from typing import Any, Protocol, TypeVar

import msgspec
from msgspec import inspect

from kvtier.counters import Counters
from kvtier.keys import NamespaceLabel
from kvtier.protocol import messages as p
from kvtier.protocol import status as s
from kvtier.protocol.negotiation import ChunkSizeNegotiator
from kvtier.server.handoff.table import HandoffTable
from kvtier.server.quality import QualityBoard
from kvtier.server.registrations import Registrations
from kvtier.server.sessions import SessionTable
from kvtier.server.upkeep import Upkeep
from kvtier.server.warmup import Warmup
from kvtier.storage import StorageManager
from kvtier.tenancy.ledger import SavingsLedger
from kvtier.tenancy.purge import Purger
from kvtier.tenancy.retention import Retention
from kvtier.tenancy.usage import L2Usage

log = logging.getLogger(__name__)
S = TypeVar("S", bound=msgspec.Struct)

_unmapped: set[str] = set()
_unmapped_lock = threading.Lock()


class StatusSources(Protocol):
    """What the status is gathered from: the cache server's components
    (``CacheServer`` has them all)."""

    boot_id: str
    chunks: ChunkSizeNegotiator
    draining: bool
    storage: StorageManager
    sessions: SessionTable
    registrations: Registrations
    counters: Counters
    transport_counters: Counters
    publisher_status: Callable[[], dict[str, object]] | None
    warmup: Warmup
    purger: Purger
    ledger: SavingsLedger
    quality: QualityBoard
    l2_usage: L2Usage
    retention: Retention
    upkeep: Upkeep
    handoffs: HandoffTable


def server_status(core: StatusSources, uptime_s: float) -> s.ServerStatus:
    """The whole document, as the server's components stand now."""
    sessions = core.sessions.status()
    storage = core.storage.status()
    events = core.publisher_status() if core.publisher_status else None
    return s.ServerStatus(
        boot_id=core.boot_id,
        protocol=p.PROTOCOL_VERSION,
        hash_algorithm=p.HASH_ALGORITHM,
        chunk_size=core.chunks.frozen or core.chunks.minimum,
        chunk_size_frozen=core.chunks.frozen is not None,
        uptime_s=uptime_s,
        draining=core.draining,
        clients=sessions["clients"],
        sessions=sessions["sessions"],
        session_objects=sessions["session_objects"],
        store_reservations=sessions["store_reservations"],
        namespaces=sorted({str(NamespaceLabel.of(c)) for c in core.sessions.clients()}),
        layouts=msgspec.convert(
            core.registrations.layouts(), dict[str, dict[str, s.RegisteredLayout]]
        ),
        hash_namespaces=msgspec.convert(
            core.registrations.hash_namespaces(), list[s.HashNamespace]
        ),
        events=None if events is None else fold(s.EventsStatus, events, "events"),
        warmup=fold(s.WarmupStatus, core.warmup.status(), "warmup"),
        purges=_purges(core),
        ledger=_ledger(core),
        quality=[
            s.QualityEntry(
                tenant=row.tenant,
                namespace=row.namespace,
                path=row.path,
                samples=row.samples,
                agreed=row.agreed,
                kl_sum=row.kl_sum,
                off=row.off,
            )
            for row in core.quality.rows()
        ],
        l2_usage=s.L2Usage(
            tenant_bytes=core.l2_usage.by_tenant(),
            over_quota=fold(s.L2Usage, core.l2_usage.counters.snapshot(), "l2_usage").over_quota,
        ),
        retention=fold(
            s.RetentionCounts,
            core.retention.counters.snapshot(),
            "retention",
            families={"retention_removed": "removed"},
        ),
        upkeep=fold(s.UpkeepCounts, core.upkeep.status(), "upkeep"),
        handoffs=fold(s.HandoffHolds, core.handoffs.status(), "handoffs"),
        server=fold(s.ServerCounts, core.counters.snapshot(), "server"),
        transport=fold(s.TransportCounts, core.transport_counters.snapshot(), "transport"),
        storage=_storage(storage),
    )


def _storage(status: Mapping[str, Any]) -> s.StorageStatus:
    adapters = status["l2"]
    return s.StorageStatus(
        held_lookup_locks=status["held_lookup_locks"],
        lookup_timeouts=status["lookup_timeouts"],
        l1=fold(s.L1Status, status["l1"], "storage.l1"),
        l2={
            name: fold(s.L2AdapterStatus, adapter, f"storage.l2.{name}")
            for name, adapter in adapters.items()
        },
        store=fold(s.StoreStatus, status["store"], "storage.store"),
        prefetch=fold(
            s.PrefetchStatus,
            status["prefetch"],
            "storage.prefetch",
            families={"recompute_cheaper_chunks": "recompute_cheaper_chunks_by_tier"},
        ),
    )


def _purges(core: StatusSources) -> s.PurgeCounts:
    jobs = core.purger.jobs()
    by_state = dict.fromkeys(("running", "done", "failed"), 0)
    for job in jobs:
        by_state[job["state"]] = by_state.get(job["state"], 0) + 1
    return s.PurgeCounts(jobs=by_state, deleted_objects=sum(j["deleted"] for j in jobs))


def _ledger(core: StatusSources) -> list[s.LedgerEntry]:
    return [
        s.LedgerEntry(
            tenant=row["tenant"],
            namespace=str(row["namespace"]),
            served_tokens=dict(row["served_tokens"]),
            loaded_tokens=row["loaded_tokens"],
            load_seconds=row["load_s"],
            saved_seconds=row["saved_s"],
            net_seconds=row["net_s"],
            prefill_seconds_per_token=row["prefill_s_per_token"],
            prefill_fixed_seconds=row["prefill_fixed_s"],
            forwards=row["rate_samples"],
        )
        for row in core.ledger.report()["namespaces"]
    ]


# ------------------------------------------------------------------ folding


def fold(
    cls: type[S],
    flat: Mapping[str, Any],
    where: str,
    families: Mapping[str, str] | None = None,
) -> S:
    """``cls`` from a component's flat ``status()`` (see the module docstring).
    ``families`` renames a family whose name is also a plain counter's
    (``recompute_cheaper_chunks`` and ``recompute_cheaper_chunks.L1``)."""
    kinds = _field_kinds(cls)
    values: dict[str, Any] = {}
    for name, value in flat.items():
        head, dot, member = name.partition(".")
        field = (families or {}).get(head, head) if dot else head
        kind = kinds.get(field)
        if kind is None or (dot and kind == "value"):
            _drop(where, name)
        elif kind == "value" or (not dot and kind == "family" and isinstance(value, Mapping)):
            values[field] = dict(value) if kind == "family" else value
        elif not dot:
            _drop(where, name)  # a section or a family needs a member
        else:
            values.setdefault(field, {})[member] = value
    for field, kind in kinds.items():
        if isinstance(kind, type) and field in values:
            values[field] = fold(kind, values[field], f"{where}.{field}")
    return cls(**values)


def unmapped() -> frozenset[str]:
    """Every counter name a status has dropped since the process started."""
    with _unmapped_lock:
        return frozenset(_unmapped)


def _drop(where: str, name: str) -> None:
    with _unmapped_lock:
        new = f"{where}.{name}" not in _unmapped
        _unmapped.add(f"{where}.{name}")
    if new:
        log.warning(
            "status: %s has no field for %r; it is not in /status or /metrics "
            "(add it to kvtier.protocol.status)",
            where,
            name,
        )


@functools.cache
def _field_kinds(cls: type[msgspec.Struct]) -> dict[str, Any]:
    """Each field of ``cls``: "value", "family" (a dict), or a section's type."""
    info = inspect.type_info(cls)
    assert isinstance(info, inspect.StructType)
    kinds: dict[str, Any] = {}
    for field in info.fields:
        t = field.type.type if isinstance(field.type, inspect.Metadata) else field.type
        if isinstance(t, inspect.DictType):
            kinds[field.name] = "family"
        elif isinstance(t, inspect.StructType):
            kinds[field.name] = t.cls
        else:
            kinds[field.name] = "value"
    return kinds


__all__ = ["fold", "server_status", "unmapped"]
