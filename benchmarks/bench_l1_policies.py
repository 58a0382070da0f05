"""L1's eviction policies against LRU and the offline optimum, on many
traces and capacities: the check that a policy wins on traffic it was not
tuned on.

Traces: every ``--trace FILE`` (any Mooncake-format trace; the conversation
trace, Mooncake FAST'25, by default when no other is named) and the shapes
of ``kvtier.traces.shapes`` named by ``--shapes`` (one-off prompts, long
multi-turn sessions, agent tool loops, a few hot documents under many
questions, short chats, a mix), generated with ``--seed``; ``--held-back``
adds every shape again under a seed the policy was never looked at on.

Capacities: ``--fractions`` of each trace's distinct blocks (1 % to 100 %),
plus ``--blocks`` on the conversation trace (5,000 and 20,000 blocks: 2.56 M
and 10.24 M tokens). Each cell replays the trace as ``kvtier serve``'s L1
sees it (``kvtier.planner.policy_sim``: prefix hits, one write batch per
request) under LRU, GDSF and the probation policy, beside the offline
optimum; it reports hit ratios (tokens), each policy's share of the optimum
and its difference from LRU.

Targets: on the conversation trace at 5,000 blocks the default
policy >= 1.4x LRU and >= 1/3 of the way from LRU to the optimum; on every
trace and capacity never below LRU by more than 0.005.

    python benchmarks/bench_l1_policies.py [--trace FILE ...] [--shapes oneoff,unshared]
        [--fractions 0.01,0.1,1] [--held-back] [--markdown]
"""

from __future__ import annotations

import argparse
import functools
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

from common import named_traces, report, trace_options
from kvtier.planner.policy_sim import optimum_hit_tokens, simulate_policy
from kvtier.planner.reuse import Access, accesses
from kvtier.traces import read_mooncake

POLICIES = ("lru", "gdsf", "probation")
HELD_BACK_SEED = 1000  # the held-back traces': never used while the policy was built
TOLERANCE = 0.005  # how far below LRU a policy may fall anywhere


def _touches(path: Path) -> list[Access]:
    return accesses(read_mooncake(path))


def _cell(path: Path, blocks: int) -> dict[str, Any]:
    touches = _touches(path)
    total = sum(access.tokens for access in touches)
    row: dict[str, Any] = {"blocks": blocks}
    for name in POLICIES:
        row[name] = simulate_policy(touches, name, blocks) / total
    row["opt"] = optimum_hit_tokens(touches, blocks) / total
    return row


def _capacities(path: Path, fractions: list[float], extra: list[int]) -> list[int]:
    distinct = len({access.block for access in _touches(path)})
    sizes = {max(1, round(f * distinct)) for f in fractions}
    return sorted(sizes | set(extra))


def _markdown(results: dict[str, list[dict[str, Any]]]) -> str:
    lines = []
    for trace, rows in results.items():
        lines += [
            f"**{trace}**",
            "",
            "| capacity (blocks) | LRU | GDSF | probation | optimum | probation/LRU "
            "| probation - LRU | share of the optimum (LRU / probation) |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for r in rows:
            ratio = r["probation"] / r["lru"] if r["lru"] else 1.0
            lines.append(
                f"| {r['blocks']:,} | {r['lru']:.3f} | {r['gdsf']:.3f} | {r['probation']:.3f} "
                f"| {r['opt']:.3f} | x{ratio:.2f} | {r['probation'] - r['lru']:+.3f} "
                f"| {r['lru'] / r['opt']:.0%} / {r['probation'] / r['opt']:.0%} |"
            )
        lines.append("")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    trace_options(parser, "oneoff,unshared,agent,long,short,mixed")
    parser.add_argument("--held-back", action="store_true")
    parser.add_argument("--fractions", default="0.01,0.02,0.05,0.1,0.2,0.5,1")
    parser.add_argument("--blocks", default="5000,20000", help="extra capacities, conversation")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--markdown", action="store_true")
    args = parser.parse_args()
    fractions = [float(f) for f in args.fractions.split(",") if f]
    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        paths = named_traces(args, Path(tmp), HELD_BACK_SEED if args.held_back else None)
        jobs = {
            name: _capacities(
                path,
                fractions,
                [int(b) for b in args.blocks.split(",") if b] if name == "conversation" else [],
            )
            for name, path in paths.items()
        }
        with ProcessPoolExecutor(args.workers) as pool:
            futures = {
                name: [pool.submit(functools.partial(_cell, paths[name], c)) for c in capacities]
                for name, capacities in jobs.items()
            }
            results = {name: [f.result() for f in fs] for name, fs in futures.items()}
    worst = min(
        (r["probation"] - r["lru"], name, r["blocks"]) for name, rs in results.items() for r in rs
    )
    rows = [
        (
            f"{name} {r['blocks']:,} blocks",
            f"LRU {r['lru']:.3f}  GDSF {r['gdsf']:.3f}  "
            f"probation {r['probation']:.3f}  optimum {r['opt']:.3f}",
        )
        for name, rs in results.items()
        for r in rs
    ]
    rows.append(
        ("probation's worst cell against LRU", f"{worst[0]:+.3f} ({worst[1]}, {worst[2]:,} blocks)")
    )
    conversation = {r["blocks"]: r for r in results.get("conversation", [])}
    summary: dict[str, Any] = {
        "worst_against_lru": worst[0],
        "within_tolerance": worst[0] >= -TOLERANCE,
    }
    if 5000 in conversation:
        r = conversation[5000]
        way = (r["probation"] - r["lru"]) / (r["opt"] - r["lru"]) if r["opt"] > r["lru"] else 1.0
        summary |= {
            "conversation_5000_ratio": r["probation"] / r["lru"],
            "conversation_5000_way_to_opt": way,
        }
        rows.append(
            (
                "conversation at 5,000 blocks",
                f"x{r['probation'] / r['lru']:.2f} LRU, {way:.0%} of the way to the optimum",
            )
        )
    rows.append(("wall", f"{time.perf_counter() - started:.0f} s"))
    report("L1 policies against LRU and the offline optimum", rows, {"cells": results, **summary})
    if args.markdown:
        print(_markdown(results))


if __name__ == "__main__":
    main()
