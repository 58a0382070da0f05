"""Purging a tenant while the server serves another: ``kvtier serve`` with a
tenants file, an fs L2 and a real Redis.

Tenant ``acme`` stores ``--objects`` objects (written back to the fs L2 and
Redis: three tiers to purge); tenant ``globex`` keeps looking up its own
chunks in a loop. Measured in the same run: ``globex``'s lookup latency
(LOOKUP + WAIT, 8 chunks, from L1) before the purge — the baseline — and
while ``kvtier admin purge --tenant acme`` runs, and the purge's duration and
objects deleted per tier (from its progress, which is polled throughout).

    python benchmarks/bench_purge.py [--objects 100000]
"""

from __future__ import annotations

import argparse
import json
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np

from common import percentile, report
from kvtier.bench.stores import RedisProcess, redis_binary
from kvtier.commands.admin import call
from kvtier.keys import Namespace, TokenHasher
from kvtier.layout import KVLayout
from kvtier.process import ServerProcess
from kvtier.protocol import messages as p
from kvtier.protocol.client import CacheClient, ClientConfig
from kvtier.tenancy.tenants import token_digest

CHUNK = 64
SPEC = p.LayoutSpec(0, num_layers=1, kv_heads=1, head_dim=8, dtype="float16")
LAYOUT = KVLayout(1, 1, 8, "float16", CHUNK)
TENANTS = f"""
[[tenant]]
name = "acme"
token_sha256 = ["{token_digest("acme")}"]
salts = ["acme"]

[[tenant]]
name = "globex"
token_sha256 = ["{token_digest("globex")}"]
salts = ["globex"]

[[tenant]]
name = "ops"
token_sha256 = ["{token_digest("ops")}"]
salts = ["ops"]
admin = true
"""


def client(rpc: str, token: str) -> CacheClient:
    return CacheClient(
        ClientConfig(address=rpc, model="bench", layouts=(SPEC,), auth_token=token, shm=False)
    )


def hashes(seed: int, n: int) -> list[bytes]:
    tokens = np.random.default_rng(seed).integers(0, 1 << 30, n * CHUNK, dtype=np.uint32)
    return TokenHasher(Namespace("bench", layout=LAYOUT.digest()), CHUNK).chunk_hashes(tokens)


def lookups(c: CacheClient, chunks: list[bytes], stop: threading.Event, out: list[float]) -> None:
    n = 0
    while not stop.is_set():
        started = time.perf_counter()
        found = c.query(c.lookup(f"g{n}", chunks), timeout_s=10.0) or 0
        out.append(time.perf_counter() - started)
        if found:
            c.release(f"g{n}", 0, found)
        c.end_session(f"g{n}", wait=False)
        n += 1


def written(server: ServerProcess, adapter: str) -> int:
    store = server.status_json("ops")["storage"]["store"]
    return int(store["stored_objects"].get(adapter, 0))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--objects", type=int, default=100_000)
    parser.add_argument("--baseline-s", type=float, default=10.0)
    args = parser.parse_args()
    binary = redis_binary()
    if binary is None:
        raise SystemExit("this benchmark needs redis-server (apt-get install redis-server)")
    tmp = Path(tempfile.mkdtemp(prefix="kvtier-bench-purge-"))
    (tmp / "tenants.toml").write_text(TENANTS)
    redis = RedisProcess.start(binary, tmp / "redis.log")
    size = LAYOUT.object_bytes()
    l1 = max(256 << 20, 3 * args.objects * 4096)
    server_args = ["--port", "0", "--http-port", "0", "--l1-size", str(l1)]
    server_args += ["--cache-dir", str(tmp / "fs"), "--chunk-size", str(CHUNK)]
    server_args += ["--tenants-file", str(tmp / "tenants.toml"), "--l2", json.dumps(redis.spec())]
    results: dict[str, Any] = {"objects": args.objects, "object_bytes": size}
    try:
        with ServerProcess.start(server_args, tmp / "kvtier.log") as server:
            acme, globex = client(server.rpc, "acme"), client(server.rpc, "globex")
            mine = hashes(1, args.objects)
            payload = [np.full(size, 3, np.uint8)] * 1000
            for start in range(0, len(mine), 1000):
                part = mine[start : start + 1000]
                acme.store(f"s{start}", part, payload[: len(part)])
            theirs = hashes(2, 8)
            globex.store("g", theirs, payload[:8])
            deadline = time.monotonic() + 600
            while min(written(server, "fs"), written(server, "redis")) < args.objects + 8:
                if time.monotonic() > deadline:
                    raise RuntimeError("the write-back did not finish")
                time.sleep(1)
            stop, before, during = threading.Event(), [], []
            loop = threading.Thread(target=lookups, args=(globex, theirs, stop, before))
            loop.start()
            time.sleep(args.baseline_s)
            stop.set()
            loop.join()
            stop = threading.Event()
            loop = threading.Thread(target=lookups, args=(globex, theirs, stop, during))
            loop.start()
            started = time.perf_counter()
            call(server.http, "ops", "POST", "/admin/purge", {"tenant": "acme"})
            progress = []
            while True:
                job = call(server.http, "ops", "GET", "/admin/purges")["purges"][0]
                progress.append((round(time.perf_counter() - started, 2), job["deleted"]))
                if job["state"] != "running":
                    break
                time.sleep(0.5)
            purge_s = time.perf_counter() - started
            stop.set()
            loop.join()
            acme.close()
            globex.close()
    finally:
        redis.stop()
    results |= {
        "purge_s": purge_s,
        "state": job["state"],
        "deleted": {tier: t["deleted"] for tier, t in job["tiers"].items()},
        "progress": progress,
    }
    rows = [
        ("purge", f"{job['state']} in {purge_s:.1f} s: "
         + ", ".join(f"{tier} {n:,}" for tier, n in results["deleted"].items())
         + f" objects ({job['deleted'] / purge_s:,.0f} objects/s)"),
    ]  # fmt: skip
    for name, got in (("before (baseline)", before), ("during the purge", during)):
        ms = [s * 1e3 for s in got]
        p50, p99 = percentile(ms, 50), percentile(ms, 99)
        results[name] = {"lookups": len(ms), "p50_ms": p50, "p99_ms": p99}
        text = f"{len(ms):,} lookups, p50 {p50:.2f} ms, p99 {p99:.2f} ms"
        rows.append((f"globex lookups {name}", text))
    ratio = results["during the purge"]["p99_ms"] / results["before (baseline)"]["p99_ms"]
    results["p99_ratio"] = ratio
    rows.append(("globex p99 during / before", f"{ratio:.2f}x"))
    report("Purge of a tenant across L1, fs and Redis, another tenant served", rows, results)


if __name__ == "__main__":
    main()
