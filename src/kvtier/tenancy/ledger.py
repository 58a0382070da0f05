"""``SavingsLedger``: what the cache bought, per tenant and namespace.

For each (tenant, namespace ``model@salt``):

- **tokens served** from each tier: the server's own lookup answers (hit
  chunks x chunk size, by the tier each chunk came from). This is what
  kvtier *offered*, not what it saved: vLLM loads only the part of a hit
  past its own prefix cache, and its scheduler and worker each look the
  same chunks up;
- **tokens loaded**: what the engines report copying from kvtier into
  their KV cache (``UsageReport.loaded_tokens``: the transformers
  integration after each prefill or blend, the vLLM connector after each
  step that loads, blends or stores), tokens the engine would otherwise
  have computed (a blend recomputes a share of them: for it, an upper bound);
- **prefill seconds saved**: each report's loaded tokens x what one more
  computed token costs the namespace's engines: the per-token part of a fit,
  ``fixed + per_token x tokens`` (``kvtier.costfit``), over the forwards
  its engines report (each report carries one: its seconds and computed
  tokens). A forward's fixed part (an engine step's own time) is paid with
  or without the cache, so it is not a saving: a rate taken as a forward's
  time over its tokens, the ledger's before, priced a vLLM-CPU hit at
  0.53 ms a token where a whole no-cache prefill cost 0.33 ms a token, and
  reported savings 1.6 times too high. Until the namespace's engines have
  reported a forward, loads are priced at ``default_prefill_s_per_token`` if
  set; failing that, their tokens wait, unpriced, for the first one. While
  any wait and none is known, saved is unknown (``None``: the ledger does
  not invent a rate);
- **load seconds spent**: what the engines report spending to load KV;
- **net seconds**: saved minus spent — the time the cache bought.

Loads are counted per namespace, not per tier: a report does not say
which tier its tokens came from (``served`` does, per lookup).

A namespace is named by its clients, so each tenant keeps at most
``rows_per_tenant`` of them (``limits.max_namespace_rows``): past it, the
least recently used are summed into the tenant's ``(other)`` row
(``kvtier.tenancy.folding``), totals intact.

``served`` and ``reported`` run on the server loop; ``report`` and
``status`` on any thread; one lock guards the table.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field, replace
from typing import Any

from kvtier.costfit import CostFit
from kvtier.keys import NamespaceLabel
from kvtier.tenancy.folding import OTHER, FoldingTable

PRIOR_S_PER_TOKEN = 1e-3  # the fit's start, replaced by the first forward reported


@dataclass(slots=True)
class _Entry:
    served: dict[str, int] = field(default_factory=dict)  # tier -> tokens
    load_s: float = 0.0
    loaded_tokens: int = 0
    saved_s: float = 0.0  # loaded tokens priced when they were reported
    unpriced_tokens: int = 0  # loaded before any rate was known
    fit: CostFit | None = None  # the engines' forwards (None: none reported yet)
    reports: int = 0

    @property
    def rate(self) -> float | None:
        """Seconds one more computed token costs (None: no forward reported)."""
        return None if self.fit is None else self.fit.per_token_s


class SavingsLedger:
    """See the module docstring."""

    def __init__(
        self, default_prefill_s_per_token: float | None = None, rows_per_tenant: int = 256
    ) -> None:
        self.default_rate = default_prefill_s_per_token
        self._lock = threading.Lock()
        self._entries: FoldingTable[NamespaceLabel | str, _Entry] = FoldingTable(
            rows_per_tenant, lambda tenant, key: _Entry(), _fold, lambda key: OTHER
        )

    def served(self, tenant: str, namespace: NamespaceLabel, tier: str, tokens: int) -> None:
        """A lookup answered ``tokens`` from ``tier`` (offered, not saved)."""
        with self._lock:
            entry = self._entries.row(tenant, namespace)
            entry.served[tier] = entry.served.get(tier, 0) + tokens

    def reported(
        self,
        tenant: str,
        namespace: NamespaceLabel,
        prefill_s: float,
        computed_tokens: int,
        load_s: float,
        loaded_tokens: int,
    ) -> None:
        """An engine's ``UsageReport``: its forward teaches the namespace's
        fit, then its loaded tokens are credited as saved at the fit's
        per-token part (see the module docstring for a namespace without one)."""
        with self._lock:
            entry = self._entries.row(tenant, namespace)
            entry.load_s += load_s
            entry.loaded_tokens += loaded_tokens
            if computed_tokens > 0 and prefill_s > 0:
                if entry.fit is None:
                    entry.fit = CostFit(0.0, PRIOR_S_PER_TOKEN)
                entry.fit.add(computed_tokens, prefill_s)
            price = entry.rate if entry.rate is not None else self.default_rate
            if price is None:
                entry.unpriced_tokens += loaded_tokens
            else:
                entry.saved_s += loaded_tokens * price
            entry.reports += 1

    def measured_rate(self, tenant: str, namespace: NamespaceLabel) -> float | None:
        """The prefill seconds per token the namespace's engines reported (None: none yet)."""
        with self._lock:
            entry = self._entries.get(tenant, namespace)
            return None if entry is None else entry.rate

    def report(self) -> dict[str, Any]:
        """Every (tenant, namespace): tokens served by tier, tokens loaded,
        the namespace's rate, saved, spent and net seconds; and the totals
        per tenant."""
        rows: list[dict[str, Any]] = []
        tenants: dict[str, dict[str, float]] = {}
        with self._lock:
            items = [((t, k), _copy(e)) for t, k, e in self._entries.items()]
        # In the text order of the namespaces, as listings show them.
        for (tenant, namespace), entry in sorted(items, key=lambda i: (i[0][0], str(i[0][1]))):
            rate = entry.rate if entry.rate is not None else self.default_rate
            saved = _saved(entry, rate)
            served = sum(entry.served.values())
            rows.append(
                {
                    "tenant": tenant,
                    "namespace": str(namespace),
                    "served_tokens": dict(entry.served),
                    "loaded_tokens": entry.loaded_tokens,
                    "prefill_s_per_token": rate,
                    "prefill_fixed_s": None if entry.fit is None else entry.fit.fixed_s,
                    "rate_samples": 0 if entry.fit is None else entry.fit.samples,
                    "saved_s": saved,
                    "load_s": entry.load_s,
                    "net_s": None if saved is None else saved - entry.load_s,
                }
            )
            total = tenants.setdefault(
                tenant, {"served_tokens": 0, "loaded_tokens": 0, "saved_s": 0.0, "load_s": 0.0}
            )
            total["served_tokens"] += served
            total["loaded_tokens"] += entry.loaded_tokens
            total["saved_s"] += saved or 0.0
            total["load_s"] += entry.load_s
        for total in tenants.values():
            total["net_s"] = total["saved_s"] - total["load_s"]
        return {"namespaces": rows, "tenants": tenants}


def _saved(entry: _Entry, rate: float | None) -> float | None:
    """Seconds saved: the priced loads, plus those that waited for a rate
    priced at ``rate`` (None while they still wait)."""
    if not entry.unpriced_tokens:
        return entry.saved_s
    return None if rate is None else entry.saved_s + entry.unpriced_tokens * rate


def _fold(into: _Entry, entry: _Entry) -> None:
    """Sum ``entry`` into an other row (its fit, when the other row has
    none yet: a mean over namespaces would mean nothing either way)."""
    for tier, tokens in entry.served.items():
        into.served[tier] = into.served.get(tier, 0) + tokens
    into.load_s += entry.load_s
    into.loaded_tokens += entry.loaded_tokens
    into.saved_s += entry.saved_s
    into.unpriced_tokens += entry.unpriced_tokens
    into.fit = into.fit if into.fit is not None else entry.fit
    into.reports += entry.reports


def _copy(entry: _Entry) -> _Entry:
    return replace(entry, served=dict(entry.served))


__all__ = ["SavingsLedger"]
