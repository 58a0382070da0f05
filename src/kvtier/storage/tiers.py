"""``StorageTiers``: L1 and the L2 adapters behind a ``StorageManager``
(``kvtier.storage.manager``, whose base class this is), and what callers may
do to one tier at a time.

``StorageManager`` adds the controllers between the tiers and the data path
(store, lookup, retrieve, release). This class builds the tiers, tells them
their owners, reports what they hold to KV events, and carries:

- L1: ``arena_name``, ``l1_capacity``, ``read_lease_s``, ``in_l1``, ``pin``,
  ``delete_l1``, ``clear_l1``, ``l1_status``, ``l1_audit``; read locks that a
  caller keeps itself (a hand-off): ``reserve_read_all``, ``view``,
  ``finish_read``.
- Owners (the cache server's tenants, given at construction as ``Owners``):
  ``owner_usage``, ``owner_limit``, ``set_owner_limit``.
- Tiers by name (``tiers()``: ``L1``, then the adapters fastest first):
  ``held_sizes``, ``remove_older_than`` (retention), and the steps of a
  purge: ``resident_keys``, ``purge_l1``, ``staging_count``,
  ``purged_in_io_count``, ``purge_l2``.

Callers use these operations, never L1 or an adapter itself: their locks,
leases and KV events are this object's to keep consistent. Thread safety:
L1 and each adapter lock for themselves; the fields set here do not change
after construction, except the layout book (``_remember``: a dict that one
caller at a time extends, and that readers only index).
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import numpy.typing as npt

from kvtier.events.residency import L1_TIER, Residency, Tier
from kvtier.keys import KeySelector, ObjectKey
from kvtier.l1 import L1Config, L1Manager, L1Result, Placement
from kvtier.l1.quotas import OwnerLimit
from kvtier.l2 import L2Adapter, TaskKind, TaskResult, make_adapter
from kvtier.l2.base import CompletionCallback, PurgeStep
from kvtier.l2.seal import Sealer
from kvtier.layout import KVLayout

L1 = L1_TIER.name  # the tier name of L1; the others are the adapters' names

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Owners:
    """Who owns each object and what each owner may hold (the cache server's
    tenants): ``owner_of(key.salt)`` names the owner; ``l1_limits`` are its
    L1 limits; ``l2_caps`` (adapter name -> owner -> bytes) are kept by each
    node-local adapter that can, as each store lands (``self_capped_tiers``)."""

    owner_of: Callable[[str], str]
    l1_limits: Mapping[str, OwnerLimit] = field(default_factory=dict)
    l2_caps: Mapping[str, Mapping[str, int]] = field(default_factory=dict)


class StorageTiers:
    """L1 and the adapters, by tier name; see the module docstring."""

    def __init__(
        self,
        l1: L1Config,
        l2: Sequence[Mapping[str, Any]],
        on_complete: CompletionCallback,
        *,
        residency: Residency | None = None,
        clock: Callable[[], float] = time.monotonic,
        owners: Owners | None = None,
        seal: Sealer | None = None,
    ) -> None:
        """``l2``: adapter specs, fastest first; ``on_complete``: told of
        every adapter task's result (the adapters' threads); ``seal``: what
        every shared store seals its objects with (a node-local tier, written
        by this server alone, is inside its trust as L1 is: unsealed)."""
        self._residency = residency
        self._events_tiers: dict[str, Tier] = {}  # adapter name -> its tier in KV events
        self._l1 = L1Manager(l1, clock=clock)
        self._adapters: list[L2Adapter] = []
        try:
            for spec in l2:
                adapter = make_adapter(spec, on_complete)
                if any(a.name == adapter.name for a in self._adapters):
                    adapter.close()
                    raise ValueError(
                        f"two L2 adapters are named {adapter.name!r}; give each a distinct 'name'"
                    )
                self._adapters.append(adapter)
        except BaseException:
            self._close_adapters()
            self._l1.close()
            raise
        # Layouts by digest, for the adapters' codecs (they are told digests)
        self._layouts: dict[str, KVLayout] = {}
        self._digests: dict[KVLayout, str] = {}
        for adapter in self._adapters:
            adapter.register_memory(self._l1.memory)
            adapter.share_layouts(self._layouts)
            adapter.seal_with(seal if adapter.shared else None)
        self._say_sealing(seal)
        self._self_capped = self._set_owners(owners) if owners is not None else frozenset()
        if residency is not None:
            self._report_residency(residency)

    def _say_sealing(self, seal: Sealer | None) -> None:
        """Whether the shared stores' objects are sealed, once at start."""
        shared = ", ".join(a.name for a in self._adapters if a.shared)
        if not shared:
            return
        if seal is None:
            log.info(
                "L2 %s: objects not sealed (no cluster secret): a copy is checked against its "
                "checksum only, so whoever can write to the store can plant KV; set a cluster "
                "secret (kvtier serve --cluster-secret-file) to seal them",
                shared,
            )
        else:
            log.info("L2 %s: objects sealed (key %s)", shared, seal.key_ids[0])

    # -------------------------------------------------------------------- L1

    @property
    def arena_name(self) -> str:
        """L1's shared-memory region, for other processes to map."""
        return self._l1.arena_name

    @property
    def l1_capacity(self) -> int:
        """L1's bytes."""
        return self._l1.capacity

    @property
    def read_lease_s(self) -> float:
        """How long an L1 read lock lasts unless taken again."""
        return self._l1.config.read_lease_s

    def wait_mapped(self, timeout: float | None = None) -> bool:
        """Wait until every L1 page is mapped (``L1Config.populate``)."""
        return self._l1.wait_mapped(timeout)

    def in_l1(self, key: ObjectKey) -> bool:
        """Whether L1 holds ``key`` now (a copy being written does not count)."""
        return self._l1.contains(key)

    def pin(self, keys: Sequence[ObjectKey], ttl_s: float) -> list[L1Result]:
        """Keep L1 objects from eviction for ``ttl_s`` (0 unpins); per key
        SUCCESS, NOT_FOUND (not in L1) or OVER_QUOTA (past the owner's pin
        limit, or L1's ``max_pinned_fraction``)."""
        return self._l1.pin(keys, ttl_s)

    def delete_l1(self, keys: Sequence[ObjectKey]) -> list[L1Result]:
        """Free L1 objects; per key SUCCESS, NOT_FOUND, or LOCKED (a reader
        or an I/O holds it: it stays)."""
        return self._l1.delete(keys)

    def clear_l1(self) -> int:
        """Free every L1 object nobody holds; how many."""
        return self._l1.clear()

    def l1_status(self) -> dict[str, object]:
        """L1's gauges and counters (``status()["l1"]``, without asking the rest)."""
        return self._l1.status()

    def l1_audit(self) -> dict[str, int]:
        """L1's locks and bytes recounted from its tables (tests, debugging)."""
        return self._l1.audit()

    def reserve_read_all(
        self, keys: Sequence[ObjectKey], layout: KVLayout | None = None
    ) -> tuple[list[Placement], int]:
        """Read-lock every one of ``keys`` in L1 once, or none of them: their
        placements, and how many are not in L1 under ``layout`` (None:
        stored without one) (0: all are locked; else none is, and the
        placements are empty). The caller
        keeps these locks, reads them with ``view`` and drops each once with
        ``finish_read`` (``release`` is for a lookup's locks); a lock not
        taken again lapses after ``read_lease_s``."""
        digest = self._remember(layout) if layout else ""
        return self._l1.reserve_read_all(keys, layouts={key.group: digest for key in keys})

    def view(self, placement: Placement) -> npt.NDArray[np.uint8]:
        """The bytes of a successful placement (a read lock or a store
        reservation) as a writable view, no copy; valid while it is held."""
        return self._l1.view(placement)

    def finish_read(self, keys: Sequence[ObjectKey]) -> list[L1Result]:
        """Drop one lock per key taken with ``reserve_read_all``; per key
        SUCCESS, WRONG_STATE (it holds none) or NOT_FOUND."""
        return self._l1.finish_read(keys)

    # ---------------------------------------------------------------- owners

    def owner_usage(self) -> dict[str, dict[str, int]]:
        """Per owner, in L1: ``bytes`` (resident + being written) and ``pinned_bytes``."""
        return self._l1.owner_usage()

    def owner_limit(self, owner: str) -> OwnerLimit:
        """``owner``'s L1 limits (no limit where none was given)."""
        return self._l1.limit(owner)

    def set_owner_limit(self, owner: str, limit: OwnerLimit) -> int:
        """Change ``owner``'s L1 limits and keep them at once: its pins past a
        lower pin limit end, then its objects past a lower soft limit are
        evicted (returns the bytes freed)."""
        return self._l1.set_limit(owner, limit)

    # ----------------------------------------------------------------- tiers

    def tiers(self) -> list[str]:
        """``L1``, then the adapters' names in lookup order (fastest first)."""
        return [L1, *(a.name for a in self._adapters)]

    def self_capped_tiers(self) -> frozenset[str]:
        """The adapters that keep their owners' ``l2_caps`` themselves."""
        return self._self_capped

    def held_sizes(self, tier: str) -> list[tuple[ObjectKey, int]]:
        """What ``tier`` holds, each object's key and bytes (a snapshot): L1's
        objects, or a node-local adapter's (a shared store lists nothing)."""
        if tier == L1:
            return self._l1.resident_sizes()
        return self._adapter(tier).held_sizes()

    def remove_older_than(self, age_s: float, which: Callable[[ObjectKey], bool]) -> dict[str, int]:
        """Remove the objects ``which`` picks that are older than ``age_s``
        from L1 and the node-local adapters (a shared store keeps its own
        clock: a Redis ``ttl_s``, an S3 lifecycle rule); per tier, how many
        went. An L1 object a reader holds stays (the next call takes it)."""
        old = [k for k in self._l1.older_than(age_s) if which(k)]
        removed = {L1: sum(r is L1Result.SUCCESS for r in self._l1.delete(old))}
        for adapter in self._adapters:
            if not adapter.shared:
                stale = [k for k in adapter.older_than(age_s) if which(k)]
                removed[adapter.name] = adapter.delete(stale) if stale else 0
        return removed

    # ---------------------------------------------------------------- purges

    def resident_keys(self, selector: KeySelector) -> list[ObjectKey]:
        """L1's objects that ``selector`` matches, newest first (a snapshot)."""
        return [k for k, _ in self._l1.resident_objects() if selector.matches(k)]

    def purge_l1(self, keys: Sequence[ObjectKey]) -> list[L1Result]:
        """Delete L1 objects for good: SUCCESS, freed now; LOCKED, held (no
        reader finds it any more; freed when the last holder lets go);
        NOT_FOUND."""
        return self._l1.purge(keys)

    def staging_count(self, selector: KeySelector) -> int:
        """Copies of objects ``selector`` matches being written into L1 (a
        store or a load in flight)."""
        return sum(selector.matches(k) for k in self._l1.staging_keys())

    def purged_in_io_count(self, selector: KeySelector) -> int:
        """Purged L1 objects ``selector`` matches that an I/O (a write-back to
        an L2) still reads."""
        return sum(bool(io) and selector.matches(k) for k, io in self._l1.doomed_objects())

    def purge_l2(
        self, tier: str, selector: KeySelector, cursor: str | None, limit: int
    ) -> PurgeStep:
        """One step of purging adapter ``tier`` (``L2Adapter.purge``): a
        backend failure raises, and so does an adapter that cannot purge."""
        return self._adapter(tier).purge(selector, cursor, limit)

    # ------------------------------------------------------------ internals

    def _adapter(self, name: str) -> L2Adapter:
        found = next((a for a in self._adapters if a.name == name), None)
        if found is None:
            raise ValueError(f"no L2 tier {name!r}; the tiers are {self.tiers()}")
        return found

    def _remember(self, layout: KVLayout) -> str:
        """``layout``'s digest, the layout kept for the adapters' codecs."""
        digest = self._digests.get(layout)
        if digest is None:
            digest = self._digests[layout] = layout.digest()
            self._layouts[digest] = layout
        return digest

    def _set_owners(self, owners: Owners) -> frozenset[str]:
        """Tell L1 and each node-local adapter who owns what and the limits;
        the adapters that keep their caps themselves."""
        self._l1.set_owners(owners.owner_of, dict(owners.l1_limits))
        return frozenset(
            a.name
            for a in self._adapters
            if not a.shared and a.set_owners(owners.owner_of, owners.l2_caps.get(a.name, {}))
        )

    def _report_residency(self, residency: Residency) -> None:
        """Tell ``residency`` (KV events) what each tier holds and will hold:
        what node-local adapters hold now, then every change."""
        self._events_tiers = {a.name: Tier(a.name, a.shared) for a in self._adapters}
        for adapter in self._adapters:
            tier = self._events_tiers[adapter.name]
            residency.added(tier, adapter.held_keys())
            adapter.on_removed = functools.partial(residency.removed, tier)

        def on_l1(stored: bool, keys: Sequence[ObjectKey]) -> None:
            (residency.added if stored else residency.removed)(L1_TIER, keys)

        self._l1.on_residency = on_l1

    def _note_residency(self, result: TaskResult) -> None:
        """Stores that landed; objects a shared store's lookup or load found
        gone (a node-local adapter reports its own removals)."""
        if self._residency is None:
            return
        tier = self._events_tiers[result.adapter]
        if result.kind is TaskKind.STORE:
            self._residency.added(
                tier, [k for k, ok in zip(result.keys, result.ok, strict=True) if ok]
            )
        elif tier.shared and not result.failure:
            self._residency.removed(
                tier, [k for k, ok in zip(result.keys, result.ok, strict=True) if not ok]
            )

    def _close_adapters(self) -> None:
        for adapter in self._adapters:
            adapter.close()


__all__ = ["L1", "Owners", "StorageTiers"]
