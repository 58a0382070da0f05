"""Tenants the cache server enforces: ``TenantTable``, read from a TOML file.

Each tenant is known by the SHA-256 digests of its tokens (never the tokens:
``kvtier admin token-digest`` prints a digest), and owns salts (the key
labels of its namespaces)::

    [[tenant]]
    name = "acme"
    token_sha256 = ["9f86d081..."]   # one or more
    salts = ["acme", "acme-rag"]     # its namespaces: read and written by it only
    read = ["public"]                # others' namespaces it may read, never write
    admin = false                    # the admin API (kvtier admin, the dashboard)
    retention_s = 604800             # its objects older than this go (L1, the local disk)
    [tenant.quota]
    l1_bytes = "4GiB"                # over it, its own objects are evicted first
    l1_hard_bytes = "6GiB"           # a store that would pass it is refused
    pin_bytes = "512MiB"             # what it may pin in L1
    l2_bytes = { fs = "100GiB", redis = "10GiB" }   # per L2 adapter, by name

At HELLO the server finds the tenant of the token (every digest compared in
constant time) and the salt the client may use: the one it names, if the
tenant owns it (read and write) or may read it (read only), or the tenant's
first salt when it names none. Every object key a client names carries that
salt, so a client can never read, write or evict another tenant's objects.
A salt belongs to at most one tenant. A tenant whose ``salts`` is ``["*"]``
may use any salt no other tenant owns: that is how the single
``--auth-token`` keeps working (``TenantTable.single``: one admin tenant,
``default``), and how a table without tokens (no auth) behaves.

Errors in the file name the line and the field.
"""

from __future__ import annotations

import hashlib
import hmac
import math
import re
import tomllib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvtier.keys import salt_label
from kvtier.l1.quotas import OwnerLimit
from kvtier.storage import Owners
from kvtier.units import parse_size

ANY_SALT = "*"
DEFAULT_TENANT = "default"
_HEX64 = re.compile(r"[0-9a-f]{64}")
_TENANT_FIELDS = {"name", "token_sha256", "salts", "read", "admin", "quota", "retention_s"}
_QUOTA_FIELDS = {"l1_bytes", "l1_hard_bytes", "pin_bytes", "l2_bytes"}


def token_digest(token: str) -> str:
    """The SHA-256 hex digest a tenants file holds for ``token``."""
    return hashlib.sha256(token.encode()).hexdigest()


def is_token_digest(text: str) -> bool:
    """Whether ``text`` has the form ``token_digest`` gives (lowercase hex, 64)."""
    return _HEX64.fullmatch(text) is not None


@dataclass(frozen=True, slots=True)
class Quota:
    """Bytes a tenant may hold; None: no limit."""

    l1_bytes: int | None = None  # soft: over it, the tenant's own objects go first
    l1_hard_bytes: int | None = None  # hard: a store that would pass it is refused
    pin_bytes: int | None = None  # pins in L1 (None: no cap of its own; a file's default: 0)
    l2_bytes: Mapping[str, int] = field(default_factory=dict)  # adapter name -> hard cap


@dataclass(frozen=True, slots=True)
class Tenant:
    name: str
    digests: tuple[str, ...] = ()
    salts: tuple[str, ...] = ()  # key labels (salt_label applied)
    read: tuple[str, ...] = ()
    admin: bool = False
    quota: Quota = field(default_factory=Quota)
    retention_s: float | None = None  # its objects older than this are removed (L1, local L2)

    @property
    def any_salt(self) -> bool:
        return ANY_SALT in self.salts


@dataclass(frozen=True, slots=True)
class Access:
    """What a HELLO gets: the tenant, the salt its keys carry, and whether it
    may write there."""

    tenant: Tenant
    salt: str
    writable: bool


