"""The L2 adapter contract (``kvtier.l2.base``), checked for every adapter type.

To add an adapter, add one entry to ``ADAPTER_FACTORIES``: how to build it
(``build(tmp_path, on_complete, server, **options)`` through ``make_adapter``),
how to rewrite one stored object directly in its backend (``tamper``), options
that make each task take a while (``slow``, for the ``close()`` tests), and
for a backend that is a server the name of the session fixture that runs it
(``server``; it skips when the server's binary is missing).
Every test uses keys with a salt of its own, so a backend shared between
tests (a server) never sees another test's objects.
"""

from __future__ import annotations

import struct
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kvtier.keys import KeySelector, ObjectKey
from kvtier.l2 import (
    CompletionQueue,
    L2Adapter,
    TaskId,
    TaskKind,
    TaskResult,
    make_adapter,
)
from kvtier.l2.base import Buffer, CompletionCallback
from kvtier.l2.format import checksum
from kvtier.l2.fs import FSAdapter
from kvtier.l2.mock import MockAdapter
from kvtier.l2.mooncake import MooncakeAdapter
from kvtier.l2.payload_codec import PayloadCodec
from kvtier.l2.redis import RedisAdapter
from kvtier.l2.s3 import S3Adapter
from kvtier.l2.seal import Sealer
from kvtier.l2.stored_value import decode_object, encode_object
from tests.conftest import make_key
from tests.servers import MooncakeProcess, RedisProcess, SeaweedProcess
from tests.unit.l2.harness import Change, Harness, drain, payload

LAYOUT_A = "00112233445566778899aabbccddeeff"
LAYOUT_B = "ffeeddccbbaa99887766554433221100"

# ------------------------------------------------------------ adapter types


def _build_mock(
    tmp_path: Path, on_complete: CompletionCallback, server: Any, **options: Any
) -> L2Adapter:
    return make_adapter({"type": "mock", **options}, on_complete)


def _tamper_mock(adapter: L2Adapter, key: ObjectKey, change: Change) -> None:
    assert isinstance(adapter, MockAdapter)
    adapter.tamper(key, change)


def _build_fs(
    tmp_path: Path, on_complete: CompletionCallback, server: Any, **options: Any
) -> L2Adapter:
    return make_adapter({"type": "fs", "path": str(tmp_path / "l2"), **options}, on_complete)


def _build_redis(
    tmp_path: Path, on_complete: CompletionCallback, server: RedisProcess, **options: Any
) -> L2Adapter:
    return make_adapter({"type": "redis", "url": server.url, **options}, on_complete)


def _build_valkey(
    tmp_path: Path, on_complete: CompletionCallback, server: RedisProcess, **options: Any
) -> L2Adapter:
    return make_adapter({"type": "valkey", "url": server.url, **options}, on_complete)


def _build_s3(
    tmp_path: Path, on_complete: CompletionCallback, server: SeaweedProcess, **options: Any
) -> L2Adapter:
    return make_adapter(server.spec(**options), on_complete)


def _tamper_s3(adapter: L2Adapter, key: ObjectKey, change: Change) -> None:
    assert isinstance(adapter, S3Adapter)
    bucket, name = adapter.s3_config.bucket, adapter.name_of(key)
    body = adapter._s3.get_object(Bucket=bucket, Key=name)["Body"].read()
    adapter._s3.put_object(Bucket=bucket, Key=name, Body=change(body))


def _build_mooncake(
    tmp_path: Path, on_complete: CompletionCallback, server: MooncakeProcess, **options: Any
) -> L2Adapter:
    return make_adapter(server.spec(**options), on_complete)


def _tamper_mooncake(adapter: L2Adapter, key: ObjectKey, change: Change) -> None:
    assert isinstance(adapter, MooncakeAdapter)
    store, name = adapter._store_client, adapter.name_of(key)
    value = change(bytes(store.get(name)))
    assert store.remove(name, True) == 0
    assert store.put(name, value) == 0


def _tamper_redis(adapter: L2Adapter, key: ObjectKey, change: Change) -> None:
    assert isinstance(adapter, RedisAdapter)
    client = adapter._client
    name = adapter.name_of(key)
    client.set(name, change(client.get(name)))


