"""The planner and the server agree, request by request: a trace replayed
through a real ``kvtier serve`` (real client, real L1, eviction on demand)
gets exactly the hit runs ``kvtier.planner.policy_sim`` predicts, for LRU
and for the probation policy, at a capacity that evicts all the time."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest

from kvtier.bench.l1_replay import replay_through_server
from kvtier.planner.policy_sim import hit_runs, requests
from kvtier.planner.reuse import accesses
from kvtier.traces import read_mooncake
from kvtier.traces.shapes import ShapeSpec, shape_trace, write_mooncake


@pytest.mark.parametrize("policy", ["lru", "probation"])
def test_the_server_hits_exactly_what_the_planner_predicts(policy: str, tmp_path: Path) -> None:
    trace = tmp_path / "agent.jsonl"
    write_mooncake(trace, shape_trace(ShapeSpec("agent", sessions=12, duration_s=120.0, seed=3)))
    kept = list(itertools.islice(requests(accesses(read_mooncake(trace))), 150))
    touches = [access for request in kept for access in request]
    capacity = 40  # blocks: a few sessions' worth, so requests evict all the time
    planned = [hits for _, hits in hit_runs(touches, policy, capacity)]
    served = replay_through_server(touches, policy, capacity)
    assert served.capacity_blocks == capacity
    assert sum(planned) > 0 and any(h < len(r) for r, h in zip(kept, planned, strict=True))
    assert served.hit_runs == planned
