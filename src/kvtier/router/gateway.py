"""The gateway: who is asking, what namespace they get, how much they may ask.

- An API key (``Authorization: Bearer <key>``) names a tenant; a missing or
  unknown key is refused (401). With no tenants configured, every request is
  the ``default`` tenant (a single-team deployment). With the cache server's
  tenants file (``tenants_file``), its tenants are the gateway's: a client's
  cache token is its API key, and its tenant's salt its ``cache_salt``.
- The tenant's ``salt`` becomes the request's ``cache_salt``; whatever the
  client sent there is replaced, so no client can read another tenant's KV
  (the chunk hashes of two salts never meet, docs/hashing.md).
- Per tenant, two token buckets: requests per second and prompt tokens per
  second, each with a burst. A request that would overdraw either is refused
  (429) with ``Retry-After``: the seconds until the bucket holds enough.
  A prompt larger than a whole bucket could ever hold is refused for good
  (the error says so), not asked to retry. The request bucket is asked
  first, before the prompt is tokenized (``admit_request``); the prompt
  bucket once its tokens are known (``admit_prompt``).
- The router's ``/status`` and ``/metrics`` describe every tenant: they need
  the operator's token (``operator``), never a tenant's key.

Keys are compared as SHA-256 digests in constant time; they are never logged
or shown in ``/status``.
"""

from __future__ import annotations

import hmac
import math
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from kvtier.tenancy.tenants import is_token_digest, token_digest

DEFAULT_TENANT = "default"


@dataclass(frozen=True, slots=True, kw_only=True)
class TenantSpec:
    """One ``[[tenants]]`` table of ``kvtier route``'s config."""

    name: str
    api_keys: tuple[str, ...] = ()  # secret: from the config file only
    api_key_sha256: tuple[str, ...] = ()  # hex digests of keys (a tenants file's token_sha256)
    salt: str = ""  # "" -> the tenant's name
    requests_per_s: float = 0.0  # 0: no limit
    request_burst: float = 0.0  # 0 -> max(1, requests_per_s)
    prompt_tokens_per_s: float = 0.0  # 0: no limit
    prompt_token_burst: float = 0.0  # 0 -> prompt_tokens_per_s x 10

    def __post_init__(self) -> None:
        if not self.name:
            raise ValueError("a tenant needs a 'name'")
        for option in (
            "requests_per_s",
            "request_burst",
            "prompt_tokens_per_s",
            "prompt_token_burst",
        ):
            if getattr(self, option) < 0:
                raise ValueError(f"tenant {self.name!r}: option {option!r} must be >= 0")
        if any(not key for key in self.api_keys):
            raise ValueError(f"tenant {self.name!r}: an API key must not be empty")
        for digest in self.api_key_sha256:
            if not is_token_digest(digest):
                raise ValueError(
                    f"tenant {self.name!r}: api_key_sha256 {digest[:12]!r}... is not a "
                    "SHA-256 hex digest (kvtier admin token-digest)"
                )

    @property
    def cache_salt(self) -> str:
        return self.salt or self.name


class TokenBucket:
    """``rate`` per second up to ``burst``; ``take`` answers how long to wait."""

    def __init__(self, rate: float, burst: float, clock: Callable[[], float]) -> None:
        self.rate = rate
        self.burst = burst
        self._level = burst
        self._clock = clock
        self._at = clock()

    def take(self, amount: float) -> float | None:
        """Take ``amount`` and return 0, or take nothing and return the seconds
        until it would fit; None when it never can (more than the burst)."""
        if amount > self.burst:
            return None
        now = self._clock()
        self._level = min(self.burst, self._level + (now - self._at) * self.rate)
        self._at = now
        if amount <= self._level:
            self._level -= amount
            return 0.0
        return (amount - self._level) / self.rate

    def give_back(self, amount: float) -> None:
        self._level = min(self.burst, self._level + amount)


@dataclass(frozen=True, slots=True)
class Admission:
    """``retry_after_s`` None and ``refusal`` "": admitted. Otherwise why not."""

    refusal: str = ""  # "requests", "prompt_tokens", "too_large"
    retry_after_s: float | None = None

    @property
    def admitted(self) -> bool:
        return not self.refusal


@dataclass(eq=False)
class Tenant:
    spec: TenantSpec
    requests: TokenBucket | None
    tokens: TokenBucket | None
    counts: dict[str, int] = field(default_factory=dict)  # outcome -> requests

    @property
    def name(self) -> str:
        return self.spec.name