def _tamper_fs(adapter: L2Adapter, key: ObjectKey, change: Change) -> None:
    assert isinstance(adapter, FSAdapter)
    path = adapter.path_of(key)
    path.write_bytes(change(path.read_bytes()))


@dataclass(frozen=True)
class AdapterFactory:
    build: Callable[..., L2Adapter]  # (tmp_path, on_complete, **options) -> adapter
    tamper: Callable[[L2Adapter, ObjectKey, Change], None]
    slow: dict[str, Any] = field(default_factory=dict)
    server: str | None = None  # the session fixture that runs the backend


ADAPTER_FACTORIES: dict[str, AdapterFactory] = {
    "mock": AdapterFactory(_build_mock, _tamper_mock, slow={"latency_s": 0.05}),
    "fs": AdapterFactory(_build_fs, _tamper_fs, slow={"fsync": True}),
    # Redis and Valkey: batches of one key per round trip, so tasks take a while.
    "mooncake": AdapterFactory(
        _build_mooncake, _tamper_mooncake, slow={"max_batch": 1}, server="mooncake_server"
    ),
    "redis": AdapterFactory(
        _build_redis, _tamper_redis, slow={"batch_bytes": 1}, server="redis_server"
    ),
    "s3": AdapterFactory(_build_s3, _tamper_s3, slow={"io_threads": 1}, server="seaweed_server"),
    "valkey": AdapterFactory(
        _build_valkey, _tamper_redis, slow={"batch_bytes": 1}, server="valkey_server"
    ),
    # The contract holds with a codec too: payloads stored with zstd (kvtier.l2.codecs).
    "mock-zstd": AdapterFactory(
        lambda *a, **o: _build_mock(*a, **{"codec": "zstd", **o}),
        _tamper_mock,
        slow={"latency_s": 0.05},
    ),
    "redis-zstd": AdapterFactory(
        lambda *a, **o: _build_redis(*a, **{"codec": "zstd", **o}),
        _tamper_redis,
        slow={"batch_bytes": 1},
        server="redis_server",
    ),
}

# ------------------------------------------------------------ fixtures


class ContractHarness(Harness):
    def __init__(self, adapter: L2Adapter, queue: CompletionQueue, factory: AdapterFactory):
        super().__init__(adapter, queue, factory.tamper)
        self.salt = uuid.uuid4().hex[:16]

    def key(self, i: int) -> ObjectKey:
        return make_key(i, salt=self.salt)

    def keys(self, *indices: int) -> list[ObjectKey]:
        return [self.key(i) for i in indices]


@pytest.fixture(params=sorted(ADAPTER_FACTORIES))
def adapter_type(request: pytest.FixtureRequest) -> str:
    name: str = request.param
    return name


@pytest.fixture
def open_adapter(
    adapter_type: str, tmp_path: Path, request: pytest.FixtureRequest
) -> Iterator[Callable[..., ContractHarness]]:
    """Build harnesses for ``adapter_type``; all are closed at teardown."""
    made: list[ContractHarness] = []
    factory = ADAPTER_FACTORIES[adapter_type]
    server = request.getfixturevalue(factory.server) if factory.server else None

    def build(**options: Any) -> ContractHarness:
        queue = CompletionQueue()
        adapter = factory.build(tmp_path / f"a{len(made)}", queue.put, server, **options)
        made.append(ContractHarness(adapter, queue, factory))
        return made[-1]

    yield build
    for harness in made:
        harness.adapter.close()
        harness.drain()  # fails the test if any task was delivered twice


@pytest.fixture
def h(open_adapter: Callable[..., ContractHarness]) -> ContractHarness:
    return open_adapter()


def _codec(h: ContractHarness) -> PayloadCodec | None:
    codec: PayloadCodec | None = getattr(h.adapter, "codec", None)
    return codec


def _blank(*sizes: int) -> list[Buffer]:
    return [np.zeros(n, dtype=np.uint8) for n in sizes]


def _store_one(h: ContractHarness, key: ObjectKey, data: Buffer, layout: str = "") -> None:
    assert h.store([key], [data], layout).ok == (True,)


