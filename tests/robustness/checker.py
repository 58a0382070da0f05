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
| released_within_ttl   | 6         | a killed client's reservations and locks are freed in time |
| handoff_once          | 7         | no hand-off is granted to two consumers (per server boot)  |
| server_alive          | 4         | the cache server never exits or logs a traceback by itself |
| never_raises          | 4         | no client call raises into its caller: failures are misses |

Operations whose outcome is unknown (an error, a timeout) may or may not have
taken effect, as in any history checker: a store that failed still counts as
a store that may have committed.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

from tests.robustness.history import History, Op

STORE, READ, TAKE, PURGE = "store", "read", "take", "purge"


@dataclass(frozen=True, slots=True)
class Violation:
    rule: str
    op: int  # the index of the operation that breaks the rule
    message: str


def check(history: History) -> list[Violation]:
    """Every violation in the history, in operation order."""
    found: list[Violation] = []
    for rule in (_reads, _timeouts, _handoffs, _faults, _exceptions):
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
