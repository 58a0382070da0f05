"""``QualityBoard``: the engines' quality-gate samples of lossy reuse, by
tenant, namespace and lossy path (``kvtier.engine.quality_gate``).

Each engine keeps its own gate and decides for itself; the board is the
node's view of them: samples, agreements and KL summed, and whether an
engine has turned the path off. The first report that a path is off is
logged, once per (tenant, namespace, path). Shown in ``/status``
(``quality``), on ``/metrics`` and on the dashboard.

Locking: one lock; reports come on the server loop, the status from any thread.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from dataclasses import dataclass

from kvtier.keys import NamespaceLabel
from kvtier.server.sessions import shown

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

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._rows: dict[tuple[str, str, str], QualityRow] = {}

    def record(
        self,
        tenant: str,
        namespace: NamespaceLabel,
        path: str,
        agreed: bool,
        kl: float,
        off: bool,
    ) -> None:
        key = (tenant, str(namespace), path)
        with self._lock:
            row = self._rows.setdefault(key, QualityRow(*key))
            row.samples += 1
            row.agreed += agreed
            row.kl_sum += kl
            turned_off = off and not row.off
            row.off = row.off or off
            samples, agreement = row.samples, row.agreed / row.samples
        if turned_off:
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
            return [dataclasses.replace(row) for row in self._rows.values()]
