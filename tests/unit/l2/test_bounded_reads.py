"""A reader of a store that other nodes write (Redis, S3) reads no more of a
copy than an honest copy of that object can take (``format.stored_bound``):
a value another writer planted under an object's name, however large, is a
counted miss that costs the reader about the object's size, not the value's."""

from __future__ import annotations

import numpy as np

from kvtier.l2 import CompletionQueue, make_adapter
from kvtier.l2.format import stored_bound
from tests.conftest import make_key
from tests.servers import RedisProcess, SeaweedProcess
from tests.unit.l2.harness import Harness, payload

SIZE = 2000
PLANTED = 32 << 20  # what the other writer adds past an honest copy


def _sent_to_clients(client: object) -> int:
    stats = client.info("stats")  # type: ignore[attr-defined]
    return int(stats["total_net_output_bytes"])


def test_an_oversized_redis_value_is_refused_having_read_only_its_bound(
    redis_server: RedisProcess,
) -> None:
    queue = CompletionQueue()
    adapter = make_adapter({"type": "redis", "url": redis_server.url}, queue.put)
    h = Harness(adapter, queue)
    try:
        key = make_key(7, salt="bounded-redis")
        assert h.store([key], [payload(SIZE, seed=1)]).ok == (True,)
        client = adapter._client  # type: ignore[attr-defined]
        name = adapter.name_of(key)  # type: ignore[attr-defined]
        client.append(name, bytes(PLANTED))
        before = _sent_to_clients(client)
        loaded = h.load([key], [np.zeros(SIZE, np.uint8)])
        sent = _sent_to_clients(client) - before
        assert loaded.ok == (False,)
        assert h.failures()["corrupt_length"] == 1
        assert client.exists(name) == 0  # the bad copy is removed
        # The INFO reply itself is a few KiB; the planted value is 32 MiB.
        assert sent < stored_bound(SIZE) + (64 << 10), sent
    finally:
        adapter.close()


def test_an_oversized_s3_object_is_refused_and_removed(seaweed_server: SeaweedProcess) -> None:
    queue = CompletionQueue()
    adapter = make_adapter(seaweed_server.spec(), queue.put)
    h = Harness(adapter, queue)
    try:
        key = make_key(8, salt="bounded-s3")
        assert h.store([key], [payload(SIZE, seed=2)]).ok == (True,)
        s3, bucket = adapter._s3, adapter.s3_config.bucket  # type: ignore[attr-defined]
        name = adapter.name_of(key)  # type: ignore[attr-defined]
        honest = s3.get_object(Bucket=bucket, Key=name)["Body"].read()
        s3.put_object(Bucket=bucket, Key=name, Body=honest + bytes(PLANTED))
        assert h.load([key], [np.zeros(SIZE, np.uint8)]).ok == (False,)
        assert h.failures()["corrupt_length"] == 1
        assert h.lookup([key]).ok == (False,)
    finally:
        adapter.close()
