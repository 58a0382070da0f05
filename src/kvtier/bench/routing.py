"""``kvtier bench`` with ``bench = "route"``: routing policies on real engines.

Two vLLM-CPU engines (each pinned to its own CPU), each with its own
``kvtier serve`` (an L1 smaller than the working set, a local fs L2, KV
events on) and, unless ``shared_l2`` is off (each node on its own: the
llm-d and Dynamo deployment), all sharing one Redis as the shared L2;
with ``slow_engine`` the last engine shares its CPU with a process that
spins there (a noisy neighbour meant to halve its speed, for unequal
nodes; on the project's 2-core VM the engine's busy worker keeps the whole
CPU and calibrates as fast as the other: ``slowed_engine_calibration`` says);
``kvtier route`` in front (the gateway with one API key per tenant, or open
for a trace without tenants; the engines' own KV events and the cache
servers'). The trace (the multi-tenant one of ``kvtier.bench.tenants``, or
a window of a Mooncake trace) is replayed open loop through a fresh router
once per policy and round;
rounds run the policies in rotated order (ABCD, BCDA, ...), so drift on a
shared machine falls on every policy alike, after one unmeasured run that
warms the new engines up. Before each run every cache is
emptied: the engines' prefix caches (``/reset_prefix_cache``), the cache
servers (restarted on the same ports with new disk directories; the
engines' connectors register again before the run starts) and Redis.

Reported per policy, over all its rounds: TTFT p50/p95/p99 (and per round),
prompt tokens by where they came from (vLLM's ``cached_tokens``: its own
cache and the connector; the cache servers' hits by tier), requests per
engine, failures, and outputs compared token by token with the first run's
(greedy, exact reuse: they must be equal); the kvtier policy's speed-up over
each other policy is the ratio of the rounds' median p50 (and p95), with a
bootstrap 95 % interval over rounds. Before the runs, ``calibrate`` measures
engine 0 and its L1 one request at a time (and the slowed engine, if any);
those costs are what ``benchmarks/bench_route_calibrate.py`` gives the
simulator to check it against the run.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
import urllib.request
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec
import numpy as np
from aiohttp import web

from kvtier.bench.engines import EngineOptions, kvtier_transfer, vllm_server
from kvtier.bench.replay import RequestResult, replay
from kvtier.bench.stores import RedisProcess, free_port, redis_binary
from kvtier.bench.summary import mismatches, percentiles, ratio_interval
from kvtier.process import ServerProcess
from kvtier.protocol.status import ServerStatus
from kvtier.router.app import RouterService
from kvtier.router.config import RouterConfig
from kvtier.router.cost import CostConfig
from kvtier.traces import TraceRequest, write_trace

POLICIES = ("kvtier", "longest_prefix", "least_loaded", "round_robin")
BLOCK = 128  # vLLM-CPU's block size


@dataclass(frozen=True, slots=True, kw_only=True)
class RouteBenchRequest:
    trace: list[TraceRequest]
    source: dict[str, Any]  # what the trace is, for the report
    model: Path
    kv_bytes_per_token: int
    out: Path
    policies: tuple[str, ...] = POLICIES
    rounds: int = 4
    engines: int = 2
    l1_size_bytes: int = 32 << 20
    engine_kv_tokens: int = 8192
    chunk_size: int = 256
    shared_l2: bool = True  # one Redis shared by every node, or none
    slow_engine: bool = False  # the last engine shares its CPU with a spinning neighbour
    slo_ttft_s: float = 0.5  # goodput: requests with a first token within it
    command: str = ""


@dataclass(eq=False)
class _Node:
    """One engine, its cache server and the fixed ports a restart keeps."""

    index: int
    rpc_port: int
    http_port: int
    events_port: int
    replay_port: int
    engine_events_port: int
    engine_replay_port: int
    server: ServerProcess | None = None
    engine_url: str = ""

    def spec(self) -> dict[str, Any]:
        assert self.server is not None
        return {
            "name": f"engine{self.index}",
            "url": self.engine_url,
            "cache_url": self.server.http,
            "events": f"tcp://127.0.0.1:{self.events_port}",
            "events_replay": f"tcp://127.0.0.1:{self.replay_port}",
            "engine_events": f"tcp://127.0.0.1:{self.engine_events_port}",
            "engine_events_replay": f"tcp://127.0.0.1:{self.engine_replay_port}",
            "engine_events_bind": True,  # vLLM connects to a non-wildcard endpoint
        }


class _Cluster:
    """The engines, their cache servers and Redis, started once; ``reset``
    empties every cache between runs."""

    def __init__(self, request: RouteBenchRequest, trace: list[TraceRequest], logs: Path) -> None:
        self.request = request
        self.trace = trace
        self.logs = logs
        self.stack = ExitStack()
        self.nodes = []
        for n in range(request.engines):
            ports = [free_port() for _ in range(6)]
            self.nodes.append(_Node(n, ports[0], ports[1], ports[2], ports[3], ports[4], ports[5]))
        self.redis: RedisProcess | None = None
        self.runs = 0

    def __enter__(self) -> _Cluster:
        self.logs.mkdir(parents=True, exist_ok=True)
        if self.request.shared_l2:
            binary = redis_binary()
            if binary is None:
                raise RuntimeError(
                    "the routing bench's shared L2 needs redis-server "
                    "(apt-get install redis-server, or --no-shared-l2)"
                )
            self.redis = RedisProcess.start(binary, self.logs / "redis.log")
            self.stack.callback(self.redis.stop)
        if self.request.slow_engine:
            self.stack.callback(_stop, _neighbour(self._cpu(self.nodes[-1])))
        longest = max(len(r.prompt) + r.output_tokens for r in self.trace)
        for node in self.nodes:
            self._start_server(node)
            options = EngineOptions(
                self.request.model,
                longest + BLOCK,
                self.request.engine_kv_tokens * self.request.kv_bytes_per_token,
                kv_events={
                    "enable_kv_cache_events": True,
                    "publisher": "zmq",
                    "endpoint": f"tcp://127.0.0.1:{node.engine_events_port}",
                    "replay_endpoint": f"tcp://127.0.0.1:{node.engine_replay_port}",
                },
                cpus=str(self._cpu(node)),
                dev_mode=True,
            )
            rpc = f"tcp://127.0.0.1:{node.rpc_port}"
            log = self.logs / f"vllm-{node.index}.log"
            engine = self.stack.enter_context(vllm_server(options, kvtier_transfer(rpc), log))
            node.engine_url = engine.url
        return self

    def __exit__(self, *exc: object) -> None:
        for node in self.nodes:
            if node.server is not None:
                node.server.stop()
        self.stack.close()

    @staticmethod
    def _cpu(node: _Node) -> int:
        return node.index % 2  # one engine per core

    def _start_server(self, node: _Node) -> None:
        r = self.request
        args = ["--port", str(node.rpc_port), "--http-port", str(node.http_port)]
        args += ["--l1-size", str(r.l1_size_bytes), "--chunk-size", str(r.chunk_size)]
        args += ["--cache-dir", str(self.logs / f"l2-{node.index}-run{self.runs}")]
        if self.redis is not None:
            args += ["--l2", json.dumps(self.redis.spec())]
        args += ["--set", f"events.endpoint=tcp://127.0.0.1:{node.events_port}"]
        args += ["--set", f"events.replay_endpoint=tcp://127.0.0.1:{node.replay_port}"]
        log = self.logs / f"kvtier-{node.index}-run{self.runs}.log"
        node.server = ServerProcess.start(args, log)

    def reset(self) -> None:
        """Empty every cache: new cache servers (same ports, new disks), the
        engines' prefix caches, Redis; wait until the connectors are back."""
        import redis

        self.runs += 1
        for node in self.nodes:
            assert node.server is not None
            node.server.stop()
            self._start_server(node)
        if self.redis is not None:
            redis.Redis(port=self.redis.port).flushall()
        for node in self.nodes:
            _post(node.engine_url + "/reset_prefix_cache", None)
        deadline = time.monotonic() + 60
        for node in self.nodes:
            assert node.server is not None
            while not node.server.status_json().get("namespaces"):
                if time.monotonic() > deadline:
                    raise RuntimeError(f"engine {node.index}'s connector did not come back")
                # a prompt shorter than a block: it stores nothing anywhere
                _post(
                    node.engine_url + "/v1/completions",
                    {
                        "model": str(self.request.model),
                        "prompt": [1, 2, 3],
                        "max_tokens": 1,
                    },
                )
                time.sleep(0.5)


