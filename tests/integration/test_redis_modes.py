"""The redis adapter's modes on real servers: objects that expire (``ttl_s``)
and Redis Cluster (``cluster``, a one-node cluster owning every slot)."""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from kvtier.l2 import CompletionQueue, TaskResult, make_adapter
from tests.conftest import make_key
from tests.integration.harness import wait_for
from tests.servers import RedisProcess, free_port_pair, redis_binary


def command(port: int, *words: str) -> bytes:
    """One RESP command; the raw reply."""
    body = f"*{len(words)}\r\n" + "".join(f"${len(w)}\r\n{w}\r\n" for w in words)
    with socket.create_connection(("127.0.0.1", port), timeout=5) as conn:
        conn.sendall(body.encode())
        return conn.recv(4096)


class Adapter:
    def __init__(self, spec: dict[str, object]) -> None:
        self.queue = CompletionQueue()
        self.adapter = make_adapter(spec, self.queue.put)

    def wait(self, task: object) -> TaskResult:
        result = self.queue.get(timeout=30)
        assert result is not None and result.task == task
        return result


def test_objects_expire_after_ttl(redis_server: RedisProcess) -> None:
    a = Adapter({"type": "redis", "url": redis_server.url, "ttl_s": 0.5})
    key = make_key(1, salt=f"ttl{time.monotonic_ns()}")
    try:
        assert a.wait(a.adapter.submit_store([key], [np.ones(100, np.uint8)])).ok == (True,)
        assert a.wait(a.adapter.submit_lookup([key])).ok == (True,)
        ttl = command(redis_server.port, "PTTL", a.adapter.name_of(key))
        assert ttl.startswith(b":") and 0 < int(ttl[1:]) <= 500
        gone = wait_for(
            lambda: a.wait(a.adapter.submit_lookup([key])).ok, lambda ok: ok == (False,)
        )
        assert gone == (False,)
    finally:
        a.adapter.close()


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[RedisProcess]:
    binary = redis_binary()
    if binary is None:
        pytest.skip("no redis-server binary")
    conf = str(tmp_path / "nodes.conf")
    extra = ["--cluster-enabled", "yes", "--cluster-config-file", conf]
    # The cluster bus listens on port + 10000: the port must leave room for it.
    port = free_port_pair()
    server = RedisProcess.start(binary, tmp_path / "cluster.log", port=port, extra=extra)
    try:
        assert command(server.port, "CLUSTER", "ADDSLOTSRANGE", "0", "16383").startswith(b"+OK")
        state = wait_for(
            lambda: command(server.port, "CLUSTER", "INFO"), lambda r: b"cluster_state:ok" in r
        )
        assert b"cluster_state:ok" in state
        yield server
    finally:
        server.stop()


def test_cluster_mode_round_trip(cluster: RedisProcess) -> None:
    a = Adapter({"type": "redis", "url": cluster.url.removesuffix("/0"), "cluster": True})
    keys = [make_key(i, salt="cluster") for i in range(20)]  # spread over many slots
    data = [np.full(1000 + i, i, np.uint8) for i in range(20)]
    try:
        assert a.wait(a.adapter.submit_store(keys, data)).ok == (True,) * 20
        assert a.wait(a.adapter.submit_lookup(keys)).ok == (True,) * 20
        out = [np.zeros_like(d) for d in data]
        assert a.wait(a.adapter.submit_load(keys, out)).ok == (True,) * 20
        assert all(np.array_equal(o, d) for o, d in zip(out, data, strict=True))
    finally:
        a.adapter.close()
