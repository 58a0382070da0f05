"""Checks a robustness run's history against kvtier's guarantees
(docs/guarantees.md). Each rule reads the whole history and names the
operations that break it:

| rule                  | guarantee | what must hold                                             |
|-----------------------|-----------|------------------------------------------------------------|
| exact_or_miss         | 1, 2      | every chunk read is the bytes a store of that tenant, prompt |
|                       |           | and chunk sent (a store invoked before the read ended)     |
| no_cross_tenant       | 3         | no hit on a chunk its tenant never stored; no bytes another |
|                       |           | tenant stored                                              |
| purged_stays_purged   | 3         | after a purge is done, a tenant's chunks stored before it  |
|                       |           | began are misses                                           |
| within_timeout        | 4         | every call returns within its documented bound; none hangs |
| recovers              | 4         | after each fault, a store and read round trip works again  |
| fs_survives_restart   | 5         | a killed server's restart indexes every object file it left |
| released_within_ttl   | 6         | a killed client's reservations and locks, pins and hand-   |
|                       |           | offs never taken are freed in time (TTL or lease)          |
| handoff_once          | 7         | no hand-off is granted to two consumers (per server boot)  |
| server_alive          | 4         | the cache server never exits or logs a traceback by itself |
| never_raises          | 4         | no client call raises into its caller: failures are misses |
| quiet_while_away      | 4         | an idle client's process uses little CPU while the server  |
|                       |           | is away past its heartbeat (no busy loop)                  |
| bounded_memory        | 9         | every table a client can add to stays within its bound,    |
|                       |           | and the server's RSS within its growth bound, per process  |
| fails_over            | 4         | every request through the router is answered 200, but a    |
|                       |           | non-streamed one a slow engine held past the first-byte    |
|                       |           | timeout (a 504 naming it); a silent engine is taken out    |

Operations whose outcome is unknown (an error, a timeout) may or may not have
taken effect, as in any history checker: a store that failed still counts as
a store that may have committed.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

from tests.robustness.history import History, Op

STORE, READ, TAKE, PURGE = "store", "read", "take", "purge"
AWAY_CPU_SHARE = 0.1  # of the time the server was away: a busy loop takes most of it
AWAY_CPU_SLACK_S = 0.3


@dataclass(frozen=True, slots=True)
class Violation:
    rule: str
    op: int  # the index of the operation that breaks the rule
    message: str


def check(history: History) -> list[Violation]:
    """Every violation in the history, in operation order."""
    found: list[Violation] = []
    for rule in (_reads, _timeouts, _handoffs, _faults, _exceptions, _memory, _routes):
        found += rule(history)
    return sorted(found, key=lambda v: v.op)


def _stores_by_chunk(history: History) -> dict[tuple[str, int, int], list[Op]]:
    """The stores that sent each (tenant, prompt, chunk)."""
    stores: dict[tuple[str, int, int], list[Op]] = defaultdict(list)
    for op in history.ops:
        if op.kind == STORE:
            for chunk in range(op.args["chunks"]):
                stores[op.args["tenant"], op.args["prompt"], chunk].append(op)
    return stores


def _reads(history: History) -> list[Violation]:
    stores = _stores_by_chunk(history)
    purges = [op for op in history.ops if op.kind == PURGE and op.outcome == "ok"]
    found = []
    for read in history.ops:
        if read.kind != READ or read.end is None:
            continue
        tenant, prompt = read.args["tenant"], read.args["prompt"]
        digests = read.result.get("digests", [])
        for chunk in range(read.result.get("hit", 0)):
            mine = [s for s in stores[tenant, prompt, chunk] if s.start < read.end]
            theirs = [
                s
                for (t, p, c), ops in stores.items()
                if t != tenant and p == prompt and c == chunk
                for s in ops
            ]
            got = digests[chunk] if chunk < len(digests) else None
            if not mine:
                whose = "another tenant's" if theirs else "no"
                found.append(
                    Violation(
                        "no_cross_tenant",
                        read.index,
                        f"{tenant} hit prompt {prompt} chunk {chunk}, which only "
                        f"{whose} store sent",
                    )
                )
                continue
            if got is not None and got not in {s.result.get("digests", [])[chunk] for s in mine}:
                other = any(
                    got == s.result.get("digests", [None] * (chunk + 1))[chunk] for s in theirs
                )
                found.append(
                    Violation(
                        "no_cross_tenant" if other else "exact_or_miss",
                        read.index,
                        f"{tenant} read prompt {prompt} chunk {chunk} as {got}: "
                        + ("another tenant's bytes" if other else "no store sent these bytes"),
                    )
                )
            for purge in purges:
                if purge.args["tenant"] != tenant or purge.end is None or purge.end > read.start:
                    continue
                if all(s.end is not None and s.end < purge.start for s in mine):
                    found.append(
                        Violation(
                            "purged_stays_purged",
                            read.index,
                            f"{tenant} hit prompt {prompt} chunk {chunk} after purge op "
                            f"{purge.index} was done, and every store of it ended before",
                        )
                    )
    return found


def _timeouts(history: History) -> list[Violation]:
    found = []
    for op in history.ops:
        if op.bound_s <= 0:
            continue
        if op.end is None:
            found.append(Violation("within_timeout", op.index, f"{op.kind} never returned"))
        elif op.end - op.start > op.bound_s:
            found.append(
                Violation(
                    "within_timeout",
                    op.index,
                    f"{op.kind} took {op.end - op.start:.2f} s, over its {op.bound_s:.1f} s bound",
                )
            )
    return found


def _handoffs(history: History) -> list[Violation]:
    granted: dict[tuple[str, str], set[str]] = defaultdict(set)
    found = []
    for op in history.ops:
        if op.kind != TAKE or op.result.get("outcome") != "granted":
            continue
        key = (op.args["handoff"], op.result.get("boot", ""))
        granted[key].add(op.client)
        if len(granted[key]) > 1:
            found.append(
                Violation(
                    "handoff_once",
                    op.index,
                    f"hand-off {key[0]} granted to {sorted(granted[key])} on one server boot",
                )
            )
    return found


def _faults(history: History) -> list[Violation]:
    found = []
    for op in history.ops:
        if op.kind == "fault" and op.outcome != "ok":
            found.append(
                Violation("recovers", op.index, f"{op.args['fault']}: {op.outcome} {op.result}")
            )
        if op.kind == "fault" and op.result.get("indexed", 0) < op.result.get("files", 0):
            found.append(
                Violation(
                    "fs_survives_restart",
                    op.index,
                    f"the restart indexed {op.result['indexed']} of "
                    f"{op.result['files']} object files",
                )
            )
        if op.kind == "fault" and "client_cpu_s" in op.result:
            allowed = AWAY_CPU_SHARE * op.result["away_s"] + AWAY_CPU_SLACK_S
            if op.result["client_cpu_s"] > allowed:
                found.append(
                    Violation(
                        "quiet_while_away",
                        op.index,
                        f"an idle client used {op.result['client_cpu_s']} CPU s while the "
                        f"server was away {op.result['away_s']} s (at most {allowed:.2f})",
                    )
                )
        if op.kind == "settle" and op.outcome != "ok":
            found.append(Violation("released_within_ttl", op.index, str(op.result)))
        if op.kind == "server" and op.outcome != "ok":
            found.append(Violation("server_alive", op.index, str(op.result)))
    return found


def _exceptions(history: History) -> list[Violation]:
    return [
        Violation("never_raises", op.index, f"{op.kind} raised {op.result['exception']}")
        for op in history.ops
        if op.kind not in ("fault", "settle", "server") and "exception" in op.result
    ]


def _memory(history: History) -> list[Violation]:
    """Each sample's tables within the bounds it carries, and the server's
    RSS within its growth bound over the first sample of the same process."""
    first_rss: dict[int, int] = {}
    found = []
    for op in history.ops:
        if op.kind != "memory" or op.outcome != "ok":
            continue
        bounds, seen = op.args, op.result
        over = [
            f"{table} rows of tenant {tenant}: {n} > {bounds['rows_per_tenant']}"
            for table in ("quality_rows", "ledger_rows")
            for tenant, n in seen[table].items()
            if n > bounds["rows_per_tenant"]
        ]
        over += [
            f"{name}: {seen[name]} > {bounds[bound]}"
            for name, bound in (
                ("clients", "clients"),
                ("session_objects", "session_objects"),
                ("layouts", "remembered"),
                ("hash_namespaces", "remembered"),
            )
            if seen[name] > bounds[bound]
        ]
        first = first_rss.setdefault(seen["pid"], seen["rss_bytes"])
        if seen["rss_bytes"] - first > bounds["rss_growth_bytes"]:
            over.append(
                f"RSS grew {(seen['rss_bytes'] - first) >> 20} MiB past its first sample "
                f"(bound {bounds['rss_growth_bytes'] >> 20} MiB)"
            )
        found += [Violation("bounded_memory", op.index, message) for message in over]
    return found


def _routes(history: History) -> list[Violation]:
    """Requests through the router, and what its engines' faults left."""
    slow = [op for op in history.ops if op.kind == "fault" and op.args["fault"] == "engine_slow"]
    found = []
    for op in history.ops:
        if op.kind == "fault" and op.args["fault"] in ("engine_silent", "engine_slow"):
            if not op.result.get("live_again", False):
                found.append(Violation("recovers", op.index, f"an engine stayed out: {op.result}"))
            if op.result.get("held_early", 0) > 0 and op.result["silent_failures"] < 1:
                found.append(
                    Violation(
                        "fails_over",
                        op.index,
                        f"engine {op.result['engine']} held {op.result['held_early']} requests "
                        "while silent, and the router never counted it silent",
                    )
                )
        if op.kind != "route" or op.end is None or op.outcome == "ok":
            continue
        error = str(op.result.get("error", ""))
        held_by_slow = any(
            fault.start <= op.end
            and op.start <= (fault.end if fault.end is not None else float("inf"))
            and f"engine {fault.result.get('engine')} " in error
            for fault in slow
        )
        timed_out = op.result.get("status") == 504 and op.result.get("type") == "timeout"
        if not (timed_out and not op.args["stream"] and held_by_slow):
            found.append(
                Violation(
                    "fails_over",
                    op.index,
                    f"a {'streamed ' if op.args['stream'] else ''}request through the router "
                    f"got {op.result.get('status')}: {error[:200]}",
                )
            )
    return found


def shrink(history: History, violation: Violation) -> list[Op]:
    """The operations that explain a violation: its own, the others on the
    same tenant and prompt (or hand-off) up to it, the purges of that tenant
    and every fault before it."""
    target = history.ops[violation.op]
    end = target.end if target.end is not None else float("inf")
    tenant, prompt = target.args.get("tenant"), target.args.get("prompt")
    handoff = target.args.get("handoff")

    def related(op: Op) -> bool:
        if op.start > end:
            return False
        if op.kind in ("fault", "server", "settle") or op.index == target.index:
            return True
        if handoff is not None:
            return op.args.get("handoff") == handoff
        if op.kind == PURGE:
            return op.args.get("tenant") == tenant
        return op.args.get("prompt") == prompt and prompt is not None

    return [op for op in history.ops if related(op)]
