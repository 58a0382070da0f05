"""The faults a robustness run injects, each a function of the cluster and
the run's random generator that returns what it did (recorded in the history).

| fault          | what happens                                                    |
|----------------|-----------------------------------------------------------------|
| server_kill    | SIGKILL of the cache server, then a restart on its directory     |
| server_stop    | SIGSTOP of the cache server for a while, then SIGCONT            |
| redis_kill     | SIGKILL of Redis, down a while, restarted empty                  |
| redis_stop     | SIGSTOP of Redis for a while, then SIGCONT                       |
| disk_full      | the fs tier's tmpfs filled for a while (where one is mounted)    |
| corrupt_fs     | a byte of some fs objects flipped in place                       |
| fs_lost        | the fs objects deleted behind the server (a wiped disk): reads   |
|                | find them missing, then load from Redis                          |
| forge_redis    | some Redis objects rewritten with a byte changed and the         |
|                | checksum made right again (sealing must refuse them)             |
| proxy_latency  | the link to Redis slowed for a while                             |
| proxy_drop     | every connection to Redis cut, new ones refused for a while      |
| client_kill    | a client process SIGKILLed mid-store or mid-retrieve             |
| server_away    | the cache server stopped for several heartbeats of an idle        |
|                | client in a process of its own: that client's CPU seconds         |
| engine_silent  | one engine behind the router accepts and answers nothing          |
| engine_slow    | one engine behind the router slow to its first byte               |

The engines' faults are ``tests.robustness.routing``'s.
"""

from __future__ import annotations

import contextlib
import os
import random
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np

from kvtier.l2.format import checksum
from kvtier.process import clean_env, read_line, stop_process
from tests.integration.harness import ROOT
from tests.robustness import routing
from tests.robustness.cluster import TOKENS, Cluster

Fault = Callable[[Cluster, random.Random], dict[str, Any]]


def _pause(rng: random.Random) -> float:
    return round(rng.uniform(0.3, 1.5), 2)


def server_kill(cluster: Cluster, rng: random.Random) -> dict[str, Any]:
    files, indexed = cluster.restart_server()
    return {"files": files, "indexed": indexed}


def server_stop(cluster: Cluster, rng: random.Random) -> dict[str, Any]:
    return _stopped([cluster.server.pid], _pause(rng))


def redis_kill(cluster: Cluster, rng: random.Random) -> dict[str, Any]:
    down_s = _pause(rng)
    cluster.redis.kill()
    time.sleep(down_s)
    cluster.redis.launch()
    return {"down_s": down_s}


def redis_stop(cluster: Cluster, rng: random.Random) -> dict[str, Any]:
    return _stopped(cluster.redis.pids, _pause(rng))


def disk_full(cluster: Cluster, rng: random.Random) -> dict[str, Any]:
    full_s = _pause(rng)
    ballast = cluster.fs_dir / "fill.ballast"
    written = 0
    # the tier may have filled the disk itself: then even the open fails
    with contextlib.suppress(OSError), ballast.open("wb") as out:
        block = bytes(1 << 20)
        while True:
            written += out.write(block)
            out.flush()
    time.sleep(full_s)
    ballast.unlink(missing_ok=True)
    return {"full_s": full_s, "ballast_bytes": written}


def corrupt_fs(cluster: Cluster, rng: random.Random) -> dict[str, Any]:
    files = sorted(cluster.object_files())
    flipped = []
    for path in rng.sample(files, min(8, len(files))):
        with contextlib.suppress(OSError), path.open("r+b") as handle:
            data = handle.read()
            header_len = int.from_bytes(data[6:8], "little")
            if len(data) <= header_len:
                continue
            at = rng.randrange(header_len, len(data))
            handle.seek(at)
            handle.write(bytes([data[at] ^ 0x5A]))
            flipped.append(path.name)
    return {"flipped": flipped}


def fs_lost(cluster: Cluster, rng: random.Random) -> dict[str, Any]:
    files = cluster.object_files()
    for path in files:
        path.unlink(missing_ok=True)
    return {"lost": len(files)}


def forge_redis(cluster: Cluster, rng: random.Random) -> dict[str, Any]:
    import redis  # the test extra's; only this fault talks to Redis itself

    store = redis.Redis(port=cluster.redis.port, socket_timeout=5)
    forged = []
    with contextlib.suppress(redis.RedisError):
        names = sorted(store.scan_iter(count=1000))
        for name in rng.sample(names, min(8, len(names))):
            value = store.get(name)
            if value is None:
                continue
            value = bytearray(value)
            header_len = int.from_bytes(value[6:8], "little")
            if len(value) <= header_len:
                continue
            value[rng.randrange(header_len, len(value))] ^= 0x5A
            payload = np.frombuffer(bytes(value[header_len:]), dtype=np.uint8)
            value[32:40] = checksum(payload).to_bytes(8, "little")
            store.set(name, bytes(value))
            forged.append(name.decode(errors="replace"))
    return {"forged": forged}


