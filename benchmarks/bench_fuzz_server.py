"""A long hostile run against a live ``kvtier serve``: the fuzz suite's traffic
(``tests/integration/hostile.py``) at volume, in rounds, with the server's
private memory sampled after each round.

Baseline, in the same run and on the same server: the same number of PINGs
(the cheapest well-formed request) over the same sockets and window. Reports
hostile messages per second and its ratio to PINGs per second, every reply
kind, and the server's private resident memory (RssAnon: the shared-memory
arena excluded) at the start, after each round and at the end. Every message
must get exactly one reply and the server must stay up, as in the test.

    python benchmarks/bench_fuzz_server.py [--messages 200000] [--rounds 10] [--seed 14]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repo root, for tests

from tests.integration import hostile

from common import report
from kvtier.process import ServerProcess
from kvtier.protocol import messages as p

MiB = 1 << 20


def rss_anon(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("RssAnon:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no RssAnon in /proc status")


def pings() -> Iterator[hostile.Message]:
    body = p.encode(p.Ping())
    registered = False
    while True:
        registered = not registered
        yield hostile.Message("ping", [body], registered)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--messages", type=int, default=200_000)
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--seed", type=int, default=14)
    args = parser.parse_args()
    per_round = max(1, args.messages // args.rounds)
    with tempfile.TemporaryDirectory() as tmp:
        server_args = ["--port", "0", "--http-port", "-1", "--l1-size", "64MiB"]
        server_args += ["--cache-dir", str(Path(tmp) / "l2")]
        with ServerProcess.start(server_args, Path(tmp) / "server.log") as server:
            start_rss = rss_anon(server.pid)
            baseline = hostile.blast(server.rpc, pings(), per_round)
            traffic = iter(hostile.HostileMessages(args.seed))
            kinds: Counter[str] = Counter()
            replies: Counter[str] = Counter()
            seconds = 0.0
            samples = []
            for _ in range(args.rounds):
                run = hostile.blast(server.rpc, traffic, per_round)
                kinds.update(run.kinds)
                replies.update(run.replies)
                seconds += run.seconds
                samples.append(rss_anon(server.pid))
            alive = server.proc.poll() is None
            log = server.log
    sent = per_round * args.rounds
    hostile_rate = sent / seconds
    ping_rate = baseline.messages / baseline.seconds
    rows = [
        ("hostile messages", f"{sent:,} in {seconds:.1f} s = {hostile_rate:,.0f}/s"),
        ("PING baseline", f"{baseline.messages:,} = {ping_rate:,.0f}/s"),
        ("hostile / PING throughput", f"{hostile_rate / ping_rate:.2f}"),
        (
            "server RssAnon",
            f"start {start_rss / MiB:.0f} MiB, max {max(samples) / MiB:.0f} MiB, "
            f"end {samples[-1] / MiB:.0f} MiB",
        ),
        ("per round (MiB)", " ".join(f"{s / MiB:.0f}" for s in samples)),
        ("internal errors", str(replies.get("internal", 0))),
        ("server alive, no traceback", str(alive and "Traceback" not in log)),
        ("replies", ", ".join(f"{k} {v}" for k, v in replies.most_common())),
    ]
    report(
        "kvtier serve under hostile traffic",
        rows,
        {
            "messages": sent,
            "hostile_per_s": hostile_rate,
            "ping_per_s": ping_rate,
            "ratio": hostile_rate / ping_rate,
            "rss_start": start_rss,
            "rss_samples": samples,
            "internal_errors": replies.get("internal", 0),
            "alive": alive,
            "kinds": dict(kinds),
            "replies": dict(replies),
        },
    )
    if not alive or replies.get("internal") or "Traceback" in log:
        raise SystemExit("the server failed under hostile traffic")


if __name__ == "__main__":
    main()
