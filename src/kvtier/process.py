"""Run ``kvtier serve`` as a child process: start it, read its ready line,
stop it by PID.

``ServerProcess.start(args)`` launches ``python -m kvtier serve ARGS
--stop-with-stdin``, waits for the ready line ``serve()`` prints and parses
the addresses from it. ``stop()`` sends SIGTERM (or the signal given), waits
until a deadline, then SIGKILLs; a shared-memory arena left by a killed
server is removed. The child's stdin is a pipe this process holds and never
writes: if this process dies without stopping it (SIGKILL, a SIGTERM it does
not handle), the pipe ends and the server stops by itself, arena and all,
instead of holding its L1 memory for nobody. Used by ``kvtier demo``, the
benchmarks and the tests.

``GroupProcess`` is the same promise for third-party servers (vLLM,
LMCache), which cannot be told to watch a pipe: each runs in a session of
its own, and a reaper (``kvtier.reaper``) stops its process group if this
process dies without stopping it.
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from kvtier.reaper import release, start_reaper

READY = re.compile(
    r"kvtier serve: rpc (?P<rpc>tcp://[^:\s]+:(?P<port>\d+)) "
    r"http (?P<http>\S+) boot (?P<boot>[0-9a-f]+) "
    r"l1 .+ arena (?P<arena>kvtier-\d+-[0-9a-f]+) l2 (?P<l2>\S+) "
    r"events (?P<events>off|(?P<pub>\S+) replay (?P<replay>\S+))"
)
START_TIMEOUT_S = 20.0
STOP_TIMEOUT_S = 10.0
GROUP_EXIT_S = 5.0  # a stopped server's group may take this long to exit on its own


def read_line(stream: IO[str], timeout_s: float) -> str | None:
    """One line from a pipe, or None if none came within the timeout."""
    lines: queue.Queue[str] = queue.Queue()
    threading.Thread(target=lambda: lines.put(stream.readline()), daemon=True).start()
    try:
        return lines.get(timeout=timeout_s)
    except queue.Empty:
        return None


def stop_process(proc: subprocess.Popen[Any], sig: int, timeout_s: float = STOP_TIMEOUT_S) -> int:
    """Signal by PID, wait until the deadline, then SIGKILL; return the exit status."""
    if proc.poll() is None:
        os.kill(proc.pid, sig)
        try:
            proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait()
    return proc.returncode


def clean_env(extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """This environment without KVTIER_* settings (they override flags and files)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVTIER_")}
    env["PYTHONUNBUFFERED"] = "1"
    env.update(extra or {})
    return env


@dataclass(eq=False)
class GroupProcess:
    """A third-party server (vLLM, LMCache) started in a session of its own,
    so that its children are in its process group, with a reaper
    (``kvtier.reaper``) that stops that group should this process die
    without stopping it."""

    proc: subprocess.Popen[bytes]
    reaper: subprocess.Popen[bytes]

    @classmethod
    def start(cls, command: Sequence[str], log_path: Path, env: Mapping[str, str]) -> GroupProcess:
        """Start ``command`` with stdout and stderr to ``log_path``."""
        with log_path.open("w") as out:
            proc = subprocess.Popen(
                command, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True
            )
        return cls(proc, start_reaper("killpg", str(proc.pid)))

    @property
    def pid(self) -> int:
        return self.proc.pid

    def stop(self, timeout_s: float) -> None:
        """SIGTERM with a deadline, then SIGKILL what is left of the group once
        it had ``GROUP_EXIT_S`` to exit on its own: a child that outlives its
        parent a moment (Python's resource tracker, which unlinks the named
        semaphores in ``/dev/shm`` the others leave) is not killed mid-way."""
        stop_process(self.proc, signal.SIGTERM, timeout_s=timeout_s)
        deadline = time.monotonic() + GROUP_EXIT_S
        with contextlib.suppress(ProcessLookupError, PermissionError):
            while time.monotonic() < deadline:
                os.killpg(self.proc.pid, 0)  # ProcessLookupError: the group is gone
                time.sleep(0.05)
            os.killpg(self.proc.pid, signal.SIGKILL)
        release(self.reaper)


@dataclass(eq=False)
class ServerProcess:
    """One running ``kvtier serve`` and what its ready line said."""

    proc: subprocess.Popen[str]
    args: list[str]
    log_path: Path
    rpc: str
    port: int
    http: str
    boot_id: str
    arena: str
    l2: str
    events: str = ""  # the KV-event PUB endpoint; "" when off
    events_replay: str = ""  # its replay endpoint; "" when off or none
    shm_dir: Path = Path("/dev/shm")

    @classmethod
    def start(
        cls,
        args: Sequence[str],
        log_path: Path,
        *,
        cwd: Path | None = None,
        env: Mapping[str, str] | None = None,
        timeout_s: float = START_TIMEOUT_S,
        shm_dir: Path = Path("/dev/shm"),
    ) -> ServerProcess:
        """Start ``kvtier serve ARGS`` (stderr to ``log_path``) and wait for its
        ready line; RuntimeError with the log if it does not come."""
        command = [sys.executable, "-m", "kvtier", "serve", *args, "--stop-with-stdin"]
        with log_path.open("w") as log_file:
            proc = subprocess.Popen(
                command,
                stdout=subprocess.PIPE,
                stderr=log_file,
                stdin=subprocess.PIPE,  # held, never written: it ends when this process does
                text=True,
                cwd=cwd,
                env=clean_env(env),
            )
        try:
            assert proc.stdout is not None
            line = read_line(proc.stdout, timeout_s)
            match = READY.fullmatch(line.strip()) if line else None
            if match is None:
                raise RuntimeError(
                    f"kvtier serve did not become ready (exit status {proc.poll()}); "
                    f"stdout {line!r}; log:\n{log_path.read_text(errors='replace')}"
                )
        except BaseException:
            stop_process(proc, signal.SIGKILL)
            raise
        return cls(
            proc,
            command,
            log_path,
            match["rpc"],
            int(match["port"]),
            match["http"],
            match["boot"],
            match["arena"],
            match["l2"],
            match["pub"] or "",
            "" if match["replay"] in (None, "none") else match["replay"],
            shm_dir,
        )

    @property
    def pid(self) -> int:
        return self.proc.pid

    @property
    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def status_json(self, token: str = "") -> dict[str, Any]:
        """The admin port's ``/status`` (a snapshot the server refreshes every tick)."""
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        request = urllib.request.Request(self.http + "/status", headers=headers)
        with urllib.request.urlopen(request, timeout=10) as response:
            status: dict[str, Any] = json.loads(response.read())
        return status

    def stop(self, sig: int = signal.SIGTERM, timeout_s: float = STOP_TIMEOUT_S) -> int:
        """Stop by PID; return the exit status. A killed server's arena is removed."""
        code = stop_process(self.proc, sig, timeout_s)
        for stream in (self.proc.stdin, self.proc.stdout):
            if stream is not None:
                stream.close()
        if code != 0:
            (self.shm_dir / self.arena).unlink(missing_ok=True)
        return code

    def __enter__(self) -> ServerProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
