"""A live ``kvtier route`` over stand-in engines, for the tests that need
one (``test_fuzz_router``) and the robustness harness's router faults.

The router runs as its own process and stops when its stdin closes (or on
SIGTERM); the stand-in engines (``tests.unit.router.standin``) run on an
event loop on a thread of this process, where the faults can reach them:
``Engines.silence`` makes one accept and answer nothing (not even
``/health``) until ``Engines.release``; ``Engines.stall`` makes one wait
before its first byte while ``/health`` answers (busy, not gone).
"""

from __future__ import annotations

import asyncio
import http.client
import json
import signal
import subprocess
import sys
import threading
from collections.abc import Coroutine, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar
from urllib.parse import urlsplit

from kvtier.process import read_line, stop_process
from tests.unit.router.standin import StandIn

T = TypeVar("T")

# The router as a child that stops when this process goes (its stdin closes).
CHILD = """
import asyncio, sys, threading
from kvtier.router.config import load_router_config
from kvtier.router.main import serve

async def main() -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    def watch() -> None:
        sys.stdin.read()
        loop.call_soon_threadsafe(stop.set)
    threading.Thread(target=watch, daemon=True).start()
    await serve(load_router_config({}, sys.argv[1]), stop)

asyncio.run(main())
"""


class Engines:
    """Stand-in engines served by an event loop on a thread of this process."""

    def __init__(self, engines: list[StandIn]) -> None:
        self.engines = engines
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        for engine in engines:
            self.call(engine.start())

    def call(self, coroutine: Coroutine[Any, Any, T]) -> T:
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop).result(60)

    def silence(self, engine: StandIn) -> None:
        """From now on ``engine`` accepts and answers nothing."""
        self.loop.call_soon_threadsafe(setattr, engine, "silent", True)

    def release(self, engine: StandIn) -> None:
        """``engine`` answers again; what it held while silent ends (503)."""

        async def unsilence() -> None:
            engine.silent = False
            engine.released.set()
            engine.released = asyncio.Event()

        self.call(unsilence())

    def stall(self, engine: StandIn, stall_s: float) -> None:
        """``engine`` waits ``stall_s`` before each answer's first byte (0: none)."""
        self.loop.call_soon_threadsafe(setattr, engine, "stall_s", stall_s)

    def close(self) -> None:
        for engine in self.engines:
            self.call(engine.stop())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


@dataclass
class Router:
    proc: subprocess.Popen[str]
    url: str
    log_path: Path
    operator_token: str

    @property
    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def status(self) -> dict[str, Any]:
        headers = {"Authorization": f"Bearer {self.operator_token}"}
        code, data = request(self.url, "GET", "/status", headers)
        assert code == 200, data
        return json.loads(data)  # type: ignore[no-any-return]

    def rss_bytes(self) -> int:
        for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
        raise AssertionError("no VmRSS in /proc status")


def request(
    url: str,
    method: str,
    path: str,
    headers: dict[str, str],
    body: bytes = b"",
    timeout_s: float = 60.0,
) -> tuple[int, bytes]:
    parts = urlsplit(url)
    connection = http.client.HTTPConnection(parts.hostname, parts.port, timeout=timeout_s)
    try:
        connection.request(method, path, body=body or None, headers=headers)
        response = connection.getresponse()
        return response.status, response.read()
    finally:
        connection.close()


def route_toml(engines: Engines, options: Sequence[str], tenants: Sequence[str]) -> str:
    """A ``kvtier route`` config: the top-level ``options`` (TOML lines), an
    ``[[engines]]`` table per stand-in and the ``tenants`` tables (TOML)."""
    lines = list(options)
    for engine in engines.engines:
        lines += ["[[engines]]", f'name = "{engine.name}"', f'url = "{engine.url}"']
    return "\n".join([*lines, *tenants]) + "\n"


@contextmanager
def running_router(config: Path, log_path: Path, operator_token: str) -> Iterator[Router]:
    """``kvtier route --config config`` in a child process, until the block ends."""
    with log_path.open("w") as log:
        proc = subprocess.Popen(
            [sys.executable, "-c", CHILD, str(config)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=log,
            text=True,
        )
    try:
        assert proc.stdout is not None
        line = read_line(proc.stdout, 60.0) or ""
        assert line.startswith("kvtier route: http://"), (line, log_path.read_text())
        yield Router(proc, line.split()[2], log_path, operator_token)
    finally:
        stop_process(proc, signal.SIGTERM)
        for stream in (proc.stdin, proc.stdout):
            if stream is not None:
                stream.close()