class Gateway:
    """See the module docstring. Thread-safe."""

    def __init__(
        self,
        tenants: Sequence[TenantSpec],
        clock: Callable[[], float] = time.monotonic,
        operator_token: str = "",
    ) -> None:
        names = [t.name for t in tenants]
        if len(set(names)) != len(names):
            raise ValueError(f"two tenants share a name: {names}")
        self._lock = threading.Lock()
        self._keys: list[tuple[str, Tenant]] = []  # (SHA-256 hex digest, tenant)
        self.tenants: dict[str, Tenant] = {}
        for spec in tenants or [TenantSpec(name=DEFAULT_TENANT)]:
            tenant = Tenant(
                spec,
                _bucket(spec.requests_per_s, spec.request_burst, 1.0, clock),
                _bucket(spec.prompt_tokens_per_s, spec.prompt_token_burst, 10.0, clock),
            )
            self.tenants[spec.name] = tenant
            for digest in [*map(token_digest, spec.api_keys), *spec.api_key_sha256]:
                if any(hmac.compare_digest(digest, d) for d, _ in self._keys):
                    raise ValueError(f"tenant {spec.name!r}: an API key is given to two tenants")
                self._keys.append((digest, tenant))
        self.open = not tenants  # no tenants configured: no keys asked for
        self._operator = token_digest(operator_token) if operator_token else None
        if self._operator and any(hmac.compare_digest(self._operator, d) for d, _ in self._keys):
            raise ValueError("operator_token is also a tenant's API key: give the operator its own")

    def authenticate(self, authorization: str | None) -> Tenant | None:
        """The tenant of an ``Authorization`` header; None: refuse (401)."""
        if self.open:
            return self.tenants[DEFAULT_TENANT]
        if not authorization or not authorization.startswith("Bearer "):
            return None
        digest = token_digest(authorization[len("Bearer ") :].strip())
        found = None
        for known, tenant in self._keys:  # every key is compared: no early exit by timing
            if hmac.compare_digest(digest, known):
                found = tenant
        return found

    def admit_request(self, tenant: Tenant) -> Admission:
        """Take one request from the tenant's request bucket, before any work
        is done for the request (tokenizing included)."""
        with self._lock:
            if tenant.requests is not None:
                wait = tenant.requests.take(1)
                if wait is None or wait > 0:
                    return Admission("requests", wait)
            return Admission()

    def give_back_request(self, tenant: Tenant) -> None:
        """Undo ``admit_request`` for a request refused through no fault of
        the tenant's (no engine could tokenize it)."""
        with self._lock:
            if tenant.requests is not None:
                tenant.requests.give_back(1)

    def admit_prompt(self, tenant: Tenant, prompt_tokens: int) -> Admission:
        """Take the tokenized prompt from the tenant's prompt-token bucket.
        A refusal keeps the request's token: the request was tokenized, and
        the request rate is what bounds the tokenizing a tenant can cause."""
        with self._lock:
            if tenant.tokens is not None:
                wait = tenant.tokens.take(prompt_tokens)
                if wait is None or wait > 0:
                    return Admission("too_large" if wait is None else "prompt_tokens", wait)
            return Admission()

    def operator(self, authorization: str | None) -> bool | None:
        """Whether an ``Authorization`` header is the operator's (``/status``,
        ``/metrics``). None: no credential is needed (no tenants and no
        operator token configured: a single-team router)."""
        if self._operator is None:
            return None if self.open else False
        if not authorization or not authorization.startswith("Bearer "):
            return False
        digest = token_digest(authorization[len("Bearer ") :].strip())
        return hmac.compare_digest(digest, self._operator)

    def count(self, tenant: Tenant, outcome: str) -> None:
        with self._lock:
            tenant.counts[outcome] = tenant.counts.get(outcome, 0) + 1

    def status(self) -> dict[str, object]:
        with self._lock:
            return {
                "open": self.open,
                "tenants": {
                    name: {
                        "requests": dict(t.counts),
                        "api_keys": len(t.spec.api_keys) + len(t.spec.api_key_sha256),
                    }
                    for name, t in self.tenants.items()
                },
            }


def retry_after(seconds: float | None) -> str:
    """``Retry-After``'s value: whole seconds, at least 1."""
    return str(max(1, math.ceil(seconds or 0)))


def _bucket(
    rate: float, burst: float, default_burst: float, clock: Callable[[], float]
) -> TokenBucket | None:
    if rate <= 0:
        return None
    return TokenBucket(rate, burst or max(1.0, rate * default_burst), clock)


__all__ = [
    "DEFAULT_TENANT",
    "Admission",
    "Gateway",
    "Tenant",
    "TenantSpec",
    "TokenBucket",
    "retry_after",
]
