"""The leftover checker (``tests.leftovers``): what appears after its
snapshot (a process of the suite's kind, a /dev/shm file, a temporary
directory) is listed; what is gone again is not. (Only this test's own
things are looked for: other tests may start servers meanwhile.)"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import uuid
from pathlib import Path

from kvtier.process import stop_process
from tests import leftovers

NAME = f"kvtier-leftover-test-{uuid.uuid4().hex[:8]}"  # this run's: /tmp may be shared


def test_what_a_run_leaves_is_listed_and_what_it_cleans_is_not() -> None:
    before = leftovers.snapshot()
    segment = leftovers.SHM / NAME
    directory = Path(tempfile.gettempdir()) / NAME
    # A process whose command line names kvtier, as a forgotten server's would.
    proc = subprocess.Popen(
        [sys.executable, "-c", "import sys; sys.stdin.read()", NAME], stdin=subprocess.PIPE
    )
    try:
        segment.write_bytes(b"")
        directory.mkdir()
        assert mine(leftovers.leftovers(before)) == [
            f"process {proc.pid}",
            f"{segment}",
            f"{directory}",
        ]
    finally:
        stop_process(proc, signal.SIGKILL)
        segment.unlink(missing_ok=True)
        directory.rmdir()
    assert mine(leftovers.leftovers(before)) == []
    assert os.getpid() not in {pid for pid, _ in leftovers.processes()}  # never itself


def mine(lines: list[str]) -> list[str]:
    """The lines about this test's things (named after it), up to the colon."""
    return [line.split(":")[0] for line in lines if NAME in line]
