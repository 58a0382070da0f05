"""``kvtier bench`` with ``bench = "route"``: routing policies on real engines.

Two vLLM-CPU engines (each pinned to its own CPU), each with its own
``kvtier serve`` (an L1 smaller than the tenants' working set, a local fs L2,
KV events on) and all sharing one Redis as the shared L2; ``kvtier route``
in front (the gateway with one API key per tenant, the engines' own KV events
and the cache servers'). The multi-tenant trace (``kvtier.bench.tenants``)
is replayed open loop through the router once per policy; every policy gets
fresh engines, cache servers and Redis, so none inherits another's caches.

Reported per policy: TTFT p50/p95/p99, prompt tokens by where they came from
(the engine's own cache and the connector, per vLLM's ``cached_tokens``; the
cache servers' hits by tier), requests per engine, failures, and outputs
compared token by token with the first policy's (greedy, exact reuse: they
must be equal). The kvtier policy's learned costs (prefill seconds per
token per engine, load seconds per token per tier) are what the simulator
(``benchmarks/bench_route_sim.py``) takes to scale the comparison out.
"""

from __future__ import annotations

import asyncio
import json
import time
from contextlib import ExitStack
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
from aiohttp import web

from kvtier.bench.engines import EngineOptions, kvtier_transfer, vllm_server
from kvtier.bench.replay import RequestResult, replay
from kvtier.bench.stores import RedisProcess, free_port, redis_binary
from kvtier.bench.tenants import TenancySpec, tenant_name, tenant_trace
from kvtier.process import ServerProcess
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
    engines: int = 2
    l1_size_bytes: int = 32 << 20
    engine_kv_tokens: int = 8192
    chunk_size: int = 256
    command: str = ""


def _percentiles(values: list[float]) -> dict[str, float]:
    if not values:
        return {}
    return {f"p{q}": round(float(np.percentile(values, q)), 4) for q in (50, 95, 99)}


def _hits(status: dict[str, Any]) -> dict[str, int]:
    server = status.get("server", {})
    return {k.split(".", 1)[1]: int(v) for k, v in server.items() if k.startswith("hit_tokens.")}


