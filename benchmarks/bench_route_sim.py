"""Routing policies over 8-64 simulated nodes (``kvtier.bench.simulate``).

The multi-tenant trace grows with the cluster (``--tenants-per-node``
tenants and ``--rate-per-node`` arrivals per second per node), so every size
runs at the same load per node. Service times are measured ones, passed in
(defaults: this machine's vLLM-CPU engines and tiers as the router learned
them in the real run, docs/bench-log/routing.md); each node's L1 and the
engine's own cache hold fewer chunks than the tenants' working set.
``--shared-s-per-token`` above the prefill rate plays a slow shared store (S3
across a WAN), where the engines' connectors still load what they find.
Baseline in the same run: round-robin and least-loaded over the same trace
and nodes.

    python benchmarks/bench_route_sim.py [--nodes 8,16,32,64] [--shared-s-per-token 2e-3]
"""

from __future__ import annotations

import argparse
import dataclasses
import time

from common import report
from kvtier.bench.simulate import SimConfig, SimCosts, simulate
from kvtier.bench.tenants import TenancySpec, tenant_trace
from kvtier.router.scoring import POLICIES


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--nodes", default="8,16,32,64")
    # Defaults: the real run's (kvtier bench --scenario benchmarks/scenarios/route.toml):
    # 2 tenants and 0.75 requests/s per node, a 32-chunk L1, vLLM's 8,192-token KV
    # space, and the costs the router learned there (docs/bench-log/routing.md).
    parser.add_argument("--requests-per-node", type=int, default=40)
    parser.add_argument("--tenants-per-node", type=float, default=2.0)
    parser.add_argument("--rate-per-node", type=float, default=0.75, help="arrivals/s per node")
    parser.add_argument("--l1-chunks", type=int, default=32, help="per node")
    parser.add_argument("--engine-chunks", type=int, default=32, help="per node")
    parser.add_argument("--prefill-s-per-token", type=float, default=1e-3)
    parser.add_argument("--l1-s-per-token", type=float, default=4e-5)
    parser.add_argument("--shared-s-per-token", type=float, default=1e-4)
    parser.add_argument("--overhead-s", type=float, default=0.02)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    costs = SimCosts(
        prefill_s_per_token=args.prefill_s_per_token,
        l1_s_per_token=args.l1_s_per_token,
        shared_s_per_token=args.shared_s_per_token,
        overhead_s=args.overhead_s,
    )
    rows: list[tuple[str, str]] = []
    results: dict[str, object] = {"costs": dataclasses.asdict(costs)}
    for n in (int(x) for x in args.nodes.split(",")):
        spec = TenancySpec(
            tenants=max(1, round(n * args.tenants_per_node)),
            requests=n * args.requests_per_node,
            rate=n * args.rate_per_node,
            seed=args.seed,
        )
        trace = tenant_trace(spec)
        config = SimConfig(
            nodes=n, l1_chunks=args.l1_chunks, engine_chunks=args.engine_chunks, costs=costs
        )
        per_size: dict[str, object] = {}
        for policy in POLICIES:
            started = time.perf_counter()
            summary = simulate(trace, config, policy).summary()
            summary["wall_s"] = round(time.perf_counter() - started, 1)
            per_size[policy] = summary
            rows.append(
                (
                    f"{n} nodes, {policy}",
                    f"TTFT p50 {summary['ttft_p50_s']:.3f} s  p95 {summary['ttft_p95_s']:.3f} s  "
                    f"p99 {summary['ttft_p99_s']:.3f} s  load max/mean "
                    f"{summary['load_max_over_mean']}  tokens {summary['token_share']}",
                )
            )
        k = per_size["kvtier"]
        for baseline in ("least_loaded", "round_robin", "longest_prefix"):
            b = per_size[baseline]
            for q in ("p50", "p95"):
                ratio = b[f"ttft_{q}_s"] / max(k[f"ttft_{q}_s"], 1e-9)  # type: ignore[index,operator]
                per_size[f"{q}_vs_{baseline}"] = round(ratio, 2)
        rows.append(
            (
                f"{n} nodes, kvtier's speed-up",
                "p50 x{p50_vs_least_loaded} / x{p50_vs_round_robin} / x{p50_vs_longest_prefix}, "
                "p95 x{p95_vs_least_loaded} / x{p95_vs_round_robin} / x{p95_vs_longest_prefix} "
                "(vs least-loaded / round-robin / longest-prefix)".format(**per_size),
            )
        )
        results[str(n)] = per_size
    report("routing policies, simulated nodes", rows, results)


if __name__ == "__main__":
    main()
