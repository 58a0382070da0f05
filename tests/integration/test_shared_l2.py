"""Shared L2 on real stores: two kvtier nodes sharing one Redis/Valkey, and
what happens when the store dies, comes back or stalls."""

from __future__ import annotations

import json
import threading
import time
from collections import Counter
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

from kvtier.keys import ObjectKey
from kvtier.l1 import L1Config
from kvtier.l2 import CompletionQueue, TaskResult, make_adapter
from kvtier.l2.format import checksum
from kvtier.layout import KVLayout
from kvtier.protocol.client import CacheClient
from kvtier.storage import StorageConfig, StorageManager
from tests.conftest import make_key
from tests.integration import workload as w
from tests.integration.harness import ServerFactory, paused, wait_for
from tests.servers import (
    MooncakeProcess,
    RedisProcess,
    SeaweedProcess,
    mooncake_binaries,
    redis_binary,
)

CHUNKS = 8


@pytest.fixture(params=["redis_server", "valkey_server", "mooncake_server"])
def shared_spec(request: pytest.FixtureRequest) -> dict[str, Any]:
    """The L2 spec (named ``shared``) of one real shared store."""
    server = request.getfixturevalue(request.param)
    if isinstance(server, MooncakeProcess):
        return server.spec(name="shared")
    return {"type": "redis", "url": server.url, "name": "shared"}


def node(kvtier_server: ServerFactory, spec: dict[str, Any]) -> Any:
    return kvtier_server.start("--cache-dir", "none", "--l2", json.dumps(spec))


def written_back(client: CacheClient) -> int:
    status = client.status()
    if status is None:
        return 0
    return status.storage.store.stored_objects.get("shared", 0)


def stored_and_written_back(
    client: CacheClient, seed: int
) -> tuple[int, list[bytes], list[np.ndarray]]:
    """``CHUNKS`` chunks of ``seed`` stored through ``client`` and written back
    to the shared store: their object size, hashes and payloads."""
    chunk = client.chunk_size
    assert chunk is not None
    size = w.object_bytes(chunk)
    hashes = w.chunk_hashes(chunk, seed, CHUNKS)
    data = w.payloads(seed, CHUNKS, size)
    assert client.store(f"s{seed}", hashes, data) == CHUNKS
    assert wait_for(lambda: written_back(client), lambda n: n >= CHUNKS) >= CHUNKS
    return size, hashes, data


def test_node_b_hits_what_node_a_stored_and_other_tenants_miss(
    kvtier_server: ServerFactory, shared_spec: dict[str, Any]
) -> None:
    a, b = node(kvtier_server, shared_spec), node(kvtier_server, shared_spec)
    salt = f"t{time.monotonic_ns()}"  # this run's own objects in the shared store
    on_a = CacheClient(w.client_config(a.rpc, salt=salt))
    on_b = CacheClient(w.client_config(b.rpc, salt=salt))
    other = CacheClient(w.client_config(b.rpc, salt=salt + "-other"))
    try:
        size, hashes, data = stored_and_written_back(on_a, 5)

        state = on_b.lookup("r", hashes, wait_s=10.0)
        assert (state.hit_chunks, state.chunks_by_tier) == (
            CHUNKS,
            {"shared": CHUNKS},
        )  # from Redis, not L1
        out = w.empty_buffers(CHUNKS, size)
        assert on_b.retrieve_into("r", 0, CHUNKS, out)
        assert all(np.array_equal(o, d) for o, d in zip(out, data, strict=True))
        on_b.end_session("r")

        assert other.lookup("x", hashes, wait_s=10.0).hit_chunks == 0  # another salt: other keys
        other.end_session("x")
    finally:
        for client in (on_a, on_b, other):
            client.close()


# ------------------------------------------------------------------ faults


class Stream:
    """Stores and lookups on an adapter from a thread, counting results."""

    def __init__(self, spec: dict[str, Any]) -> None:
        self.queue = CompletionQueue()
        self.adapter = make_adapter(
            {**spec, "timeout_s": 2.0, "backoff_max_s": 1.0}, self.queue.put
        )
        self.salt = f"f{time.monotonic_ns()}"
        self.errors: list[BaseException] = []
        self.results: Counter[str] = Counter()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._n = 0

    def key(self, i: int) -> ObjectKey:
        return make_key(i, salt=self.salt)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(30)
        self.adapter.close()

    def wait(self, task: object) -> TaskResult:
        """The result of ``task`` (this stream runs one task at a time)."""
        result = self.queue.get(timeout=30)
        assert result is not None and result.task == task, "a task was not delivered"
        return result

    def round(self) -> tuple[TaskResult, TaskResult]:
        """Store a new key, then look it up; both results."""
        self._n += 1
        key, data = self.key(self._n), np.full(4096, self._n % 251, np.uint8)
        stored = self.wait(self.adapter.submit_store([key], [data]))
        found = self.wait(self.adapter.submit_lookup([key]))
        return stored, found

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                stored, found = self.round()
                self.results["stored" if stored.count else "store_failed"] += 1
                self.results["found" if found.count else "missed"] += 1
            except BaseException as exc:  # nothing may escape the adapter
                self.errors.append(exc)
                return


