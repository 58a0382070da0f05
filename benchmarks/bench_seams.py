"""The client/server seam, this tree against an earlier revision in the same run.

Each measurement runs in a child process whose ``PYTHONPATH`` holds one
revision's ``src`` (``git archive`` of ``--baseline`` into a temporary
directory, and this tree), alternating revisions round by round, each with its
own ``kvtier serve``, pinned to the first CPU and the benchmark to the others:

- lookup: LOOKUP then WAIT (two round trips) for a 128-chunk prompt all in
  L1, p50/p99 over ``--lookups``; and pipelined (``lookup(..., wait_s=)``).
- shared client: ``--threads`` engine threads share one ``CacheClient``; each
  looks up fresh prompts that the server must ask a slow L2 about (a ``mock``
  adapter with ``--l2-latency-ms``), waits for the answer and ends the session.
  Lookups per second against one thread's, and (this tree) the most requests
  the client had on the wire at once.
- parked WAITs: ``--parked`` clients each leave a WAIT parked on the server
  (their lookups wait on an L2 that takes 30 s); the server's CPU time over
  ``--window-s`` against the same clients connected and idle.

    python benchmarks/bench_seams.py [--baseline fc4d860] [--rounds 3]
"""

from __future__ import annotations

import argparse
import io
import json
import os
import statistics
import subprocess
import sys
import tarfile
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from common import percentile, report

REPO = Path(__file__).resolve().parent.parent
PREFETCH_DEADLINE_S = 5.0  # the server's default: it ends the parked lookups


# ------------------------------------------------------------ in the child


def start_server(work: Path, *flags: str) -> Any:
    try:
        from kvtier.process import ServerProcess
    except ImportError:  # before the launcher moved out of kvtier.server
        from kvtier.server.process import ServerProcess  # type: ignore[no-redef]
    work.mkdir(parents=True, exist_ok=True)
    args = ["--host", "127.0.0.1", "--port", "0", "--http-port", "-1", *flags]
    server = ServerProcess.start(args, work / "server.log")
    pin(server.pid, this_process=os.getpid())
    return server


def pin(server: int, this_process: int) -> None:
    """The server on the first CPU, the benchmark on the others (when there
    are two or more): without it, where the scheduler puts the two decides a
    round trip's time more than the code does (1.3 vs 2.6 ms on two cores)."""
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        return
    for task in Path(f"/proc/{server}/task").iterdir():
        os.sched_setaffinity(int(task.name), cpus[:1])
    os.sched_setaffinity(this_process, cpus[1:])


def make_client(address: str, name: str) -> Any:
    from kvtier.protocol.client import CacheClient, ClientConfig
    from kvtier.protocol.messages import LayoutSpec

    layout = LayoutSpec(0, num_layers=1, kv_heads=1, head_dim=8, dtype="uint8")  # 4 KiB
    config = ClientConfig(
        address=address, model="bench/model", layouts=(layout,), client_id=name,
        request_timeout_s=30,
    )  # fmt: skip
    return CacheClient(config)


def prompt(seed: int, chunks: int, chunk_size: int) -> list[bytes]:
    from kvtier.keys import Namespace, TokenHasher

    tokens = [(seed * 1_000_003 + i) % 50_000 for i in range(chunks * chunk_size)]
    return TokenHasher(Namespace(model="bench/model"), chunk_size).chunk_hashes(tokens)


def measure_lookup(work: Path, lookups: int) -> dict[str, float]:
    import numpy as np

    server = start_server(work, "--l1-size", "256MiB", "--cache-dir", "none")
    try:
        client = make_client(server.rpc, "lookup")
        hashes = prompt(7, 128, client.chunk_size)
        client.store("seed", hashes, [np.zeros(4096, np.uint8)] * 128)
        two, piped = [], []
        for i in range(lookups):
            start = time.perf_counter()
            state = client.lookup(f"l{i}", hashes)
            hit = client.query(state, timeout_s=5)
            two.append(time.perf_counter() - start)
            assert hit == 128, hit
            client.end_session(f"l{i}")
            start = time.perf_counter()
            state = client.lookup(f"p{i}", hashes, wait_s=5)
            piped.append(time.perf_counter() - start)
            assert state.done, state
            client.end_session(f"p{i}")
        client.close()
    finally:
        server.stop()
    return {
        "p50_s": percentile(two, 50),
        "p99_s": percentile(two, 99),
        "pipelined_p50_s": percentile(piped, 50),
    }