# ------------------------------------------------------------ round trip


@pytest.mark.parametrize("layout", ["", LAYOUT_A])
def test_round_trip_is_bit_identical(h: ContractHarness, layout: str) -> None:
    sizes = [1, 100, 4096, 5000, 65536]
    keys = h.keys(*range(len(sizes)))
    data = [payload(n, seed=i) for i, n in enumerate(sizes)]

    stored = h.store(keys, data, layout)
    assert stored.kind is TaskKind.STORE
    assert stored.keys == tuple(keys)
    assert stored.ok == (True,) * len(keys)
    assert stored.adapter == h.adapter.name
    raw = [h.raw(k) for k in keys]
    assert stored.nbytes == sum(len(r) for r in raw)  # the bytes really written
    for key, value, original in zip(keys, raw, data, strict=True):
        copy = np.zeros(original.nbytes, dtype=np.uint8)
        decode_object(value, key, layout, copy, _codec(h))  # the shared object format
        assert np.array_equal(copy, original)

    found = h.lookup(keys)
    assert found.kind is TaskKind.LOOKUP
    assert found.ok == (True,) * len(keys)
    assert found.nbytes == 0

    out = _blank(*sizes)
    loaded = h.load(keys, out, layout)
    assert loaded.kind is TaskKind.LOAD
    assert loaded.ok == (True,) * len(keys)
    assert loaded.nbytes == sum(sizes)
    for got, original in zip(out, data, strict=True):
        assert got.tobytes() == original.tobytes()
    assert h.failures() == Counter()


def test_load_is_repeatable(h: ContractHarness) -> None:
    key, data = h.key(0), payload(3000, seed=1)
    _store_one(h, key, data)
    for _ in range(3):
        out = _blank(3000)
        assert h.load([key], out).ok == (True,)
        assert np.array_equal(out[0], data)


def test_task_ids_are_distinct(h: ContractHarness) -> None:
    key = h.key(0)
    tasks = [
        h.adapter.submit_store([key], [payload(10, seed=0)]),
        h.adapter.submit_lookup([key]),
        h.adapter.submit_load([key], _blank(10)),
    ]
    assert len(set(tasks)) == 3
    for task in tasks:
        assert h.wait(task).task == task


# ------------------------------------------------------------ delivery


def test_every_task_is_delivered_exactly_once_under_concurrency(h: ContractHarness) -> None:
    submitted: dict[TaskId, tuple[TaskKind, tuple[ObjectKey, ...]]] = {}
    keep: list[Buffer] = []  # buffers belong to the adapter until the results arrive
    lock = threading.Lock()
    errors: list[BaseException] = []

    def submitter(thread: int) -> None:
        try:
            for j in range(20):
                keys = [h.key(1000 * thread + j), h.key(1000 * thread + j + 500)]
                data = [payload(2048, seed=j), payload(512, seed=j + 1)]
                out = _blank(2048, 512)
                with lock:
                    keep.extend(data + out)
                tasks = [
                    (TaskKind.STORE, h.adapter.submit_store(keys, data)),
                    (TaskKind.LOOKUP, h.adapter.submit_lookup(keys)),
                    (TaskKind.LOAD, h.adapter.submit_load(keys, out)),
                ]
                with lock:
                    for kind, task in tasks:
                        assert task not in submitted
                        submitted[task] = (kind, tuple(keys))
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=submitter, args=(t,)) for t in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert errors == []
    h.adapter.close()  # waits for every in-flight task

    results = drain(h.queue)
    delivered = Counter(r.task for r in results)
    assert len(submitted) == 4 * 20 * 3
    assert delivered == Counter(dict.fromkeys(submitted, 1))
    for result in results:
        assert (result.kind, result.keys) == submitted[result.task]
        assert len(result.ok) == len(result.keys)
    stores = [r for r in results if r.kind is TaskKind.STORE]
    assert all(r.ok == (True, True) for r in stores)


def test_empty_batches_complete_with_empty_results(h: ContractHarness) -> None:
    for result, kind in [
        (h.store([], []), TaskKind.STORE),
        (h.lookup([]), TaskKind.LOOKUP),
        (h.load([], []), TaskKind.LOAD),
    ]:
        assert result.kind is kind
        assert result.keys == ()
        assert result.ok == ()
        assert result.nbytes == 0
        assert result.count == 0
    assert h.failures() == Counter()