class TenantTable:
    """Tenants by token digest and by salt; see the module docstring."""

    def __init__(self, tenants: Sequence[Tenant]) -> None:
        self.tenants = {t.name: t for t in tenants}
        if len(self.tenants) != len(tenants):
            raise ValueError("tenants: two tenants have the same name")
        self._owner: dict[str, Tenant] = {}
        for tenant in tenants:
            for salt in tenant.salts:
                if salt == ANY_SALT:
                    continue
                other = self._owner.setdefault(salt, tenant)
                if other is not tenant:
                    raise ValueError(
                        f"tenants: salt {salt!r} belongs to both {other.name!r} and "
                        f"{tenant.name!r}; a salt has one owner (give the other read access)"
                    )
        self._digests = [(d, t) for t in tenants for d in t.digests]
        self.open = not self._digests  # no tokens: no authentication

    @classmethod
    def single(cls, token: str = "") -> TenantTable:
        """One admin tenant that may use any salt: the single ``--auth-token``
        (or no auth at all)."""
        digests = (token_digest(token),) if token else ()
        return cls([Tenant(DEFAULT_TENANT, digests, (ANY_SALT,), admin=True)])

    @classmethod
    def from_file(cls, path: str | Path) -> TenantTable:
        text = _read(path)
        try:
            data = tomllib.loads(text)
        except tomllib.TOMLDecodeError as exc:
            raise ValueError(f"tenants file {path}: {exc}") from None
        return cls(_parse(data, text, str(path)))

    def authenticate(self, token: str) -> Tenant | None:
        """The tenant whose digest matches ``token`` (every digest is compared,
        in constant time); with no tokens configured, the only tenant."""
        if self.open:
            return next(iter(self.tenants.values()), None)
        given = token_digest(token).encode()
        found = None
        for digest, tenant in self._digests:
            if hmac.compare_digest(given, digest.encode()):
                found = tenant
        return found

    def owner(self, salt: str) -> Tenant | None:
        """The tenant that owns a salt label (None: nobody, or a ``*`` tenant)."""
        return self._owner.get(salt)

    def access(self, tenant: Tenant, salt: str) -> Access | None:
        """The salt a client of ``tenant`` asking for ``salt`` gets (see the
        module docstring); None when it may not use it."""
        if not salt:
            first = next((s for s in tenant.salts if s != ANY_SALT), "")
            return Access(tenant, first, True)
        owner = self._owner.get(salt)
        if owner is tenant or (owner is None and tenant.any_salt):
            return Access(tenant, salt, True)
        if salt in tenant.read:
            return Access(tenant, salt, False)
        return None

    def l1_limits(self) -> dict[str, OwnerLimit]:
        """Every tenant's L1 limits (part of ``owners``)."""
        return {
            t.name: OwnerLimit(t.quota.l1_bytes, t.quota.l1_hard_bytes, t.quota.pin_bytes)
            for t in self.tenants.values()
        }

    def owners(self) -> Owners:
        """Who owns each salt's objects, each tenant's L1 limits and its caps
        in each L2 adapter: for ``StorageManager(owners=...)``."""
        caps: dict[str, dict[str, int]] = {}
        for tenant in self.tenants.values():
            for adapter, cap in tenant.quota.l2_bytes.items():
                caps.setdefault(adapter, {})[tenant.name] = cap
        return Owners(self.tenant_of, self.l1_limits(), caps)

    def tenant_of(self, salt: str) -> str:
        """Whose objects a salt label's are, for quotas and usage: the owner,
        else the ``*`` tenant's name (the default tenant)."""
        owner = self._owner.get(salt)
        if owner is not None:
            return owner.name
        wildcard = next((t for t in self.tenants.values() if t.any_salt), None)
        return wildcard.name if wildcard is not None else DEFAULT_TENANT


def _read(path: str | Path) -> str:
    try:
        return Path(path).read_text()
    except OSError as exc:
        raise ValueError(f"tenants file {path}: {exc}") from None


def _parse(data: dict[str, Any], text: str, path: str) -> list[Tenant]:
    unknown = set(data) - {"tenant"}
    if unknown:
        raise ValueError(
            f"tenants file {path}: unknown top-level key {sorted(unknown)[0]!r}; "
            "tenants are [[tenant]] tables"
        )
    tables = data.get("tenant", [])
    if not isinstance(tables, list) or not tables:
        raise ValueError(f"tenants file {path}: no [[tenant]] tables")
    starts = [i + 1 for i, line in enumerate(text.splitlines()) if line.strip() == "[[tenant]]"]
    return [_tenant(table, _Where(path, text, starts, i)) for i, table in enumerate(tables)]