@pytest.fixture(params=["redis", "mooncake"])
def killable(request: pytest.FixtureRequest, tmp_path: Any) -> Iterator[Any]:
    """A store of this test's own (RedisProcess or MooncakeProcess), to kill."""
    store: RedisProcess | MooncakeProcess
    if request.param == "redis":
        binary = redis_binary()
        if binary is None:
            pytest.skip("no redis-server binary")
        store = RedisProcess.start(binary, tmp_path / "redis.log")
    else:
        binaries = mooncake_binaries()
        if binaries is None:
            pytest.skip("no mooncake_master binary")
        store = MooncakeProcess.start(binaries, tmp_path)
    try:
        yield store
    finally:
        store.stop()


@pytest.mark.slow
def test_backend_killed_mid_stream_then_restarted(killable: Any) -> None:
    spec = killable.spec() if isinstance(killable, MooncakeProcess) else None
    stream = Stream(spec or {"type": "redis", "url": killable.url})
    try:
        stream.start()
        assert wait_for(lambda: stream.results["found"], lambda n: n >= 20) >= 20
        killable.kill()
        before = stream.results["store_failed"]
        assert wait_for(lambda: stream.results["store_failed"], lambda n: n > before) > before
        assert stream.adapter.status()["failures"], "the failures are counted by reason"
        killable.launch()  # a fresh, empty store on the same port
        found = stream.results["found"]
        assert wait_for(lambda: stream.results["found"], lambda n: n > found + 5, timeout_s=30)
    finally:
        stream.stop()
    assert stream.errors == []


def test_data_lost_with_a_restart_is_a_miss_not_an_error(tmp_path: Any) -> None:
    binary = redis_binary()
    if binary is None:
        pytest.skip("no redis-server binary")
    store = RedisProcess.start(binary, tmp_path / "redis.log")
    stream = Stream({"type": "redis", "url": store.url})
    try:
        assert stream.round()[1].count == 1
        store.restart()  # no persistence: the object is gone
        key = stream.key(1)

        def looked_up() -> TaskResult:
            return stream.wait(stream.adapter.submit_lookup([key]))

        result = wait_for(looked_up, lambda r: "backoff" not in str(r), timeout_s=10)
        assert result.ok == (False,)
        out = [np.zeros(4096, np.uint8)]
        loaded = stream.wait(stream.adapter.submit_load([key], out))
        assert loaded.ok == (False,)
    finally:
        try:
            stream.stop()
        finally:
            store.stop()


@pytest.mark.slow
def test_a_paused_backend_does_not_hold_a_lookup_past_its_deadline(
    redis_server: RedisProcess,
) -> None:
    spec = {"type": "redis", "url": redis_server.url, "timeout_s": 20.0, "name": "shared"}
    config = StorageConfig(l1=L1Config(size_bytes=16 << 20, populate=False), l2=(spec,))
    keys = [make_key(i, salt=f"p{time.monotonic_ns()}") for i in range(4)]
    layout = KVLayout(1, 1, 128, "float32", tokens_per_chunk=1)  # 1,024-byte objects
    with StorageManager(config) as storage:
        storage.store(keys, [np.full(1024, i, np.uint8) for i in range(4)], layout)
        assert storage.flush(30)
        storage.delete_l1(keys)  # only Redis has them now
        redis_server.pause(8.0)
        started = time.monotonic()
        result = storage.lookup(keys, layout, deadline_s=0.5)
        waited = time.monotonic() - started
        storage.release(list(result.placements))
        assert result.hit_chunks == 0  # nothing could come back in time
        assert waited < 6.0, f"the lookup waited {waited:.1f} s for a paused store"