def _run_policy(
    request: RouteBenchRequest, policy: str, trace: list[TraceRequest], workdir: Path
) -> dict[str, Any]:
    logs = workdir / policy
    logs.mkdir(parents=True, exist_ok=True)
    binary = redis_binary()
    if binary is None:
        raise RuntimeError("the routing bench needs redis-server (apt-get install redis-server)")
    with ExitStack() as stack:
        redis = RedisProcess.start(binary, logs / "redis.log")
        stack.callback(redis.stop)
        engines, servers = [], []
        specs: list[dict[str, Any]] = []
        for n in range(request.engines):
            pub, replay_port = free_port(), free_port()
            args = ["--port", "0", "--http-port", "0", "--l1-size", str(request.l1_size_bytes)]
            args += ["--cache-dir", str(logs / f"l2-{n}"), "--chunk-size", str(request.chunk_size)]
            args += ["--l2", json.dumps(redis.spec())]
            args += ["--set", f"events.endpoint=tcp://127.0.0.1:{pub}"]
            args += ["--set", f"events.replay_endpoint=tcp://127.0.0.1:{replay_port}"]
            server = stack.enter_context(ServerProcess.start(args, logs / f"kvtier-{n}.log"))
            servers.append(server)
            engine_pub, engine_replay = free_port(), free_port()
            options = EngineOptions(
                request.model,
                max(len(r.prompt) + r.output_tokens for r in trace) + BLOCK,
                request.engine_kv_tokens * request.kv_bytes_per_token,
                kv_events={
                    "enable_kv_cache_events": True,
                    "publisher": "zmq",
                    "endpoint": f"tcp://127.0.0.1:{engine_pub}",  # vLLM connects; the router binds
                    "replay_endpoint": f"tcp://127.0.0.1:{engine_replay}",
                },
                cpus=str(n % 2),
            )
            engine = stack.enter_context(
                vllm_server(options, kvtier_transfer(server.rpc), logs / f"vllm-{n}.log")
            )
            engines.append(engine)
            specs.append(
                {
                    "name": f"engine{n}",
                    "url": engine.url,
                    "cache_url": server.http,
                    "events": f"tcp://127.0.0.1:{pub}",
                    "events_replay": f"tcp://127.0.0.1:{replay_port}",
                    "engine_events": f"tcp://127.0.0.1:{engine_pub}",
                    "engine_events_replay": f"tcp://127.0.0.1:{engine_replay}",
                    "engine_events_bind": True,
                }
            )
        tenants = sorted({r.tenant for r in trace})
        config = RouterConfig(
            port=0,
            policy=policy,
            model=str(request.model),
            engines=tuple(specs),
            tenants=tuple({"name": t, "api_keys": [f"key-{t}"]} for t in tenants),
            cost=CostConfig(prefill_s_per_token=4e-4, tier_s_per_token={"L1": 4e-5, "fs": 6e-5}),
        )
        started = time.perf_counter()
        results, router_status = asyncio.run(_replay_through(config, trace))
        wall_s = time.perf_counter() - started
        hits = [_hits(s.status_json()) for s in servers]
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
    policy: str, run: dict[str, Any], reference: dict[str, list[int]] | None
) -> dict[str, Any]:
    results: list[RequestResult] = run["results"]
    ok = [r for r in results if r.ok]
    failed = [r for r in results if not r.ok]
    diffs = 0
    if reference is not None:
        diffs = sum(1 for r in ok if r.id in reference and reference[r.id] != r.tokens)
    prompt = sum(r.prompt_tokens for r in ok)
    cached = sum(r.cached_tokens or 0 for r in ok)
    hits: dict[str, int] = {}
    for node in run["cache_hits"]:
        for tier, tokens in node.items():
            hits[tier] = hits.get(tier, 0) + tokens
    nodes = run["router"]["router"]["nodes"]
    return {
        "policy": policy,
        "requests": len(results),
        "failed": len(failed),
        "failures": [r.error for r in failed][:5],
        "output_differences": diffs,
        "ttft_s": _percentiles([r.ttft_s for r in ok if r.ttft_s is not None]),
        "prompt_tokens": prompt,
        "cached_tokens": cached,
        "cached_share": round(cached / max(prompt, 1), 3),
        "kvtier_hit_tokens": hits,
        "routed": {n["name"]: n["routed"] for n in nodes},
        "engine_failures": {n["name"]: n["failures"] for n in nodes if n["failures"]},
        "learned_costs": run["router"]["router"]["cost"],
        "wall_s": run["wall_s"],
    }


def run_route_bench(request: RouteBenchRequest) -> dict[str, Any]:
    request.out.mkdir(parents=True, exist_ok=True)
    trace = tenant_trace(request.spec)
    write_trace(request.out / "trace.jsonl", trace)
    workdir = request.out / "work"
    summaries: dict[str, dict[str, Any]] = {}
    reference: dict[str, list[int]] | None = None
    for policy in request.policies:
        run = _run_policy(request, policy, trace, workdir)
        summaries[policy] = summarize(policy, run, reference)
        if reference is None:
            reference = {r.id: r.tokens for r in run["results"] if r.ok}
        print(f"route bench: {policy}: {json.dumps(summaries[policy]['ttft_s'])}", flush=True)
    comparison = {}
    if "kvtier" in summaries:
        k = summaries["kvtier"]["ttft_s"]
        for baseline in request.policies:
            if baseline != "kvtier" and summaries[baseline]["ttft_s"]:
                b = summaries[baseline]["ttft_s"]
                comparison[baseline] = {q: round(b[q] / k[q], 2) for q in ("p50", "p95", "p99")}
    results = {
        "command": request.command,
        "trace": asdict(request.spec),
        "tenants": [tenant_name(i) for i in range(request.spec.tenants)],
        "l1_size_bytes": request.l1_size_bytes,
        "engine_kv_tokens": request.engine_kv_tokens,
        "policies": summaries,
        "kvtier_speedup": comparison,
    }
    (request.out / "route-results.json").write_text(json.dumps(results, indent=1, default=str))
    return results


__all__ = ["POLICIES", "RouteBenchRequest", "run_route_bench", "summarize"]