def proxy_latency(cluster: Cluster, rng: random.Random) -> dict[str, Any]:
    slow_s, latency_s = _pause(rng), round(rng.uniform(0.05, 0.5), 2)
    cluster.proxy.latency_s = latency_s
    time.sleep(slow_s)
    cluster.proxy.latency_s = 0.0
    return {"slow_s": slow_s, "latency_s": latency_s}


def proxy_drop(cluster: Cluster, rng: random.Random) -> dict[str, Any]:
    refuse_s = _pause(rng)
    cluster.proxy.refusing = True
    dropped = cluster.proxy.drop()
    time.sleep(refuse_s)
    cluster.proxy.refusing = False
    return {"dropped": dropped, "refuse_s": refuse_s}


def client_kill(cluster: Cluster, rng: random.Random) -> dict[str, Any]:
    mode = rng.choice(["mid-store", "mid-retrieve"])
    tenant = rng.choice(sorted(TOKENS))
    seed = rng.randrange(1 << 30)
    with _client("victim", cluster.server.rpc, TOKENS[tenant], str(seed), mode) as (_, line):
        pass  # killed as it holds what its line says
    return {"mode": mode, "tenant": tenant, "victim": line}


IDLE_HEARTBEAT_S = 1.0  # the idle client's; the server stays away six to eight of them


def server_away(cluster: Cluster, rng: random.Random) -> dict[str, Any]:
    """The cache server away (stopped) for longer than an idle client's
    heartbeat: the CPU seconds that client's process used meanwhile (a past-
    due heartbeat once turned its wait into a busy loop)."""
    away_s = round(rng.uniform(6.0, 8.0), 2)
    args = (cluster.server.rpc, TOKENS["acme"], str(IDLE_HEARTBEAT_S))
    with _client("idler", *args) as (pid, line):
        before = cpu_seconds(pid)
        _stopped([cluster.server.pid], away_s)
        used = cpu_seconds(pid) - before
    return {
        "away_s": away_s,
        "heartbeat_s": IDLE_HEARTBEAT_S,
        "client_cpu_s": round(used, 3),
        "client": line,
    }


@contextlib.contextmanager
def _client(module: str, *args: str) -> Iterator[tuple[int, str]]:
    """``python -m tests.robustness.MODULE ARGS...`` once it printed its first
    line: its pid and that line; SIGKILLed when the block ends."""
    proc = subprocess.Popen(
        [sys.executable, "-m", f"tests.robustness.{module}", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        stdin=subprocess.PIPE,
        text=True,
        cwd=ROOT,
        env=clean_env(),
    )
    try:
        assert proc.stdout is not None
        yield proc.pid, (read_line(proc.stdout, 30.0) or "").strip()
    finally:
        stop_process(proc, signal.SIGKILL)
        for stream in (proc.stdin, proc.stdout):
            if stream is not None:
                stream.close()


def engine_silent(cluster: Cluster, rng: random.Random) -> dict[str, Any]:
    return routing.engine_silent(cluster.router, rng)


def engine_slow(cluster: Cluster, rng: random.Random) -> dict[str, Any]:
    return routing.engine_slow(cluster.router, rng)


def cpu_seconds(pid: int) -> float:
    """User and system CPU seconds of a process, all its threads."""
    fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _stopped(pids: list[int], pause_s: float) -> dict[str, Any]:
    for pid in pids:
        os.kill(pid, signal.SIGSTOP)
    try:
        time.sleep(pause_s)
    finally:
        for pid in pids:
            os.kill(pid, signal.SIGCONT)
    return {"stopped_s": pause_s}


FAULTS: dict[str, Fault] = {
    fault.__name__: fault
    for fault in (
        server_kill,
        server_stop,
        redis_kill,
        redis_stop,
        disk_full,
        corrupt_fs,
        fs_lost,
        forge_redis,
        proxy_latency,
        proxy_drop,
        client_kill,
        server_away,
        engine_silent,
        engine_slow,
    )
}


def available(cluster: Cluster) -> list[str]:
    """The faults this machine can inject (disk_full needs the tmpfs)."""
    return [name for name in FAULTS if cluster.mounted or name != "disk_full"]
