"""The connector's settings, read from ``kv_connector_extra_config``:

- ``kvtier.address`` (``tcp://127.0.0.1:5555``): the node's cache server.
- ``kvtier.auth_token`` (env ``KVTIER_AUTH_TOKEN``): the server's token, if any.
- ``kvtier.salt`` (``""``): the tenant salt of requests without a ``cache_salt``.
- ``kvtier.salt_source`` (``request``): ``request``: a request's ``cache_salt``
  wins; ``fixed``: always ``kvtier.salt``.
- ``kvtier.store`` (``prompt``): ``prompt`` stores every full prompt chunk;
  ``none`` only loads.
- ``kvtier.revision`` (the model config's revision): the weights' revision in
  the namespace.
- ``kvtier.lookup_wait_s`` (0.02): how long a request's first lookup waits
  before the request is deferred to the next step.
- ``kvtier.request_timeout_s`` (2.0): a server silent this long is away (misses).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kvtier.keys import salt_label

PREFIX = "kvtier."
SALT_SOURCES = ("request", "fixed")
STORE_POLICIES = ("prompt", "none")


@dataclass(frozen=True, slots=True, kw_only=True)
class ConnectorSettings:
    address: str = "tcp://127.0.0.1:5555"
    auth_token: str = ""
    salt: str = ""
    salt_source: str = "request"
    store: str = "prompt"
    revision: str | None = None
    lookup_wait_s: float = 0.02
    request_timeout_s: float = 2.0

    @classmethod
    def from_extra_config(cls, extra: Mapping[str, Any]) -> ConnectorSettings:
        """ValueError naming the key for anything unknown or out of range."""
        names = {name for name in cls.__dataclass_fields__}
        values: dict[str, Any] = {}
        for key, value in extra.items():
            if not key.startswith(PREFIX):
                continue  # another connector's key (e.g. in a MultiConnector)
            name = key.removeprefix(PREFIX)
            if name not in names:
                raise ValueError(
                    f"kv_connector_extra_config: unknown key {key!r}; known: "
                    f"{sorted(PREFIX + n for n in names)}"
                )
            values[name] = value
        values.setdefault("auth_token", os.environ.get("KVTIER_AUTH_TOKEN", ""))
        settings = cls(**values)
        if settings.salt_source not in SALT_SOURCES:
            raise ValueError(f"kvtier.salt_source must be one of {SALT_SOURCES}")
        if settings.store not in STORE_POLICIES:
            raise ValueError(f"kvtier.store must be one of {STORE_POLICIES}")
        for name in ("lookup_wait_s", "request_timeout_s"):
            if not float(getattr(settings, name)) > 0:
                raise ValueError(f"kvtier.{name} must be a positive number of seconds")
        return settings

    def salt_for(self, cache_salt: str | None) -> str:
        """The salt label of a request: its ``cache_salt`` (when the source is
        ``request``), else ``salt``; see ``salt_label``."""
        salt = cache_salt if cache_salt and self.salt_source == "request" else self.salt
        return salt_label(salt)
