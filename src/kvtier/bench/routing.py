"""``kvtier bench`` with ``bench = "route"``: routing policies on real engines.

Two vLLM-CPU engines (each pinned to its own CPU), each with its own
``kvtier serve`` (an L1 smaller than the tenants' working set, a local fs L2,
KV events on) and all sharing one Redis as the shared L2; ``kvtier route``
in front (the gateway with one API key per tenant, the engines' own KV events
and the cache servers'). The multi-tenant trace (``kvtier.bench.tenants``)
is replayed open loop through a fresh router once per policy and round;
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
(greedy, exact reuse: they must be equal). The kvtier policy's learned costs
(prefill seconds per token per engine, load seconds per token per tier) are
what the simulator (``benchmarks/bench_route_sim.py``) takes to scale the
comparison out.
"""

from __future__ import annotations

import asyncio
import json
import time
import urllib.request
from contextlib import ExitStack
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import msgspec
from aiohttp import web

from kvtier.bench.engines import EngineOptions, kvtier_transfer, vllm_server
from kvtier.bench.replay import RequestResult, replay
from kvtier.bench.stores import RedisProcess, free_port, redis_binary
from kvtier.bench.summary import mismatches, percentiles
from kvtier.bench.tenants import TenancySpec, tenant_name, tenant_trace
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
    spec: TenancySpec
    model: Path
    kv_bytes_per_token: int
    out: Path
    policies: tuple[str, ...] = POLICIES
    rounds: int = 4
    engines: int = 2
    l1_size_bytes: int = 32 << 20
    engine_kv_tokens: int = 8192
    chunk_size: int = 256
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
        binary = redis_binary()
        if binary is None:
            raise RuntimeError(
                "the routing bench needs redis-server (apt-get install redis-server)"
            )
        self.logs.mkdir(parents=True, exist_ok=True)
        self.redis = RedisProcess.start(binary, self.logs / "redis.log")
        self.stack.callback(self.redis.stop)
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
                cpus=str(node.index % 2),
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

    def _start_server(self, node: _Node) -> None:
        r = self.request
        args = ["--port", str(node.rpc_port), "--http-port", str(node.http_port)]
        args += ["--l1-size", str(r.l1_size_bytes), "--chunk-size", str(r.chunk_size)]
        args += ["--cache-dir", str(self.logs / f"l2-{node.index}-run{self.runs}")]
        assert self.redis is not None
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
        assert self.redis is not None
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


def _post(url: str, body: dict[str, Any] | None) -> None:
    data = json.dumps(body).encode() if body is not None else b""
    request = urllib.request.Request(
        url, data=data, headers={"Content-Type": "application/json"}, method="POST"
    )
    with urllib.request.urlopen(request, timeout=60) as response:
        response.read()


def _hits(status: dict[str, Any]) -> dict[str, int]:
    return dict(msgspec.convert(status, ServerStatus).server.hit_tokens)


def _run_policy(cluster: _Cluster, policy: str) -> dict[str, Any]:
    """One replay of the trace through a fresh router, on emptied caches."""
    cluster.reset()
    tenants = sorted({r.tenant for r in cluster.trace})
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
            headers_of=lambda r: {"Authorization": f"Bearer key-{r.tenant}"},
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
    policy: str, runs: list[dict[str, Any]], reference: dict[str, list[int]]
) -> dict[str, Any]:
    results: list[RequestResult] = [r for run in runs for r in run["results"]]
    ok = [r for r in results if r.ok]
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
        "ttft_s": percentiles([r.ttft_s for r in ok if r.ttft_s is not None], "ttft"),
        "ttft_s_by_round": rounds,
        "prompt_tokens": prompt,
        "cached_tokens": cached,
        "cached_share": round(cached / max(prompt, 1), 3),
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


def run_route_bench(request: RouteBenchRequest) -> dict[str, Any]:
    request.out.mkdir(parents=True, exist_ok=True)
    trace = tenant_trace(request.spec)
    write_trace(request.out / "trace.jsonl", trace)
    runs: dict[str, list[dict[str, Any]]] = {p: [] for p in request.policies}
    reference: dict[str, list[int]] | None = None
    with _Cluster(request, trace, request.out / "work") as cluster:
        # Unmeasured: new engines are slow on their first requests (thread pools,
        # kernels for new shapes); that must not fall on the policy that runs first.
        _run_policy(cluster, request.policies[-1])
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
    summaries = {p: summarize(p, runs[p], reference) for p in request.policies}
    comparison = {}
    if "kvtier" in summaries:
        k = summaries["kvtier"]["ttft_s"]
        for baseline in request.policies:
            if baseline != "kvtier" and summaries[baseline]["ttft_s"]:
                b = summaries[baseline]["ttft_s"]
                comparison[baseline] = {
                    q: round(b[f"ttft_{q}_s"] / k[f"ttft_{q}_s"], 2) for q in ("p50", "p95", "p99")
                }
    results = {
        "command": request.command,
        "trace": asdict(request.spec),
        "rounds": request.rounds,
        "tenants": [tenant_name(i) for i in range(request.spec.tenants)],
        "l1_size_bytes": request.l1_size_bytes,
        "engine_kv_tokens": request.engine_kv_tokens,
        "policies": summaries,
        "kvtier_speedup": comparison,
    }
    (request.out / "route-results.json").write_text(json.dumps(results, indent=1, default=str))
    return results


__all__ = ["POLICIES", "RouteBenchRequest", "run_route_bench", "summarize"]
