"""L1 metadata at scale: 1 M resident objects.

Reports the Python memory per object (resident-set growth while admitting
the objects, divided by their number; the arena is sparse and never touched,
so the growth is metadata: keys, records, the policy's order, the allocator's
extents) and the p50/p99 latency of ``StorageManager.lookup`` + ``release``
for 128 chained keys (a 32K-token prompt at chunk 256). Baseline in the same
run: one lookup per key, for the same 128 keys, in a plain ``dict`` of all the
objects: the floor for any Python index.

    python benchmarks/bench_l1_metadata.py [--objects 1000000]
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repo root, for tests

from tests import storage_parts

from common import percentile, report
from kvtier.keys import Namespace, ObjectKey, TokenHasher
from kvtier.l1 import L1Config, WriterTag
from kvtier.storage import StorageConfig, StorageManager

OBJECT_BYTES = 4096
PROMPT_CHUNKS = 128


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--objects", type=int, default=1_000_000)
    parser.add_argument("--lookups", type=int, default=2000)
    parser.add_argument("--policy", default="lru")
    args = parser.parse_args()

    prompts = args.objects // PROMPT_CHUNKS
    hasher = TokenHasher(Namespace(model="bench"), 4)
    config = L1Config(
        size_bytes=2 * args.objects * OBJECT_BYTES, populate=False, eviction_policy=args.policy
    )
    with StorageManager(StorageConfig(l1=config)) as storage:
        l1 = storage_parts.l1(storage)  # L1's own transitions are what the admission times
        chains: list[list[ObjectKey]] = []
        rss_before = rss_bytes()
        start = time.perf_counter()
        for p in range(prompts):
            hashes = hasher.chunk_hashes(range(p * 512, p * 512 + 4 * PROMPT_CHUNKS))
            keys = [ObjectKey(h, "bench", 0) for h in hashes]
            tag = WriterTag("w")
            l1.reserve_write(keys, [OBJECT_BYTES] * len(keys), tag)
            l1.finish_write(keys, tag)
            chains.append(keys)
        admit_s = time.perf_counter() - start
        per_object = (rss_bytes() - rss_before) / (prompts * PROMPT_CHUNKS)
        assert l1.status()["resident_objects"] == prompts * PROMPT_CHUNKS
        assert l1.status()["evictions"] == 0

        rng = random.Random(0)
        picks = [chains[rng.randrange(prompts)] for _ in range(args.lookups)]
        lookup_s = []
        for keys in picks:
            start = time.perf_counter()
            hit = storage.lookup(keys).hit_chunks
            storage.release(keys[:hit])
            lookup_s.append(time.perf_counter() - start)
            assert hit == PROMPT_CHUNKS
        index = {key: True for keys in chains for key in keys}
        dict_s = []
        for keys in picks:
            start = time.perf_counter()
            for key in keys:
                index[key]
            dict_s.append(time.perf_counter() - start)

    p50, p99 = percentile(lookup_s, 50), percentile(lookup_s, 99)
    base = percentile(dict_s, 50)
    rows = [
        ("objects", f"{prompts * PROMPT_CHUNKS:,} ({args.policy})"),
        ("admission", f"{admit_s:.1f} s ({prompts * PROMPT_CHUNKS / admit_s / 1e3:.0f} K obj/s)"),
        ("Python metadata per object", f"{per_object:.0f} bytes"),
        ("lookup+release of 128 keys", f"p50 {p50 * 1e6:.0f} us, p99 {p99 * 1e6:.0f} us"),
        ("baseline: 128 dict lookups", f"p50 {base * 1e6:.1f} us ({p50 / base:.0f}x)"),
    ]
    report(
        "L1 metadata at scale",
        rows,
        {
            "objects": prompts * PROMPT_CHUNKS,
            "policy": args.policy,
            "metadata_bytes_per_object": per_object,
            "lookup128_p50_s": p50,
            "lookup128_p99_s": p99,
            "dict128_p50_s": base,
            "admit_objects_per_s": prompts * PROMPT_CHUNKS / admit_s,
        },
    )


if __name__ == "__main__":
    main()
