"""``Retention``: each tenant's objects older than its ``retention_s`` are
removed, every ``check_s``, from L1 and from the node-local adapters (the fs
L2 knows when each file was written).

Shared stores keep their own clocks and are left to them: a Redis adapter's
``ttl_s``, an S3 bucket's lifecycle rule. An object a reader holds is not
removed (the next sweep takes it). Counted ``retention_removed.<tier>``.
"""

from __future__ import annotations

import logging
import threading

from kvtier.counters import Counters
from kvtier.l1 import L1Result
from kvtier.storage import StorageManager
from kvtier.tenancy.tenants import TenantTable

log = logging.getLogger(__name__)


class Retention:
    """See the module docstring; a thread of its own when any tenant has a retention."""

    def __init__(self, storage: StorageManager, tenants: TenantTable, check_s: float = 60.0):
        self.storage = storage
        self.tenants = tenants
        self.check_s = check_s
        self.counters = Counters()
        self._rules = {t.name: t.retention_s for t in tenants.tenants.values() if t.retention_s}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        if self._rules:
            self._thread = threading.Thread(target=self._run, name="kvtier-retention", daemon=True)
            self._thread.start()

    def sweep(self) -> int:
        """One pass over every tenant with a retention; objects removed."""
        removed = 0
        owner = self.tenants.tenant_of
        for tenant, age in self._rules.items():
            old = [k for k in self.storage.l1.older_than(age) if owner(k.salt) == tenant]
            done = sum(r is L1Result.SUCCESS for r in self.storage.l1.delete(old))
            self.counters.add("retention_removed.L1", done)
            removed += done
            for adapter in self.storage.adapters:
                if adapter.shared:
                    continue
                stale = [k for k in adapter.older_than(age) if owner(k.salt) == tenant]
                done = adapter.delete(stale) if stale else 0
                self.counters.add(f"retention_removed.{adapter.name}", done)
                removed += done
        if removed:
            log.info("retention: %d objects past their tenants' retention removed", removed)
        return removed

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)

    def _run(self) -> None:
        while not self._stop.wait(self.check_s):
            try:
                self.sweep()
            except Exception:
                log.exception("retention: a sweep failed")


__all__ = ["Retention"]
