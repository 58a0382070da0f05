"""The stores a benchmark (or a test) runs for kvtier's remote tier, on 127.0.0.1.

``RedisProcess.start(binary, log)`` runs ``redis-server`` (or Valkey's
``valkey-server``) on a free port with no persistence and waits until it
answers PING; ``MooncakeProcess.start(binaries, log_dir)`` runs a Mooncake
master and a client that lends the pool its memory. ``stop()``/``kill()``/
``restart()`` act on the processes by PID; a restarted store is empty.
"""

from __future__ import annotations

import shutil
import signal
import socket
import subprocess
import sysconfig
import time
from dataclasses import dataclass, field
from pathlib import Path

from kvtier.process import stop_process

_HANDED_OUT: set[int] = set()  # ports free_port gave this process


def free_port() -> int:
    """A port nothing listens on now that this process was not given before:
    a server given a port may not listen on it yet, and the system may offer
    the same port again."""
    for _ in range(100):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port: int = s.getsockname()[1]
        if port not in _HANDED_OUT:
            _HANDED_OUT.add(port)
            return port
    raise RuntimeError("no free port that this process was not given before")


def installed_binary(name: str) -> str | None:
    """``name`` on PATH, else among this Python's scripts (a server binary a pip
    package installed into a virtualenv that is not activated)."""
    return shutil.which(name) or shutil.which(name, path=sysconfig.get_path("scripts"))


def redis_binary() -> str | None:
    return installed_binary("redis-server")


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
    extra: list[str] = field(default_factory=list)  # more server flags
    proc: subprocess.Popen[bytes] | None = None

    @classmethod
    def start(
        cls, binary: str, log: Path, port: int | None = None, extra: list[str] | None = None
    ) -> RedisProcess:
        server = cls(binary, port or free_port(), log, extra or [])
        server.launch()
        return server

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def spec(self, **options: object) -> dict[str, object]:
        """A ``redis`` adapter spec for this server."""
        return {"type": "redis", "url": self.url, **options}

    @property
    def pids(self) -> list[int]:
        return [self.proc.pid] if self.proc is not None else []

    def launch(self) -> None:
        args = [self.binary, "--port", str(self.port), "--bind", "127.0.0.1"]
        args += ["--save", "", "--appendonly", "no", "--protected-mode", "yes", *self.extra]
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


# ------------------------------------------------------------------ Mooncake


def mooncake_binaries() -> tuple[str, str] | None:
    master, holder = installed_binary("mooncake_master"), installed_binary("mooncake_client")
    return (master, holder) if master and holder else None


@dataclass(eq=False)
class MooncakeProcess:
    """``mooncake_master`` and a ``mooncake_client`` that lends the pool its
    memory (``segment``, 512 MB by default), both on 127.0.0.1, TCP, P2P handshake."""

    binaries: tuple[str, str]
    log_dir: Path
    master_port: int = 0
    segment: str = "512MB"
    lease_ttl_ms: int = 200  # short, so a read lease soon stops blocking removes
    master: subprocess.Popen[bytes] | None = None
    holder: subprocess.Popen[bytes] | None = None

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.master_port}"

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in (self.master, self.holder) if p is not None]

    def spec(self, **options: object) -> dict[str, object]:
        return {"type": "mooncake", "master": self.address, **options}

    @classmethod
    def start(
        cls,
        binaries: tuple[str, str],
        log_dir: Path,
        segment: str = "512MB",
        lease_ttl_ms: int = 200,
    ) -> MooncakeProcess:
        server = cls(binaries, log_dir, free_port(), segment, lease_ttl_ms)
        server.launch()
        return server

    def launch(self) -> None:
        master, holder = self.binaries
        args = [master, "--rpc_address=127.0.0.1", f"--rpc_port={self.master_port}"]
        args += ["--metrics_host=127.0.0.1", f"--metrics_port={free_port()}"]
        args += [f"--default_kv_lease_ttl={self.lease_ttl_ms}"]
        with (self.log_dir / "master.log").open("a") as out:
            self.master = subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 10
        while not _listening(self.master_port):
            if self.master.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"mooncake_master did not start (see {self.log_dir})")
            time.sleep(0.02)
        args = [holder, "--host=127.0.0.1", f"--port={free_port()}"]
        args += [f"--master_server_address={self.address}", "--metadata_server=P2PHANDSHAKE"]
        args += [f"--global_segment_size={self.segment}", "--protocol=tcp"]
        with (self.log_dir / "holder.log").open("a") as out:
            self.holder = subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT)
        time.sleep(1.0)  # the holder mounts its segment with the master
        if self.holder.poll() is not None:
            raise RuntimeError(f"mooncake_client exited (see {self.log_dir})")

    def stop(self, sig: int = signal.SIGTERM) -> None:
        for proc in (self.holder, self.master):
            if proc is not None:
                stop_process(proc, sig, timeout_s=10)

    def kill(self) -> None:
        self.stop(signal.SIGKILL)

    def restart(self) -> None:
        """A fresh, empty pool on the same master port."""
        self.kill()
        self.launch()


def _listening(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.2):
            return True
    except OSError:
        return False
