"""Routing policies on the real conversation trace (Mooncake FAST'25),
simulated (``kvtier.bench.simulate``) at 8-64 nodes with GPU-like costs.

The trace is replayed with ``--block-tokens`` synthetic tokens per 512-token
trace block (8: one kvtier chunk per block), so every cost below is per real
token times 512 / block_tokens. Stated costs (real tokens): prefill 1e-4 s a
token (10 k tokens/s, an 8B model on one H100), in engine steps of 8,192
tokens (vLLM's max_num_batched_tokens) with 10 ms of overhead a step; L1
5e-6 s a token (128 KiB a token over 25 GB/s of PCIe); with ``--shared``, a
store every node reads at 1/3 of recomputing, its bandwidth shared by all
(``--store-tokens-per-s``, real tokens; 0: unbounded). Each node's engine
keeps 400 k tokens and its L1 4 M. Utilisation is the no-cache prefill work
over the nodes' capacity at full steps: the trace's time is scaled to reach
it. Seeds draw half the sessions each (``ReplaySpec.sample``); a speed-up is
the ratio of the seeds' medians with a bootstrap 95 % interval.

Compared in the same run: round-robin, least-loaded, longest-prefix, the
kvtier policy, the simulator's per-request oracle (the least true TTFT per
request: a bound for per-request policies, not for placement over time),
and, with ``--ablations``, the kvtier policy without its price for the work
it adds (the least expected TTFT alone), with its cost model learning from
every request (not only those that had their engine to itself), with the
router's previous queue
(the sum of the plans of every request without a first token), or without
the credit for routed, unannounced chunks.

    python benchmarks/bench_route_trace.py [--nodes 8,16] [--utilization 0.7,0.95]
"""

from __future__ import annotations

import argparse
import dataclasses
import time
from pathlib import Path

import numpy as np

from common import report
from kvtier.bench.simulate import ORACLE, SimConfig, SimCosts, simulate
from kvtier.bench.summary import ratio_interval
from kvtier.router.queue import PrefillQueue
from kvtier.traces import TRACE_BLOCK_TOKENS, ReplaySpec, TraceRequest, load_trace

TRACE = Path(__file__).resolve().parents[2] / "shared" / "traces" / "conversation_trace.jsonl"
BASELINES = ("round_robin", "least_loaded", "longest_prefix")