@pytest.mark.parametrize("kind", ["store", "load"])
def test_keys_and_buffers_of_different_lengths_raise(h: ContractHarness, kind: str) -> None:
    submit = h.adapter.submit_store if kind == "store" else h.adapter.submit_load
    keys = h.keys(0, 1)
    with pytest.raises(ValueError):
        submit(keys, _blank(10))
    with pytest.raises(ValueError):
        submit(keys[:1], _blank(10, 10))
    with pytest.raises(ValueError):
        submit([], _blank(10))
    h.adapter.close()
    assert drain(h.queue) == []  # no task was created
    assert h.failures() == Counter()


# ------------------------------------------------------------ misses


def test_missing_keys_are_misses(h: ContractHarness) -> None:
    keys = h.keys(0, 1, 2)
    assert h.lookup(keys).ok == (False, False, False)
    out = _blank(10, 10, 10)
    loaded = h.load(keys, out)
    assert loaded.ok == (False, False, False)
    assert loaded.nbytes == 0
    assert h.failures()["not_found"] == 3
    assert h.counter("corrupt_objects") == 0


def test_mixed_batch_gives_a_per_key_bitmap(h: ContractHarness) -> None:
    keys = h.keys(*range(6))
    sizes = [100, 200, 300, 400, 500, 600]
    data = [payload(n, seed=n) for n in sizes]
    present = [0, 2, 3]
    assert h.store([keys[i] for i in present], [data[i] for i in present]).ok == (True,) * 3

    expected = tuple(i in present for i in range(6))
    assert h.lookup(keys).ok == expected
    out = _blank(*sizes)
    loaded = h.load(keys, out)
    assert loaded.ok == expected
    assert loaded.nbytes == sum(sizes[i] for i in present)
    for i in present:
        assert np.array_equal(out[i], data[i])
    assert h.failures() == Counter({"not_found": 3})


# ------------------------------------------------------------ bad copies


def _corrupt_failures(h: ContractHarness) -> int:
    return sum(n for reason, n in h.failures().items() if reason.startswith("corrupt_"))


def test_load_with_another_layout_is_a_miss_and_removes_the_copy(h: ContractHarness) -> None:
    key, data = h.key(0), payload(1000, seed=0)
    _store_one(h, key, data, LAYOUT_A)
    out = _blank(1000)
    loaded = h.load([key], out, LAYOUT_B)
    assert loaded.ok == (False,)
    assert loaded.nbytes == 0
    assert h.counter("corrupt_objects") == 1
    assert h.failures() == Counter({"corrupt_layout": 1})
    assert h.lookup([key]).ok == (False,)
    assert h.load([key], _blank(1000), LAYOUT_A).ok == (False,)  # gone for every reader
    assert h.failures()["not_found"] == 1


def test_load_without_layout_of_a_copy_with_one_is_a_miss(h: ContractHarness) -> None:
    key = h.key(0)
    _store_one(h, key, payload(100, seed=0), LAYOUT_A)
    assert h.load([key], _blank(100), "").ok == (False,)
    assert h.failures() == Counter({"corrupt_layout": 1})
    assert h.lookup([key]).ok == (False,)


def _flip_last_byte(data: bytes) -> bytes:
    return data[:-1] + bytes([data[-1] ^ 0x01])


def _flip_first_payload_byte(size: int) -> Change:
    def change(data: bytes) -> bytes:
        at = len(data) - size
        return data[:at] + bytes([data[at] ^ 0x80]) + data[at + 1 :]

    return change


def _truncate(data: bytes) -> bytes:
    return data[: len(data) - 7]


