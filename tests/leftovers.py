"""What a test run left behind: processes, shared-memory files, temporary directories.

    python -m tests.leftovers --save BEFORE.json   # before the run: what is there already
    python -m tests.leftovers BEFORE.json          # after it: exit 1, listing what is new

After the run it lists, of what was not there before (everything, with no
file), this user's processes that look like the suite's (kvtier servers, peers
and reapers, vLLM and its engine processes, the backend servers and browser
the tests start), every file in ``/dev/shm`` (kvtier arenas, vLLM's
``psm_*`` segments, semaphores) and every entry of the temporary directory
but pytest's own (``pytest-of-USER``, which pytest prunes itself). A leftover
process is listed as found, never stopped: who started it is the bug.
"""

from __future__ import annotations

import argparse
import getpass
import json
import os
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

SHM = Path("/dev/shm")
# Command-line words of the processes a test run starts.
SUITE_WORDS = (
    "kvtier",
    "tests.integration",
    "vllm",
    "VLLM::",
    "multiprocessing.resource_tracker",
    "redis-server",
    "valkey-server",
    "weed",
    "mooncake",
    "chromedriver",
    "chromium",
)


def processes() -> Iterator[tuple[int, str]]:
    """This user's processes with a suite word in their command line (not this
    one nor its ancestors: the shell that runs the suite may have "kvtier" in
    its path): PID and command line."""
    mine = os.getuid()
    skip = ancestors(os.getpid())
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) in skip:
            continue
        try:
            if entry.stat().st_uid != mine or state(int(entry.name)) == "Z":
                continue
            command = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:  # it ended meanwhile
            continue
        if any(word in command for word in SUITE_WORDS):
            yield int(entry.name), command.strip()


def state(pid: int) -> str:
    """The process's state letter (``Z``: ended, not yet reaped)."""
    return Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0]


def ancestors(pid: int) -> set[int]:
    """``pid`` and every process above it."""
    found = {pid}
    while pid > 1:
        try:
            pid = int(Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[1])
        except OSError:
            break
        found.add(pid)
    return found


def shared_memory() -> list[str]:
    return sorted(p.name for p in SHM.iterdir()) if SHM.is_dir() else []


def temporary() -> list[str]:
    """Entries of the temporary directory, but pytest's own base directory."""
    pytest_own = f"pytest-of-{getpass.getuser()}"
    root = Path(tempfile.gettempdir())
    return sorted(p.name for p in root.iterdir() if not p.name.startswith(pytest_own))


def snapshot() -> dict[str, list[str]]:
    return {
        "processes": [str(pid) for pid, _ in processes()],
        "shm": shared_memory(),
        "tmp": temporary(),
    }


def leftovers(before: dict[str, list[str]]) -> list[str]:
    """What is there now and was not ``before``, a line each."""
    lines = [
        f"process {pid}: {' '.join(command.split())[:200]}"
        for pid, command in processes()
        if str(pid) not in before.get("processes", ())
    ]
    lines += [f"{SHM / n}" for n in shared_memory() if n not in before.get("shm", ())]
    tmp = Path(tempfile.gettempdir())
    lines += [f"{tmp / n}" for n in temporary() if n not in before.get("tmp", ())]
    return lines


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("before", nargs="?", type=Path, help="a --save file from before the run")
    parser.add_argument("--save", type=Path, help="write what is there now to this file")
    args = parser.parse_args()
    if args.save:
        now = snapshot()
        now["tmp"].append(args.save.name)  # itself, should it be written there
        args.save.write_text(json.dumps(now))
        return 0
    before = json.loads(args.before.read_text()) if args.before else {}
    left = leftovers(before)
    for line in left:
        print(f"left behind: {line}", file=sys.stderr)
    return 1 if left else 0


if __name__ == "__main__":
    sys.exit(main())
