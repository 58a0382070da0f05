"""A robustness campaign: many seeded runs of the fault-injection harness
(``tests/robustness``), each against a real ``kvtier serve`` with an fs L2
and a real Redis, every history checked against the guarantees.

    python benchmarks/bench_robustness.py --seeds 1-200 --faults 5 --jobs 2

Reports the runs, the faults injected (by kind), the operations checked, the
violations and hangs, what the servers counted (objects loaded from each L2
tier, corrupt or forged copies refused, by reason), and the recovery time
after each kind of fault (from the fault's end until a store and read round
trip through the server works and every L2 tier is healthy again): p50 and
max. Then what the newer parts of a run saw: requests through the router by
status, the idle client's CPU seconds while the server was away, the names
the flood registered, and the largest tables and RSS growth the monitor
sampled. Exits 1 on any violation.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections import Counter, defaultdict
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repo root, for tests

from tests.robustness.run import RunReport, run, seeds_of


def _one(seed: int, faults: int, ops: int, keep: Path) -> RunReport:
    return run(seed, faults, ops, keep=keep)


def parts_seen(reports: list[RunReport]) -> dict[str, object]:
    """The router's requests by status, the idle client's CPU while the
    server was away, the flood's names and the monitor's largest samples."""
    ops = [op for report in reports for op in report.history.ops]
    routes = Counter(str(op.result.get("status")) for op in ops if op.kind == "route")
    away = [op.result for op in ops if op.kind == "fault" and "client_cpu_s" in op.result]
    names = [op.result.get("registered", 0) for op in ops if op.kind == "flood"]
    samples = [op.result for op in ops if op.kind == "memory"]
    growth: dict[int, list[int]] = defaultdict(list)
    for sample in samples:
        growth[sample["pid"]].append(sample["rss_bytes"])
    return {
        "router_requests_by_status": dict(routes),
        "server_away_client_cpu_s_max": max((a["client_cpu_s"] for a in away), default=None),
        "server_away_s_total": round(sum(a["away_s"] for a in away), 1),
        "flood_names_registered": sum(names),
        "flood_names_per_run_min": min(names, default=0),
        "quality_rows_per_tenant_max": max(
            (n for sample in samples for n in sample["quality_rows"].values()), default=0
        ),
        "ledger_rows_per_tenant_max": max(
            (n for sample in samples for n in sample["ledger_rows"].values()), default=0
        ),
        "rss_growth_mib_max": round(
            max((max(v) - v[0] for v in growth.values()), default=0) / (1 << 20), 1
        ),
        "memory_samples": len(samples),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", default="1-200")
    parser.add_argument("--faults", type=int, default=5)
    parser.add_argument("--ops", type=int, default=30, help="operations per tenant, at least")
    parser.add_argument("--jobs", type=int, default=2, help="runs at once")
    parser.add_argument("--keep", type=Path, default=Path("robustness-failures"))
    args = parser.parse_args()
    seeds = seeds_of(args.seeds)
    began = time.monotonic()
    reports: list[RunReport] = []
    with ProcessPoolExecutor(args.jobs) as pool:
        futures = [pool.submit(_one, s, args.faults, args.ops, args.keep) for s in seeds]
        for future in futures:
            report = future.result()
            reports.append(report)
            print(report.line(), flush=True)
    elapsed = time.monotonic() - began

    kinds: Counter[str] = Counter()
    recovery: dict[str, list[float]] = defaultdict(list)
    for report in reports:
        for fault in report.faults:
            kinds[fault["fault"]] += 1
            if fault["recovery_s"] is not None:
                recovery[fault["fault"]].append(fault["recovery_s"])
    violations = [v for report in reports for v in report.violations]
    hangs = [v for v in violations if v.rule == "within_timeout"]
    print(
        f"\n{len(reports)} runs in {elapsed / 60:.1f} min; {sum(kinds.values())} faults; "
        f"{sum(r.ops for r in reports)} operations checked; "
        f"{len(violations)} violations ({len(hangs)} hangs) in "
        f"{sum(1 for r in reports if r.violations)} runs"
    )
    print("\n| fault | injected | recovery p50 (s) | recovery max (s) |\n|---|---|---|---|")
    everything = [t for times in recovery.values() for t in times]
    for kind in sorted(kinds):
        times = recovery[kind]
        p50 = f"{np.percentile(times, 50):.3f}" if times else "-"
        worst = f"{max(times):.3f}" if times else "-"
        print(f"| {kind} | {kinds[kind]} | {p50} | {worst} |")
    if everything:
        print(
            f"| all | {sum(kinds.values())} | {np.percentile(everything, 50):.3f} | "
            f"{max(everything):.3f} |"
        )
    tally: Counter[str] = Counter()
    for report in reports:
        tally.update(report.tally)
    print("\nwhat the servers counted (L2 loads, copies refused by reason):")
    for name, count in sorted(tally.items()):
        print(f"  {name}: {count}")
    seen = parts_seen(reports)
    print("\nwhat the other parts saw:")
    for name, value in seen.items():
        print(f"  {name}: {value}")
    for rule, count in Counter(v.rule for v in violations).items():
        print(f"violations of {rule}: {count}")
    results = {
        "runs": len(reports),
        "faults": dict(kinds),
        "operations": sum(r.ops for r in reports),
        "violations": len(violations),
        "hangs": len(hangs),
        "recovery_p50_s": float(np.percentile(everything, 50)) if everything else None,
        "recovery_max_s": max(everything, default=None),
        "counted": dict(tally),
        "parts": seen,
    }
    print("json:", json.dumps(results, sort_keys=True))
    return 1 if violations else 0


if __name__ == "__main__":
    sys.exit(main())