@pytest.mark.parametrize(
    ("plant", "reasons"),
    [
        ("flip_last", {"corrupt_checksum"}),
        ("flip_first", {"corrupt_checksum"}),
        ("truncate", {"corrupt_short", "corrupt_length"}),
        ("header_only", {"corrupt_short", "corrupt_length"}),
        ("other_key", {"corrupt_key"}),
        ("garbage", {"corrupt_magic"}),
    ],
)
def test_planted_bad_copy_is_a_counted_miss_and_is_removed(
    h: ContractHarness, plant: str, reasons: set[str]
) -> None:
    size = 2000
    key, other, data = h.key(0), h.key(1), payload(size, seed=3)
    _store_one(h, key, data, LAYOUT_A)
    header_len = len(h.raw(key)) - size
    change: Change = {
        "flip_last": _flip_last_byte,
        "flip_first": _flip_first_payload_byte(size),
        "truncate": _truncate,
        "header_only": lambda b: b[:header_len],
        "other_key": lambda b: encode_object(other, LAYOUT_A, data),
        "garbage": lambda b: bytes(len(b)),
    }[plant]
    h.tamper(key, change)

    out = _blank(size)
    loaded = h.load([key], out, LAYOUT_A)
    assert loaded.ok == (False,)
    assert loaded.nbytes == 0
    assert h.counter("corrupt_objects") == 1
    failures = h.failures()
    assert sum(failures.values()) == 1
    assert set(failures) <= reasons, failures
    assert h.lookup([key]).ok == (False,)  # the bad copy is gone
    assert h.load([key], _blank(size), LAYOUT_A).ok == (False,)
    assert h.failures()["not_found"] == 1
    assert h.lookup([other]).ok == (False,)  # nothing was planted under the other key

    # the key is usable again
    _store_one(h, key, data, LAYOUT_A)
    out = _blank(size)
    assert h.load([key], out, LAYOUT_A).ok == (True,)
    assert np.array_equal(out[0], data)


# ---------------------------------------------------------------- sealing

CLUSTER_SECRET = b"c" * 40
OTHER_SECRET = b"o" * 40  # a writer that does not hold the cluster's secret


def _recheck_summed(data: bytes) -> bytes:
    """A payload byte flipped and the header's checksum made right again:
    what a writer who knows the format but not the secret can do."""
    header_len = struct.unpack_from("<H", data, 6)[0]
    changed = bytearray(data)
    changed[header_len] ^= 0x01
    payload_view = np.frombuffer(bytes(changed[header_len:]), dtype=np.uint8)
    struct.pack_into("<Q", changed, 32, checksum(payload_view))
    return bytes(changed)


@pytest.mark.parametrize(
    ("plant", "reasons"),
    [
        ("rechecksummed", {"corrupt_mac"}),
        ("unsealed", {"corrupt_mac", "corrupt_short", "corrupt_length"}),
        ("other_secret", {"corrupt_mac"}),
        ("other_key_sealed", {"corrupt_key"}),
    ],
)
def test_a_forged_object_with_a_valid_checksum_is_a_counted_miss_and_removed(
    h: ContractHarness, plant: str, reasons: set[str]
) -> None:
    """With the cluster secret, only objects sealed under it are served: a
    copy re-checksummed after tampering, an unsealed one, one sealed under
    another secret each cost one counted miss and are removed; what was
    stored is served bit-exact."""
    h.adapter.seal_with(Sealer([CLUSTER_SECRET]))
    size = 2000
    key, other, data = h.key(0), h.key(1), payload(size, seed=3)
    forged = payload(size, seed=4)
    _store_one(h, key, data, LAYOUT_A)
    assert struct.unpack_from("<H", h.raw(key), 4)[0] == 3  # a sealed header
    out = _blank(size)
    assert h.load([key], out, LAYOUT_A).ok == (True,) and np.array_equal(out[0], data)
    change: Change = {
        "rechecksummed": _recheck_summed,
        "unsealed": lambda b: encode_object(key, LAYOUT_A, forged),
        "other_secret": lambda b: encode_object(key, LAYOUT_A, forged, seal=Sealer([OTHER_SECRET])),
        "other_key_sealed": lambda b: encode_object(
            other, LAYOUT_A, forged, seal=Sealer([CLUSTER_SECRET])
        ),
    }[plant]
    h.tamper(key, change)
    out = _blank(size)
    assert h.load([key], out, LAYOUT_A).ok == (False,)  # the buffer is not the caller's
    assert h.counter("corrupt_objects") == 1
    assert set(h.failures()) <= reasons, h.failures()
    assert h.lookup([key]).ok == (False,)  # removed
    _store_one(h, key, data, LAYOUT_A)
    assert h.load([key], out, LAYOUT_A).ok == (True,) and np.array_equal(out[0], data)


