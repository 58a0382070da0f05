"""``QualityBoard``: the engines' quality-gate samples of lossy reuse, by
tenant, namespace and lossy path (``kvtier.engine.quality_gate``).

Each engine keeps its own gate and decides for itself; the board is the
node's view of them: samples, agreements and KL summed, and whether an
engine has turned the path off. The first report that a path is off is
logged, once per (tenant, namespace, path). Shown in ``/status``
(``quality``), on ``/metrics`` and on the dashboard.

A namespace is named by its clients, so each tenant keeps at most
``rows_per_tenant`` rows (``limits.max_namespace_rows``): past it the least
recently reported rows are summed into the tenant's ``(other)`` row of their
path (``kvtier.tenancy.folding``). Past it too, turn-offs are no longer
logged one by one (that would let the same client fill the log): the first
fold is logged once per tenant, and ``/status`` shows the rest.

Locking: one lock; reports come on the server loop, the status from any thread.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from dataclasses import dataclass

from kvtier.keys import NamespaceLabel
from kvtier.server.sessions import shown
from kvtier.tenancy.folding import OTHER, FoldingTable

log = logging.getLogger(__name__)


@dataclass(slots=True)
class QualityRow:
    tenant: str
    namespace: str  # model@salt
    path: str  # "blend", "codec:int8"...
    samples: int = 0
    agreed: int = 0
    kl_sum: float = 0.0
    off: bool = False


class QualityBoard:
    """See the module docstring."""

    def __init__(self, rows_per_tenant: int = 256) -> None:
        self._lock = threading.Lock()
        self._rows: FoldingTable[tuple[str, str], QualityRow] = FoldingTable(
            rows_per_tenant,
            lambda tenant, key: QualityRow(tenant, *key),
            _fold,
            lambda key: (OTHER, key[1]),
        )
        self._folding: set[str] = set()  # tenants whose rows were folded (logged once)

    def record(
        self,
        tenant: str,
        namespace: NamespaceLabel,
        path: str,
        agreed: bool,
        kl: float,
        off: bool,
    ) -> None:
        key = (str(namespace), path)
        with self._lock:
            # A new row while the tenant's are full folds an older one away.
            full = self._rows.full(tenant) and self._rows.get(tenant, key) is None
            row = self._rows.row(tenant, key)
            row.samples += 1
            row.agreed += agreed
            row.kl_sum += kl
            turned_off = off and not row.off
            row.off = row.off or off
            samples, agreement = row.samples, row.agreed / row.samples
            first_fold = full and tenant not in self._folding
            if full:
                self._folding.add(tenant)
        if first_fold:
            log.warning(
                "quality board: tenant %s reports on more than %d namespaces; the least "
                "recent are summed under %s and their turn-offs are no longer logged",
                shown(tenant),
                self._rows.per_tenant,
                OTHER,
            )
        if turned_off and not full:
            log.warning(
                "quality gate: an engine turned %s off for %s (tenant %s) after %d samples "
                "here (top-1 agreement %.3f): its prompts now get exact reuse or recompute",
                shown(path),
                shown(str(namespace)),
                shown(tenant),
                samples,
                agreement,
            )

    def rows(self) -> list[QualityRow]:
        with self._lock:
            return [dataclasses.replace(row) for _, _, row in self._rows.items()]

    @property
    def folded(self) -> int:
        """Rows folded into an other row so far."""
        with self._lock:
            return self._rows.folded


def _fold(into: QualityRow, row: QualityRow) -> None:
    into.samples += row.samples
    into.agreed += row.agreed
    into.kl_sum += row.kl_sum
    into.off = into.off or row.off
