"""The configurations the bench compares, and how each one is started.

============== ============================================================
apc            vLLM's own prefix cache only (no connector)
apc+l1         + kvtier: a cache server whose L1 holds the whole working set
apc+l1+remote  + kvtier: an L1 too small for the working set, then a remote
               L2 (Redis, or Mooncake Store) that holds it
apc+l1+remote  the same, loading hits on the worker's own thread while the
+async         request waits for remote KV (``kvtier.load_async``)
lmcache        + LMCache 0.5.6 (``lmcache server`` with an L1 as large as
               kvtier's, vLLM's ``LMCacheMPConnector``): the peer
============== ============================================================

Every configuration is its own vLLM OpenAI server with the same flags
(``EngineOptions``: prefix caching on, a KV space smaller than the working
set), so what differs is only the cache behind it.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from kvtier.bench.engines import (
    Engine,
    EngineOptions,
    kvtier_transfer,
    lmcache_python,
    lmcache_server,
    lmcache_transfer,
    vllm_server,
)
from kvtier.bench.stores import MooncakeProcess, RedisProcess, mooncake_binaries, redis_binary
from kvtier.process import ServerProcess

Remote = Literal["redis", "mooncake"]
Store = RedisProcess | MooncakeProcess


@dataclass(frozen=True, slots=True)
class Configuration:
    name: str
    description: str
    cache: Literal["none", "kvtier", "lmcache"]
    small_l1: bool = False  # kvtier: an L1 smaller than the working set
    remote: bool = False  # kvtier: a remote L2 behind L1
    load_async: bool = False  # kvtier: vLLM's asynchronous loads


CONFIGURATIONS: dict[str, Configuration] = {
    c.name: c
    for c in (
        Configuration("apc", "vLLM prefix caching only", "none"),
        Configuration("apc+l1", "+ kvtier, L1 holds the working set", "kvtier"),
        Configuration(
            "apc+l1+remote", "+ kvtier, small L1 + remote L2", "kvtier", small_l1=True, remote=True
        ),
        Configuration(
            "apc+l1+remote+async",
            "+ kvtier, small L1 + remote L2, asynchronous loads",
            "kvtier",
            small_l1=True,
            remote=True,
            load_async=True,
        ),
        Configuration("lmcache", "+ LMCache 0.5.6 (its L1 as large as kvtier's)", "lmcache"),
    )
}


@dataclass(frozen=True, slots=True)
class BenchSettings:
    """What every configuration shares."""

    engine: EngineOptions
    workdir: Path
    l1_size_bytes: int  # apc+l1's L1 (and LMCache's)
    small_l1_size_bytes: int  # apc+l1+remote's L1
    remote: Remote = "redis"
    chunk_size: int = 256
    lmcache_venv: Path = Path()


@dataclass(frozen=True, slots=True)
class Running:
    """A started configuration."""

    config: Configuration
    engine: Engine
    kvtier: ServerProcess | None
    store: Store | None
    peer_pid: int | None  # the LMCache server

    def pids(self) -> list[int]:
        """Every process whose memory counts (a restarted store's new ones too)."""
        pids = [self.engine.pid, *(self.store.pids if self.store else [])]
        pids += [self.kvtier.pid] if self.kvtier else []
        return pids + ([self.peer_pid] if self.peer_pid else [])


def _start_store(settings: BenchSettings, log_dir: Path) -> Store:
    if settings.remote == "redis":
        binary = redis_binary()
        if binary is None:
            raise RuntimeError("apc+l1+remote needs redis-server (apt-get install redis-server)")
        return RedisProcess.start(binary, log_dir / "redis.log")
    binaries = mooncake_binaries()
    if binaries is None:
        raise RuntimeError(
            "apc+l1+remote with --remote mooncake needs mooncake_master and mooncake_client "
            '(pip install "kvtier[mooncake]")'
        )
    # a long lease: a batch read of many objects must not lose its lease midway
    return MooncakeProcess.start(binaries, log_dir, segment="1GB", lease_ttl_ms=5000)


@contextmanager
def serve(config: Configuration, settings: BenchSettings, label: str = "") -> Iterator[Running]:
    """Start ``config`` (its stores, cache server and vLLM), stop it all at
    exit; logs go to ``WORKDIR/logs/LABEL`` (default: the configuration's name)."""
    log_dir = settings.workdir / "logs" / (label or config.name).replace("+", "_")
    log_dir.mkdir(parents=True, exist_ok=True)
    with ExitStack() as stack:
        store, kvtier, peer_pid = None, None, None
        transfer, python = None, sys.executable
        if config.remote:
            store = _start_store(settings, log_dir)
            stack.callback(store.stop)
        if config.cache == "kvtier":
            l1 = settings.small_l1_size_bytes if config.small_l1 else settings.l1_size_bytes
            args = ["--port", "0", "--http-port", "0", "--l1-size", str(l1)]
            args += ["--cache-dir", "none", "--chunk-size", str(settings.chunk_size)]
            if store is not None:
                args += ["--l2", json.dumps(store.spec())]
            kvtier = stack.enter_context(ServerProcess.start(args, log_dir / "kvtier.log"))
            transfer = kvtier_transfer(kvtier.rpc, load_async=config.load_async)
        elif config.cache == "lmcache":
            python = str(lmcache_python(settings.lmcache_venv))
            gb = settings.l1_size_bytes / 1e9
            peer = stack.enter_context(
                lmcache_server(
                    settings.lmcache_venv, gb, settings.chunk_size, log_dir / "lmcache.log"
                )
            )
            peer_pid = peer.pid
            transfer = lmcache_transfer(peer.port)
        engine = stack.enter_context(
            vllm_server(settings.engine, transfer, log_dir / "vllm.log", python)
        )
        yield Running(config, engine, kvtier, store, peer_pid)


__all__ = ["CONFIGURATIONS", "BenchSettings", "Configuration", "Running", "serve"]
