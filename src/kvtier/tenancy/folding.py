"""``FoldingTable``: per-tenant rows keyed by what a client names, bounded.

The quality board and the savings ledger keep a row per namespace, and a
namespace's model name is whatever a client sent in HELLO: one client
registering under ever new names would grow them, ``/status`` and
``/metrics`` without bound. Here each tenant has at most ``per_tenant``
rows. Past that, the least recently used row is folded into the tenant's
"other" row for its kind (``other_of(key)``: the ledger has one, the quality
board one per lossy path) with ``fold(into, row)``, so totals stay exact
while the rows stay bounded; the other rows are ordinary rows that are never
folded themselves. The tenants are bounded by the tenants file (without one,
every client is the tenant "").

Rejected: refusing reports past the cap (a real engine's numbers lost for
good, at the mercy of whoever registered first) and one cap for every
tenant together (one tenant's names would fold another's rows away).

Not thread-safe: the owner (board, ledger) calls it under its own lock.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Hashable, Iterator
from typing import Generic, TypeVar

OTHER = "(other)"  # the name an other row is shown under (no label can be spelled so)
MIN_ROWS = 4

Key = TypeVar("Key", bound=Hashable)
Row = TypeVar("Row")


class FoldingTable(Generic[Key, Row]):
    """See the module docstring."""

    def __init__(
        self,
        per_tenant: int,
        new_row: Callable[[str, Key], Row],
        fold: Callable[[Row, Row], None],
        other_of: Callable[[Key], Key],
    ) -> None:
        if per_tenant < MIN_ROWS:
            raise ValueError(f"rows per tenant must be at least {MIN_ROWS}, got {per_tenant}")
        self.per_tenant = per_tenant
        self._new_row = new_row
        self._fold = fold
        self._other_of = other_of
        self._tenants: dict[str, OrderedDict[Key, Row]] = {}
        self.folded = 0  # rows folded into an other row so far

    def row(self, tenant: str, key: Key) -> Row:
        """``key``'s row of ``tenant`` (made if new), now its most recent."""
        rows = self._tenants.setdefault(tenant, OrderedDict())
        found = rows.get(key)
        if found is not None:
            rows.move_to_end(key)
            return found
        self._make_room(tenant, rows)
        made = rows[key] = self._new_row(tenant, key)
        return made

    def get(self, tenant: str, key: Key) -> Row | None:
        """``key``'s row of ``tenant`` if there is one (not counted as use)."""
        return self._tenants.get(tenant, OrderedDict()).get(key)

    def full(self, tenant: str) -> bool:
        """Whether a new row of ``tenant`` would fold an older one."""
        return len(self._tenants.get(tenant, ())) >= self.per_tenant

    def items(self) -> Iterator[tuple[str, Key, Row]]:
        for tenant, rows in self._tenants.items():
            for key, row in rows.items():
                yield tenant, key, row

    def __len__(self) -> int:
        return sum(len(rows) for rows in self._tenants.values())

    def _make_room(self, tenant: str, rows: OrderedDict[Key, Row]) -> None:
        """Fold the least recent rows (never an other row) into their other
        rows until one more fits. An other row made on the way takes the
        victim's place, so the loop goes on to the next victim."""
        while len(rows) >= self.per_tenant:
            victim = next((k for k in rows if self._other_of(k) != k), None)
            if victim is None:
                return  # only other rows: at most one per kind (MIN_ROWS covers them)
            row = rows.pop(victim)
            other = self._other_of(victim)
            if other not in rows:
                rows[other] = self._new_row(tenant, other)
            self._fold(rows[other], row)
            self.folded += 1


__all__ = ["MIN_ROWS", "OTHER", "FoldingTable"]
