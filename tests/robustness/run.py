"""Run seeded robustness runs and check their histories.

``python -m tests.robustness.run --seeds 1-20 [--faults 5] [--ops 60]
[--plant skip-checksum] [--keep DIR]`` prints one line per seed and, for a
seed whose history breaks a guarantee, the violations and the shrunk history
(the operations that explain the first one); it exits 1 if any seed did.

A run is reproducible from its seed: the faults, their order, their
parameters and the point in the traffic where each is injected, and every
worker's operations, come from generators seeded by it. The interleaving of
the workers with each other and with the servers is the machine's.

One run: start the cluster (``cluster.Cluster``), start the tenant workers
(``traffic.TenantWorker``), a client registering under ever new names
(``flood.NameFlood``), completions through the router
(``routing.RouterWorker``) and the sampler of the server's memory and tables
(``monitor.Monitor``), inject each fault once the workers have done its
share of operations and probe until a store and read round trip works again
(its recovery time), let the workers finish, wait for every lock and
reservation to be freed (a killed client's within its TTL), stop the
cluster, and check the history (``checker.check``).
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from kvtier.protocol.client import CacheClient
from tests.integration import workload as w
from tests.robustness import faults as f
from tests.robustness.checker import Violation, check, shrink
from tests.robustness.cluster import ADMIN_TOKEN, CLIENT_TTL_S, TIMEOUT_S, Cluster
from tests.robustness.flood import NameFlood
from tests.robustness.history import History
from tests.robustness.monitor import Monitor
from tests.robustness.routing import RouterWorker
from tests.robustness.traffic import CHUNK, LONGEST_HOLD_S, SIZE, TenantWorker

RECOVERY_WAIT_S = 30.0
SETTLE_SLACK_S = 8.0  # the reaper's tick and a busy machine, past the longest hold


@dataclass
class RunReport:
    seed: int
    faults: list[dict[str, Any]]
    violations: list[Violation]
    elapsed_s: float
    history: History
    tally: dict[str, int] = field(default_factory=dict)  # ``Cluster.tally``
    history_path: Path | None = None
    shrunk: list[str] = field(default_factory=list)

    @property
    def ops(self) -> int:
        return len(self.history.ops)

    def line(self) -> str:
        kinds = ",".join(fault["fault"] for fault in self.faults)
        verdict = "ok" if not self.violations else f"{len(self.violations)} VIOLATIONS"
        return (
            f"seed {self.seed}: {self.ops} ops, faults {kinds}, {self.elapsed_s:.1f} s: {verdict}"
        )


def run(
    seed: int,
    faults: int = 5,
    min_ops: int = 30,
    plant: str = "",
    keep: Path | None = None,
    kinds: Sequence[str] = (),
) -> RunReport:
    """One seeded run (``kinds``: the faults to draw from; all this machine
    can inject by default); its history is saved under ``keep`` (or the
    run's temporary directory) when it breaks a guarantee."""
    began = time.monotonic()
    root = Path(tempfile.mkdtemp(prefix=f"kvtier-robustness-{seed}-"))
    rng = random.Random(seed)
    history = History(seed)
    cluster = Cluster.start(root, plant)
    kinds = list(kinds) or f.available(cluster)
    schedule = [(rng.choice(kinds), rng.randrange(1 << 30)) for _ in range(faults)]
    workers = [TenantWorker(t, cluster, history, seed, min_ops) for t in ("acme", "globex")]
    background = [
        NameFlood(cluster, history, seed),
        RouterWorker(cluster.router, history, seed),
        Monitor(cluster, history),
    ]
    probe = CacheClient(
        w.client_config(cluster.server.rpc, auth_token=ADMIN_TOKEN, request_timeout_s=TIMEOUT_S)
    )
    injected = []
    try:
        for worker in workers:
            worker.start()
        for part in background:
            part.start()
        for n, (kind, fault_seed) in enumerate(schedule):
            share = (n + 1) * min_ops // (faults + 1)
            while min(worker.done for worker in workers) < share:
                time.sleep(0.02)
            injected.append(_inject(cluster, history, probe, kind, fault_seed, n))
        for worker in workers:
            worker.stop.set()
        for worker in workers:
            worker.close()
        for part in background:
            part.close()
        # a killed client's holds end with its TTL; a pin or a hand-off not
        # taken (its consumers degraded) with its own lease
        held_s = max(CLIENT_TTL_S, LONGEST_HOLD_S)
        with history.record("runner", "settle", ttl_s=held_s) as op:
            op.result = cluster.settled(held_s + SETTLE_SLACK_S)
            op.outcome = "ok" if not any(op.result.values()) else "held"
    finally:
        probe.close()
        for worker in workers:
            worker.close()
        for part in background:
            part.close()
        alive = cluster.server.proc.poll() is None
        problems = cluster.close()
        with history.record("runner", "server") as op:
            op.outcome = "ok" if alive and not problems else "down"
            op.result = {"alive": alive, "problems": [p[:2000] for p in problems]}
    violations = check(history)
    elapsed = time.monotonic() - began
    report = RunReport(seed, injected, violations, elapsed, history, dict(cluster.tally))
    if violations:
        folder = keep or root
        folder.mkdir(parents=True, exist_ok=True)
        report.history_path = folder / f"history-{seed}.jsonl"
        history.save(report.history_path)
        report.shrunk = [json.dumps(_brief(op)) for op in shrink(history, violations[0])]
    if not violations or keep is not None:
        shutil.rmtree(root, ignore_errors=True)
    return report


def _inject(
    cluster: Cluster, history: History, probe: CacheClient, kind: str, seed: int, n: int
) -> dict[str, Any]:
    """Inject one fault, then probe until a round trip works again: the
    fault's record carries what it did and its recovery time."""
    with history.record("faults", "fault", fault=kind, seed=seed) as op:
        op.result = f.FAULTS[kind](cluster, random.Random(seed))
        ended = time.monotonic()
        recovered = _recovered(cluster, probe, n)
        op.result["recovery_s"] = round(time.monotonic() - ended, 3) if recovered else None
        op.outcome = "ok" if recovered else "unrecovered"
    return {"fault": kind, "recovery_s": op.result["recovery_s"]}


def _recovered(cluster: Cluster, probe: CacheClient, n: int) -> bool:
    """Whether, within ``RECOVERY_WAIT_S``, a fresh chunk stored through the
    server reads back bit-exact and every L2 tier is healthy again."""
    deadline = time.monotonic() + RECOVERY_WAIT_S
    attempt = 0
    while time.monotonic() < deadline:
        attempt += 1
        hashes = w.chunk_hashes(CHUNK, (n << 16) + attempt, 1)
        data = w.payloads((n << 16) + attempt, 1, SIZE)
        request = f"probe-{n}-{attempt}"
        if probe.store(request, hashes, data) == 1:
            state = probe.lookup(request, hashes, wait_s=TIMEOUT_S)
            out = w.empty_buffers(1, SIZE)
            ok = state.hit_chunks == 1 and probe.retrieve_into(request, 0, 1, out)
            probe.end_session(request)
            if ok and np.array_equal(out[0], data[0]) and _tiers_healthy(cluster):
                return True
        time.sleep(0.05)
    return False


def _tiers_healthy(cluster: Cluster) -> bool:
    status = cluster.status()
    return status is not None and all(a["healthy"] for a in status["storage"]["l2"].values())


def _brief(op: Any) -> dict[str, Any]:
    return {
        "i": op.index,
        "client": op.client,
        "kind": op.kind,
        "args": op.args,
        "t": [round(op.start, 3), None if op.end is None else round(op.end, 3)],
        "outcome": op.outcome,
        "result": op.result,
    }


def seeds_of(text: str) -> list[int]:
    """``1-20,33`` -> [1, ..., 20, 33]."""
    seeds: list[int] = []
    for part in text.split(","):
        first, _, last = part.partition("-")
        seeds += range(int(first), int(last or first) + 1)
    return seeds


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.robustness.run")
    parser.add_argument("--seeds", default="1", help="e.g. 1-20,33")
    parser.add_argument("--faults", type=int, default=5, help="faults per run")
    parser.add_argument("--ops", type=int, default=30, help="operations per tenant, at least")
    parser.add_argument("--plant", default="", help="a defect to plant (see cluster.PLANTS)")
    parser.add_argument("--keep", type=Path, help="where failing runs' histories go")
    parser.add_argument("--fault-kinds", default="", help=f"comma-separated, of {sorted(f.FAULTS)}")
    args = parser.parse_args(argv)
    failed = 0
    for seed in seeds_of(args.seeds):
        kinds = [k for k in args.fault_kinds.split(",") if k]
        unknown = sorted(set(kinds) - set(f.FAULTS))
        if unknown:
            parser.error(f"--fault-kinds: unknown {unknown}; choose from {sorted(f.FAULTS)}")
        report = run(seed, args.faults, args.ops, args.plant, args.keep, kinds)
        print(report.line(), flush=True)
        if report.violations:
            failed += 1
            for violation in report.violations:
                print(f"  {violation.rule} at op {violation.op}: {violation.message}")
            print(f"  history: {report.history_path}; shrunk to {len(report.shrunk)} ops:")
            for line in report.shrunk:
                print("   ", line)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
