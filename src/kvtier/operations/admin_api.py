"""The admin JSON API (``/admin/...`` on the admin port; ``kvtier admin``).

Every call needs an admin tenant's token (``AdminHTTP`` checks it). Bodies
and answers are JSON; a bad request is a 400 whose ``error`` says what to
change, an unknown tenant or namespace a 404. GET handlers run on the
request's thread and read only what is thread-safe (the status snapshot,
the tenants table, L1's and the adapters' listings, the purger's jobs);
POST handlers change the server's state, so they run on the server loop
(``ServerTransport.call``), between two requests: a 503 says when the loop
did not get to one within ``LOOP_CALL_TIMEOUT_S``.

======================  ==================================================
``GET  /admin/status``  uptime, draining, L1 use, tenants, running purges
``GET  /admin/tenants`` each tenant: salts, role, quotas, usage per tier
``GET  /admin/namespaces``  each model@salt: objects and bytes per tier
``POST /admin/pin``     ``{model, salt, hashes, ttl_s}``: pin chunks in L1
``POST /admin/unpin``   ``{model, salt, hashes}``
``POST /admin/purge``   ``{model?, salt?}`` or ``{tenant}``: start purges
``GET  /admin/purges``  every purge job and its progress per tier
``POST /admin/drain``   ``{on: true|false}``: stop (or resume) taking stores
``POST /admin/quota``   ``{tenant, l1_bytes?, l1_hard_bytes?, pin_bytes?}``
``GET  /admin/ledger``  the savings ledger (``kvtier.tenancy.ledger``)
``POST /admin/handoff``  ``{id}``: what became of a prefill/decode hand-off
``GET  /admin/dashboard``  what the dashboard page draws
======================  ==================================================
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import msgspec

from kvtier.keys import KeySelector, NamespaceLabel
from kvtier.l1 import L1Result
from kvtier.l1.quotas import OwnerLimit
from kvtier.operations.dashboard import History, totals
from kvtier.server.transport import LoopStopped
from kvtier.storage import L1
from kvtier.tenancy.tenants import ANY_SALT
from kvtier.units import parse_size

if TYPE_CHECKING:
    from kvtier.server.transport import ServerTransport

log = logging.getLogger(__name__)
Answer = tuple[int, dict[str, Any]]
MAX_BYTES = (1 << 63) - 1  # a size every store, metric and JSON reader can hold
# How long a write waits for the server loop: it runs between two requests,
# so only a stuck loop (or an L1 clear or quota change that evicts a lot) nears it.
LOOP_CALL_TIMEOUT_S = 30.0


class BadRequest(ValueError):
    """400: the message says what to change."""


class NotFound(LookupError):
    """404."""


class AdminAPI:
    """The handlers; see the module docstring."""

    def __init__(self, transport: ServerTransport, history: History | None = None) -> None:
        self.transport = transport
        self.core = transport.core
        self.history = history
        self._top: tuple[float, list[dict[str, Any]]] = (0.0, [])
        self.routes: dict[tuple[str, str], Callable[[dict[str, Any]], dict[str, Any]]] = {
            ("GET", "/admin/status"): self.status,
            ("GET", "/admin/tenants"): self.tenants,
            ("GET", "/admin/namespaces"): self.namespaces,
            ("POST", "/admin/pin"): self.pin,
            ("POST", "/admin/unpin"): self.unpin,
            ("POST", "/admin/purge"): self.purge,
            ("GET", "/admin/purges"): self.purges,
            ("POST", "/admin/drain"): self.drain,
            ("POST", "/admin/quota"): self.quota,
            ("GET", "/admin/ledger"): self.ledger,
            ("POST", "/admin/handoff"): self.handoff,
            ("GET", "/admin/dashboard"): self.dashboard,
        }

    def handle(self, method: str, path: str, body: dict[str, Any]) -> Answer:
        """One call's status and answer. A handler's own failure is a 500 that
        says so (and is logged): a fault of the server, never of the body."""
        route = self.routes.get((method, path))
        if route is None:
            known = sorted({p for _, p in self.routes})
            return 404, {"error": f"no {method} {path}; the admin API has {known}"}
        try:
            if method == "POST":  # a write: on the loop that owns the state
                return 200, self.transport.call(lambda: route(body), LOOP_CALL_TIMEOUT_S)
            return 200, route(body)
        except BadRequest as exc:
            return 400, {"error": str(exc)}
        except NotFound as exc:
            return 404, {"error": str(exc)}
        except (TimeoutError, LoopStopped) as exc:
            return 503, {"error": f"{method} {path}: {exc}"}
        except Exception:
            log.exception("admin: %s %s failed", method, path)
            return 500, {"error": f"{method} {path} failed inside the server (see its log)"}

    # ------------------------------------------------------------- reads

    def status(self, body: dict[str, Any]) -> dict[str, Any]:
        snapshot = self.transport.snapshot
        l1 = self.core.storage.l1_status()
        return {
            "boot_id": snapshot.boot_id,
            "uptime_s": snapshot.uptime_s,
            "draining": self.core.draining,
            "clients": snapshot.clients,
            "l1": {k: l1[k] for k in ("capacity_bytes", "used_bytes", "resident_objects")},
            "tenants": sorted(self.core.tenants.tenants),
            "purges_running": sum(j["state"] == "running" for j in self.core.purger.jobs()),
        }

    def tenants(self, body: dict[str, Any]) -> dict[str, Any]:
        usage = self.core.storage.owner_usage()
        l2 = self.core.l2_usage.by_tenant()
        out = []
        for tenant in self.core.tenants.tenants.values():
            used = usage.get(tenant.name, {"bytes": 0, "pinned_bytes": 0})
            out.append(
                {
                    "name": tenant.name,
                    "salts": list(tenant.salts),
                    "read": list(tenant.read),
                    "admin": tenant.admin,
                    "tokens": len(tenant.digests),
                    "quota": dataclasses.asdict(tenant.quota)
                    | {"l1": dataclasses.asdict(self.core.storage.owner_limit(tenant.name))},
                    "usage": {
                        "L1": used["bytes"],
                        "L1_pinned": used["pinned_bytes"],
                        **l2.get(tenant.name, {}),
                    },
                }
            )
        return {"tenants": out}

    def namespaces(self, body: dict[str, Any]) -> dict[str, Any]:
        """Objects and bytes per namespace (model@salt) and tier: L1 and the
        node-local adapters from what they hold, shared stores from what this
        server wrote there (others may have written more)."""
        tenants = self.core.tenants
        table: dict[tuple[str, str], dict[str, dict[str, int]]] = {}  # (namespace, tenant)

        def add(tier: str, namespace: NamespaceLabel, size: int) -> None:
            row = table.setdefault((str(namespace), tenants.tenant_of(namespace.salt)), {})
            entry = row.setdefault(tier, {"objects": 0, "bytes": 0})
            entry["objects"] += 1
            entry["bytes"] += size

        for tier in self.core.storage.tiers():
            for key, size in self.core.storage.held_sizes(tier):
                add(tier, NamespaceLabel.of_key(key), size)
        for tenant, namespace, tier, objects, size in self.core.l2_usage.written():
            row = table.setdefault((str(namespace), tenant), {})
            if tier not in row:
                row[tier] = {"objects": objects, "bytes": size, "written_here": 1}
        return {
            "namespaces": [
                {"namespace": name, "tenant": tenant, "tiers": tiers}
                for (name, tenant), tiers in sorted(table.items())
            ]
        }

    def dashboard(self, body: dict[str, Any]) -> dict[str, Any]:
        """Everything the dashboard page draws (``kvtier.operations.dashboard``)."""
        return {
            "status": self.status(body),
            "series": self.history.series() if self.history is not None else {},
            "totals": totals(self.transport.snapshot),
            "ledger": self.core.ledger.report(),
            "quality": msgspec.to_builtins(self.transport.snapshot.quality),
            "namespaces": self._top_namespaces(),
            "tenants": self.tenants(body)["tenants"],
        }

    def _top_namespaces(self, count: int = 10, every_s: float = 5.0) -> list[dict[str, Any]]:
        """The namespaces holding the most L1 bytes (recounted every ``every_s``)."""
        taken, top = self._top
        if time.monotonic() - taken < every_s:
            return top
        table: dict[NamespaceLabel, list[int]] = {}
        for key, size in self.core.storage.held_sizes(L1):
            entry = table.setdefault(NamespaceLabel.of_key(key), [0, 0])
            entry[0] += 1
            entry[1] += size
        ranked = sorted(table.items(), key=lambda item: -item[1][1])[:count]
        top = [
            {
                "namespace": str(name),
                "tenant": self.core.tenants.tenant_of(name.salt),
                "objects": objects,
                "bytes": nbytes,
            }
            for name, (objects, nbytes) in ranked
        ]
        self._top = (time.monotonic(), top)
        return top

    def handoff(self, body: dict[str, Any]) -> dict[str, Any]:
        """``{"id": ...}``: what became of a prefill/decode hand-off."""
        handoff_id = _text(body, "id")
        return {"id": handoff_id, **self.core.handoffs.fate(handoff_id)}

    def purges(self, body: dict[str, Any]) -> dict[str, Any]:
        return {"purges": self.core.purger.jobs()}

    def ledger(self, body: dict[str, Any]) -> dict[str, Any]:
        return self.core.ledger.report()

    # ------------------------------------------------------------ writes

    def pin(self, body: dict[str, Any]) -> dict[str, Any]:
        ttl = _number(body, "ttl_s", default=3600.0)
        limit = self.core.limits.max_pin_ttl_s
        if not 0 < ttl <= limit:
            raise BadRequest(f"ttl_s must be in (0, {limit}] seconds, got {ttl}")
        return self._pin(body, ttl)

    def unpin(self, body: dict[str, Any]) -> dict[str, Any]:
        return self._pin(body, 0.0)

    def _pin(self, body: dict[str, Any], ttl_s: float) -> dict[str, Any]:
        namespace = NamespaceLabel.given(_text(body, "model"), _text(body, "salt", ""))
        hashes = body.get("hashes")
        if not isinstance(hashes, list) or not all(isinstance(h, str) for h in hashes):
            raise BadRequest("give 'hashes': a list of chunk hashes in hex")
        try:
            keys = self.core.warmup.keys(namespace, [bytes.fromhex(h) for h in hashes])
        except LookupError as exc:
            raise NotFound(str(exc)) from None
        except ValueError as exc:
            raise BadRequest(str(exc)) from None
        results = self.core.storage.pin(keys, ttl_s)
        counts = {r.value: sum(x is r for x in results) for r in L1Result if r in results}
        if L1Result.OVER_QUOTA in results:
            owner = self.core.tenants.tenant_of(namespace.salt)
            cap = self.core.storage.owner_limit(owner).pins
            counts["cap_bytes"] = cap if cap is not None else -1
        return {"objects": len(keys), "results": counts}

    def purge(self, body: dict[str, Any]) -> dict[str, Any]:
        """A namespace (model and/or salt) or a tenant (each of its salts)."""
        if "tenant" in body:
            tenant = self.core.tenants.tenants.get(_text(body, "tenant"))
            if tenant is None:
                raise NotFound(f"no tenant {body['tenant']!r}; see GET /admin/tenants")
            salts = [s for s in tenant.salts if s != ANY_SALT]
            if not salts:
                raise BadRequest(f"tenant {tenant.name!r} owns no salt of its own to purge")
            selectors = [KeySelector(salt=s) for s in salts]  # the table holds labels
        else:
            model = _text(body, "model") if body.get("model") is not None else None
            salt = _text(body, "salt") if body.get("salt") is not None else None
            if model is None and salt is None:
                raise BadRequest("give 'model', 'salt' (or both), or 'tenant'")
            selectors = [KeySelector.of(model, salt)]
        jobs = [self.core.purger.start(s).id for s in selectors]
        return {"jobs": jobs, "purges": [self.core.purger.job(j) for j in jobs]}

    def drain(self, body: dict[str, Any]) -> dict[str, Any]:
        on = body.get("on", True)
        if not isinstance(on, bool):
            raise BadRequest(f"'on' is true or false, got {on!r}")
        self.core.draining = on
        log.warning("admin: the server %s stores", "refuses" if on else "takes")
        return {"draining": on}

    def quota(self, body: dict[str, Any]) -> dict[str, Any]:
        name = _text(body, "tenant")
        if name not in self.core.tenants.tenants:
            raise NotFound(f"no tenant {name!r}; see GET /admin/tenants")
        storage = self.core.storage
        current = storage.owner_limit(name)
        fields = (("soft", "l1_bytes"), ("hard", "l1_hard_bytes"), ("pins", "pin_bytes"))
        values = {f: _size(body, key) if key in body else getattr(current, f) for f, key in fields}
        limit = OwnerLimit(**values)
        if limit.soft is not None and limit.hard is not None and limit.hard < limit.soft:
            raise BadRequest(f"l1_hard_bytes ({limit.hard}) is below l1_bytes ({limit.soft})")
        freed = storage.set_owner_limit(name, limit)
        if freed:
            log.warning(
                "admin: tenant %s's L1 quota is below its use: %d bytes evicted", name, freed
            )
        return {"tenant": name, "l1": dataclasses.asdict(limit), "evicted_bytes": freed}


def _text(body: dict[str, Any], name: str, default: str | None = None) -> str:
    value = body.get(name, default)
    if not isinstance(value, str):
        raise BadRequest(f"give {name!r} as a string")
    return value


def _number(body: dict[str, Any], name: str, default: float) -> float:
    value = body.get(name, default)
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise BadRequest(f"{name!r} must be a number, got {value!r}")
    try:
        return float(value)
    except OverflowError:  # an integer of hundreds of digits
        raise BadRequest(f"{name!r} is out of range") from None


def _size(body: dict[str, Any], name: str) -> int | None:
    """A byte count: a whole number, or a size such as "4GiB"; None: no limit."""
    value = body[name]
    if value is None:
        return None
    if isinstance(value, float) and value.is_integer():
        value = int(value)  # 1e9 is a whole number; 1e400 (inf), NaN and 1.5 are not
    try:
        if isinstance(value, bool) or not isinstance(value, int | str):
            raise ValueError(f"{name}: give a byte count or a size such as '4GiB', got {value!r}")
        size = parse_size(value, name) if isinstance(value, str) else value
    except (ValueError, OverflowError) as exc:  # OverflowError: "1" and 400 zeros
        raise BadRequest(str(exc) if name in str(exc) else f"{name}: {exc}") from None
    if not 0 <= size <= MAX_BYTES:
        raise BadRequest(f"{name} must be in [0, {MAX_BYTES}] bytes, got {size}")
    return size


__all__ = ["AdminAPI", "BadRequest", "NotFound"]