def run_threads(threads: int, work: Callable[[int], None]) -> float:
    """Seconds for ``threads`` threads to each run ``work(index)``."""
    pool = [threading.Thread(target=work, args=(i,)) for i in range(threads)]
    start = time.perf_counter()
    for thread in pool:
        thread.start()
    for thread in pool:
        thread.join()
    return time.perf_counter() - start


def measure_shared_client(
    work: Path, threads: int, per_thread: int, latency_ms: float
) -> dict[str, float]:
    mock = json.dumps({"type": "mock", "latency_s": latency_ms / 1000, "io_threads": 16})
    server = start_server(work, "--l1-size", "256MiB", "--cache-dir", "none", "--l2", mock)
    try:
        client = make_client(server.rpc, "shared")
        counter = iter(range(10**9))

        def lookups(thread: int) -> None:
            for _ in range(per_thread):
                n = next(counter)
                state = client.lookup(f"s{n}", prompt(n, 4, client.chunk_size))
                assert client.query(state, timeout_s=5) == 0
                client.end_session(f"s{n}")

        one = run_threads(1, lookups)
        many = run_threads(threads, lookups)
        stats = getattr(client, "stats", None)
        peak = getattr(stats, "peak_in_flight", -1)
        client.close()
    finally:
        server.stop()
    return {
        "one_thread_per_s": per_thread / one,
        "threads_per_s": threads * per_thread / many,
        "peak_in_flight": peak,
    }


def cpu_seconds(pid: int) -> float:
    import psutil

    times = psutil.Process(pid).cpu_times()
    return float(times.user + times.system)


def measure_parked(work: Path, parked: int, window_s: float) -> dict[str, float]:
    mock = json.dumps({"type": "mock", "latency_s": 30.0})
    server = start_server(work, "--l1-size", "256MiB", "--cache-dir", "none", "--l2", mock)
    try:
        clients = [make_client(server.rpc, f"parked{i}") for i in range(parked)]
        time.sleep(1.0)
        before = cpu_seconds(server.pid)
        time.sleep(window_s)
        idle = cpu_seconds(server.pid) - before
        states = [c.lookup(f"w{i}", prompt(i, 1, c.chunk_size)) for i, c in enumerate(clients)]
        # The prefetch deadline (5 s by default) ends these lookups: park WAITs that
        # outlast the window, and measure inside it.
        waiting = [
            threading.Thread(target=c.query, args=(s,), kwargs={"timeout_s": window_s + 1.0})
            for c, s in zip(clients, states, strict=True)
        ]
        for thread in waiting:
            thread.start()
        time.sleep(0.5)
        before = cpu_seconds(server.pid)
        time.sleep(window_s)
        busy = cpu_seconds(server.pid) - before
        for thread in waiting:
            thread.join()
        for c in clients:
            c.close()
    finally:
        server.stop()
    return {"idle_cpu_fraction": idle / window_s, "parked_cpu_fraction": busy / window_s}


def child(args: argparse.Namespace) -> None:
    work = Path(args.work)
    results = {
        "lookup": measure_lookup(work / "lookup", args.lookups),
        "shared": measure_shared_client(
            work / "shared", args.threads, args.per_thread, args.l2_latency_ms
        ),
        "parked": measure_parked(work / "parked", args.parked, args.window_s),
    }
    print(json.dumps(results))


# ----------------------------------------------------------- in the parent


def baseline_tree(revision: str, into: Path) -> Path:
    archive = subprocess.run(
        ["git", "-C", str(REPO), "archive", revision, "src"],
        check=True,
        capture_output=True,
    ).stdout
    with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
        tar.extractall(into, filter="data")
    return into / "src"


