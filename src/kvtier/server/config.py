"""``ServerConfig``: the settings of ``kvtier serve``, from flags, a TOML file
and ``KVTIER_*`` environment variables (flags win, then the environment, then
the file), validated once with errors that name the flag to change."""

from __future__ import annotations

import os
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from kvtier.config import from_mapping
from kvtier.l2.registry import parse_spec

GiB = 1 << 30


def default_l1_bytes() -> int:
    """A quarter of physical memory, at most 16 GiB, at least 256 MiB."""
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return max(256 << 20, min(16 * GiB, total // 4))


def cache_home() -> Path:
    """kvtier's directory under the user's cache (``$XDG_CACHE_HOME`` or ~/.cache)."""
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "kvtier"


def default_cache_dir() -> str:
    return str(cache_home() / "l2")


@dataclass(frozen=True, slots=True, kw_only=True)
class ServerConfig:
    host: str = "127.0.0.1"
    port: int = 5555  # RPC (ZeroMQ); 0 picks a free port
    http_port: int = 8765  # admin HTTP; 0 picks a free port, -1 turns it off
    l1_size_bytes: int = 0  # 0: default_l1_bytes()
    cache_dir: str = ""  # the default fs L2; "" -> default_cache_dir(); "none" -> no L2
    chunk_size: int = 256
    auth_token: str = ""
    shm_dir: str = "/dev/shm"
    session_ttl_s: float = 300.0
    client_ttl_s: float = 60.0
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
        if self.l1_size_bytes < 0:
            raise ValueError("--l1-size must be positive")
        for spec in self.l2:
            parse_spec(spec)  # a clear error for a spec without a type

    @property
    def l1_bytes(self) -> int:
        return self.l1_size_bytes or default_l1_bytes()

    @property
    def l2_dir(self) -> str | None:
        if self.cache_dir == "none":
            return None
        return self.cache_dir or default_cache_dir()


def env_name(option: str) -> str:
    """``l1_size_bytes`` -> ``KVTIER_L1_SIZE``, ``auth_token`` -> ``KVTIER_AUTH_TOKEN``."""
    return "KVTIER_" + option.upper().removesuffix("_BYTES")


def load_config(flags: Mapping[str, Any], config_file: str | None = None) -> ServerConfig:
    """Merge a TOML file, ``KVTIER_<OPTION>`` variables and flags (set ones only)."""
    merged: dict[str, Any] = {}
    if config_file:
        try:
            merged.update(tomllib.loads(Path(config_file).read_text()))
        except (OSError, tomllib.TOMLDecodeError) as exc:
            raise ValueError(f"--config {config_file}: {exc}") from None
    names = {f.name: f for f in fields(ServerConfig)}
    for name, f in names.items():
        value = os.environ.get(env_name(name))
        if value is not None:
            merged[name] = _from_text(value, f.type)
    merged.update({k: v for k, v in flags.items() if v is not None})
    try:
        return from_mapping(ServerConfig, merged, "kvtier serve")
    except ValueError as exc:  # name the flag, not the field
        message = str(exc).removeprefix("kvtier serve: ")  # the CLI names the command
        for name in names:
            message = message.replace(f"option {name!r}", flag_name(name))
        raise ValueError(message) from None


def flag_name(option: str) -> str:
    """``l1_size_bytes`` -> ``--l1-size``."""
    return "--" + option.removesuffix("_bytes").replace("_", "-")


def _from_text(value: str, hint: object) -> object:
    if hint in ("int", int):
        return value if not value.lstrip("-").isdigit() else int(value)
    if hint in ("float", float):
        return float(value)
    return value