def _neighbour(cpu: int) -> subprocess.Popen[bytes]:
    """A process spinning on ``cpu``: the engine pinned there gets about half of it."""
    proc = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    os.sched_setaffinity(proc.pid, {cpu})
    return proc


def _stop(proc: subprocess.Popen[bytes]) -> None:
    proc.kill()
    proc.wait()


def _post(url: str, body: dict[str, Any] | None) -> None:
    data = json.dumps(body).encode() if body is not None else b""
    request = urllib.request.Request(
        url, data=data, headers={"Content-Type": "application/json"}, method="POST"
    )
    with urllib.request.urlopen(request, timeout=60) as response:
        response.read()


def _hits(status: dict[str, Any]) -> dict[str, int]:
    return dict(msgspec.convert(status, ServerStatus).server.hit_tokens)


CALIBRATION_TOKENS = (256, 512, 1024, 2048)


def calibrate(cluster: _Cluster, node_index: int = 0) -> dict[str, Any]:
    """What one engine and its tiers cost, measured one request at a time on
    emptied caches: prompts of ``CALIBRATION_TOKENS`` cold (TTFT = overhead +
    tokens x prefill, least squares), then again after the engine's own
    cache is reset, loaded from its cache server's L1 (the rest of the TTFT
    per loaded token); the decode step is the median inter-token latency."""
    cluster.reset()
    node = cluster.nodes[node_index]
    rng = np.random.default_rng(7)
    vocab = int(max(t for r in cluster.trace for t in r.prompt)) + 1
    prompts = [tuple(int(t) for t in rng.integers(0, vocab, n)) for n in CALIBRATION_TOKENS]

    def ttfts(tag: str) -> list[RequestResult]:
        out = []
        for i, prompt in enumerate(prompts):
            request = TraceRequest(f"calibrate-{tag}-{i}", 0.0, prompt, 8)
            (result,) = asyncio.run(replay(node.engine_url, str(cluster.request.model), [request]))
            if not result.ok:
                raise RuntimeError(f"calibration request failed: {result.error}")
            out.append(result)
        return out

    cold = ttfts("cold")
    tokens = np.array(CALIBRATION_TOKENS, dtype=np.float64)
    prefill, overhead = np.polyfit(tokens, [r.ttft_s or 0.0 for r in cold], 1)
    _post(node.engine_url + "/reset_prefix_cache", None)
    warm = ttfts("l1")
    chunk = cluster.request.chunk_size
    per_token = []
    for n, result in zip(CALIBRATION_TOKENS, warm, strict=True):
        loaded = min((n // chunk) * chunk, n - 1)
        rest = (result.ttft_s or 0.0) - overhead - (n - loaded) * prefill
        per_token.append(max(rest, 0.0) / max(loaded, 1))
    return {
        "prefill_s_per_token": float(prefill),
        "overhead_s": float(overhead),
        "l1_s_per_token": float(np.median(per_token)),
        "decode_s": float(np.median([i for r in cold + warm for i in r.itls()])),
        "cold_ttft_s": [round(r.ttft_s or 0.0, 4) for r in cold],
        "l1_ttft_s": [round(r.ttft_s or 0.0, 4) for r in warm],
    }


def _run_policy(cluster: _Cluster, policy: str) -> dict[str, Any]:
    """One replay of the trace through a fresh router, on emptied caches."""
    cluster.reset()
    tenants = sorted({r.tenant for r in cluster.trace if r.tenant})
    config = RouterConfig(
        port=0,
        policy=policy,
        model=str(cluster.request.model),
        engines=tuple(node.spec() for node in cluster.nodes),
        tenants=tuple({"name": t, "api_keys": [f"key-{t}"]} for t in tenants),
        cost=CostConfig(prefill_s_per_token=7e-4, tier_s_per_token={"L1": 4e-5, "fs": 6e-5}),
    )
    started = time.perf_counter()
    results, router_status = asyncio.run(_replay_through(config, cluster.trace))
    wall_s = time.perf_counter() - started
    hits = [_hits(node.server.status_json()) for node in cluster.nodes if node.server]
    return {
        "results": results,
        "router": router_status,
        "cache_hits": hits,
        "wall_s": round(wall_s, 1),
    }


async def _replay_through(
    config: RouterConfig, trace: list[TraceRequest]
) -> tuple[list[RequestResult], dict[str, Any]]:
    service = RouterService(config)
    runner = web.AppRunner(service.app(), access_log=None)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    url = f"http://127.0.0.1:{runner.addresses[0][1]}"
    try:
        results = await replay(
            url,
            config.model,
            trace,
            headers_of=lambda r: {"Authorization": f"Bearer key-{r.tenant}"} if r.tenant else {},
        )
        status = {
            "router": service.router.status(),
            "events": {
                f"{service.specs[n].name}/{k}": s.status() for n, k, s in service.subscribers
            },
        }
        return results, status
    finally:
        await runner.cleanup()


def summarize(
    policy: str,
    runs: list[dict[str, Any]],
    reference: dict[str, list[int]],
    slo_ttft_s: float = 0.5,
) -> dict[str, Any]:
    results: list[RequestResult] = [r for run in runs for r in run["results"]]
    ok = [r for r in results if r.ok]
    ttfts = [r.ttft_s for r in ok if r.ttft_s is not None]
    failed = [r for r in results if not r.ok]
    diffs = len(mismatches(ok, reference))
    prompt = sum(r.prompt_tokens for r in ok)
    cached = sum(r.cached_tokens or 0 for r in ok)
    hits: dict[str, int] = {}
    routed: dict[str, int] = {}
    for run in runs:
        for node in run["cache_hits"]:
            for tier, tokens in node.items():
                hits[tier] = hits.get(tier, 0) + tokens
        for node in run["router"]["router"]["nodes"]:
            routed[node["name"]] = routed.get(node["name"], 0) + node["routed"]
    rounds = [
        percentiles([r.ttft_s for r in run["results"] if r.ok and r.ttft_s is not None], "ttft")
        for run in runs
    ]
    return {
        "policy": policy,
        "requests": len(results),
        "failed": len(failed),
        "failures": [r.error for r in failed][:5],
        "output_differences": diffs,
        "ttft_s": percentiles(ttfts, "ttft"),
        "ttft_mean_s": float(np.mean(ttfts)) if ttfts else None,
        "ttft_p90_s": float(np.percentile(ttfts, 90)) if ttfts else None,
        "goodput": round(sum(t <= slo_ttft_s for t in ttfts) / max(len(results), 1), 4),
        "slo_ttft_s": slo_ttft_s,
        "itl_s": percentiles([i for r in ok for i in r.itls()], "itl"),
        "ttft_s_by_round": rounds,
        "prompt_tokens": prompt,
        "cached_tokens": cached,
        "cached_share": round(cached / max(prompt, 1), 3),
        "computed_share": round(1 - cached / max(prompt, 1), 3),
        "cache_tokens_per_s": round(cached / max(sum(run["wall_s"] for run in runs), 1e-9), 1),
        "kvtier_hit_tokens": hits,
        "routed": routed,
        "engine_failures": [
            {n["name"]: n["failures"]}
            for run in runs
            for n in run["router"]["router"]["nodes"]
            if n["failures"]
        ],
        "learned_costs": runs[-1]["router"]["router"]["cost"],
        "index_at_end": {  # the last run's: what the events told the router
            "chunks": runs[-1]["router"]["router"]["chunks"],
            "blocks": runs[-1]["router"]["router"]["blocks"],
            "events": runs[-1]["router"]["events"],
        },
        "wall_s": sum(run["wall_s"] for run in runs),
    }


def speedups(summaries: dict[str, dict[str, Any]]) -> dict[str, dict[str, list[float]]]:
    """Each other policy's TTFT over the kvtier policy's, at p50 and p95: the
    ratio of the rounds' medians and its bootstrap 95 % interval over rounds
    (``[ratio, low, high]``)."""
    if "kvtier" not in summaries:
        return {}
    rng = np.random.default_rng(0)
    ours = summaries["kvtier"]["ttft_s_by_round"]
    out = {}
    for policy, summary in summaries.items():
        if policy == "kvtier":
            continue
        theirs = summary["ttft_s_by_round"]
        out[policy] = {
            q: [
                round(v, 2)
                for v in ratio_interval(
                    [r[f"ttft_{q}_s"] for r in theirs], [r[f"ttft_{q}_s"] for r in ours], rng
                )
            ]
            for q in ("p50", "p95")
        }
    return out


def run_route_bench(request: RouteBenchRequest) -> dict[str, Any]:
    request.out.mkdir(parents=True, exist_ok=True)
    trace = request.trace
    write_trace(request.out / "trace.jsonl", trace)
    runs: dict[str, list[dict[str, Any]]] = {p: [] for p in request.policies}
    reference: dict[str, list[int]] | None = None
    with _Cluster(request, trace, request.out / "work") as cluster:
        # Unmeasured: new engines are slow on their first requests (thread pools,
        # kernels for new shapes); that must not fall on the policy that runs first.
        _run_policy(cluster, request.policies[-1])
        calibration = calibrate(cluster)
        print(f"route bench: calibration {json.dumps(calibration)}", flush=True)
        slowed = calibrate(cluster, len(cluster.nodes) - 1) if request.slow_engine else None
        if slowed is not None:
            print(f"route bench: the slowed engine's calibration {json.dumps(slowed)}", flush=True)
        print("route bench: warm-up run done", flush=True)
        for round_index in range(request.rounds):
            shift = round_index % len(request.policies)
            for policy in request.policies[shift:] + request.policies[:shift]:
                run = _run_policy(cluster, policy)
                runs[policy].append(run)
                if reference is None:
                    reference = {r.id: r.tokens for r in run["results"] if r.ok}
                ttft = percentiles([r.ttft_s for r in run["results"] if r.ok and r.ttft_s], "ttft")
                print(f"route bench: round {round_index} {policy}: {json.dumps(ttft)}", flush=True)
    assert reference is not None
    summaries = {p: summarize(p, runs[p], reference, request.slo_ttft_s) for p in request.policies}
    results = {
        "command": request.command,
        "trace": request.source | {"requests": len(trace)},
        "rounds": request.rounds,
        "shared_l2": "redis" if request.shared_l2 else None,
        "tenants": sorted({r.tenant for r in trace if r.tenant}),
        "l1_size_bytes": request.l1_size_bytes,
        "kv_bytes_per_token": request.kv_bytes_per_token,
        "calibration": calibration,
        "slowed_engine_calibration": slowed,
        "chunk_size": request.chunk_size,
        "engine_kv_tokens": request.engine_kv_tokens,
        "policies": summaries,
        "kvtier_speedup": speedups(summaries),
    }
    (request.out / "route-results.json").write_text(json.dumps(results, indent=1, default=str))
    return results


__all__ = ["POLICIES", "RouteBenchRequest", "run_route_bench", "speedups", "summarize"]