def run_child(src: Path, work: Path, argv: list[str]) -> dict[str, Any]:
    env = {**os.environ, "PYTHONPATH": str(src)}
    done = subprocess.run(
        [sys.executable, __file__, "--child", "--work", str(work), *argv],
        env=env,
        capture_output=True,
        text=True,
        check=False,
    )
    if done.returncode != 0:
        raise RuntimeError(f"child for {src} failed:\n{done.stderr[-4000:]}")
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--baseline", default="fc4d860", help="the revision to compare with")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--lookups", type=int, default=500)
    parser.add_argument("--threads", type=int, default=8)
    parser.add_argument("--per-thread", type=int, default=40)
    parser.add_argument("--l2-latency-ms", type=float, default=10.0)
    parser.add_argument("--parked", type=int, default=100)
    parser.add_argument("--window-s", type=float, default=3.0)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--work", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.window_s + 1.0 >= PREFETCH_DEADLINE_S:
        parser.error(f"--window-s must end before the {PREFETCH_DEADLINE_S} s prefetch deadline")
    if args.child:
        child(args)
        return
    argv = [
        "--lookups", str(args.lookups), "--threads", str(args.threads),
        "--per-thread", str(args.per_thread), "--l2-latency-ms", str(args.l2_latency_ms),
        "--parked", str(args.parked), "--window-s", str(args.window_s),
    ]  # fmt: skip
    with tempfile.TemporaryDirectory(prefix="kvtier-seams-") as tmp:
        trees = {"baseline": baseline_tree(args.baseline, Path(tmp) / "baseline"), "this": None}
        trees["this"] = REPO / "src"
        runs: dict[str, list[dict[str, Any]]] = {"baseline": [], "this": []}
        for round_ in range(args.rounds):
            order = list(trees.items())
            for name, src in order if round_ % 2 == 0 else order[::-1]:
                assert src is not None
                runs[name].append(run_child(src, Path(tmp) / f"{name}-{round_}", argv))

    def median(name: str, part: str, field: str) -> float:
        return statistics.median(run[part][field] for run in runs[name])

    results = {
        name: {
            part: {field: median(name, part, field) for field in runs[name][0][part]}
            for part in runs[name][0]
        }
        for name in runs
    }
    for name in runs:  # the spread: round by round
        results[name]["lookup_p50_rounds_s"] = [run["lookup"]["p50_s"] for run in runs[name]]  # type: ignore[assignment]
    results["baseline_revision"] = args.baseline  # type: ignore[assignment]
    b, t = results["baseline"], results["this"]
    rows = [
        (
            "lookup p50 (LOOKUP, WAIT; 128 chunks in L1)",
            f"{t['lookup']['p50_s'] * 1e3:.3f} ms vs {b['lookup']['p50_s'] * 1e3:.3f} ms "
            f"({t['lookup']['p50_s'] / b['lookup']['p50_s']:.2f}x)",
        ),
        (
            "  round by round (this, baseline)",
            ", ".join(
                f"{x * 1e3:.2f}/{y * 1e3:.2f}"
                for x, y in zip(t["lookup_p50_rounds_s"], b["lookup_p50_rounds_s"], strict=True)
            ),
        ),
        (
            "lookup p99",
            f"{t['lookup']['p99_s'] * 1e3:.3f} ms vs {b['lookup']['p99_s'] * 1e3:.3f} ms",
        ),
        (
            "lookup p50 pipelined",
            f"{t['lookup']['pipelined_p50_s'] * 1e3:.3f} ms vs "
            f"{b['lookup']['pipelined_p50_s'] * 1e3:.3f} ms",
        ),
        (
            f"{args.threads} threads on one client, lookups/s",
            f"{t['shared']['threads_per_s']:.0f} vs {b['shared']['threads_per_s']:.0f} "
            f"(1 thread: {t['shared']['one_thread_per_s']:.0f} vs "
            f"{b['shared']['one_thread_per_s']:.0f})",
        ),
        ("peak requests in flight on the shared client", f"{t['shared']['peak_in_flight']:.0f}"),
        (
            f"server CPU, {args.parked} WAITs parked",
            f"{t['parked']['parked_cpu_fraction']:.1%} vs {b['parked']['parked_cpu_fraction']:.1%}"
            f" of a core (idle: {t['parked']['idle_cpu_fraction']:.1%} vs "
            f"{b['parked']['idle_cpu_fraction']:.1%})",
        ),
    ]
    report(f"client/server seam: this tree vs {args.baseline} (medians of {args.rounds})", rows,
           results)  # fmt: skip


if __name__ == "__main__":
    main()
