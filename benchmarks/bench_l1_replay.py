"""The planner against the real server: a trace replayed through ``kvtier
serve`` (``kvtier.bench.l1_replay``: lookups and stores through the real
client, synthetic 4 KiB objects, an L1 of ``capacity`` objects, L1 only,
eviction only when a write needs the room) beside the planner's simulation
of the same policy and capacity (``kvtier.planner.policy_sim``). Reports
both hit ratios (tokens), their difference (target: within 0.01) and how
many requests' hit runs differ, on the first ``--requests`` requests of
each trace.

    python benchmarks/bench_l1_replay.py [--trace FILE ...] [--shapes oneoff,agent]
        [--policies lru,probation] [--fractions 0.03,0.1] [--requests 3000]
"""

from __future__ import annotations

import argparse
import itertools
import tempfile
import time
from pathlib import Path
from typing import Any

from common import named_traces, report, trace_options
from kvtier.bench.l1_replay import replay_through_server
from kvtier.planner.policy_sim import hit_runs, requests
from kvtier.planner.reuse import Access, accesses
from kvtier.traces import read_mooncake

TARGET = 0.01


def _first(touches: list[Access], count: int) -> list[Access]:
    kept = list(itertools.islice(requests(touches), count))
    return [access for request in kept for access in request]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    trace_options(parser, "oneoff,agent")
    parser.add_argument("--policies", default="lru,probation")
    parser.add_argument("--fractions", default="0.03,0.1")
    parser.add_argument("--requests", type=int, default=3000)
    args = parser.parse_args()
    started = time.perf_counter()
    rows: list[tuple[str, str]] = []
    cells: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp:
        for name, path in named_traces(args, Path(tmp)).items():
            touches = _first(accesses(read_mooncake(path)), args.requests)
            total = sum(access.tokens for access in touches)
            distinct = len({access.block for access in touches})
            for fraction, policy in itertools.product(
                [float(f) for f in args.fractions.split(",")], args.policies.split(",")
            ):
                capacity = max(1, round(fraction * distinct))
                planned = list(hit_runs(touches, policy, capacity))
                served = replay_through_server(touches, policy, capacity)
                plan = sum(sum(a.tokens for a in r[:h]) for r, h in planned) / total
                real = (
                    sum(
                        sum(a.tokens for a in r[:h])
                        for (r, _), h in zip(planned, served.hit_runs, strict=True)
                    )
                    / total
                )
                differ = sum(h != s for (_, h), s in zip(planned, served.hit_runs, strict=True))
                cells.append(
                    {
                        "trace": name,
                        "policy": policy,
                        "capacity_blocks": capacity,
                        "planned": plan,
                        "served": real,
                        "requests": len(planned),
                        "requests_differing": differ,
                    }
                )
                rows.append(
                    (
                        f"{name} {policy} {capacity:,} blocks",
                        f"planner {plan:.4f}  server {real:.4f}  ({real - plan:+.4f}; "
                        f"{differ} of {len(planned)} requests differ)",
                    )
                )
    worst = max(abs(c["served"] - c["planned"]) for c in cells)
    rows.append(("largest difference", f"{worst:.4f} (target <= {TARGET})"))
    rows.append(("wall", f"{time.perf_counter() - started:.0f} s"))
    report("The planner against the real server", rows, {"cells": cells, "worst": worst})


if __name__ == "__main__":
    main()
