"""``L2Usage``: what each tenant holds in each L2 adapter, and its quota there.

A tenant's ``l2_bytes`` quota names a cap per adapter. What "holds" means
depends on what one node can see:

- a **node-local** adapter that keeps caps itself (fs, mock:
  ``L2Adapter.set_owners``) is told each tenant's cap there, and a store
  that takes a tenant past it evicts that tenant's *own* oldest objects as
  it lands (tenant-scoped eviction, counted in the adapter's
  ``quota_evictions``), never another's. Its usage is exact (its index,
  re-counted for display every ``refresh_s`` where a cap is, every
  ``IDLE_REFRESH_S`` otherwise);
- a **shared** store (Redis, S3, Mooncake), or a node-local one that cannot
  keep caps, also holds what other nodes wrote or cannot be listed cheaply:
  usage is what *this* server wrote there since it started, and past the cap
  its write-back skips the tenant's objects (the store controller's gate;
  counted ``over_quota.<adapter>``). Expiry or eviction inside the store is
  not seen, so this errs toward refusing.

``gate`` runs on the store controller's thread, ``on_stored`` on the
adapters' threads, ``refresh`` on the server's upkeep clock (every
``refresh_s`` while ``active``, off its loop: ``kvtier.server.upkeep``); one
lock guards the counters.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from kvtier.counters import Counters
from kvtier.keys import NamespaceLabel, ObjectKey
from kvtier.l2.base import TaskKind, TaskResult
from kvtier.storage import StorageManager
from kvtier.tenancy.folding import OTHER, FoldingTable
from kvtier.tenancy.tenants import TenantTable

log = logging.getLogger(__name__)
IDLE_REFRESH_S = 60.0


class L2Usage:
    """See the module docstring."""

    def __init__(
        self, tenants: TenantTable, refresh_s: float = 2.0, rows_per_tenant: int = 256
    ) -> None:
        """Built before the storage, which takes ``gate`` and ``on_stored`` at
        construction (``StorageManager(..., owners=tenants.owners(),
        store_gate=usage.gate, on_stored=usage.on_stored)``); ``watch`` it
        then, before it takes stores."""
        self.tenants = tenants
        self.refresh_s = refresh_s
        self.counters = Counters()
        self._lock = threading.Lock()
        self._owner: Callable[[str], str] = tenants.tenant_of
        self._held: dict[tuple[str, str], int] = {}  # (tenant, adapter) -> bytes, local
        self._written: dict[tuple[str, str], int] = {}  # (tenant, adapter) -> bytes, gated
        # Per tenant, (namespace, adapter) -> [objects, bytes] written to shared
        # stores; namespaces are named by clients, so bounded (kvtier.tenancy.folding).
        self._namespaces: FoldingTable[tuple[NamespaceLabel | str, str], list[int]] = FoldingTable(
            rows_per_tenant, lambda tenant, key: [0, 0], _fold, _other
        )
        self._pending: dict[tuple[str, str], int] = {}  # approved, not yet stored
        self._caps = {
            (t.name, adapter): cap
            for t in tenants.tenants.values()
            for adapter, cap in t.quota.l2_bytes.items()
        }
        self._storage: StorageManager | None = None  # set once, by watch
        self._local: frozenset[str] = frozenset()  # adapters that keep their caps themselves

    def watch(self, storage: StorageManager) -> None:
        """Count what ``storage``'s node-local adapters hold, from now on: the
        storage built with this usage's hooks (see ``__init__``). ValueError
        if a tenant has a cap on one of its adapters that only those hooks
        keep (one that does not keep caps itself) and it was built without
        them."""
        if self._storage is not None:
            raise ValueError("L2Usage.watch: this usage already watches a storage")
        local = storage.self_capped_tiers()
        gated = sorted({a for _, a in self._caps if a in storage.tiers() and a not in local})
        if gated and not storage.has_store_hooks(self.gate, self.on_stored):
            # Without them the caps below would be shown but never kept.
            raise ValueError(
                f"L2Usage.watch: the tenants' l2_bytes caps on {', '.join(gated)} are kept "
                "by this usage's hooks: build the storage with store_gate=usage.gate and "
                "on_stored=usage.on_stored (and pass this usage to the server as l2_usage)"
            )
        self._storage = storage
        self._local = local
        # Re-counting a disk of a million objects is not free: often only where
        # a tenant near its local cap wants to see it, else now and then.
        if not any(adapter in self._local for _, adapter in self._caps):
            self.refresh_s = max(self.refresh_s, IDLE_REFRESH_S)
        if self.active:
            self.refresh()

    @property
    def active(self) -> bool:
        """Whether there is usage to count (a cap, or an adapter that keeps caps)."""
        return bool(self._caps or self._local)

    # ---------------------------------------------------------- write-back

    def gate(self, adapter: str, key: ObjectKey, nbytes: int) -> bool:
        """Whether the store controller may write ``key`` to ``adapter``: always
        where the adapter keeps the cap itself, elsewhere while the tenant
        stays under its cap."""
        if not self._caps or adapter in self._local:
            return True
        tenant = self._owner(key.salt)
        cap = self._caps.get((tenant, adapter))
        if cap is None:
            return True
        with self._lock:
            used = self._written.get((tenant, adapter), 0) + self._pending.get((tenant, adapter), 0)
            if used + nbytes > cap:
                self.counters.add(f"over_quota.{adapter}")
                return False
            self._pending[(tenant, adapter)] = self._pending.get((tenant, adapter), 0) + nbytes
        return True

    def on_stored(self, result: TaskResult) -> None:
        """A store task's result: what landed in a gated store counts."""
        if result.kind is not TaskKind.STORE or result.adapter in self._local:
            return
        per_key = result.nbytes // max(result.count, 1)
        with self._lock:
            for key, ok in zip(result.keys, result.ok, strict=True):
                tenant = self._owner(key.salt)
                slot = (tenant, result.adapter)
                if slot in self._pending:
                    self._pending[slot] = max(0, self._pending[slot] - per_key)
                if ok:
                    self._written[slot] = self._written.get(slot, 0) + per_key
                    where = (NamespaceLabel.of_key(key), result.adapter)
                    counts = self._namespaces.row(tenant, where)
                    counts[0] += 1
                    counts[1] += per_key

    # -------------------------------------------------------------- reads

    def by_tenant(self) -> dict[str, dict[str, int]]:
        """Tenant -> adapter -> bytes (local: held; shared: written here)."""
        out: dict[str, dict[str, int]] = {}
        with self._lock:
            for (tenant, adapter), nbytes in (*self._held.items(), *self._written.items()):
                out.setdefault(tenant, {})[adapter] = nbytes
        return out

    def written(self) -> list[tuple[str, NamespaceLabel | str, str, int, int]]:
        """(tenant, namespace, shared adapter, objects, bytes) this server
        wrote; a tenant's least recent namespaces past ``rows_per_tenant``
        are summed under the namespace ``OTHER``."""
        with self._lock:
            return [
                (tenant, namespace, adapter, counts[0], counts[1])
                for tenant, (namespace, adapter), counts in self._namespaces.items()
            ]

    def status(self) -> dict[str, int]:
        flat = {
            f"tenant_bytes.{tenant}/{adapter}": nbytes
            for tenant, tiers in self.by_tenant().items()
            for adapter, nbytes in tiers.items()
        }
        return {**flat, **self.counters.snapshot()}

    # ------------------------------------------------------------ refresh

    def refresh(self) -> None:
        """Re-count what each tenant holds in the node-local adapters."""
        if self._storage is None:
            return
        for adapter in self._local:
            per_tenant: dict[str, int] = {}
            for key, size in self._storage.held_sizes(adapter):
                tenant = self._owner(key.salt)
                per_tenant[tenant] = per_tenant.get(tenant, 0) + size
            with self._lock:
                for slot in [s for s in self._held if s[1] == adapter]:
                    del self._held[slot]
                for tenant, used in per_tenant.items():
                    self._held[(tenant, adapter)] = used


def _fold(into: list[int], counts: list[int]) -> None:
    into[0] += counts[0]
    into[1] += counts[1]


def _other(key: tuple[NamespaceLabel | str, str]) -> tuple[NamespaceLabel | str, str]:
    return (OTHER, key[1])


__all__ = ["L2Usage"]
