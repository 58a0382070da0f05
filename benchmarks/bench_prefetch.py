"""Prefetch path: lookup -> admitted in L1 for 32 chunks from the fs tier.

Each round clears L1 (untimed), then times ``StorageManager.lookup`` of a
32-chunk prompt whose objects are all in the fs adapter (page-cache warm):
L1 lock attempt, one fs lookup, the plan, staging reservation, the load on
the adapter's threads, checksum verification and admission with read locks.
Baseline in the same run: plain ``readinto`` of the same payload bytes from
32 files (no lookup, no checks, no L1).

    python benchmarks/bench_prefetch.py [--chunks 32] [--object-kib 512 8192]
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
from pathlib import Path

import numpy as np

from common import percentile, report, timed
from kvtier.keys import ObjectKey
from kvtier.l1 import L1Config
from kvtier.layout import KVLayout
from kvtier.storage import StorageConfig, StorageManager


def measure(chunks: int, object_kib: int, rounds: int, root: Path) -> dict[str, float]:
    # One layer, one head: head_dim chosen so that one object is object_kib KiB.
    layout = KVLayout(1, 1, object_kib * 1024 // (2 * 4 * 16), "float32", 16)
    size = layout.object_bytes()
    keys = [ObjectKey(i.to_bytes(32, "big"), "bench", 0) for i in range(chunks)]
    rng = np.random.default_rng(0)
    payloads = [rng.integers(0, 256, size, dtype=np.uint8) for _ in keys]
    plain = root / f"plain-{object_kib}"
    plain.mkdir()
    for i, payload in enumerate(payloads):
        (plain / f"{i}.bin").write_bytes(payload.tobytes())
    outputs = [np.ones(size, dtype=np.uint8) for _ in keys]

    def read_plain() -> None:
        for i, out in enumerate(outputs):
            with open(plain / f"{i}.bin", "rb") as f:
                f.readinto(out)

    config = StorageConfig(
        l1=L1Config(size_bytes=4 * chunks * size + (64 << 20)),
        l2=({"type": "fs", "path": str(root / f"fs-{object_kib}")},),
    )
    lookup_s: list[float] = []
    with StorageManager(config) as storage:
        storage.store(keys, payloads, layout)
        assert storage.flush(60)
        for _ in range(rounds + 2):
            storage.clear_l1()
            result = None

            def lookup() -> None:
                nonlocal result
                result = storage.lookup(keys, layout)

            lookup_s.append(timed(lookup))
            assert result is not None and result.hit_chunks == chunks, result
            assert result.objects_by_tier == {"fs": chunks}
            storage.release(keys)
        lookup_s = lookup_s[2:]  # warm-up rounds
    plain_s = sorted(timed(read_plain) for _ in range(rounds))
    return {
        "object_bytes": size,
        "p50_s": percentile(lookup_s, 50),
        "p95_s": percentile(lookup_s, 95),
        "plain_p50_s": percentile(plain_s, 50),
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--chunks", type=int, default=32)
    parser.add_argument("--object-kib", type=int, nargs="+", default=[512, 8192])
    parser.add_argument("--rounds", type=int, default=30)
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="kvtier-bench-prefetch-"))
    rows, results = [], {}
    try:
        for kib in args.object_kib:
            m = measure(args.chunks, kib, args.rounds, root)
            results[f"{kib}KiB"] = m
            gbs = args.chunks * m["object_bytes"] / m["p50_s"] / 1e9
            rows.append(
                (
                    f"{args.chunks} x {kib} KiB from fs",
                    f"p50 {m['p50_s'] * 1e3:.2f} ms, p95 {m['p95_s'] * 1e3:.2f} ms "
                    f"({gbs:.2f} GB/s); plain readinto p50 {m['plain_p50_s'] * 1e3:.2f} ms "
                    f"= {m['plain_p50_s'] / m['p50_s']:.2f}x",
                )
            )
    finally:
        shutil.rmtree(root, ignore_errors=True)
    report("prefetch: lookup -> admitted in L1", rows, results)


if __name__ == "__main__":
    main()
