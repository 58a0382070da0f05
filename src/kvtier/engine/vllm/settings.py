"""The connector's settings: ``kv_connector_extra_config`` keys ``kvtier.<option>``
(the flags), then ``KVTIER_<OPTION>`` variables, then a TOML file named by
``kvtier.config_file`` (its ``[connector]`` table), then the defaults below:
``kvtier.config.load``'s precedence, as for ``kvtier serve``.

- ``address`` (``tcp://127.0.0.1:5555``): the node's cache server.
- ``auth_token_file`` (else ``KVTIER_AUTH_TOKEN``): the server's token, if
  any. ``auth_token`` works too, but vLLM's command line (where the extra
  config often is) shows in ``ps``.
- ``salt`` (``""``): the tenant salt of requests without a ``cache_salt``.
- ``salt_source`` (``request``): ``request``: a request's ``cache_salt``
  wins; ``fixed``: always ``salt``.
- ``store`` (``prompt``): ``prompt`` stores every full prompt chunk;
  ``none`` only loads.
- ``save_async`` (true): stores leave the engine step: the step returns
  once their pages are marked, and the worker's save thread copies and
  commits them while the next steps run (vLLM keeps a finished request's
  blocks until its saves are done; a preemption waits for them). ``false``
  copies and commits them before the step returns.
- ``revision`` (the model config's revision): the weights' revision in the
  namespace.
- ``lookup_wait_s`` (0.02): the scheduler thread's budget, per step, for
  the first lookups of new requests (together; none while hardly any answer
  has come within it); a request whose answer is later waits for its KV
  while the engine runs the others, and is asked again next step (without
  blocking).
- ``request_timeout_s`` (2.0): a server silent this long is away (misses).
- ``load_async`` (false): ``true`` loads a hit on the worker's own thread
  while the request waits for remote KV and the engine runs the others
  (vLLM's async-load path); ``false`` copies it before the step's forward,
  which measures faster on CPU (docs/bench-log/codecs.md, "Asynchronous loads").
- ``shadow_fraction`` (0.0): the share of requests with a hit whose last hit
  chunk vLLM computes anyway, to compare with kvtier's copy
  (``kvtier.engine.shadow``); ``shadow_tolerance`` (0.02): the relative error
  above which a chunk counts as a mismatch.
- ``pin_prefixes_file`` (none): a JSON file of token-id lists (system
  prompts, say): a request whose prompt starts with one keeps that prefix's
  chunks pinned in L1 (renewed as requests come, within the tenant's pin cap);
  ``pin_ttl_s`` (3600): how long a pin lasts after the last renewal.
- ``handoff_failure`` (``recompute``): what a decode engine does with a
  request whose prefill hand-off does not come (``docs/disaggregation.md``):
  ``recompute`` it (counted, and named in the response's
  ``kv_transfer_params``) or fail it with an ``error`` (needs vLLM's
  ``kv_load_failure_policy: fail``); a request's ``kvtier_on_failure``
  transfer parameter overrides it.
- ``handoff_lease_s`` (30): how long the server holds a prefill engine's
  hand-off for its decode engine.
- ``handoff_wait_s`` (10): how long a decode engine waits for a hand-off to
  be offered before its producer counts as dead.
- ``blend`` (false): serve requests that ask for a blend of their segments
  (``kvtier_blend`` in ``kv_transfer_params``, ``kvtier.engine.vllm.blending``);
  needs vLLM's prefix cache off and ``VLLM_KVTIER_BLEND=1``.
- ``log_level`` (``info``): of kvtier's messages in vLLM's log (``debug``
  adds a line per lookup with its hit and why it ends there).
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvtier.config import load, read_toml, secret
from kvtier.protocol.handoff import POLICIES

PREFIX = "kvtier."
ENV_PREFIX = "KVTIER_"
SALT_SOURCES = ("request", "fixed")
STORE_POLICIES = ("prompt", "none")
LOG_LEVELS = ("debug", "info", "warning", "error")


@dataclass(frozen=True, slots=True, kw_only=True)
class ConnectorSettings:
    address: str = "tcp://127.0.0.1:5555"
    auth_token: str = ""
    auth_token_file: str = ""
    salt: str = ""
    salt_source: str = "request"
    store: str = "prompt"
    save_async: bool = True
    revision: str | None = None
    lookup_wait_s: float = 0.02
    request_timeout_s: float = 2.0
    load_async: bool = False
    shadow_fraction: float = 0.0
    shadow_tolerance: float = 0.02
    pin_prefixes_file: str = ""
    pin_ttl_s: float = 3600.0
    handoff_failure: str = "recompute"
    handoff_lease_s: float = 30.0
    handoff_wait_s: float = 10.0
    blend: bool = False
    log_level: str = "info"

    def __post_init__(self) -> None:
        if self.salt_source not in SALT_SOURCES:
            raise ValueError(f"kvtier.salt_source must be one of {SALT_SOURCES}")
        if self.store not in STORE_POLICIES:
            raise ValueError(f"kvtier.store must be one of {STORE_POLICIES}")
        if self.handoff_failure not in POLICIES:
            raise ValueError(f"kvtier.handoff_failure must be one of {POLICIES}")
        for name in ("lookup_wait_s", "request_timeout_s", "handoff_lease_s", "handoff_wait_s"):
            if not float(getattr(self, name)) > 0:
                raise ValueError(f"kvtier.{name} must be a positive number of seconds")
        if not 0.0 <= self.shadow_fraction <= 1.0:
            raise ValueError("kvtier.shadow_fraction must be in [0, 1]")
        if not self.shadow_tolerance > 0:
            raise ValueError("kvtier.shadow_tolerance must be positive")
        if not self.pin_ttl_s > 0:
            raise ValueError("kvtier.pin_ttl_s must be a positive number of seconds")
        if self.log_level not in LOG_LEVELS:
            raise ValueError(f"kvtier.log_level must be one of {LOG_LEVELS}")

    @classmethod
    def from_extra_config(
        cls, extra: Mapping[str, Any], environ: Mapping[str, str] | None = None
    ) -> ConnectorSettings:
        """ValueError naming the key for anything unknown or out of range."""
        flags = {k.removeprefix(PREFIX): v for k, v in extra.items() if k.startswith(PREFIX)}
        config_file = flags.pop("config_file", None)
        file = read_toml(config_file, "kvtier.config_file") if config_file else {}
        settings = load(
            cls,
            file=file.get("connector", {}),
            environ=environ,
            flags=flags,
            env_prefix=ENV_PREFIX,
            where="kv_connector_extra_config",
            flag_name=lambda key: PREFIX + key,
        )
        if settings.auth_token_file:
            token = secret(settings.auth_token_file, "kvtier.auth_token_file", "KVTIER_AUTH_TOKEN")
            settings = dataclasses.replace(settings, auth_token=token)
        return settings

    def pin_prefixes(self) -> list[tuple[int, ...]]:
        """The token-id lists of ``pin_prefixes_file``; ValueError naming the key."""
        if not self.pin_prefixes_file:
            return []
        try:
            data = json.loads(Path(self.pin_prefixes_file).read_text())
        except (OSError, ValueError) as exc:
            raise ValueError(f"kvtier.pin_prefixes_file {self.pin_prefixes_file}: {exc}") from None
        if not isinstance(data, list) or not all(
            isinstance(p, list) and p and all(isinstance(t, int) for t in p) for p in data
        ):
            raise ValueError(
                f"kvtier.pin_prefixes_file {self.pin_prefixes_file} must hold a JSON list of "
                "token-id lists"
            )
        return [tuple(p) for p in data]

    def salt_for(self, cache_salt: str | None) -> str:
        """The tenant salt of a request, as given: its ``cache_salt`` (when
        the source is ``request``), else ``salt``. Not its label: the
        connector's clients and hashers label it (``ModelIdentity``), once."""
        return cache_salt if cache_salt and self.salt_source == "request" else self.salt
