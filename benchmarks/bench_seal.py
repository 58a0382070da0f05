"""What sealing L2 objects costs: store and load throughput through the fs
and Redis adapters, sealed (a cluster secret, ``kvtier.l2.seal``) against
unsealed, in alternating rounds of the same run on the same bytes.

A sealed store hashes each payload twice (the xxh3 checksum, kept for
readers without the secret, and the keyed BLAKE3 tag); a sealed load hashes
it once (the tag, which covers the checksum). Also reported: each hash alone
on one thread, GB/s, the floor under both. Starts its own ``redis-server``
on 127.0.0.1.

    python benchmarks/bench_seal.py [--objects 64] [--object-mib 8] [--repeats 7]
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import xxhash
from blake3 import blake3

from common import median_time, object_options, objects_of, report, timed
from kvtier.bench.stores import RedisProcess, redis_binary
from kvtier.keys import ObjectKey
from kvtier.l2 import CompletionQueue, L2Adapter, make_adapter
from kvtier.l2.seal import Sealer

SECRET = b"bench-secret-" + b"x" * 32


def rounds_of(
    adapter: L2Adapter, queue: CompletionQueue, sources: list[Any], rounds: int, clear: Any
) -> dict[str, list[float]]:
    """Seconds per store and load of every object, unsealed and sealed in
    turn, ``rounds`` times (after one untimed warm-up of each)."""
    outputs = [np.ones(s.nbytes, dtype=np.uint8) for s in sources]
    keys = [ObjectKey(blake3(b"%d" % i).digest(), "bench", 0) for i in range(len(sources))]
    sealer = Sealer([SECRET])

    def run(task: Any) -> None:
        result = queue.get(timeout=300)
        assert result is not None and result.task == task and all(result.ok), result

    samples: dict[str, list[float]] = {}
    for r in range(rounds + 1):
        for name, seal in (("unsealed", None), ("sealed", sealer)):
            adapter.seal_with(seal)
            clear()
            store = timed(lambda: run(adapter.submit_store(keys, sources)))
            load = timed(lambda: run(adapter.submit_load(keys, outputs)))
            assert all(np.array_equal(s, o) for s, o in zip(sources, outputs, strict=True))
            if r:  # the first round warms up
                samples.setdefault(f"{name} store", []).append(store)
                samples.setdefault(f"{name} load", []).append(load)
    return samples


def main() -> None:
    parser = argparse.ArgumentParser()
    object_options(parser, objects=64, repeats=7)
    args = parser.parse_args()
    size, sources = objects_of(args)
    total = args.objects * size
    tmp = Path(tempfile.mkdtemp(prefix="kvtier-bench-seal-"))
    binary = redis_binary()
    if binary is None:
        sys.exit("no redis-server: apt-get install redis-server")
    server = RedisProcess.start(binary, tmp / "redis.log")
    rows: list[tuple[str, str]] = []
    results: dict[str, object] = {"objects": args.objects, "object_bytes": size}
    key = blake3(SECRET).digest()
    one = sources[0]
    xxh3 = median_time(lambda: xxhash.xxh3_64_intdigest(one.data), 9)
    tag = median_time(lambda: blake3(one.data, key=key).digest(32), 9)
    rows.append(("xxh3-64, one thread", f"{size / xxh3 / 1e9:.2f} GB/s"))
    rows.append(("keyed BLAKE3, one thread", f"{size / tag / 1e9:.2f} GB/s"))
    results["xxh3_gbs"], results["blake3_gbs"] = size / xxh3 / 1e9, size / tag / 1e9
    try:
        import redis

        for name, spec, clear in (
            (
                "fs",
                {"type": "fs", "path": str(tmp / "fs"), "skip_present": False},
                lambda: shutil.rmtree(tmp / "fs" / "00", ignore_errors=True),
            ),
            (
                "redis",
                {"type": "redis", "url": server.url, "timeout_s": 60, "skip_present": False},
                lambda: redis.Redis.from_url(server.url).flushall(),
            ),
        ):
            queue = CompletionQueue()
            adapter = make_adapter(spec, queue.put)
            try:
                samples = rounds_of(adapter, queue, sources, args.repeats, clear)
            finally:
                adapter.close()
            for kind in ("store", "load"):
                plain, sealed = samples[f"unsealed {kind}"], samples[f"sealed {kind}"]
                ratio = sorted(p / s for p, s in zip(plain, sealed, strict=True))
                cost = 1 - statistics.median(ratio)
                rows.append(
                    (
                        f"{name} {kind}",
                        f"unsealed {total / statistics.median(plain) / 1e9:.2f} GB/s, sealed "
                        f"{total / statistics.median(sealed) / 1e9:.2f} GB/s: sealing costs "
                        f"{cost:+.1%} (rounds {1 - ratio[-1]:+.1%} to {1 - ratio[0]:+.1%})",
                    )
                )
                results[f"{name}_{kind}_cost"] = cost
    finally:
        server.stop()
        shutil.rmtree(tmp, ignore_errors=True)
    report(f"sealing L2 objects, {args.objects} x {args.object_mib} MiB", rows, results)


if __name__ == "__main__":
    main()
