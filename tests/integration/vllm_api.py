"""vLLM's OpenAI-compatible server as a test process, with the kvtier connector.

``ApiServers.start(...)`` launches ``vllm.entrypoints.openai.api_server`` on
127.0.0.1 and a free port (fp32, eager, the test model), several at once if
asked (they start in parallel: each takes ~40 s on two cores); ``wait``
blocks until each answers ``/health``. Every process is stopped by PID at
``close``; ``KVTIER_KEEP_LOGS`` prints their logs' tails.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvtier.process import clean_env, stop_process
from tests.integration.harness import ROOT, wait_for

START_TIMEOUT_S = 300.0
REQUEST_TIMEOUT_S = 300.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def post(url: str, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    """POST JSON; the status and the JSON answer (an error's body too)."""
    request = urllib.request.Request(
        url, json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(request, timeout=REQUEST_TIMEOUT_S) as response:
            return int(response.status), json.loads(response.read())
    except urllib.error.HTTPError as exc:
        return int(exc.code), json.loads(exc.read() or b"{}")


@dataclass(eq=False)
class ApiServer:
    proc: subprocess.Popen[str]
    log: Path
    url: str

    def healthy(self) -> bool:
        try:
            with urllib.request.urlopen(self.url + "/health", timeout=2) as response:
                return bool(response.status == 200)
        except OSError:
            return self.proc.poll() is not None  # died: stop waiting

    def tail(self) -> str:
        return self.log.read_text(errors="replace")[-6000:]


class ApiServers:
    def __init__(self, model: Path, tmp: Path) -> None:
        self.model, self.tmp, self.started = model, tmp, list[ApiServer]()

    def start(
        self,
        transfer: dict[str, Any] | None,
        *args: str,
        env: dict[str, str] | None = None,
    ) -> ApiServer:
        """Launch one (not waiting for it: ``wait``)."""
        port = free_port()
        command = [sys.executable, "-m", "vllm.entrypoints.openai.api_server"]
        command += ["--model", str(self.model), "--host", "127.0.0.1", "--port", str(port)]
        command += ["--served-model-name", "m", "--dtype", "float32", "--seed", "0"]
        command += ["--enforce-eager"]
        command += ["--max-model-len", "4096", *args]
        if transfer is not None:
            command += ["--kv-transfer-config", json.dumps(transfer)]
        log = self.tmp / f"api-{len(self.started)}.log"
        variables = clean_env({"VLLM_CPU_KVCACHE_SPACE": "1", "HF_HUB_OFFLINE": "1", **(env or {})})
        with log.open("w") as log_file:
            proc = subprocess.Popen(
                command,
                stdout=log_file,
                stderr=subprocess.STDOUT,
                cwd=ROOT,
                env=variables,
                text=True,
            )
        server = ApiServer(proc, log, f"http://127.0.0.1:{port}")
        self.started.append(server)
        return server

    def wait(self, *servers: ApiServer) -> None:
        for server in servers:
            assert wait_for(server.healthy, bool, timeout_s=START_TIMEOUT_S, every_s=1.0)
            assert server.proc.poll() is None, server.tail()

    def close(self) -> None:
        for server in self.started:
            stop_process(server.proc, signal.SIGTERM, timeout_s=30)
            if os.environ.get("KVTIER_KEEP_LOGS"):
                print(server.tail())


def connector(address: str, **options: Any) -> dict[str, Any]:
    """A ``--kv-transfer-config`` for the kvtier connector."""
    extra = {"kvtier.address": address, **{f"kvtier.{k}": v for k, v in options.items()}}
    return {
        "kv_connector": "KVTierConnector",
        "kv_connector_module_path": "kvtier.engine.vllm",
        "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": extra,
    }
