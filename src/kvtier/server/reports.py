"""``EngineReports``: what engines report to the cache server, counted.

Three requests carry an engine's own measurements, and each feeds one part of
``/status``:

- ``SHADOW_REPORT``: its shadow checks of loaded KV against recomputation
  (``server.shadow_chunks``: checked, mismatched, unavailable); a mismatch is
  logged, since it means kvtier served KV that differs from the model's;
- ``QUALITY_REPORT``: one quality-gate sample of a lossy path (``quality``,
  ``kvtier.server.quality``);
- ``USAGE_REPORT``: its prefill rate, and the seconds and tokens it spent
  loading KV, for the savings ledger (``ledger``).

Numbers out of range are a ``bad_request`` that names the bound. Runs on the
server's loop thread, like every handler; ``Counters`` and the ledger lock
for themselves.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence

from kvtier.counters import Counters
from kvtier.keys import NamespaceLabel
from kvtier.layout import LOSSY_CODECS
from kvtier.protocol import messages as p
from kvtier.server.limits import RequestError
from kvtier.server.quality import QualityBoard
from kvtier.server.requests import Buffer, Outcome
from kvtier.server.sessions import Client, shown
from kvtier.tenancy.ledger import SavingsLedger

log = logging.getLogger(__name__)

MAX_SHADOW_REPORT = 1 << 32  # chunks (or tokens) in one report
MAX_REPORT_S = 1e6  # seconds in one usage report
# The lossy paths an engine can report on: a closed set, so that one client
# cannot grow the quality board (and /metrics' label values) without bound.
LOSSY_PATHS = ("blend", *(f"codec:{codec}" for codec in LOSSY_CODECS))


class EngineReports:
    """The handlers of the two reports; see the module docstring."""

    def __init__(self, counters: Counters, ledger: SavingsLedger, quality: QualityBoard) -> None:
        self._counters = counters
        self._ledger = ledger
        self._quality = quality

    def shadow(self, client: Client, req: p.ShadowReport, frames: Sequence[Buffer]) -> Outcome:
        counts = {"checked": req.checked, "mismatched": req.mismatched}
        counts["unavailable"] = req.unavailable
        if not all(0 <= n <= MAX_SHADOW_REPORT for n in counts.values()):
            raise RequestError(
                "bad_request", f"shadow report counts must be in [0, {MAX_SHADOW_REPORT}]"
            )
        if req.mismatched > req.checked:
            raise RequestError("bad_request", "a shadow report has more mismatches than checks")
        if req.mismatched:
            log.warning(
                "client %s reports %d shadow-check mismatches: kvtier served KV that differs "
                "from the engine's recomputation",
                shown(client.client_id),
                req.mismatched,
            )
        for name, n in counts.items():
            self._counters.add(f"shadow_chunks.{name}", n)
        return p.Ack(), []

    def quality(self, client: Client, req: p.QualityReport, frames: Sequence[Buffer]) -> Outcome:
        if req.path not in LOSSY_PATHS:
            raise RequestError(
                "bad_request",
                f"a quality report's path must be one of {list(LOSSY_PATHS)}, "
                f"got {shown(req.path)}",
            )
        if not (math.isfinite(req.kl) and 0 <= req.kl <= p.MAX_REPORTED_KL):
            raise RequestError(
                "bad_request", f"a quality report's kl must be in [0, {p.MAX_REPORTED_KL}]"
            )
        namespace = NamespaceLabel.of(client)
        self._quality.record(client.tenant, namespace, req.path, req.agreed, req.kl, req.off)
        return p.Ack(), []

    def usage(self, client: Client, req: p.UsageReport, frames: Sequence[Buffer]) -> Outcome:
        for name, seconds in (("prefill_s", req.prefill_s), ("load_s", req.load_s)):
            if not (math.isfinite(seconds) and 0 <= seconds <= MAX_REPORT_S):
                message = f"a usage report's {name} must be in [0, {MAX_REPORT_S}]"
                raise RequestError("bad_request", message)
        for name, tokens in (
            ("computed_tokens", req.computed_tokens),
            ("loaded_tokens", req.loaded_tokens),
        ):
            if not 0 <= tokens <= MAX_SHADOW_REPORT:
                message = f"a usage report's {name} must be in [0, {MAX_SHADOW_REPORT}]"
                raise RequestError("bad_request", message)
        self._ledger.reported(
            client.tenant,
            NamespaceLabel.of(client),
            req.prefill_s,
            req.computed_tokens,
            req.load_s,
            req.loaded_tokens,
        )
        return p.Ack(), []


__all__ = ["MAX_REPORT_S", "MAX_SHADOW_REPORT", "EngineReports"]