def test_a_rotation_accepts_both_secrets_and_a_reader_without_one_reads_checksums(
    h: ContractHarness,
) -> None:
    old, new = Sealer([OTHER_SECRET]), Sealer([CLUSTER_SECRET, OTHER_SECRET])
    key, data = h.key(0), payload(900, seed=5)
    h.adapter.seal_with(old)
    _store_one(h, key, data)
    out = _blank(900)
    h.adapter.seal_with(new)  # mid-rotation: the new secret seals, the old one still opens
    assert h.load([key], out).ok == (True,) and np.array_equal(out[0], data)
    h.adapter.seal_with(None)  # no secret: as before sealing existed
    assert h.load([key], out).ok == (True,) and np.array_equal(out[0], data)
    h.adapter.seal_with(Sealer([CLUSTER_SECRET]))  # the rotation is over
    assert h.load([key], out).ok == (False,)
    assert h.failures() == Counter({"corrupt_mac": 1})


def test_bad_copy_in_a_batch_fails_only_its_own_key(h: ContractHarness) -> None:
    keys = h.keys(0, 1, 2)
    data = [payload(700, seed=i) for i in range(3)]
    assert h.store(keys, data).ok == (True, True, True)
    h.tamper(keys[1], _flip_last_byte)
    out = _blank(700, 700, 700)
    loaded = h.load(keys, out)
    assert loaded.ok == (True, False, True)
    assert loaded.nbytes == 1400
    assert np.array_equal(out[0], data[0])
    assert np.array_equal(out[2], data[2])
    assert h.failures() == Counter({"corrupt_checksum": 1})
    assert h.lookup(keys).ok == (True, False, True)


def test_used_bytes_are_released_when_a_bad_copy_is_removed(h: ContractHarness) -> None:
    key, data = h.key(0), payload(1000, seed=0)
    _store_one(h, key, data)
    if "used_bytes" not in h.adapter.status():
        pytest.skip(f"{adapter_type} does not report used_bytes")
    h.tamper(key, _truncate)
    assert h.load([key], _blank(1000)).ok == (False,)
    assert h.adapter.status()["used_bytes"] == 0


@pytest.mark.parametrize("size", [999, 1001, 0])
def test_load_into_a_buffer_of_the_wrong_size_is_a_miss(h: ContractHarness, size: int) -> None:
    key = h.key(0)
    _store_one(h, key, payload(1000, seed=0))
    loaded = h.load([key], _blank(size))
    assert loaded.ok == (False,)
    assert loaded.nbytes == 0
    assert sum(h.failures().values()) == 1  # a miss is counted with a reason


# ------------------------------------------------------------ overwrite


def test_a_store_skips_what_the_backend_holds(h: ContractHarness) -> None:
    """The soak's write amplification: an object L1 re-admits is not written
    again. One key's bytes are one prefix's KV, so the copy there is as good."""
    keys = h.keys(0, 1)
    first = payload(3000, seed=1)
    _store_one(h, keys[0], first)
    raw = h.raw(keys[0])
    stored = h.store(keys, [payload(3000, seed=2), payload(3000, seed=3)])
    assert stored.ok == (True, True)
    assert stored.nbytes == len(h.raw(keys[1]))  # only the missing one was written
    assert h.raw(keys[0]) == raw
    assert h.adapter.status()["store_present"] == 1
    out = _blank(3000)
    assert h.load(keys[:1], out).ok == (True,)
    assert np.array_equal(out[0], first)
    assert h.failures() == Counter()


