"""The robustness harness: its checker on histories written by hand (each
rule must fire on the history that breaks it, and only there), then seeded
runs against real processes (a fixed set of seeds must keep every
guarantee, and planted defects must be found)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.robustness.checker import check, shrink
from tests.robustness.history import History, Op
from tests.robustness.run import run
from tests.servers import redis_binary


def op(
    history: History, client: str, kind: str, start: float, end: float | None, **fields: Any
) -> Op:
    """Append an operation with given times; ``fields``: args, plus
    outcome/result/bound_s."""
    outcome = fields.pop("outcome", "ok")
    result = fields.pop("result", {})
    bound_s = fields.pop("bound_s", 0.0)
    new = Op(len(history.ops), client, kind, fields, start, end, outcome, result, bound_s)
    history.ops.append(new)
    return new


def store(history: History, tenant: str, prompt: int, digests: list[str], start: float = 0.0) -> Op:
    return op(
        history,
        tenant,
        "store",
        start,
        start + 0.1,
        tenant=tenant,
        prompt=prompt,
        chunks=len(digests),
        result={"digests": digests, "stored": len(digests)},
    )


def read(history: History, tenant: str, prompt: int, digests: list[str], start: float) -> Op:
    return op(
        history,
        tenant,
        "read",
        start,
        start + 0.1,
        tenant=tenant,
        prompt=prompt,
        result={"hit": len(digests), "digests": digests},
    )


def rules(history: History) -> list[str]:
    return [v.rule for v in check(history)]


def test_a_history_that_keeps_every_guarantee_passes() -> None:
    h = History(1)
    store(h, "acme", 1, ["a0", "a1"])
    store(h, "globex", 1, ["g0"])
    read(h, "acme", 1, ["a0", "a1"], 1.0)
    read(h, "globex", 1, ["g0"], 1.0)
    read(h, "acme", 2, [], 1.0)  # a miss is always allowed
    op(h, "acme-c0", "take", 2, 2.1, handoff="h", result={"outcome": "granted", "boot": "b1"})
    op(h, "acme-c1", "take", 2, 2.1, handoff="h", result={"outcome": "taken", "boot": "b1"})
    op(h, "faults", "fault", 3, 4, fault="server_kill", result={"files": 3, "indexed": 3})
    op(h, "runner", "settle", 5, 6)
    op(h, "runner", "server", 6, 6)
    assert check(h) == []


def test_bytes_no_store_sent_break_exact_or_miss() -> None:
    h = History(1)
    store(h, "acme", 1, ["a0", "a1"])
    read(h, "acme", 1, ["a0", "XX"], 1.0)
    assert rules(h) == ["exact_or_miss"]


def test_a_hit_before_any_store_began_is_not_exact() -> None:
    h = History(1)
    read(h, "acme", 1, ["a0"], 0.0)
    store(h, "acme", 1, ["a0"], start=1.0)
    assert rules(h) == ["no_cross_tenant"]  # a hit on a chunk this tenant had not stored


def test_another_tenants_bytes_or_a_hit_only_they_stored_are_cross_tenant() -> None:
    h = History(1)
    store(h, "acme", 1, ["a0", "a1"])
    store(h, "globex", 1, ["g0"])
    read(h, "globex", 1, ["a0"], 1.0)  # acme's bytes under globex's key
    read(h, "globex", 1, ["g0", "a1"], 2.0)  # a hit past what globex stored
    found = check(h)
    assert [(v.rule, v.op) for v in found] == [("no_cross_tenant", 2), ("no_cross_tenant", 3)]
    assert "another tenant's bytes" in found[0].message


def test_a_store_that_failed_may_still_have_committed() -> None:
    h = History(1)
    failed = store(h, "acme", 1, ["a0"])
    failed.outcome, failed.result["stored"] = "error", 0
    read(h, "acme", 1, ["a0"], 1.0)
    assert check(h) == []


def test_a_hit_after_a_purge_was_done_is_caught_unless_stored_again() -> None:
    h = History(1)
    store(h, "acme", 1, ["a0"])
    store(h, "acme", 2, ["b0"])
    op(h, "acme", "purge", 1.0, 2.0, tenant="acme")
    read(h, "acme", 1, ["a0"], 3.0)
    store(h, "acme", 2, ["b0"], start=3.0)
    read(h, "acme", 2, ["b0"], 4.0)
    op(h, "acme", "purge", 5.0, 9.0, tenant="acme", outcome="running")
    read(h, "acme", 2, ["b0"], 10.0)  # that purge never said done: no rule
    assert [(v.rule, v.op) for v in check(h)] == [("purged_stays_purged", 3)]


def test_an_operation_past_its_bound_or_never_ended_is_a_hang() -> None:
    h = History(1)
    op(h, "acme", "pin", 0.0, 1.0, bound_s=5.0)
    op(h, "acme", "pin", 0.0, 6.0, bound_s=5.0)
    op(h, "acme", "pin", 0.0, None, bound_s=5.0)
    op(h, "acme", "purge", 0.0, 60.0)  # not timed
    assert [(v.rule, v.op) for v in check(h)] == [("within_timeout", 1), ("within_timeout", 2)]


def test_a_handoff_granted_twice_on_one_boot_is_caught_not_across_a_restart() -> None:
    h = History(1)
    for client, boot in (("c0", "b1"), ("c0", "b1"), ("c1", "b2"), ("c1", "b1")):
        op(h, client, "take", 0, 1, handoff="h", result={"outcome": "granted", "boot": boot})
    assert [(v.rule, v.op) for v in check(h)] == [("handoff_once", 3)]


def test_faults_restarts_settling_and_the_server_have_rules() -> None:
    h = History(1)
    op(h, "faults", "fault", 0, 1, fault="redis_kill", outcome="unrecovered")
    op(h, "faults", "fault", 1, 2, fault="server_kill", result={"files": 5, "indexed": 4})
    op(h, "runner", "settle", 3, 4, outcome="held", result={"locked": 1})
    op(h, "runner", "server", 5, 5, outcome="down")
    assert rules(h) == ["recovers", "fs_survives_restart", "released_within_ttl", "server_alive"]


def test_a_call_that_raised_breaks_never_raises() -> None:
    h = History(1)
    op(h, "acme", "read", 0, 1, tenant="acme", prompt=1, outcome="error",
       result={"exception": "KeyError('x')"})  # fmt: skip
    op(h, "acme", "purge", 0, 1, tenant="acme", outcome="error", result={"refused": "down"})
    assert [(v.rule, v.op) for v in check(h)] == [("never_raises", 0)]


def test_an_idle_client_busy_while_the_server_was_away_breaks_quiet_while_away() -> None:
    h = History(1)
    away = {"away_s": 6.0, "heartbeat_s": 1.0}
    op(h, "faults", "fault", 0, 7, fault="server_away", result={**away, "client_cpu_s": 0.02})
    op(h, "faults", "fault", 8, 15, fault="server_away", result={**away, "client_cpu_s": 3.9})
    assert [(v.rule, v.op) for v in check(h)] == [("quiet_while_away", 1)]


def memory(h: History, pid: int, rss_mib: int, **seen: Any) -> Op:
    bounds = {
        "rows_per_tenant": 16,
        "clients": 1024,
        "session_objects": 1 << 22,
        "remembered": 64,
        "rss_growth_bytes": 96 << 20,
    }
    tables = {
        "pid": pid,
        "rss_bytes": rss_mib << 20,
        "quality_rows": {"acme": 16},
        "ledger_rows": {"acme": 16, "globex": 2},
        "clients": 8,
        "session_objects": 0,
        "layouts": 64,
        "hash_namespaces": 64,
    }
    return op(h, "monitor", "memory", 0, 0, **bounds, result={**tables, **seen})


def test_a_table_past_its_bound_or_rss_past_its_growth_breaks_bounded_memory() -> None:
    h = History(1)
    memory(h, 10, 60)
    memory(h, 10, 150)  # 90 MiB over the first sample: within
    memory(h, 11, 300)  # a restarted server: its own first sample
    memory(h, 11, 350, quality_rows={"acme": 17})  # one row past the tenant's bound
    memory(h, 11, 420)  # 120 MiB over the process's first sample
    memory(h, 11, 300, layouts=65)
    assert [(v.rule, v.op) for v in check(h)] == [
        ("bounded_memory", 3),
        ("bounded_memory", 4),
        ("bounded_memory", 5),
    ]


def route(h: History, start: float, stream: bool, **result: Any) -> Op:
    outcome = "ok" if result.get("status") == 200 and "error" not in result else "error"
    return op(h, "router", "route", start, start + 1, stream=stream, outcome=outcome,
              result=result, bound_s=8.0)  # fmt: skip


def test_a_request_the_router_did_not_answer_breaks_fails_over_but_a_slow_504_does_not() -> None:
    h = History(1)
    slow = {"engine": "e1", "stall_s": 4.0, "slow_s": 3.0, "live_again": True}
    op(h, "faults", "fault", 10, 14, fault="engine_slow", result=slow)
    late = "engine e1 did not answer within 3.0 s (first_byte_timeout_s)"
    route(h, 0, False, status=200, engine="e0")
    route(h, 11, False, status=504, type="timeout", error=late)  # the slow engine's: allowed
    route(h, 11, True, status=504, type="timeout", error=late)  # a stream is retried instead
    route(h, 20, False, status=504, type="timeout", error=late)  # no slow engine then
    route(h, 21, False, status=503, error="no engine is up")
    silent = {"engine": "e0", "silent_s": 4.0, "held_early": 2, "silent_failures": 0}
    op(h, "faults", "fault", 30, 35, fault="engine_silent", result={**silent, "live_again": True})
    op(h, "faults", "fault", 40, 45, fault="engine_silent",
       result={**silent, "silent_failures": 1, "live_again": False})  # fmt: skip
    assert [(v.rule, v.op) for v in check(h)] == [
        ("fails_over", 3),
        ("fails_over", 4),
        ("fails_over", 5),
        ("fails_over", 6),
        ("recovers", 7),
    ]


def test_shrink_keeps_the_prompts_operations_the_purges_and_the_faults() -> None:
    h = History(1)
    store(h, "acme", 1, ["a0"])
    store(h, "acme", 2, ["b0"])
    op(h, "faults", "fault", 0.5, 0.6, fault="corrupt_fs")
    op(h, "globex", "purge", 0.7, 0.8, tenant="globex")
    bad = read(h, "acme", 1, ["XX"], 1.0)
    read(h, "acme", 1, ["a0"], 5.0)  # after the violation
    (violation,) = check(h)
    assert [o.index for o in shrink(h, violation)] == [0, 2, bad.index]


def test_a_history_survives_saving_and_loading(tmp_path: Path) -> None:
    h = History(7)
    store(h, "acme", 1, ["a0"])
    op(h, "acme", "pin", 0.0, None, bound_s=5.0)
    h.save(tmp_path / "h.jsonl")
    loaded = History.load(tmp_path / "h.jsonl")
    assert (loaded.seed, loaded.ops) == (7, h.ops)


# ------------------------------------------------------------ real processes

needs_redis = pytest.mark.skipif(redis_binary() is None, reason="needs redis-server")
# CI's fixed set: about 6-10 s a seed on two cores.
CI_SEEDS = range(1, 9)


@needs_redis
@pytest.mark.slow
@pytest.mark.parametrize("seed", CI_SEEDS)
def test_a_seeded_run_with_five_faults_keeps_every_guarantee(seed: int, tmp_path: Path) -> None:
    report = run(seed, faults=5, keep=tmp_path)
    assert len(report.faults) == 5
    assert all(fault["recovery_s"] is not None for fault in report.faults)
    shown = "\n".join([str(v) for v in report.violations] + report.shrunk)
    assert report.violations == [], f"seed {seed}; history {report.history_path}\n{shown}"


@needs_redis
@pytest.mark.slow
def test_a_seed_replays_the_same_faults_and_operations(tmp_path: Path) -> None:
    first, second = (run(3, faults=3, min_ops=12, keep=tmp_path) for _ in range(2))
    assert first.faults and [f["fault"] for f in first.faults] == [
        f["fault"] for f in second.faults
    ]

    def operations(report: Any) -> list[tuple[str, str, dict[str, Any]]]:
        return [
            (o.client, o.kind, o.args)
            for o in report.history.ops
            if o.client == "acme" and o.kind in ("store", "read", "pin", "purge")
        ][:12]

    assert operations(first) == operations(second)


@needs_redis
@pytest.mark.slow
def test_a_planted_double_handoff_is_found(tmp_path: Path) -> None:
    report = run(1, faults=1, min_ops=20, plant="double-handoff", keep=tmp_path)
    assert {v.rule for v in report.violations} == {"handoff_once"}, report.violations
    assert report.history_path is not None and report.history_path.exists()
    assert any('"take"' in line for line in report.shrunk)


@needs_redis
@pytest.mark.slow
def test_a_planted_skip_of_the_checksum_is_found(tmp_path: Path) -> None:
    """Readers that take any payload, and fs objects corrupted under them:
    some seed of the first few serves the wrong bytes, and the checker says
    so (the same seeds without the plant serve none: see the fixed set)."""
    for seed in range(1, 7):
        report = run(
            seed, faults=5, min_ops=40, plant="skip-checksum", keep=tmp_path, kinds=["corrupt_fs"]
        )
        if report.violations:
            break
    assert {v.rule for v in report.violations} == {"exact_or_miss"}, report.violations


@needs_redis
@pytest.mark.slow
def test_planted_unbounded_tables_are_found(tmp_path: Path) -> None:
    """Tables that never fold: the flood of names takes the quality board and
    the ledger past their bound within the run, and the checker says so."""
    report = run(1, faults=1, min_ops=20, plant="unbounded-tables", keep=tmp_path)
    assert {v.rule for v in report.violations} == {"bounded_memory"}, report.violations
