"""Fixtures that run real ``kvtier serve`` processes and peer client processes
(see ``harness``). Whatever a test does, every process it started is stopped
by PID at teardown; a server that then does not exit 0 on SIGTERM, or that
logged a traceback, fails the test in teardown."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.integration.harness import PeerFactory, Server, ServerFactory


@pytest.fixture
def kvtier_server(tmp_path: Path) -> Iterator[ServerFactory]:
    """``kvtier_server.start(...)`` / ``.restart(server)`` / ``.kill(server)``."""
    factory = ServerFactory(tmp_path)
    try:
        yield factory
    finally:
        problems = factory.close()
    assert not problems, "\n".join(problems)


@pytest.fixture(scope="module")
def module_servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerFactory]:
    """The same, for servers that a module's tests share (fewer starts and stops)."""
    factory = ServerFactory(tmp_path_factory.mktemp("servers"))
    try:
        yield factory
    finally:
        problems = factory.close()
    assert not problems, "\n".join(problems)


@pytest.fixture
def server(kvtier_server: ServerFactory) -> Server:
    """One plain server (no auth, default TTLs)."""
    return kvtier_server.start()


@pytest.fixture
def peers(tmp_path: Path) -> Iterator[PeerFactory]:
    """``peers.spawn(...)`` / ``.read(proc)`` / ``.run(...)`` / ``.kill(proc)``."""
    factory = PeerFactory(tmp_path)
    try:
        yield factory
    finally:
        factory.close()