def test_storing_a_key_twice_leaves_one_valid_copy(
    open_adapter: Callable[..., ContractHarness],
) -> None:
    """Without ``skip_present`` the newest copy wins, whole."""
    h = open_adapter(skip_present=False)
    key = h.key(0)
    first, second = payload(3000, seed=1), payload(2000, seed=2)
    _store_one(h, key, first)
    stored = h.store([key], [second])
    assert stored.ok == (True,)
    raw = h.raw(key)
    assert stored.nbytes == len(raw)
    copy = np.zeros(2000, dtype=np.uint8)
    decode_object(raw, key, "", copy, _codec(h))
    assert np.array_equal(copy, second)

    out = _blank(2000)
    assert h.load([key], out).ok == (True,)
    assert np.array_equal(out[0], second)
    status = h.adapter.status()
    if "objects" in status:
        assert status["objects"] == 1
    if "used_bytes" in status:
        assert status["used_bytes"] == len(raw)


def test_storing_a_key_twice_in_one_batch(h: ContractHarness) -> None:
    """Parts of a batch may run in parallel: either copy may win, but only whole."""
    key = h.key(0)
    first, second = payload(100, seed=1), payload(100, seed=2)
    assert h.store([key, key], [first, second]).ok == (True, True)
    out = _blank(100)
    assert h.load([key], out).ok == (True,)
    assert out[0].tobytes() in (first.tobytes(), second.tobytes())
    status = h.adapter.status()
    if "objects" in status:
        assert status["objects"] == 1
    if "used_bytes" in status:
        assert status["used_bytes"] == len(h.raw(key))


# ------------------------------------------------------------ unlock


def test_unlock_never_raises(h: ContractHarness) -> None:
    present, missing = h.key(0), h.key(1)
    _store_one(h, present, payload(10, seed=0))
    h.adapter.unlock([h.key(7), h.key(8)])  # never looked up
    h.adapter.unlock([])
    assert h.lookup([present, missing]).ok == (True, False)
    h.adapter.unlock([present, missing])
    h.adapter.unlock([present, missing])  # twice
    assert h.lookup([present]).ok == (True,)
    assert h.lookup([present]).ok == (True,)
    h.adapter.unlock([present])
    h.adapter.unlock([present])
    status = h.adapter.status()
    if "leases" in status:
        assert status["leases"] == 0
    h.adapter.close()
    h.adapter.unlock([present, missing])  # after close too


def test_lookup_leases_are_released_by_unlock(h: ContractHarness) -> None:
    if "leases" not in h.adapter.status():
        pytest.skip("this adapter does not report leases")
    keys = h.keys(0, 1)
    assert h.store(keys, [payload(10, seed=0)] * 2).ok == (True, True)
    assert h.lookup([*keys, h.key(2)]).ok == (True, True, False)
    assert h.adapter.status()["leases"] == 2  # only what was found
    h.adapter.unlock([keys[0]])
    assert h.adapter.status()["leases"] == 1
    h.adapter.unlock([keys[1], h.key(2)])
    assert h.adapter.status()["leases"] == 0


# ------------------------------------------------------------ close


def test_close_waits_for_in_flight_tasks(
    open_adapter: Callable[..., ContractHarness], adapter_type: str
) -> None:
    h = open_adapter(**ADAPTER_FACTORIES[adapter_type].slow)
    data = [payload(256 * 1024, seed=i) for i in range(8)]
    tasks = [h.adapter.submit_store([h.key(i)], [data[i]]) for i in range(8)]
    h.adapter.close()
    results = {r.task: r for r in drain(h.queue)}  # already delivered: no waiting
    assert sorted(results) == sorted(tasks)
    assert all(r.ok == (True,) for r in results.values())
    assert h.failures() == Counter()


def test_close_waits_for_in_flight_loads(
    open_adapter: Callable[..., ContractHarness], adapter_type: str
) -> None:
    h = open_adapter(**ADAPTER_FACTORIES[adapter_type].slow)
    keys = h.keys(*range(4))
    data = [payload(64 * 1024, seed=i) for i in range(4)]
    assert h.store(keys, data).ok == (True,) * 4
    out = _blank(*[64 * 1024] * 4)
    tasks = [h.adapter.submit_load([k], [b]) for k, b in zip(keys, out, strict=True)]
    h.adapter.close()
    results = {r.task: r for r in drain(h.queue)}
    assert sorted(results) == sorted(tasks)
    assert all(r.ok == (True,) for r in results.values())
    for got, original in zip(out, data, strict=True):
        assert np.array_equal(got, original)


