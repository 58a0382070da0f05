"""End to end on a GPU: a real ``sglang.launch_server`` with HiCache and the
kvtier backend, a prompt served, the cache flushed, the same prompt served
again from kvtier (docs/sglang.md). Skipped without CUDA, SGLang's CUDA build
and a model: set KVTIER_SGLANG_MODEL to a local model directory."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from tests.integration.harness import ServerFactory
from tests.integration.sglang_host import backend_config

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)
pytest.importorskip("sglang")
MODEL = os.environ.get("KVTIER_SGLANG_MODEL", "")
if not MODEL:
    pytest.skip("set KVTIER_SGLANG_MODEL to a local model directory", allow_module_level=True)


def post(url: str, body: dict[str, object]) -> dict[str, object]:
    request = urllib.request.Request(
        url, json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=300) as reply:
        return json.loads(reply.read())  # type: ignore[no-any-return]


def test_a_prompt_is_served_from_kvtier_after_a_flush(
    kvtier_server: ServerFactory, tmp_path: Path
) -> None:
    page = 64
    server = kvtier_server.start("--chunk-size", str(page), l1_size="2GiB")
    extra = backend_config(server.rpc)
    port = 30123
    args = [
        sys.executable,
        "-m",
        "sglang.launch_server",
        "--model-path",
        MODEL,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--page-size",
        str(page),
        "--enable-hierarchical-cache",
        "--hicache-storage-backend",
        "dynamic",
        "--hicache-storage-backend-extra-config",
        json.dumps(extra),
    ]
    log = (tmp_path / "sglang.log").open("w")
    engine = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT)
    try:
        base = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline:
            try:
                urllib.request.urlopen(f"{base}/health", timeout=5)
                break
            except OSError:
                time.sleep(2)
        prompt = "kvtier shares KV pages between engines. " * 60
        body = {"text": prompt, "sampling_params": {"max_new_tokens": 16, "temperature": 0}}
        first = post(f"{base}/generate", body)
        time.sleep(5)  # write-through to storage is asynchronous
        post(f"{base}/flush_cache", {})
        second = post(f"{base}/generate", body)
        assert second["text"] == first["text"]
    finally:
        engine.terminate()
        engine.wait(timeout=60)
