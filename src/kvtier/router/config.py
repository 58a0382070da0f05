"""``RouterConfig``: every setting of ``kvtier route``.

A TOML file (``--config``) with ``[[engines]]`` and ``[[tenants]]`` tables,
``[cost]`` (``CostConfig``), and top-level options; ``KVTIER_ROUTE_*``
variables and flags override the top-level ones (``kvtier.config.load``'s
precedence). For example::

    model = "HuggingFaceTB/SmolLM2-135M-Instruct"
    tokenizer = "/models/smollm2"
    policy = "kvtier"

    [[engines]]
    name = "node0"
    url = "http://10.0.0.1:8000"            # vLLM's OpenAI server
    cache_url = "http://10.0.0.1:8765"      # its node's kvtier serve admin HTTP
    events = "tcp://10.0.0.1:5557"          # kvtier serve's [events]
    events_replay = "tcp://10.0.0.1:5558"
    engine_events = "tcp://10.0.0.1:5560"   # vLLM's --kv-events-config
    engine_events_replay = "tcp://10.0.0.1:5561"

    [[tenants]]
    name = "acme"
    api_keys = ["sk-..."]                   # keep this file private (0600)
    requests_per_s = 20
    prompt_tokens_per_s = 200000

The two tokens are secrets: ``cache_token`` (what the router shows the cache
servers) and ``operator_token`` (what its ``/status`` and ``/metrics`` ask
for) come from the file, ``KVTIER_ROUTE_CACHE_TOKEN`` /
``KVTIER_ROUTE_OPERATOR_TOKEN``, or a file named by ``cache_token_file`` /
``operator_token_file``; never from a flag.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from kvtier.config import from_mapping, load, read_toml, secret
from kvtier.keys import salt_label
from kvtier.router.chunks import MAX_NODES
from kvtier.router.cost import CostConfig
from kvtier.router.gateway import TenantSpec
from kvtier.router.scoring import POLICIES
from kvtier.tenancy.tenants import ANY_SALT, TenantTable

ENV_PREFIX = "KVTIER_ROUTE_"


@dataclass(frozen=True, slots=True, kw_only=True)
class EngineSpec:
    name: str
    url: str
    cache_url: str = ""
    events: str = ""
    events_replay: str = ""
    engine_events: str = ""
    engine_events_replay: str = ""
    # vLLM connects its PUB socket unless its endpoint is a wildcard (tcp://*:P):
    # then the router binds engine_events and vLLM connects to it.
    engine_events_bind: bool = False

    def __post_init__(self) -> None:
        if not self.url.startswith(("http://", "https://")):
            raise ValueError(
                f"engine {self.name!r}: 'url' must be an http(s) URL, got {self.url!r}"
            )
        if self.events_replay and not self.events:
            raise ValueError(f"engine {self.name!r}: 'events_replay' needs 'events'")
        if self.engine_events_replay and not self.engine_events:
            raise ValueError(f"engine {self.name!r}: 'engine_events_replay' needs 'engine_events'")


@dataclass(frozen=True, slots=True, kw_only=True)
class RouterConfig:
    host: str = "127.0.0.1"
    port: int = 8000
    model: str = ""  # the model name clients ask for ("" -> the engines' own)
    tokenizer: str = ""  # a local tokenizer ("" -> the engines' /tokenize)
    policy: str = "kvtier"
    connect_timeout_s: float = 2.0
    # No first byte this long: a stream's engine is taken out and the request
    # goes elsewhere; a non-streamed request (its first byte is its whole
    # answer) is a 504 if its engine still answers /health, else it goes elsewhere.
    first_byte_timeout_s: float = 120.0
    # While a request waits for an engine's first byte, the engine is asked
    # GET /health this often, so a silent engine is found in about interval +
    # timeout rather than first_byte_timeout_s (one probe per engine per
    # interval, whatever the number of requests waiting).
    health_probe_interval_s: float = 5.0
    # An engine that does not answer GET /health within this is silent: taken
    # out (reason "silent") and the request, which has nothing yet, goes to the
    # next engine. Also how long the router waits for an engine's /v1/models.
    health_probe_timeout_s: float = 5.0
    down_s: float = 10.0  # how long a failed engine stays out
    status_poll_s: float = 2.0  # the cache servers' /status (namespace, boot id)
    events_stale_s: float = 5.0  # no event for this long: approximate mode for that node
    approx_ttl_s: float = 60.0  # a silent node's routed chunks count as its L1 this long
    pending_ttl_s: float = 30.0  # routed chunks count as the node's L1 until announced, at most
    prefetch: bool = True  # tell the chosen node's cache server to start L2 -> L1 loads
    # A request's body, at most (413 past it). The router parses it whole: a
    # prompt of token ids costs ~10x its bytes in memory while it is checked.
    max_body_bytes: int = 16 << 20
    engines: tuple[Any, ...] = ()  # EngineSpec tables
    tenants: tuple[Any, ...] = ()  # TenantSpec tables
    # The cache servers' tenants file (kvtier.tenancy.tenants): its tenants become
    # the gateway's (token digests as API keys, first salt as cache_salt); a
    # [[tenants]] table of the same name adds its limits.
    tenants_file: str = ""
    # Secrets: from this file, KVTIER_ROUTE_CACHE_TOKEN or cache_token_file.
    # The token the router shows the cache servers (GET /status, POST /prefetch):
    # an admin tenant's, when they have tokens (kvtier serve --tenants-file or
    # --auth-token-file).
    cache_token: str = field(default="", repr=False)
    cache_token_file: str = ""
    # The token /status and /metrics ask for (they describe every tenant); with
    # tenants and no operator token, nobody may read them.
    operator_token: str = field(default="", repr=False)
    operator_token_file: str = ""
    cost: CostConfig = field(default_factory=CostConfig)

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise ValueError(f"--policy {self.policy!r} is not one of {sorted(POLICIES)}")
        if not 0 <= self.port < 65536:
            raise ValueError(f"--port {self.port} is not a TCP port")
        for option in (
            "connect_timeout_s",
            "first_byte_timeout_s",
            "health_probe_interval_s",
            "health_probe_timeout_s",
            "status_poll_s",
            "max_body_bytes",
        ):
            if getattr(self, option) <= 0:
                raise ValueError(f"option {option!r} must be positive")
        for option in ("approx_ttl_s", "pending_ttl_s"):
            if getattr(self, option) < 0:
                raise ValueError(f"option {option!r} must be >= 0 (0: no credit)")
        if len(self.engines) > MAX_NODES:
            raise ValueError(f"{len(self.engines)} engines: one router takes at most {MAX_NODES}")

    def engine_specs(self) -> list[EngineSpec]:
        return [_spec(EngineSpec, e, f"[[engines]] #{i}") for i, e in enumerate(self.engines)]

    def tenant_specs(self) -> list[TenantSpec]:
        return [_spec(TenantSpec, t, f"[[tenants]] #{i}") for i, t in enumerate(self.tenants)]


def _spec(cls: type[Any], value: Any, where: str) -> Any:
    if isinstance(value, cls):
        return value
    if not isinstance(value, Mapping):
        raise ValueError(f"{where}: expected a table of options, got {value!r}")
    return from_mapping(cls, value, where)


def load_router_config(
    flags: Mapping[str, Any],
    config_file: str | None = None,
    environ: Mapping[str, str] | None = None,
) -> RouterConfig:
    """Merge the file, ``KVTIER_ROUTE_*`` and flags; check every engine and
    tenant table (errors name the table and option)."""
    file = read_toml(config_file, "--config") if config_file else {}
    config = load(
        RouterConfig,
        file=file,
        environ=environ,
        flags=flags,
        env_prefix=ENV_PREFIX,
        where=f"--config {config_file}" if config_file else "kvtier route",
        defaults=RouterConfig(),
    )
    engines = tuple(config.engine_specs())
    if not engines:
        raise ValueError(
            "kvtier route needs engines: [[engines]] tables in --config, or --engine URL"
        )
    names = [e.name for e in engines]
    if len(set(names)) != len(names):
        raise ValueError(f"two engines share a name: {names}")
    tenants = _with_tenants_file(config.tenant_specs(), config.tenants_file)
    secrets: dict[str, Any] = {
        name: secret(path, f"{name}_file", ENV_PREFIX + name.upper())
        for name in ("cache_token", "operator_token")
        if (path := getattr(config, f"{name}_file"))
    }
    return dataclasses.replace(config, engines=engines, tenants=tuple(tenants), **secrets)


def _with_tenants_file(specs: list[TenantSpec], path: str) -> list[TenantSpec]:
    """``specs`` with the tenants of the cache servers' tenants file merged in."""
    if not path:
        return specs
    by_name = {spec.name: spec for spec in specs}
    merged = []
    for tenant in TenantTable.from_file(path).tenants.values():
        spec = by_name.pop(tenant.name, TenantSpec(name=tenant.name))
        owned = [s for s in tenant.salts if s != ANY_SALT]
        salt = spec.salt or (owned[0] if owned else "")
        if not spec.salt and salt and salt_label(salt) != salt:  # the file holds its hash
            raise ValueError(
                f"tenants_file {path}: tenant {tenant.name!r}'s salt is not a plain label, so "
                "the gateway cannot send it as cache_salt: name it in its [[tenants]] table"
            )
        digests = spec.api_key_sha256 + tenant.digests
        merged.append(dataclasses.replace(spec, salt=salt, api_key_sha256=digests))
    return merged + list(by_name.values())


__all__ = ["EngineSpec", "RouterConfig", "load_router_config"]