def test_tasks_after_close_are_closed_misses(h: ContractHarness) -> None:
    key = h.key(0)
    _store_one(h, key, payload(10, seed=0))
    h.adapter.close()
    h.adapter.close()  # idempotent
    tasks = [
        h.adapter.submit_store(h.keys(1, 2), [payload(10, seed=1)] * 2),
        h.adapter.submit_lookup([key]),
        h.adapter.submit_load([key], _blank(10)),
        h.adapter.submit_lookup([]),
    ]
    results: dict[TaskId, TaskResult] = {r.task: r for r in drain(h.queue)}  # at once
    assert sorted(results) == sorted(tasks)
    assert [results[t].ok for t in tasks] == [(False, False), (False,), (False,), ()]
    assert [results[t].kind for t in tasks] == [
        TaskKind.STORE,
        TaskKind.LOOKUP,
        TaskKind.LOAD,
        TaskKind.LOOKUP,
    ]
    assert all(results[t].nbytes == 0 for t in tasks)
    assert h.failures() == Counter({"closed": 4})


# ------------------------------------------------------------ status


def test_status_reports_type_name_health_and_failures(
    h: ContractHarness, adapter_type: str
) -> None:
    status = h.adapter.status()
    type_name, _, codec = adapter_type.partition("-")
    assert status["type"] == type_name
    assert status["name"] == type_name
    assert status["codec"] == (codec or "none")
    assert status["healthy"] is True
    assert status["failures"] == {}
    h.load([h.key(0)], _blank(1))
    status = h.adapter.status()
    assert status["failures"] == {"not_found": 1}
    assert status["healthy"] is True


def test_name_option_names_the_adapter(
    open_adapter: Callable[..., ContractHarness], adapter_type: str
) -> None:
    h = open_adapter(name="tier-b")
    assert h.adapter.name == "tier-b"
    status = h.adapter.status()
    assert (status["type"], status["name"]) == (adapter_type.partition("-")[0], "tier-b")
    assert h.lookup([h.key(0)]).adapter == "tier-b"


def test_status_failures_are_a_snapshot(h: ContractHarness) -> None:
    failures = h.adapter.status()["failures"]
    h.load([h.key(0)], _blank(1))
    assert failures == {}


# ----------------------------------------------------------------- purge


def _purge_all(h: ContractHarness, selector: KeySelector, limit: int) -> tuple[int, int]:
    """Purge in steps of ``limit`` until done: objects deleted, steps taken."""
    deleted, cursor, steps = 0, None, 0
    while True:
        step = h.adapter.purge(selector, cursor, limit)
        deleted, steps = deleted + step.deleted, steps + 1
        if step.cursor is None:
            return deleted, steps
        cursor = step.cursor
        assert steps < 100_000


def test_purge_removes_exactly_the_selected_namespace_in_batches(h: ContractHarness) -> None:
    mine = h.keys(*range(7))
    other_salt = [make_key(i, salt=h.salt + "x") for i in range(3)]
    other_model = [ObjectKey(k.chunk_hash, "other-model", 0, 0, h.salt) for k in mine[:2]]
    everything = mine + other_salt + other_model
    assert h.store(everything, [payload(64, seed=i) for i in range(len(everything))]).ok == (
        (True,) * len(everything)
    )
    deleted, steps = _purge_all(h, KeySelector("test-model", h.salt), limit=3)
    assert deleted == 7 and steps >= 2  # in batches
    assert h.lookup(mine).ok == (False,) * 7
    assert h.lookup(other_salt + other_model).ok == (True,) * 5
    assert _purge_all(h, KeySelector("test-model", h.salt), limit=3)[0] == 0  # nothing left
    # A tenant's objects, any model. The lookup above leased them in Mooncake, and
    # a read lease defers removal (the test server's leases last 200 ms): the
    # purger passes again until a pass finds nothing, as here.
    deadline, deleted = time.monotonic() + 10, 0
    while deleted < 2 and time.monotonic() < deadline:
        deleted += _purge_all(h, KeySelector(salt=h.salt), limit=100)[0]
        time.sleep(0.05)
    assert deleted == 2
    assert h.lookup(other_salt).ok == (True,) * 3
