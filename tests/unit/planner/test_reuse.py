"""The reuse curve: exact LRU at every capacity, checked against a
brute-force LRU simulation; kvtier's policies simulated; the tier split and
the capacity for a share of the ceiling; ``kvtier plan --trace`` end to end."""

from __future__ import annotations

import json
from collections import OrderedDict
from pathlib import Path

import pytest

from kvtier.commands.cli import main
from kvtier.planner.policy_sim import optimum_hit_tokens, requests, simulate_policy
from kvtier.planner.reuse import Access, accesses, reuse_curve
from kvtier.planner.trace_plan import TraceQuestion, plan_trace
from kvtier.traces import read_mooncake
from tests.unit.traces.conversations import conversation_rows, write_rows


def brute_force_lru(touches: list[Access], capacity: int) -> tuple[int, bool]:
    """Hit tokens of an LRU cache of ``capacity`` blocks, and whether every
    request's hits were a prefix of its blocks (a request starts at block 0)."""
    cache: OrderedDict[int, None] = OrderedDict()
    hit_tokens, prefixes, missed = 0, True, False
    for touch in touches:
        if touch.block == 0:  # every request of these traces starts at block 0
            missed = False
        if touch.block in cache:
            cache.move_to_end(touch.block)
            hit_tokens += touch.tokens
            prefixes &= not missed
            continue
        missed = True
        if capacity:
            cache[touch.block] = None
            if len(cache) > capacity:
                cache.popitem(last=False)
    return hit_tokens, prefixes


def brute_force_served_lru(touches: list[Access], capacity: int) -> int:
    """Hit tokens of LRU as ``kvtier serve``'s L1 runs it: a request's leading
    resident blocks hit and are touched head last; its missing blocks are
    written as one batch (room first, oldest out; a batch larger than the
    cache is refused), admitted head last."""
    cache: OrderedDict[int, None] = OrderedDict()
    hit_tokens = 0
    for request in requests(touches):
        hits = 0
        while hits < len(request) and request[hits].block in cache:
            hits += 1
        hit_tokens += sum(a.tokens for a in request[:hits])
        for access in reversed(request[:hits]):
            cache.move_to_end(access.block)
        batch = [a.block for a in request[hits:] if a.block not in cache]
        if len(batch) > capacity:
            continue
        while len(cache) + len(batch) > capacity:
            cache.popitem(last=False)
        for block in reversed(batch):
            cache[block] = None
    return hit_tokens


