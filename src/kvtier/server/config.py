"""``ServerConfig``: every setting of ``kvtier serve``, in one frozen dataclass.

Its sections are the components' own settings: ``[l1]`` (``L1Config``:
size, shared-memory directory, eviction policy, watermarks, leases),
``[store]`` (``StoreConfig``: write-back policy and bounds), ``[prefetch]``
(``PrefetchConfig``: deadline and bounds), ``[limits]`` (``ServerLimits``:
time-to-live and what a client may make the server hold), ``[events]``
(``EventsConfig``: where KV events are published), ``[purge]``
(``PurgeConfig``: how purges pace themselves), and ``[[l2]]``
tables for the shared stores after the local disk. ``load_config`` reads
them with ``kvtier.config.load``'s precedence (flags > ``KVTIER_*``
environment > ``--config`` TOML file > defaults); ``--print-config`` shows
the result. The auth token comes from the environment (``KVTIER_AUTH_TOKEN``),
a file (``--auth-token-file``) or the TOML file, never from a flag: a command
line is visible to every user of the machine in ``ps``. So does the cluster
secret that seals L2 objects (``KVTIER_CLUSTER_SECRET``,
``--cluster-secret-file``; ``kvtier.l2.seal``). Both files are read by
``kvtier.config.secret_file``: UTF-8 text, private to their owner (0600).
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from kvtier.config import SECRET_FIELDS, load, read_toml, secret
from kvtier.controllers import PrefetchConfig, StoreConfig
from kvtier.events.publisher import EventsConfig
from kvtier.l1 import L1Config
from kvtier.l2.registry import parse_spec
from kvtier.l2.seal import Sealer, parse_secrets
from kvtier.paths import cache_home
from kvtier.server.limits import ServerLimits
from kvtier.tenancy.purge import PurgeConfig

GiB = 1 << 30
ENV_PREFIX = "KVTIER_"
# The flags of ``kvtier serve`` that set a nested option; the others are the
# top-level options' own names (``--port`` -> ``port``). Everything else:
# ``--set section.option=value``.
SECTION_FLAGS: dict[str, str] = {
    "l1.size_bytes": "--l1-size",
    "l1.shm_dir": "--shm-dir",
    "l1.eviction_policy": "--eviction-policy",
    "store.policy": "--store-policy",
    "prefetch.deadline_s": "--prefetch-deadline-s",
}


def default_l1_bytes() -> int:
    """A quarter of physical memory, at most 16 GiB, at least 256 MiB."""
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return max(256 << 20, min(16 * GiB, total // 4))


def default_cache_dir() -> str:
    return str(cache_home() / "l2")


@dataclass(frozen=True, slots=True, kw_only=True)
class ServerConfig:
    host: str = "127.0.0.1"
    port: int = 5555  # RPC (ZeroMQ); 0 picks a free port
    http_port: int = 8765  # admin HTTP; 0 picks a free port, -1 turns it off
    cache_dir: str = ""  # the default fs L2; "" -> default_cache_dir(); "none" -> no L2
    chunk_size: int = 256
    auth_token: str = ""  # secret: from KVTIER_AUTH_TOKEN, auth_token_file or the file
    auth_token_file: str = ""  # text, mode 0600: refused if group or others may use it
    # The secret L2 objects are sealed with (kvtier.l2.seal): from
    # KVTIER_CLUSTER_SECRET, cluster_secret_file or the file; "" unsealed.
    cluster_secret: str = ""
    cluster_secret_file: str = ""  # text, mode 0600: refused if group or others may use it
    # Tenants the server enforces (kvtier.tenancy.tenants): token digests, salts,
    # quotas, roles. Without it the auth token (if any) is one admin tenant.
    tenants_file: str = ""
    # The savings ledger's prefill seconds per token for namespaces whose engines
    # have not reported one yet; 0: unknown, not estimated.
    ledger_prefill_s_per_token: float = 0.0
    l1: L1Config = field(default_factory=lambda: L1Config(size_bytes=default_l1_bytes()))
    store: StoreConfig = field(default_factory=StoreConfig)
    prefetch: PrefetchConfig = field(default_factory=PrefetchConfig)
    limits: ServerLimits = field(default_factory=ServerLimits)
    events: EventsConfig = field(default_factory=EventsConfig)  # KV events; off by default
    purge: PurgeConfig = field(default_factory=PurgeConfig)
    # More L2 adapters after the fs one, e.g. shared stores: TOML ``[[l2]]``
    # tables or ``--l2 '{"type": "redis", "url": "redis://..."}'`` (repeatable).
    l2: tuple[dict[str, Any], ...] = ()

    def __post_init__(self) -> None:
        if not 0 <= self.port < 65536:
            raise ValueError(f"--port {self.port} is not a TCP port")
        if not -1 <= self.http_port < 65536:
            raise ValueError(f"--http-port {self.http_port} is not a TCP port (or -1 for none)")
        if self.chunk_size <= 0:
            raise ValueError(f"--chunk-size must be positive, got {self.chunk_size}")
        for spec in self.l2:
            parse_spec(spec)  # a clear error for a spec without a type

    @property
    def sealer(self) -> Sealer | None:
        """What L2 objects are sealed with (None: no cluster secret)."""
        if not self.cluster_secret:
            return None
        return Sealer(parse_secrets(self.cluster_secret, "the cluster secret"))

    @property
    def l2_dir(self) -> str | None:
        if self.cache_dir == "none":
            return None
        return self.cache_dir or default_cache_dir()


def flag_name(key: str) -> str:
    """How a (dotted) option is given on the command line: ``l1.size_bytes``
    -> ``--l1-size``, ``port`` -> ``--port``, ``store.batch_objects`` ->
    ``--set store.batch_objects=...``."""
    if key in SECTION_FLAGS:
        return SECTION_FLAGS[key]
    if "." in key:
        return f"--set {key}=..."
    return "--" + key.replace("_", "-")


def load_config(
    flags: Mapping[str, Any],
    config_file: str | None = None,
    environ: Mapping[str, str] | None = None,
) -> ServerConfig:
    """Merge the ``--config`` file, ``KVTIER_*`` variables and the flags given
    (None: not given; keys may be dotted), then read the token file."""
    if any(flags.get(key) for key in SECRET_FIELDS):
        raise ValueError(
            "a secret is never a flag (a command line shows in ps): use --auth-token-file or "
            "KVTIER_AUTH_TOKEN, --cluster-secret-file or KVTIER_CLUSTER_SECRET"
        )
    file = read_toml(config_file, "--config") if config_file else {}
    config = load(
        ServerConfig,
        file=file,
        environ=environ,
        flags=flags,
        env_prefix=ENV_PREFIX,
        where=f"--config {config_file}" if config_file else "kvtier serve",
        flag_name=flag_name,
        defaults=ServerConfig(),
    )
    if config.auth_token_file:
        token = secret(config.auth_token_file, "--auth-token-file", ENV_PREFIX + "AUTH_TOKEN")
        config = dataclasses.replace(config, auth_token=token)
    if config.cluster_secret_file:
        text = secret(
            config.cluster_secret_file, "--cluster-secret-file", ENV_PREFIX + "CLUSTER_SECRET"
        )
        config = dataclasses.replace(config, cluster_secret=text)
    if config.cluster_secret:
        where = (
            f"--cluster-secret-file {config.cluster_secret_file}"
            if config.cluster_secret_file
            else "the cluster secret (KVTIER_CLUSTER_SECRET or the file's cluster_secret)"
        )
        parse_secrets(config.cluster_secret, where)
    elif config.cluster_secret_file:
        raise ValueError(f"--cluster-secret-file {config.cluster_secret_file} is empty")
    if config.tenants_file and config.auth_token:
        raise ValueError(
            "give --tenants-file or an auth token, not both: the tenants file holds every "
            "tenant's token digests (the single token is one admin tenant)"
        )
    return config


__all__ = ["ServerConfig", "default_l1_bytes", "flag_name", "load_config"]