class SumOfPlans(PrefillQueue):
    """The router's queue before the drain time: every request without a
    first token counts its whole plan, a half-done prefill included."""

    def __init__(self) -> None:
        super().__init__()
        self.plans: dict[float, float] = {}  # planned first token -> its service

    def wait_s(self, now: float) -> float:
        return sum(self.plans.values())

    def dispatch(self, now: float, service_s: float, tokens: int) -> float:
        planned = super().dispatch(now, service_s, tokens)
        self.plans[planned] = self.plans.get(planned, 0.0) + service_s
        return planned

    def first_token(self, now: float, planned_at: float, tokens: int) -> None:
        super().first_token(now, planned_at, tokens)
        self.plans.pop(planned_at, None)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--trace", type=Path, default=TRACE)
    parser.add_argument("--nodes", default="8,16")
    parser.add_argument("--utilization", default="0.7,0.95")
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--window-s", type=float, default=1200.0, help="trace seconds replayed")
    parser.add_argument("--block-tokens", type=int, default=8)
    parser.add_argument("--shared", action="store_true", help="a shared store at 1/3 recompute")
    parser.add_argument(
        "--store-tokens-per-s", type=float, default=200_000.0, help="its bandwidth (0: unbounded)"
    )
    parser.add_argument("--ablations", action="store_true")
    parser.add_argument("--slo-s", type=float, default=2.0, help="TTFT SLO for goodput")
    args = parser.parse_args()
    scale = TRACE_BLOCK_TOKENS / args.block_tokens
    prefill = 1e-4 * scale
    step_tokens = max(1, round(8192 / scale))
    costs = SimCosts(
        prefill_s_per_token=prefill,
        l1_s_per_token=5e-6 * scale,
        shared_s_per_token=prefill / 3 if args.shared else None,
        overhead_s=0.01,
        shared_tokens_per_s=(args.store_tokens_per_s / scale) if args.shared else None,
    )
    capacity = step_tokens / (costs.overhead_s + step_tokens * prefill)  # tokens/s a node
    engine_chunks = int(400_000 / TRACE_BLOCK_TOKENS)
    l1_chunks = int(4_000_000 / TRACE_BLOCK_TOKENS)
    traces: list[list[TraceRequest]] = []
    for seed in range(args.seeds):
        spec = ReplaySpec(
            block_tokens=args.block_tokens,
            vocab_size=1 << 30,
            seed=seed,
            duration_s=args.window_s,
            sample=0.5,
            max_output_tokens=1,
        )
        traces.append(load_trace(args.trace, spec))
    policies = ["kvtier", *BASELINES, ORACLE]
    variants: dict[str, dict[str, object]] = {name: {} for name in policies}
    if args.ablations:
        variants["kvtier, TTFT alone"] = {"work_cost": False}
        variants["kvtier, learns from every request"] = {"learn_from_all": True}
        variants["kvtier, sum-of-plans queue"] = {"queue": SumOfPlans}
        variants["kvtier, no routed credit"] = {"pending_ttl_s": 0.0}
    rows: list[tuple[str, str]] = []
    results: dict[str, object] = {"costs": dataclasses.asdict(costs), "step_tokens": step_tokens}
    results["args"] = {k: str(v) for k, v in vars(args).items()}
    rng = np.random.default_rng(0)
    started = time.perf_counter()
    for n in (int(x) for x in args.nodes.split(",")):
        for u in (float(x) for x in args.utilization.split(",")):
            runs: dict[str, list[dict[str, object]]] = {name: [] for name in variants}
            for trace in traces:
                tokens = sum(len(r.prompt) for r in trace)
                span = max(r.arrival_s for r in trace) or 1.0
                stretch = tokens / (span * u * n * capacity)  # replay seconds per trace second
                timed = [dataclasses.replace(r, arrival_s=r.arrival_s * stretch) for r in trace]
                for name, extra in variants.items():
                    policy = name.split(",")[0]
                    config = SimConfig(
                        nodes=n,
                        l1_chunks=l1_chunks,
                        engine_chunks=engine_chunks,
                        costs=costs,
                        chunk_size=args.block_tokens,
                        step_tokens=step_tokens,
                        **extra,  # type: ignore[arg-type]
                    )
                    runs[name].append(simulate(timed, config, policy).summary(args.slo_s))
            point: dict[str, object] = {name: runs[name] for name in variants}
            for name in variants:
                s = runs[name]
                p50 = np.median([r["ttft_p50_s"] for r in s])
                p95 = np.median([r["ttft_p95_s"] for r in s])
                good = np.median([r["goodput"] for r in s])
                computed = np.median([r["computed_share"] for r in s])
                rows.append(
                    (
                        f"{n} nodes, u {u}, {name}",
                        f"TTFT p50 {p50:.3f} s  p95 {p95:.3f} s  goodput@{args.slo_s}s "
                        f"{good:.3f}  computed {computed:.3f}",
                    )
                )
            ratios = {}
            for name in variants:
                if name == "kvtier":
                    continue
                for q in ("p50", "p95"):
                    theirs = [float(r[f"ttft_{q}_s"]) for r in runs[name]]  # type: ignore[arg-type]
                    ours = [float(r[f"ttft_{q}_s"]) for r in runs["kvtier"]]  # type: ignore[arg-type]
                    ratio, low, high = ratio_interval(theirs, ours, rng)
                    ratios[f"{q} vs {name}"] = (round(ratio, 2), round(low, 2), round(high, 2))
            point["kvtier_speedup"] = ratios
            rows.append(
                (
                    f"{n} nodes, u {u}, kvtier's speed-up",
                    "  ".join(f"{k} x{v[0]} [{v[1]}, {v[2]}]" for k, v in ratios.items()),
                )
            )
            results[f"{n} nodes, u {u}"] = point
    results["wall_s"] = round(time.perf_counter() - started, 1)
    report("routing policies on the conversation trace, simulated", rows, results)


if __name__ == "__main__":
    main()
