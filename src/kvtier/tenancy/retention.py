"""``Retention``: each tenant's objects older than its ``retention_s`` are
removed, every ``check_s``, from L1 and from the node-local adapters (the fs
L2 knows when each file was written).

Shared stores keep their own clocks and are left to them: a Redis adapter's
``ttl_s``, an S3 bucket's lifecycle rule. An object a reader holds is not
removed (the next sweep takes it). Counted ``retention_removed.<tier>``.

No thread of its own: the server runs ``sweep`` every ``check_s`` on its
upkeep clock (``kvtier.server.upkeep``), off its loop, while ``active``.
"""

from __future__ import annotations

import functools
import logging

from kvtier.counters import Counters
from kvtier.keys import ObjectKey
from kvtier.storage import StorageManager
from kvtier.tenancy.tenants import TenantTable

log = logging.getLogger(__name__)


class Retention:
    """See the module docstring."""

    def __init__(self, storage: StorageManager, tenants: TenantTable, check_s: float = 60.0):
        self.storage = storage
        self.tenants = tenants
        self.check_s = check_s
        self.counters = Counters()
        self._rules = {t.name: t.retention_s for t in tenants.tenants.values() if t.retention_s}

    @property
    def active(self) -> bool:
        """Whether any tenant has a retention (else there is nothing to sweep)."""
        return bool(self._rules)

    def sweep(self) -> int:
        """One pass over every tenant with a retention; objects removed."""
        removed = 0
        for tenant, age in self._rules.items():
            gone = self.storage.remove_older_than(age, functools.partial(self._owns, tenant))
            for tier, done in gone.items():
                self.counters.add(f"retention_removed.{tier}", done)
                removed += done
        if removed:
            log.info("retention: %d objects past their tenants' retention removed", removed)
        return removed

    def _owns(self, tenant: str, key: ObjectKey) -> bool:
        return self.tenants.tenant_of(key.salt) == tenant


__all__ = ["Retention"]
