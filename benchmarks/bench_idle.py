"""``kvtier serve`` at rest: its threads, and how often each wakes.

Starts ``python -m kvtier serve --port 0 --http-port 0`` (with a small L1 and
an fs L2 in a temporary directory), waits for its ready line and for
``/healthz``, lets it settle, then for ``--seconds`` reads every thread's
``voluntary_ctxt_switches + nonvoluntary_ctxt_switches`` from
``/proc/PID/task/*/status``: threads at rest, and wake-ups per second per
thread and in all. Then stops the server by its PID.

Two configurations, so that every upkeep job runs:

- ``default``: the command above;
- ``upkeep``: also KV events (a PUB and a replay endpoint) and a tenants file
  whose tenant has a retention and an fs quota (retention sweeps, L2 usage
  counts).

The same run measures ``--baseline`` (``git archive`` of that revision's
``src``) and this tree, one after the other, each in a fresh server.

Python 3.11 does not name its OS threads (``/proc`` shows ``python``), so the
server runs under a small launcher that sets each thread's OS name from its
``threading`` name (``prctl(PR_SET_NAME)`` as the thread starts); threads
libzmq starts name themselves (``ZMQbg/...``); ``python`` is what numpy's
OpenBLAS starts as it loads (one per core but one; the server does no BLAS).

    python benchmarks/bench_idle.py [--seconds 10] [--baseline 7c77821]
"""

from __future__ import annotations

import argparse
import io
import os
import re
import signal
import subprocess
import sys
import tarfile
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

from common import report

REPO = Path(__file__).resolve().parents[1]
READY = re.compile(r"kvtier serve: rpc \S+ http (?P<http>\S+) ")
START_TIMEOUT_S = 30.0
LAUNCHER = """
import ctypes, runpy, sys, threading
_prctl = ctypes.CDLL(None, use_errno=True).prctl
def _name(name):
    _prctl(15, name.encode()[:15])  # PR_SET_NAME: the calling thread's name in /proc
_run = threading.Thread.run
def run(self):
    _name(self.name)
    _run(self)
threading.Thread.run = run
import numpy  # numpy's OpenBLAS starts its threads now: they keep the name "python"
_name("main")
sys.argv = ["kvtier", *sys.argv[1:]]
runpy.run_module("kvtier", run_name="__main__", alter_sys=True)
"""
TENANTS = """
[[tenant]]
name = "acme"
token_sha256 = ["{digest}"]
salts = ["acme"]
admin = true
retention_s = 86400
[tenant.quota]
l2_bytes = {{ fs = "1GiB" }}
"""


def server_args(config: str, work: Path) -> list[str]:
    args = ["serve", "--port", "0", "--http-port", "0", "--l1-size", "64MiB"]
    args += ["--cache-dir", str(work / "l2")]
    if config == "upkeep":
        digest = "0" * 64  # no client connects: any digest will do
        (work / "tenants.toml").write_text(TENANTS.format(digest=digest))
        args += ["--tenants-file", str(work / "tenants.toml")]
        args += ["--set", "events.endpoint=tcp://127.0.0.1:0"]
        args += ["--set", "events.replay_endpoint=tcp://127.0.0.1:0"]
    return [*args, "--stop-with-stdin"]


def threads(pid: int) -> dict[int, tuple[str, int]]:
    """Thread id -> (name, context switches so far)."""
    out = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            status = (task / "status").read_text()
        except FileNotFoundError:  # it ended while we looked
            continue
        fields = dict(line.split(":\t", 1) for line in status.splitlines() if ":\t" in line)
        switches = int(fields["voluntary_ctxt_switches"]) + int(
            fields["nonvoluntary_ctxt_switches"]
        )
        out[int(task.name)] = (fields["Name"].strip(), switches)
    return out


def wait_ready(proc: subprocess.Popen[str], log: Path) -> str:
    """The admin address from the ready line, once ``/healthz`` answers."""
    assert proc.stdout is not None
    line = proc.stdout.readline()  # the server prints it, or exits
    match = READY.match(line)
    if match is None:
        raise RuntimeError(f"kvtier serve did not start: {line!r}\n{log.read_text()[-4000:]}")
    deadline = time.monotonic() + START_TIMEOUT_S
    while True:
        try:
            with urllib.request.urlopen(match["http"] + "/healthz", timeout=5) as response:
                response.read()
            return match["http"]
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)


def measure(src: Path, config: str, work: Path, seconds: float, settle: float) -> dict[str, Any]:
    """Threads at rest and wake-ups per second of one fresh server."""
    work.mkdir(parents=True)
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVTIER_")}
    env["PYTHONPATH"] = str(src)
    log = work / "serve.log"
    with log.open("w") as err:
        proc = subprocess.Popen(
            [sys.executable, "-c", LAUNCHER, *server_args(config, work)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=err,
            text=True,
            env=env,
        )
    try:
        wait_ready(proc, log)
        time.sleep(settle)  # start-up work (L1 prefault, first refreshes) ends
        before, started = threads(proc.pid), time.monotonic()
        time.sleep(seconds)
        after, elapsed = threads(proc.pid), time.monotonic() - started
    finally:
        os.kill(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait()
    rows = []
    for tid, (name, switches) in sorted(after.items()):
        start = before.get(tid, (name, 0))[1]
        rows.append({"tid": tid, "name": name, "wakes_s": (switches - start) / elapsed})
    rows.sort(key=lambda r: -r["wakes_s"])
    return {
        "threads": len(after),
        "wakes_s": sum(r["wakes_s"] for r in rows),
        "per_thread": rows,
        "exit_status": proc.returncode,
    }


def baseline_tree(revision: str, into: Path) -> Path:
    archive = subprocess.run(
        ["git", "-C", str(REPO), "archive", revision, "src"], check=True, capture_output=True
    ).stdout
    with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
        tar.extractall(into, filter="data")
    return into / "src"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=10.0, help="the measured window")
    parser.add_argument("--settle", type=float, default=2.0, help="rest before the window")
    parser.add_argument("--baseline", default="7c77821", help="the revision to compare with")
    parser.add_argument(
        "--trees", default="baseline,this", help="which to measure: baseline, this, or both"
    )
    args = parser.parse_args()
    if args.seconds <= 0 or args.settle < 0:
        parser.error("--seconds must be > 0 and --settle >= 0")
    wanted = args.trees.split(",")
    if not wanted or not set(wanted) <= {"baseline", "this"}:
        parser.error(f"--trees takes baseline, this or baseline,this; got {args.trees!r}")
    results: dict[str, Any] = {"seconds": args.seconds}
    rows: list[tuple[str, str]] = []
    with tempfile.TemporaryDirectory(prefix="kvtier-idle-") as tmp:
        trees = {}
        if "baseline" in wanted:
            trees["baseline"] = baseline_tree(args.baseline, Path(tmp) / "baseline")
            results["baseline_revision"] = args.baseline
        if "this" in wanted:
            trees["this"] = REPO / "src"
        for name, src in trees.items():
            for config in ("default", "upkeep"):
                work = Path(tmp) / f"{name}-{config}"
                run = measure(src, config, work, args.seconds, args.settle)
                results[f"{name}.{config}"] = run
                rows.append(
                    (
                        f"{name} {config}",
                        f"{run['threads']} threads, {run['wakes_s']:.1f} wakes/s in all",
                    )
                )
                for thread in run["per_thread"]:
                    rows.append((f"    {thread['name']}", f"{thread['wakes_s']:.1f} wakes/s"))
    report(f"kvtier serve at rest ({args.seconds:g} s window)", rows, results)


if __name__ == "__main__":
    main()