@dataclass(frozen=True, slots=True)
class _Where:
    """Names a field of the i-th tenant and its line, for errors."""

    path: str
    text: str
    starts: list[int]
    index: int

    def error(self, field_name: str, message: str) -> ValueError:
        line = self._line(field_name.split(".")[-1])
        at = f" line {line}" if line else ""
        return ValueError(
            f"tenants file {self.path}{at}: tenant {self.index + 1} {field_name}: {message}"
        )

    def _line(self, name: str) -> int | None:
        lines = self.text.splitlines()
        first = self.starts[self.index] if self.index < len(self.starts) else 1
        last = self.starts[self.index + 1] if self.index + 1 < len(self.starts) else len(lines)
        pattern = re.compile(rf"^\s*{re.escape(name)}\s*=")
        for number in range(first, last + 1):
            if number <= len(lines) and pattern.match(lines[number - 1]):
                return number
        return first if self.starts else None


def _tenant(table: Any, where: _Where) -> Tenant:
    if not isinstance(table, dict):
        raise where.error("", "each [[tenant]] must be a table")
    unknown = set(table) - _TENANT_FIELDS
    if unknown:
        name = sorted(unknown)[0]
        raise where.error(name, f"unknown field; tenants have {sorted(_TENANT_FIELDS)}")
    name = table.get("name")
    if not isinstance(name, str) or not name:
        raise where.error("name", "every tenant needs a name")
    digests = _strings(table, "token_sha256", where)
    for digest in digests:
        if not is_token_digest(digest):
            raise where.error(
                "token_sha256",
                f"{digest[:12]!r}... is not a lowercase SHA-256 hex digest (64 characters); "
                "write digests, never tokens (kvtier admin token-digest)",
            )
    salts = _strings(table, "salts", where)
    if not salts:
        raise where.error("salts", "a tenant owns at least one salt ('*': any unowned salt)")
    admin = table.get("admin", False)
    if not isinstance(admin, bool):
        raise where.error("admin", f"must be true or false, got {admin!r}")
    retention = table.get("retention_s")
    if retention is not None and (
        isinstance(retention, bool)
        or not isinstance(retention, int | float)
        or not 0 < retention < math.inf  # TOML has nan and inf
    ):
        raise where.error("retention_s", f"must be a number of seconds > 0, got {retention!r}")
    return Tenant(
        name,
        tuple(digests),
        tuple(s if s == ANY_SALT else salt_label(s) for s in salts),
        tuple(salt_label(s) for s in _strings(table, "read", where)),
        admin,
        _quota(table.get("quota", {}), where),
        None if retention is None else float(retention),
    )


def _strings(table: dict[str, Any], name: str, where: _Where) -> list[str]:
    value = table.get(name, [])
    if not isinstance(value, list) or not all(isinstance(v, str) and v for v in value):
        raise where.error(name, "must be a list of non-empty strings")
    return list(value)


def _quota(table: Any, where: _Where) -> Quota:
    if not isinstance(table, dict):
        raise where.error("quota", "must be a table ([tenant.quota])")
    unknown = set(table) - _QUOTA_FIELDS
    if unknown:
        raise where.error(
            f"quota.{sorted(unknown)[0]}", f"unknown; quotas are {sorted(_QUOTA_FIELDS)}"
        )

    def size(name: str, value: Any) -> int:
        try:
            return parse_size(value, name) if isinstance(value, str) else _count(value)
        except (ValueError, TypeError, OverflowError) as exc:  # Overflow: "1" and 400 zeros
            raise where.error(f"quota.{name}", str(exc)) from None

    l2 = table.get("l2_bytes", {})
    if not isinstance(l2, dict):
        raise where.error("quota.l2_bytes", "must be a table of adapter name = size")
    sizes = {k: size(k, v) for k, v in table.items() if k != "l2_bytes"}
    quota = Quota(
        l1_bytes=sizes.get("l1_bytes"),
        l1_hard_bytes=sizes.get("l1_hard_bytes"),
        pin_bytes=sizes.get("pin_bytes", 0),
        l2_bytes={name: size(f"l2_bytes.{name}", v) for name, v in l2.items()},
    )
    soft, hard = quota.l1_bytes, quota.l1_hard_bytes
    if soft is not None and hard is not None and hard < soft:
        raise where.error("quota.l1_hard_bytes", f"{hard} is below l1_bytes ({soft})")
    return quota


def _count(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"must be a size such as 4GiB or a byte count >= 0, got {value!r}")
    return value


__all__ = [
    "ANY_SALT",
    "DEFAULT_TENANT",
    "Access",
    "Quota",
    "Tenant",
    "TenantTable",
    "is_token_digest",
    "token_digest",
]