@pytest.fixture(scope="module")
def trace(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_rows(tmp_path_factory.mktemp("trace") / "t.jsonl", conversation_rows(1500, seed=2))


@pytest.fixture(scope="module")
def touches(trace: Path) -> list[Access]:
    return accesses(read_mooncake(trace))


def test_the_curve_is_exact_lru_at_every_sampled_capacity(touches: list[Access]) -> None:
    curve = reuse_curve(touches, requests=1500, duration_s=1.0)
    distinct = len({t.block for t in touches})
    assert curve.distinct_blocks == distinct
    assert curve.input_tokens == sum(t.tokens for t in touches)
    capacities = sorted({0, 1, 2, 3, 5, 8, 13, 40, 100, 333, 1000, distinct - 1, distinct})
    for capacity in capacities:
        hits, prefixes = brute_force_lru(touches, capacity)
        assert curve.hit_tokens(capacity) == hits, f"capacity {capacity}"
        assert prefixes, "LRU hits of prefix-chained requests are prefixes"
        assert simulate_policy(touches, "lru", capacity) == brute_force_served_lru(
            touches, capacity
        )
    assert curve.ceiling_tokens == brute_force_lru(touches, distinct)[0] > 0
    assert 0 < curve.hit_ratio(100) < curve.ceiling_tokens / curve.input_tokens


def test_the_capacity_for_a_share_of_the_ceiling_is_the_smallest(touches: list[Access]) -> None:
    curve = reuse_curve(touches, requests=1500, duration_s=1.0)
    for share in (0.1, 0.5, 0.9, 1.0):
        want = share * curve.ceiling_tokens
        blocks = curve.blocks_for(want)
        assert blocks is not None
        assert curve.hit_tokens(blocks) >= want > curve.hit_tokens(blocks - 1)
    assert curve.blocks_for(curve.ceiling_tokens + 1) is None


def test_gdsf_is_simulated_with_kvtiers_policy(touches: list[Access]) -> None:
    """GDSF keeps frequently reused blocks: at a small capacity it differs
    from LRU, and neither beats the ceiling."""
    curve = reuse_curve(touches, requests=1500, duration_s=1.0)
    gdsf = [simulate_policy(touches, "gdsf", c) for c in (10, 50, 200)]
    assert gdsf != [curve.hit_tokens(c) for c in (10, 50, 200)]
    assert all(0 < g <= curve.ceiling_tokens for g in gdsf)


def test_the_tiers_split_the_hits_and_sum_to_the_larger_cache(trace: Path) -> None:
    question = TraceQuestion(
        capacities_tokens=(512 * 40,),
        policies=(),
        l1_tokens=512 * 40,
        l2_tokens=512 * 400,
        prefill_tokens_per_s=1000.0,
        bytes_per_token=10,
    )
    plan = plan_trace(trace, question)
    tiers = plan.tiers
    assert tiers is not None
    assert tiers["l1_hit_ratio"] == plan.points[0]["hit_ratio"]
    both = plan.curve.hit_ratio(400)
    assert tiers["l1_hit_ratio"] + tiers["l2_hit_ratio"] == pytest.approx(both)
    l2_tokens = (both - tiers["l1_hit_ratio"]) * plan.curve.input_tokens
    assert tiers["prefill_s_saved_l2"] == pytest.approx(l2_tokens / 1000)
    assert tiers["l2_read_bytes_per_s_mean"] == pytest.approx(
        10 * l2_tokens / plan.curve.duration_s
    )
    assert tiers["l2_read_tokens_per_s_peak_minute"] >= tiers["l2_read_tokens_per_s_mean"]


def test_plan_trace_command_writes_the_curve(trace: Path, tmp_path: Path) -> None:
    out, plot = tmp_path / "plan.json", tmp_path / "curve.png"
    code = main(
        [
            "plan",
            "--trace",
            str(trace),
            "--capacities",
            "5120,51200,512000",
            "--layers",
            "2",
            "--kv-heads",
            "2",
            "--head-dim",
            "64",
            "--dtype",
            "fp32",
            "--plot",
            str(plot),
            "--json",
            str(out),
        ]
    )
    assert code == 0
    report = json.loads(out.read_text())
    touches = accesses(read_mooncake(trace))
    assert [p["capacity_tokens"] for p in report["curve"]] == [5120, 51200, 512000]
    total = sum(t.tokens for t in touches)
    for point in report["curve"]:
        hits, _ = brute_force_lru(touches, point["capacity_tokens"] // 512)
        assert point["hit_ratio"] == hits / total
        assert point["capacity_bytes"] == point["capacity_tokens"] * 2 * 2 * 2 * 64 * 4
        assert set(point["policies"]) == {"gdsf", "probation"}
        assert point["opt_hit_ratio"] >= max(point["hit_ratio"], *point["policies"].values())
        assert set(point["share_of_opt"]) == {"lru", "gdsf", "probation"}
    distinct = len({t.block for t in touches})
    assert report["reuse_ceiling"] == brute_force_lru(touches, distinct)[0] / total
    assert plot.stat().st_size > 0


def test_plan_trace_refuses_bad_input_by_name(
    trace: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    bad = write_rows(tmp_path / "bad.jsonl", ['{"timestamp": 1}'])
    assert main(["plan", "--trace", str(bad)]) == 2
    assert f"{bad}:1: field 'input_length' is missing" in capsys.readouterr().err
    assert main(["plan", "--trace", str(trace), "--policies", "fifo"]) == 2
    assert "--policies: unknown eviction policy 'fifo'" in capsys.readouterr().err
    assert main(["plan", "--trace", str(trace), "--l2-tokens", "5"]) == 2
    assert "--l2-tokens needs --l1-tokens" in capsys.readouterr().err
    assert main(["plan", "--trace", str(bad), "--skip-bad-lines"]) == 2
    assert "no requests" in capsys.readouterr().err


def _one_block_requests(*blocks: int) -> list[Access]:
    return [Access(block, 512, 0, number) for number, block in enumerate(blocks)]


def test_the_optimum_keeps_the_block_used_soonest() -> None:
    # a b a b a, one slot: keep a (used again first), never b: two hits of a
    touches = _one_block_requests(1, 2, 1, 2, 1)
    assert optimum_hit_tokens(touches, 1) == 2 * 512
    # a b b a, one slot: b's next use (request 2) is sooner than a's (3): b replaces a
    assert optimum_hit_tokens(_one_block_requests(1, 2, 2, 1), 1) == 512
    # never used again: not admitted, and it leaves the cache
    assert optimum_hit_tokens(_one_block_requests(1, 2, 3, 1), 1) == 512
    assert optimum_hit_tokens(_one_block_requests(1, 1, 1), 0) == 0


def test_the_optimum_counts_prefix_hits_only() -> None:
    # [a b] twice with one slot: a is kept (a tie with b is not a reason to swap),
    # b cannot be; the second request hits a only
    touches = [
        Access(1, 512, 0, 0),
        Access(2, 512, 0, 0),
        Access(1, 512, 0, 1),
        Access(2, 512, 0, 1),
    ]
    assert optimum_hit_tokens(touches, 1) == 512
    assert optimum_hit_tokens(touches, 2) == 1024
    # [b], then [a b] with room for one: b is resident but a is not: no hit at all
    touches = [
        Access(2, 512, 0, 0),
        Access(1, 512, 0, 1),
        Access(2, 512, 0, 1),
        Access(2, 512, 0, 2),
    ]
    assert optimum_hit_tokens(touches, 1) == 512  # only the last request's b


def test_no_policy_beats_the_optimum_and_it_beats_lru(touches: list[Access]) -> None:
    for capacity in (3, 30, 300):
        best = optimum_hit_tokens(touches, capacity)
        for policy in ("lru", "gdsf", "probation"):
            assert simulate_policy(touches, policy, capacity) <= best, (policy, capacity)