@pytest.fixture(params=["seaweed_server", "mooncake_server"])
def stoppable(request: pytest.FixtureRequest) -> tuple[dict[str, Any], list[int]]:
    """A shared store's L2 spec and the PIDs that SIGSTOP freezes it by."""
    server = request.getfixturevalue(request.param)
    if isinstance(server, MooncakeProcess):
        assert server.master is not None and server.holder is not None
        return server.spec(name="shared"), [server.master.pid, server.holder.pid]
    assert isinstance(server, SeaweedProcess) and server.proc is not None
    return server.spec(name="shared", timeout_s=20.0), [server.proc.pid]


@pytest.mark.slow
def test_a_stopped_store_does_not_hold_a_lookup_past_its_deadline(
    stoppable: tuple[dict[str, Any], list[int]],
) -> None:
    spec, pids = stoppable
    config = StorageConfig(l1=L1Config(size_bytes=16 << 20, populate=False), l2=(spec,))
    keys = [make_key(i, salt=f"p{time.monotonic_ns()}") for i in range(4)]
    layout = KVLayout(1, 1, 128, "float32", tokens_per_chunk=1)  # 1,024-byte objects
    with StorageManager(config) as storage:
        storage.store(keys, [np.full(1024, i, np.uint8) for i in range(4)], layout)
        assert storage.flush(60)
        storage.delete_l1(keys)  # only the shared store has them now
        with paused(pids):
            started = time.monotonic()
            result = storage.lookup(keys, layout, deadline_s=0.5)
            waited = time.monotonic() - started
        storage.release(list(result.placements))
        assert result.hit_chunks == 0
        assert waited < 6.0, f"the lookup waited {waited:.1f} s for a stopped store"
        again = storage.lookup(keys, layout, deadline_s=30.0)  # the store is back
        assert again.hit_chunks == 4
        storage.release(list(again.placements))


def test_objects_rewritten_in_the_store_with_a_valid_checksum_are_never_served(
    kvtier_server: ServerFactory, redis_server: RedisProcess, tmp_path: Any
) -> None:
    """Two nodes sealing with one cluster secret share a real Redis. Someone
    with write access to Redis but not the secret rewrites every object of a
    prefix: a payload byte changed and the checksum made right again. Node
    B serves none of it (counted corrupt, removed, a miss), keeps serving,
    and hits again once node A stores the prefix anew."""
    import redis

    secret = tmp_path / "cluster.secret"
    secret.write_text("0123456789abcdef0123456789abcdef\n")
    secret.chmod(0o600)  # a secret file group or others may read is refused
    spec = {"type": "redis", "url": redis_server.url, "name": "shared"}
    a, b = (
        kvtier_server.start(
            "--cache-dir", "none", "--l2", json.dumps(spec), "--cluster-secret-file", str(secret)
        )
        for _ in range(2)
    )
    salt = f"sealed{time.monotonic_ns()}"
    on_a = CacheClient(w.client_config(a.rpc, salt=salt))
    on_b = CacheClient(w.client_config(b.rpc, salt=salt))
    try:
        size, hashes, data = stored_and_written_back(on_a, 9)
        store = redis.Redis.from_url(redis_server.url)
        names = list(store.scan_iter(match=f"*{salt}*"))
        assert len(names) == CHUNKS
        for name in names:
            value = bytearray(store.get(name))
            header_len = int.from_bytes(value[6:8], "little")
            assert int.from_bytes(value[4:6], "little") == 3  # sealed
            value[header_len] ^= 0x01
            payload = np.frombuffer(bytes(value[header_len:]), dtype=np.uint8)
            value[32:40] = checksum(payload).to_bytes(8, "little")
            store.set(name, bytes(value))

        state = on_b.lookup("r", hashes, wait_s=10.0)
        assert state.hit_chunks == 0  # the first chunk is refused: nothing past it is a hit
        on_b.end_session("r")
        shared = on_b.status()
        assert shared is not None
        adapter = shared.storage.l2["shared"]
        assert adapter.corrupt_objects >= 1 and adapter.failures.get("corrupt_mac", 0) >= 1
        assert adapter.sealed_with
        assert store.exists(*names) < CHUNKS  # the forged copies read are gone

        _, fresh, data = stored_and_written_back(on_b, 10)  # the store works both ways
        state = on_a.lookup("r2", fresh, wait_s=10.0)
        assert (state.hit_chunks, state.chunks_by_tier) == (CHUNKS, {"shared": CHUNKS})
        out = w.empty_buffers(CHUNKS, size)
        assert on_a.retrieve_into("r2", 0, CHUNKS, out)
        assert all(np.array_equal(o, d) for o, d in zip(out, data, strict=True))
        on_a.end_session("r2")
    finally:
        for client in (on_a, on_b):
            client.close()
