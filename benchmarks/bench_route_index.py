"""Where should several routers' index live? Each router's own memory, fed by
every node's events (stateless routers), or one Redis that every router reads?

Measured in the same run, with the same ``--chunks`` chunks over 64 nodes:

- applying events to a router's in-memory ``ChunkIndex`` (events/s: what one
  router must keep up with, per router, when every router subscribes to
  every node) and the memory it takes (RSS growth);
- reading one request's chunks (``--request-chunks``, as
  ``ChunkIndex.view`` does) from that index, against the same read from a
  local Redis holding the same masks (one pipelined MGET per request: the
  least a shared index costs per request, before any network hop);
- writing one event's chunks to that Redis (what each node's events cost a
  shared index, once, instead of once per router).

    python benchmarks/bench_route_index.py [--chunks 1000000] [--requests 2000]
"""

from __future__ import annotations

import argparse
import os
import resource
import tempfile
import time
from pathlib import Path

import numpy as np

from common import percentile, report
from kvtier.bench.stores import RedisProcess, redis_binary
from kvtier.events.wire import BlockStored, DecodedBatch
from kvtier.router.chunks import ChunkIndex


def rss_bytes() -> int:
    with open(f"/proc/{os.getpid()}/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--chunks", type=int, default=1_000_000)
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--request-chunks", type=int, default=32)
    parser.add_argument("--event-chunks", type=int, default=8, help="chunks per BlockStored")
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    hashes = [bytes(h) for h in rng.integers(0, 256, (args.chunks, 32), dtype=np.uint8)]
    index = ChunkIndex()
    batches = []
    for start in range(0, args.chunks, args.event_chunks):
        node = int(rng.integers(0, 64))
        event = BlockStored(hashes[start : start + args.event_chunks], ownership="kvtier:L1")
        batches.append((node, DecodedBatch(0.0, [event], None, 0)))
    before = rss_bytes()
    started = time.perf_counter()
    for node, batch in batches:
        index.apply(node, batch)
    apply_s = time.perf_counter() - started
    memory = rss_bytes() - before
    requests = [
        hashes[s : s + args.request_chunks]
        for s in rng.integers(0, args.chunks - args.request_chunks, args.requests)
    ]
    local = []
    for request in requests:
        t0 = time.perf_counter()
        index.view(request)
        local.append(time.perf_counter() - t0)
    results: dict[str, object] = {
        "chunks": args.chunks,
        "apply_events_per_s": round(len(batches) / apply_s),
        "apply_chunks_per_s": round(args.chunks / apply_s),
        "index_bytes_per_chunk": round(memory / args.chunks, 1),
        "local_view_p50_us": round(percentile(local, 50) * 1e6, 1),
        "local_view_p99_us": round(percentile(local, 99) * 1e6, 1),
    }
    binary = redis_binary()
    if binary is not None:
        import redis

        log = Path(tempfile.mkdtemp(prefix="kvtier-bench-index-")) / "redis.log"
        server = RedisProcess.start(binary, log)
        try:
            client = redis.Redis(port=server.port)
            writes = []
            pipe = client.pipeline(transaction=False)
            for start in range(0, args.chunks, args.event_chunks):
                t0 = time.perf_counter()
                for chunk in hashes[start : start + args.event_chunks]:
                    pipe.set(chunk, (1 << int(rng.integers(0, 64))).to_bytes(8, "little"))
                pipe.execute()
                writes.append(time.perf_counter() - t0)
            shared = []
            for request in requests:
                t0 = time.perf_counter()
                client.mget(request)
                shared.append(time.perf_counter() - t0)
            results |= {
                "redis_event_write_p50_us": round(percentile(writes, 50) * 1e6, 1),
                "redis_view_p50_us": round(percentile(shared, 50) * 1e6, 1),
                "redis_view_p99_us": round(percentile(shared, 99) * 1e6, 1),
                "redis_used_memory_bytes": int(client.info("memory")["used_memory"]),
            }
        finally:
            server.stop()
    rows = [
        ("index", f"{args.chunks:,} chunks over 64 nodes, {args.event_chunks} chunks per event"),
        (
            "in-memory: apply",
            f"{results['apply_events_per_s']:,} events/s "
            f"({results['apply_chunks_per_s']:,} chunks/s), "
            f"{results['index_bytes_per_chunk']} bytes per chunk",
        ),
        (
            f"in-memory: read {args.request_chunks} chunks",
            f"p50 {results['local_view_p50_us']} us  p99 {results['local_view_p99_us']} us",
        ),
    ]
    if "redis_view_p50_us" in results:
        rows += [
            (
                f"Redis (local): MGET {args.request_chunks} chunks",
                f"p50 {results['redis_view_p50_us']} us  p99 {results['redis_view_p99_us']} us",
            ),
            ("Redis (local): write one event", f"p50 {results['redis_event_write_p50_us']} us"),
        ]
    report("where the routers' index lives", rows, results)


if __name__ == "__main__":
    main()
