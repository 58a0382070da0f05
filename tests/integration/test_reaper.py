"""A third-party server (vLLM, LMCache) started by kvtier's tools outlives
nothing: ``GroupProcess`` pairs it with a reaper (``kvtier.reaper``) that
stops its process group when the tool dies without stopping it."""

from __future__ import annotations

import signal
from pathlib import Path

import pytest

from kvtier.process import GroupProcess, clean_env
from kvtier.reaper import start_reaper
from tests.integration.harness import doomed_parent, running, wait_for

# A tool that starts a "server" (a shell and its sleeping child, one group) and
# never stops it: it prints the pids and waits to be killed.
TOOL = """
import sys, time
from pathlib import Path
from kvtier.process import GroupProcess, clean_env
server = GroupProcess.start(["sh", "-c", "sleep 600 & wait"], Path(sys.argv[1]), clean_env())
children_of = Path(f"/proc/{server.pid}/task/{server.pid}/children")
deadline = time.monotonic() + 30
while not (children := children_of.read_text().split()) and time.monotonic() < deadline:
    time.sleep(0.05)  # until the shell has started its child
print(server.pid, server.reaper.pid, *children, flush=True)
time.sleep(600)
"""


def test_a_server_group_whose_tool_dies_is_stopped_by_its_reaper(tmp_path: Path) -> None:
    with doomed_parent(TOOL, tmp_path / "server.log") as (tool, words):
        server, reaper, *children = (int(word) for word in words)
        assert children and all(running(pid) for pid in (server, reaper, *children))
        tool.send_signal(signal.SIGKILL)  # by PID: no clean-up of its own
        tool.wait()
        for pid in (server, *children, reaper):  # the whole group, then the reaper itself
            assert wait_for(lambda pid=pid: running(pid), lambda up: not up) is False


def test_a_server_group_stopped_by_its_tool_leaves_the_reaper_nothing_to_do(
    tmp_path: Path,
) -> None:
    server = GroupProcess.start(["sleep", "600"], tmp_path / "server.log", clean_env())
    server.stop(timeout_s=5)
    assert server.proc.returncode == -signal.SIGTERM
    assert server.reaper.returncode == 0 and not running(server.pid)


def test_a_reaper_takes_only_its_actions() -> None:
    with pytest.raises(ValueError, match="reaper action must be one of"):
        start_reaper("rm -rf", "/")
