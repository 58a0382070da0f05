"""The processes a robustness run works against: a real ``kvtier serve``
with an fs L2 (on a small tmpfs of its own where this machine lets us mount
one, so that the disk can be filled) and a real Redis L2 reached through a
``TcpProxy``, with two tenants and a cluster secret; and a real
``kvtier route`` in front of two stand-in engines (``routing.RouterLeg``).

``plant`` starts the server with a defect planted by a ``sitecustomize``
module (a test of the checker: the run must find it):

- ``skip-checksum``: the fs and Redis readers take any payload;
- ``double-handoff``: a hand-off taken by another consumer is granted again;
- ``unbounded-tables``: the tables keyed by namespaces never fold a row.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import subprocess
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvtier.commands.admin import call
from tests.integration.harness import ROOT, Server, ServerFactory, tenants_toml, wait_for
from tests.robustness.proxy import TcpProxy
from tests.robustness.routing import RouterLeg
from tests.servers import RedisProcess, redis_binary

TMPFS_BYTES = 32 << 20
L1_SIZE = "2MiB"  # smaller than the traffic's objects: reads load from L2 too
SECRET = "robustness-0123456789abcdef-0123"
TOKENS = {"acme": "acme-token", "globex": "globex-token"}
ADMIN_TOKEN = "ops-token"
CLIENT_TTL_S = 2.0  # a killed client's locks and reservations are freed after this
TIMEOUT_S = 2.0  # the cache server's Redis timeout and its lookups' L2 deadline
NAMESPACE_ROWS = 16  # limits.max_namespace_rows: the flood of names folds past it

PLANTS = {
    "skip-checksum": (
        "import kvtier.l2.fs, kvtier.l2.stored_value\n"
        "kvtier.l2.fs.verify_payload = lambda *args, **kwargs: None\n"
        "kvtier.l2.stored_value.verify_payload = lambda *args, **kwargs: None\n"
        "kvtier.l2.stored_value.verify_stored = lambda *args, **kwargs: None\n"
    ),
    "double-handoff": (
        "from kvtier.protocol.handoff import HandoffOutcome\n"
        "from kvtier.server.handoff.table import HandoffTable\n"
        "_take = HandoffTable.take\n"
        "def take(self, *args, **kwargs):\n"
        "    outcome, why = _take(self, *args, **kwargs)\n"
        "    if outcome is HandoffOutcome.TAKEN:\n"
        "        return HandoffOutcome.GRANTED, ''\n"
        "    return outcome, why\n"
        "HandoffTable.take = take\n"
    ),
    "unbounded-tables": (
        "from kvtier.tenancy.folding import FoldingTable\n"
        "FoldingTable.full = lambda self, tenant: False\n"
        "FoldingTable._make_room = lambda self, tenant, rows: None\n"
    ),
}


@dataclass(eq=False)
class Cluster:
    root: Path
    factory: ServerFactory
    redis: RedisProcess
    proxy: TcpProxy
    fs_dir: Path
    mounted: bool
    env: dict[str, str]
    args: list[str]
    server: Server
    router: RouterLeg
    tally: Counter[str] = field(default_factory=Counter)

    @classmethod
    def start(cls, root: Path, plant: str = "") -> Cluster:
        binary = redis_binary()
        if binary is None:
            raise RuntimeError("redis-server is not installed (apt-get install redis-server)")
        fs_dir = root / "fs"
        fs_dir.mkdir(parents=True)
        mounted = _mount_tmpfs(fs_dir)
        redis = RedisProcess.start(binary, root / "redis.log")
        proxy = TcpProxy(redis.port)
        env = _planted_env(root, plant)
        factory = ServerFactory(root)
        args = _server_args(root, proxy)
        try:
            server = factory.start(*args, cache_dir=fs_dir, env=env)
            router = RouterLeg.start(root)
        except BaseException:
            factory.close()
            proxy.close()
            redis.kill()
            _unmount(fs_dir, mounted)
            raise
        return cls(root, factory, redis, proxy, fs_dir, mounted, env, args, server, router)

    def restart_server(self) -> tuple[int, int]:
        """SIGKILL the server and start another on its directory and ports:
        the object files it left, and the objects the new one indexes."""
        self.take_tally()
        self.factory.kill(self.server)
        files = self.object_files()
        self.server = self.factory.restart(self.server, *self.args, kill=False, env=self.env)
        return len(files), self.fs_objects()

    def object_files(self) -> list[Path]:
        """Published fs objects (temporary files and the purge journal aside)."""
        return [path for path in self.fs_dir.glob("*/*/*.kv") if ".tmp-" not in path.name]

    def fs_objects(self) -> int:
        """The objects the fs tier indexed at start (its log says: the
        status would count the traffic's changes since too)."""
        found = re.search(r"L2 fs: indexed (\d+) objects", self.server.log)
        return int(found[1]) if found else -1

    def status(self) -> dict[str, Any] | None:
        """The server's ``/status``; None while it does not answer (killed,
        stopped, restarting)."""
        try:
            return self.server.status_json(ADMIN_TOKEN)
        except (OSError, ValueError):  # no connection, an HTTP error, a cut body
            return None

    def admin(self, method: str, path: str, body: dict[str, Any] | None = None) -> Any:
        return call(self.server.http, ADMIN_TOKEN, method, path, body)

    def settled(self, timeout_s: float) -> dict[str, int]:
        """Wait until no L1 object is locked or fenced and no reservation is
        open; the last counts seen."""

        def counts() -> dict[str, int]:
            status = self.status()
            if status is None:
                return {"unreachable": 1}
            l1 = status["storage"]["l1"]
            return {
                "locked": l1["locked_objects"],
                "fenced": l1["fenced_objects"],
                "staging": l1["staging_objects"],
            }

        return wait_for(counts, lambda c: not any(c.values()), timeout_s=timeout_s, every_s=0.1)

    def take_tally(self) -> None:
        """Add what this server counted to ``tally``: objects loaded from each
        L2 tier (``loaded.fs``) and copies refused by reason
        (``refused.redis.corrupt_mac``). Nothing if it does not answer."""
        status = self.status()
        if status is None:
            return
        storage = status["storage"]
        for adapter, n in storage["prefetch"]["loaded_objects"].items():
            self.tally[f"loaded.{adapter}"] += n
        for adapter, status in storage["l2"].items():
            for reason, n in status["failures"].items():
                self.tally[f"refused.{adapter}.{reason}"] += n

    def close(self) -> list[str]:
        """Stop everything; what went wrong with the server (``ServerFactory.close``)."""
        self.take_tally()
        problems = self.factory.close() + self.router.close()
        self.proxy.close()
        self.redis.kill()
        _unmount(self.fs_dir, self.mounted)
        return problems


def _server_args(root: Path, proxy: TcpProxy) -> list[str]:
    (root / "tenants.toml").write_text(tenants_toml())
    (root / "cluster.secret").write_text(SECRET)
    (root / "cluster.secret").chmod(0o600)  # a secret file group or others may read is refused
    redis = {
        "type": "redis",
        "url": f"redis://127.0.0.1:{proxy.port}/0",
        "name": "redis",
        "timeout_s": TIMEOUT_S,
    }
    return [
        *("--tenants-file", str(root / "tenants.toml")),
        *("--cluster-secret-file", str(root / "cluster.secret")),
        *("--l2", json.dumps(redis), "--l1-size", L1_SIZE),
        *("--prefetch-deadline-s", str(TIMEOUT_S)),
        *("--set", f"limits.client_ttl_s={CLIENT_TTL_S}", "--set", "purge.settle_s=0.2"),
        *("--set", f"limits.max_namespace_rows={NAMESPACE_ROWS}"),
    ]


def _planted_env(root: Path, plant: str) -> dict[str, str]:
    if not plant:
        return {}
    if plant not in PLANTS:
        raise ValueError(f"--plant must be one of {sorted(PLANTS)}, got {plant!r}")
    folder = root / "plant"
    folder.mkdir()
    (folder / "sitecustomize.py").write_text(PLANTS[plant])
    paths = [str(folder), str(ROOT), os.environ.get("PYTHONPATH", "")]
    return {"PYTHONPATH": os.pathsep.join(p for p in paths if p)}


def _mount_tmpfs(path: Path) -> bool:
    """Whether a tmpfs of ``TMPFS_BYTES`` could be mounted there (root only)."""
    if os.geteuid() != 0:
        return False
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={TMPFS_BYTES}", "tmpfs", str(path)],
        capture_output=True,
    )
    return done.returncode == 0


def _unmount(path: Path, mounted: bool) -> None:
    if mounted:
        with contextlib.suppress(OSError):
            subprocess.run(["umount", "-l", str(path)], capture_output=True, check=False)
