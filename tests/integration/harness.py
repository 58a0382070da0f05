"""Helpers that run real ``kvtier serve`` processes and peer client processes.

``ServerFactory.start(...)`` launches
``python -m kvtier serve`` on 127.0.0.1 with ``--port 0 --http-port 0``, a
64 MiB L1 and an fs L2 under ``tmp_path``, waits for its ready line and parses
the addresses from it. ``ServerFactory.restart(server)`` starts another on the
same cache directory and RPC port. Every server is stopped by PID at teardown
(SIGTERM, a deadline, then SIGKILL), whatever the test did; a shared-memory
arena left by a killed server is removed.

``PeerFactory.spawn(...)`` runs ``python -m tests.integration.peer ...`` (a second
client process) and ``PeerFactory.read(proc)`` takes the JSON line it prints.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from kvtier.process import ServerProcess, clean_env, read_line, stop_process
from kvtier.protocol.status import ServerStatus

ROOT = Path(__file__).resolve().parents[2]
SHM_DIR = Path("/dev/shm")

T = TypeVar("T")


def post_json(url: str, body: dict[str, Any], timeout_s: float = 300.0) -> tuple[int, Any]:
    """POST JSON; the status and the JSON answer (an error's body too)."""
    request = urllib.request.Request(
        url, json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as response:
            return int(response.status), json.loads(response.read())
    except urllib.error.HTTPError as exc:
        return int(exc.code), json.loads(exc.read() or b"{}")


@contextmanager
def doomed_parent(script: str, log: Path) -> Iterator[tuple[subprocess.Popen[str], list[str]]]:
    """A Python process running ``script`` (its argv[1]: ``log``, where what
    it starts writes), which prints one line about what it started and then
    waits to be killed: yields it and that line's words, and SIGKILLs it
    (by PID) at the end if the test did not."""
    parent = subprocess.Popen(
        [sys.executable, "-c", script, str(log)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env=clean_env(),
    )
    try:
        assert parent.stdout is not None
        line = read_line(parent.stdout, 30.0)
        written = log.read_text(errors="replace") if log.exists() else "(nothing)"
        assert line, f"the parent printed nothing; {log.name}:\n{written}"
        yield parent, line.split()
    finally:
        stop_process(parent, signal.SIGKILL)


@contextmanager
def paused(pids: Sequence[int]) -> Iterator[None]:
    """The processes stopped (SIGSTOP) for the block, then continued."""
    for pid in pids:
        os.kill(pid, signal.SIGSTOP)
    try:
        yield
    finally:
        for pid in pids:
            os.kill(pid, signal.SIGCONT)


def running(pid: int) -> bool:
    """Whether ``pid`` runs: an orphan that exited stays a zombie until its
    new parent reaps it, and a zombie has ended."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state not in ("Z", "X")


def process_tree(pid: int) -> set[int]:
    """``pid`` and every process under it."""
    parents: dict[int, int] = {}
    for entry in Path("/proc").glob("[0-9]*"):
        try:
            parents[int(entry.name)] = int(
                (entry / "stat").read_text().rpartition(")")[2].split()[1]
            )
        except OSError:  # it ended meanwhile
            continue
    tree, grown = {pid}, True
    while grown:
        below = {child for child, parent in parents.items() if parent in tree}
        grown = not below <= tree
        tree |= below
    return tree


def engine_segments(pid: int) -> list[Path]:
    """The shared-memory files that multiprocessing made (``psm_*`` segments,
    ``sem.*`` semaphores) which ``pid`` and the processes under it map or
    hold open: vLLM's engine core and workers remove theirs only as they shut
    down, so a test that SIGKILLs an engine removes them itself. A kvtier
    server's arena, which a connector maps too, is not among them."""
    found: set[Path] = set()
    for member in process_tree(pid):
        for path in map(Path, _mapped_or_open(member)):
            if path.parent == SHM_DIR and path.name.startswith(("psm_", "sem.")):
                found.add(path)
    return sorted(found)


def _mapped_or_open(pid: int) -> list[str]:
    """The paths of the files a process maps or holds open (what it could read)."""
    paths = []
    with contextlib.suppress(OSError):  # it ended meanwhile
        maps = Path(f"/proc/{pid}/maps").read_text().splitlines()
        paths += [line.split(maxsplit=5)[-1] for line in maps if "/" in line]
        for fd in Path(f"/proc/{pid}/fd").iterdir():
            with contextlib.suppress(OSError):  # closed meanwhile
                paths.append(os.readlink(fd))
    return [path.removesuffix(" (deleted)") for path in paths]


def wait_for(
    probe: Callable[[], T],
    done: Callable[[T], bool],
    timeout_s: float = 15.0,
    every_s: float = 0.05,
) -> T:
    """Call ``probe`` until ``done(value)``; return the last value either way
    (the caller asserts on it, so a failure shows what was seen last)."""
    deadline = time.monotonic() + timeout_s
    value = probe()
    while not done(value) and time.monotonic() < deadline:
        time.sleep(every_s)
        value = probe()
    return value


async def settled(done: Callable[[], bool], timeout_s: float = 15.0, every_s: float = 0.05) -> bool:
    """``wait_for`` inside an event loop (its other tasks run meanwhile):
    await until ``done()`` holds or ``timeout_s`` passes; its last value."""
    deadline = time.monotonic() + timeout_s
    while not done() and time.monotonic() < deadline:
        await asyncio.sleep(every_s)
    return done()


@dataclass(eq=False)
class Server(ServerProcess):
    """One running ``kvtier serve``, with its L2 directory and auth token."""

    cache_dir: Path = Path()
    token: str = ""

    def http_get(
        self, path: str, token: str | None = None, method: str = "GET"
    ) -> tuple[int, bytes]:
        """Status code and body; ``token`` None means this server's own token."""
        token = self.token if token is None else token
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        request = urllib.request.Request(self.http + path, headers=headers, method=method)
        try:
            with urllib.request.urlopen(request, timeout=10) as response:
                return response.status, response.read()
        except urllib.error.HTTPError as exc:
            return exc.code, exc.read()

    def status(self) -> dict[str, Any]:
        return self.status_json(self.token)

    def fresh_status(self) -> dict[str, Any]:
        """The status from a snapshot taken after this call began: the
        server's may be a tick old (``kvtier.server.transport``), so
        ``status()`` may not show yet what a reply just confirmed."""
        began = self.status()["uptime_s"]
        status = wait_for(self.status, lambda s: s["uptime_s"] > began, timeout_s=10.0)
        assert status["uptime_s"] > began, "the server took no status snapshot in 10 s"
        return status

    def metrics(self) -> str:
        code, body = self.http_get("/metrics")
        assert code == 200, (code, body)
        return body.decode()

    def stalled(self) -> AbstractContextManager[None]:
        """The server stopped for the block: connected, but quiet."""
        return paused([self.proc.pid])


@dataclass(eq=False)
class ServerFactory:
    tmp_path: Path
    started: list[Server] = field(default_factory=list)

    def start(
        self,
        *extra: str,
        cache_dir: Path | None = None,
        port: int = 0,
        http_port: int = 0,
        config: str | None = None,
        env: dict[str, str] | None = None,
        token: str = "",
        l1_size: str = "64MiB",
    ) -> Server:
        """Start a server and wait for its ready line. ``config`` is TOML text
        written to a file and passed with --config; ``token`` to a file passed with
        --auth-token-file."""
        n = len(self.started)
        cache_dir = cache_dir or self.tmp_path / f"l2-{n}"
        args = ["--host", "127.0.0.1", "--port", str(port), "--http-port", str(http_port)]
        args += ["--l1-size", l1_size, "--cache-dir", str(cache_dir)]
        if config is not None:
            config_path = self.tmp_path / f"server-{n}.toml"
            config_path.write_text(config)
            args += ["--config", str(config_path)]
        if token:  # a file, as an operator would: a command line shows in ps
            token_path = self.tmp_path / f"server-{n}.token"
            token_path.write_text(token)
            token_path.chmod(0o600)  # a secret file group or others may read is refused
            args += ["--auth-token-file", str(token_path)]
        args += list(extra)
        log_path = self.tmp_path / f"server-{n}.log"
        server = Server.start(args, log_path, cwd=self.tmp_path, env=env)
        server.cache_dir, server.token = cache_dir, token
        self.started.append(server)
        return server

    def stop(self, server: Server, sig: int = signal.SIGTERM) -> int:
        """Stop by PID (SIGTERM by default; SIGKILL after the deadline)."""
        return server.stop(sig)

    def kill(self, server: Server) -> None:
        """SIGKILL, as a crash: the arena file stays behind until removed here."""
        assert self.stop(server, signal.SIGKILL) == -signal.SIGKILL
        (SHM_DIR / server.arena).unlink(missing_ok=True)

    def restart(self, server: Server, *extra: str, kill: bool = True, **options: Any) -> Server:
        """Stop ``server`` (SIGKILL unless ``kill`` is False) and start another on
        the same cache directory, RPC and HTTP ports, with the same flags by
        default: a fixture holding ``server`` still reaches its successor."""
        if kill:
            self.kill(server)
        else:
            self.stop(server)
        options.setdefault("token", server.token)
        options.setdefault("http_port", int(server.http.rsplit(":", 1)[1]))
        return self.start(*extra, cache_dir=server.cache_dir, port=server.port, **options)

    def close(self) -> list[str]:
        """Stop every server still running (SIGTERM, then SIGKILL after the
        deadline) and remove leftover arenas. Returns what went wrong: a server
        that did not exit 0 on SIGTERM, or logged a traceback."""
        problems = []
        for server in self.started:
            running = server.proc.poll() is None
            code = self.stop(server)
            (SHM_DIR / server.arena).unlink(missing_ok=True)
            if running and code != 0:
                problems.append(f"server {server.pid} exited {code} on SIGTERM:\n{server.log}")
            if "Traceback" in server.log:
                problems.append(f"server {server.pid} logged a traceback:\n{server.log}")
        return problems


# ------------------------------------------------------------------ peers


@dataclass(eq=False)
class PeerFactory:
    tmp_path: Path
    procs: list[subprocess.Popen[str]] = field(default_factory=list)

    def spawn(self, *args: str) -> subprocess.Popen[str]:
        log = (self.tmp_path / f"peer-{len(self.procs)}.log").open("w")
        with log:
            proc = subprocess.Popen(
                [sys.executable, "-m", "tests.integration.peer", *args],
                stdout=subprocess.PIPE,
                stderr=log,
                stdin=subprocess.DEVNULL,
                text=True,
                cwd=ROOT,
                env=clean_env(),
            )
        self.procs.append(proc)
        return proc

    def read(self, proc: subprocess.Popen[str], timeout_s: float = 30.0) -> dict[str, Any]:
        """The JSON line the peer prints (fails with its log if none comes)."""
        line = read_line(proc.stdout, timeout_s)
        if not line:
            index = self.procs.index(proc)
            log = (self.tmp_path / f"peer-{index}.log").read_text(errors="replace")
            raise AssertionError(f"peer printed nothing (exit status {proc.poll()}); log:\n{log}")
        result: dict[str, Any] = json.loads(line)
        return result

    def run(self, *args: str, timeout_s: float = 30.0) -> dict[str, Any]:
        """Spawn, take its line, and require a clean exit."""
        proc = self.spawn(*args)
        result = self.read(proc, timeout_s)
        assert proc.wait(timeout=timeout_s) == 0
        return result

    def kill(self, proc: subprocess.Popen[str]) -> None:
        assert stop_process(proc, signal.SIGKILL) == -signal.SIGKILL

    def close(self) -> None:
        for proc in self.procs:
            stop_process(proc, signal.SIGKILL)
            if proc.stdout is not None:
                proc.stdout.close()


def spawn_args(**options: object) -> Sequence[str]:
    """``--name value`` flags for a peer (True -> ``--name``, False/None -> nothing)."""
    out: list[str] = []
    for name, value in options.items():
        flag = "--" + name.replace("_", "-")
        if value is True:
            out.append(flag)
        elif value not in (False, None):
            out += [flag, str(value)]
    return out


def wait_written_back(probe: Callable[[], ServerStatus | None], objects: int) -> ServerStatus:
    """Wait until the fs L2 has stored ``objects`` objects in all and the store
    controller has let go of them (it counts a write before it unlocks).
    ``probe`` must read the live tables (``CacheClient.status``), so that the
    second wait sees a state later than the first."""

    def written(s: ServerStatus | None) -> int:
        return 0 if s is None else s.storage.store.stored_objects.get("fs", 0)

    status = wait_for(probe, lambda s: written(s) >= objects)
    assert written(status) == objects, status

    def let_go(s: ServerStatus | None) -> bool:
        return s is not None and s.storage.l1.locked_objects == s.storage.l1.fenced_objects == 0

    status = wait_for(probe, let_go)
    assert status is not None and let_go(status), status
    return status


def tenants_toml(
    quotas: dict[str, str] | None = None, ops_salt: str = "ops", acme_reads: str = ""
) -> str:
    """The tenants file the tenant tests share: ``acme`` and ``globex`` (their
    own salts), ``ops`` (admin), each known by the token ``<name>-token``;
    ``quotas``: a tenant's ``[tenant.quota]`` lines; ``acme_reads``: a salt
    acme may read."""
    from kvtier.tenancy.tenants import token_digest

    quotas = quotas or {}
    blocks = []
    for name, salt in (("acme", "acme"), ("globex", "globex"), ("ops", ops_salt)):
        lines = ["[[tenant]]", f'name = "{name}"']
        lines.append(f'token_sha256 = ["{token_digest(name + "-token")}"]')
        lines.append(f'salts = ["{salt}"]')
        if name == "acme" and acme_reads:
            lines.append(f'read = ["{acme_reads}"]')
        if name == "ops":
            lines.append("admin = true")
        if name in quotas:
            lines += ["[tenant.quota]", quotas[name]]
        blocks.append("\n".join(lines))
    return "\n\n".join(blocks) + "\n"
