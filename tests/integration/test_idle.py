"""``kvtier serve`` at rest: its upkeep runs on the loop's one clock, so the
process holds few threads (counted from ``/proc``), and the upkeep still
runs (the dashboard's samples come from it). How often each thread wakes is
measured by ``benchmarks/bench_idle.py``, not asserted here."""

from __future__ import annotations

import json
from pathlib import Path

from kvtier.commands.admin import call
from kvtier.tenancy.tenants import token_digest
from tests.integration.harness import Server, ServerFactory, wait_for

# The loop, the store and prefetch controllers, libzmq's two and, with KV
# events on, the publisher. (numpy's OpenBLAS would start a thread per core
# but one as it loads; ``kvtier serve`` tells it to start none.)
IDLE_THREADS = 6
TENANTS = f"""
[[tenant]]
name = "ops"
token_sha256 = ["{token_digest("ops-token")}"]
salts = ["ops"]
admin = true
retention_s = 86400
[tenant.quota]
l2_bytes = {{ fs = "1GiB" }}
"""


def threads(server: Server) -> list[str]:
    """The name of each thread of the server's process."""
    tasks = Path(f"/proc/{server.pid}/task").iterdir()
    return sorted((task / "comm").read_text().strip() for task in tasks)


def test_a_server_at_rest_holds_at_most_six_threads(kvtier_server: ServerFactory) -> None:
    server = kvtier_server.start()
    assert server.http_get("/healthz") == (200, b"ok\n")  # the loop accepts it
    code, body = server.http_get("/clear", method="POST")  # a write, run on the loop
    assert code == 200 and json.loads(body) == {"cleared": 0}
    names = wait_for(lambda: threads(server), lambda names: len(names) <= IDLE_THREADS)
    assert len(names) <= IDLE_THREADS, names


def test_with_every_upkeep_job_on_it_still_holds_at_most_six(
    kvtier_server: ServerFactory, tmp_path: Path
) -> None:
    """KV events on, a tenant with a retention and an fs quota (retention
    sweeps and usage counts are scheduled): the publisher's thread is the
    only one more."""
    path = tmp_path / "tenants.toml"
    path.write_text(TENANTS)
    server = kvtier_server.start(
        "--tenants-file", str(path),
        "--set", "events.endpoint=tcp://127.0.0.1:0",
        "--set", "events.replay_endpoint=tcp://127.0.0.1:0",
    )  # fmt: skip
    names = wait_for(lambda: threads(server), lambda names: len(names) <= IDLE_THREADS)
    assert len(names) <= IDLE_THREADS, names

    def series() -> list[float]:
        answer = call(server.http, "ops-token", "GET", "/admin/dashboard")
        times: list[float] = answer["series"]["t"]
        return times

    # Two samples make the first interval: the clock ran the dashboard's job twice.
    assert wait_for(series, bool, timeout_s=20.0)
