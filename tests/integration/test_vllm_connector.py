"""The vLLM connector end to end on vLLM's CPU build (slow: each engine takes
~30-40 s to start on two cores).

A tiny random-weight Llama (fp32, so equality is meaningful; the ``model_dir``
fixture in conftest) is saved once;
engines run as separate processes (``vllm_engine``) against one real
``kvtier serve``. Every output is compared with a no-connector engine's:
identical greedy tokens and |Δlogprob| <= 1e-4 at every step.
"""

from __future__ import annotations

import contextlib
import json
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec
import numpy as np
import pytest

from kvtier.bench.engines import EngineOptions, kvtier_transfer, vllm_server
from kvtier.commands.admin import call
from kvtier.keys import ObjectKey
from kvtier.l2.format import unpack_header
from kvtier.l2.fs import SUFFIX
from kvtier.l2.stored_value import encode_object
from kvtier.process import clean_env, read_line, stop_process
from kvtier.protocol.status import ServerStatus
from tests.integration.harness import (
    ROOT,
    Server,
    ServerFactory,
    post_json,
    tenants_toml,
    wait_for,
    wait_written_back,
)

pytest.importorskip("vllm")
pytestmark = [pytest.mark.slow, pytest.mark.engine]

CHUNK = 256
START_TIMEOUT_S = 300.0
RUN_TIMEOUT_S = 300.0
NEW_TOKENS = 6
TOLERANCE = 1e-4
PYTHON = sys.executable


# ------------------------------------------------------------------ model


def tokens(seed: int, n: int) -> list[int]:
    import random

    rng = random.Random(seed)
    return [rng.randrange(2, 1024) for _ in range(n)]


SHARED = tokens(1, 600)
# Lengths 700, 900, 1100 and 512 (a whole number of chunks: a full hit).
PROMPTS = [SHARED + tokens(10 + i, n - 600) for i, n in enumerate((700, 900, 1100))] + [
    tokens(20, 512)
]
FRESH = [tokens(30 + i, 640) for i in range(2)]  # never stored before the kill
PREEMPT = [SHARED[:512] + tokens(40 + i, 500) for i in range(8)]
PREEMPT_TOKENS = 160


def kvtier_hit(n: int) -> int:
    """Tokens a kvtier-only engine loads for an n-token prompt whose full
    chunks are all stored: whole chunks, one token short on a full hit."""
    return min(n // CHUNK * CHUNK, n - 1)


# ---------------------------------------------------------------- engines


@dataclass(eq=False)
class Engine:
    proc: subprocess.Popen[str]
    log: Path

    def call(self, command: dict[str, Any]) -> dict[str, Any]:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(json.dumps(command) + "\n")
        self.proc.stdin.flush()
        line = read_line(self.proc.stdout, RUN_TIMEOUT_S)
        if not line:
            raise AssertionError(f"the engine did not answer; log:\n{self.tail()}")
        answer: dict[str, Any] = json.loads(line)
        return answer

    def generate(
        self,
        prompts: Sequence[list[int]],
        max_tokens: int = NEW_TOKENS,
        salts: Sequence[str] | None = None,
        params: Sequence[dict[str, Any] | None] | None = None,
    ) -> list[Any]:
        command: dict[str, Any] = {"prompts": list(prompts), "max_tokens": max_tokens}
        if salts is not None:
            command["salts"] = list(salts)
        if params is not None:
            command["params"] = list(params)  # each prompt's kv_transfer_params
        outputs: list[Any] = self.call(command)["outputs"]
        return outputs

    def metrics(self) -> dict[str, float]:
        metrics: dict[str, float] = self.call({"metrics": True})["metrics"]
        return metrics

    def tail(self) -> str:
        return self.log.read_text(errors="replace")[-6000:]


class Engines:
    def __init__(self, model: Path, tmp: Path, flags: Sequence[str] = ()) -> None:
        self.model, self.tmp, self.started = model, tmp, list[Engine]()
        self.flags = list(flags)  # every engine's (an attention backend, say)
        self.scratch: list[str] = []

    def start(self, *args: str, env: dict[str, str] | None = None) -> Engine:
        log = self.tmp / f"engine-{len(self.started)}.log"
        # vLLM's rendezvous files and IPC sockets (a short path: at most 107 bytes)
        scratch = tempfile.mkdtemp(prefix="kvtier-vllm-")
        self.scratch.append(scratch)
        command = [PYTHON, "-m", "tests.integration.vllm_engine", "--model", str(self.model)]
        with log.open("w") as log_file:
            proc = subprocess.Popen(
                [*command, *self.flags, *args],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=log_file,
                text=True,
                cwd=ROOT,
                env=clean_env({"TMPDIR": scratch, **(env or {})}),
            )
        engine = Engine(proc, log)
        self.started.append(engine)
        assert proc.stdout is not None
        line = read_line(proc.stdout, START_TIMEOUT_S)
        if not line or not json.loads(line).get("ready"):
            raise AssertionError(f"the engine did not start ({line!r}); log:\n{engine.tail()}")
        return engine

    def stop(self, engine: Engine) -> None:
        if engine.proc.poll() is None and engine.proc.stdin is not None:
            engine.proc.stdin.write("\n")
            engine.proc.stdin.flush()
            with contextlib.suppress(subprocess.TimeoutExpired):
                engine.proc.wait(timeout=60)
        stop_process(engine.proc, signal.SIGKILL)

    def close(self) -> None:
        for engine in self.started:
            self.stop(engine)
        for scratch in self.scratch:
            shutil.rmtree(scratch, ignore_errors=True)


@contextlib.contextmanager
def engines_of(model: Path, tmp: Path, flags: Sequence[str] = ()) -> Iterator[Engines]:
    """Engines of ``model`` (each started with ``flags``), every one stopped at the end."""
    factory = Engines(model, tmp, flags)
    try:
        yield factory
    finally:
        factory.close()


@pytest.fixture(scope="module")
def engines(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Engines]:
    with engines_of(model_dir, tmp_path_factory.mktemp("engines")) as factory:
        yield factory


@pytest.fixture(scope="module")
def reference(engines: Engines) -> dict[str, list[Any]]:
    """Every prompt set through an engine with no connector."""
    engine = engines.start()
    try:
        return {
            "prompts": engine.generate(PROMPTS),
            "fresh": engine.generate(FRESH),
            "preempt": engine.generate(PREEMPT, PREEMPT_TOKENS),
        }
    finally:
        engines.stop(engine)


def assert_same(
    reference: Sequence[Any], outputs: Sequence[Any], tolerance: float = TOLERANCE
) -> None:
    assert len(reference) == len(outputs)
    for i, (want, got) in enumerate(zip(reference, outputs, strict=True)):
        assert got["tokens"] == want["tokens"], f"prompt {i}: tokens differ"
        worst = max(abs(a - b) for a, b in zip(want["logprobs"], got["logprobs"], strict=True))
        assert worst <= tolerance, f"prompt {i}: |Δlogprob| {worst:.2e}"


def held_locks(server: Server) -> int:
    return int(server.fresh_status()["storage"]["held_lookup_locks"])


def stored_objects(server: Server) -> int:
    return int(server.fresh_status()["storage"]["l1"]["resident_objects"])


def resident_bytes(server: Server) -> int:
    return int(server.fresh_status()["storage"]["l1"]["used_bytes"])


def full_chunks(prompts: Sequence[list[int]]) -> int:
    """The distinct full chunks of ``prompts`` (shared prefixes once)."""
    return len({tuple(p[: (i + 1) * CHUNK]) for p in prompts for i in range(len(p) // CHUNK)})


def clear_l1_once_on_disk(server: Server, chunks: int) -> None:
    """Wait until the fs L2 holds ``chunks`` objects, then empty L1: the next
    loads come from disk."""
    stored = wait_for(
        lambda: server.fresh_status()["storage"]["store"]["stored_objects"].get("fs", 0),
        lambda n: n >= chunks,
    )
    assert stored == chunks
    assert server.http_get("/clear", method="POST")[0] == 200
    assert wait_for(lambda: stored_objects(server), lambda n: n == 0) == 0


# ------------------------------------------------------------------ tests


def test_cold_then_warm_in_a_fresh_engine_matches_no_connector(
    engines: Engines, reference: dict[str, list[Any]], kv_server: Server
) -> None:
    cold = engines.start("--kvtier", kv_server.rpc)  # vLLM's prefix caching on
    try:
        assert_same(reference["prompts"], cold.generate(PROMPTS))
    finally:
        engines.stop(cold)
    full_chunks = len(
        {tuple(p[: (i + 1) * CHUNK]) for p in PROMPTS for i in range(len(p) // CHUNK)}
    )
    assert wait_for(lambda: stored_objects(kv_server), lambda n: n >= full_chunks) >= full_chunks
    assert wait_for(lambda: held_locks(kv_server), lambda n: n == 0) == 0

    warm = engines.start("--kvtier", kv_server.rpc, "--no-prefix-caching")
    try:
        outputs = warm.generate(PROMPTS)
        assert_same(reference["prompts"], outputs)
        assert [o["cached"] for o in outputs] == [kvtier_hit(len(p)) for p in PROMPTS]
        assert warm.metrics()["vllm:external_prefix_cache_hits"] == sum(
            kvtier_hit(len(p)) for p in PROMPTS
        )
    finally:
        engines.stop(warm)
    assert wait_for(lambda: held_locks(kv_server), lambda n: n == 0) == 0


def test_server_killed_mid_run_then_back_without_restarting_vllm(
    engines: Engines, reference: dict[str, list[Any]], module_servers: ServerFactory
) -> None:
    """With ``kvtier.load_async`` (the default path is the cold-then-warm
    test's): hits load on the worker's thread while vLLM parks each request.
    Its own server (it kills it): the module's shared one stays up."""
    server = module_servers.start()
    option = "kvtier.load_async=true"
    engine = engines.start("--kvtier", server.rpc, "--no-prefix-caching", "--kvtier-option", option)
    try:
        assert_same(reference["prompts"][:2], engine.generate(PROMPTS[:2]))  # stores them
        # Their 3 chunks (two shared) on disk: the restarted server finds them there.
        wait_written_back(lambda: msgspec.convert(server.fresh_status(), ServerStatus), 3)
        first = engine.generate(PROMPTS[:1])
        assert_same(reference["prompts"][:1], first)
        assert first[0]["cached"] == kvtier_hit(len(PROMPTS[0]))
        assert wait_for(lambda: held_locks(server), lambda n: n == 0) == 0
        module_servers.kill(server)
        down = engine.generate(FRESH)  # no server: computed, stored nowhere
        assert_same(reference["fresh"], down)
        assert [o["cached"] for o in down] == [0, 0]
        module_servers.restart(server, kill=False)  # same port, same fs L2
        # the engine reconnects on its own (the client retries every second): no restart

        def hits() -> list[int]:
            return [o["cached"] for o in engine.generate(PROMPTS[1:2])]

        assert wait_for(hits, lambda h: h[0] > 0, timeout_s=30, every_s=0.5)[0] == kvtier_hit(
            len(PROMPTS[1])
        )
        assert_same(reference["prompts"][1:2], engine.generate(PROMPTS[1:2]))
    finally:
        engines.stop(engine)


def test_preemption_keeps_outputs_and_releases_every_lock(
    engines: Engines, reference: dict[str, list[Any]], kv_server: Server
) -> None:
    # 40 blocks of 128 tokens for 8 requests of ~1,000 + 160 tokens: some are preempted.
    engine = engines.start(
        "--kvtier", kv_server.rpc, "--kv-bytes", str(40 * 256 << 10), "--max-model-len", "2048"
    )
    try:
        assert_same(reference["preempt"], engine.generate(PREEMPT, PREEMPT_TOKENS))
        assert engine.metrics()["vllm:num_preemptions"] > 0, "no request was preempted"
    finally:
        engines.stop(engine)
    assert wait_for(lambda: held_locks(kv_server), lambda n: n == 0) == 0


def swap_payloads(first: Path, second: Path) -> None:
    """Give two stored objects each other's payload under their own headers,
    checksums recomputed: wrong KV that every check of the cache passes."""
    data = [path.read_bytes() for path in (first, second)]
    headers = [unpack_header(d) for d in data]
    payloads = [
        np.frombuffer(d, np.uint8, offset=h.header_len) for d, h in zip(data, headers, strict=True)
    ]
    for path, header, payload in zip((first, second), headers, reversed(payloads), strict=True):
        key = ObjectKey.from_str(header.key)
        path.write_bytes(encode_object(key, header.layout.hex(), payload))


def shadow_counts(server: Server) -> dict[str, int]:
    counts: dict[str, int] = server.status()["server"]["shadow_chunks"]
    return counts


def test_shadow_check_confirms_reuse_and_catches_kv_that_passes_its_checksums(
    engines: Engines, reference: dict[str, list[Any]], module_servers: ServerFactory
) -> None:
    server = module_servers.start("--l1-size", "256MiB")  # its fs L2 holds only this test's
    engine = engines.start(
        "--kvtier", server.rpc, "--no-prefix-caching", "--kvtier-option", "kvtier.shadow_fraction=1"
    )
    try:
        prompt = PROMPTS[:1]  # 700 tokens: 2 full chunks
        assert_same(reference["prompts"][:1], engine.generate(prompt))  # stores both
        warm = engine.generate(prompt)  # chunk 0 loaded; chunk 1 computed, then compared
        assert_same(reference["prompts"][:1], warm)
        assert [o["cached"] for o in warm] == [CHUNK]
        counts = wait_for(lambda: shadow_counts(server), lambda c: c.get("checked") == 1)
        assert (counts["checked"], counts.get("mismatched", 0)) == (1, 0)

        files = wait_for(
            lambda: sorted(server.cache_dir.rglob(f"*{SUFFIX}")), lambda f: len(f) == 2
        )
        swap_payloads(*files)
        assert server.http_get("/clear", method="POST")[0] == 200  # the next hit is from fs
        wrong = engine.generate(prompt)
        assert [o["cached"] for o in wrong] == [CHUNK]  # served: nothing in the cache objects
        counts = wait_for(lambda: shadow_counts(server), lambda c: c.get("checked") == 2)
        assert (counts["checked"], counts.get("mismatched", 0)) == (2, 1)
    finally:
        engines.stop(engine)
    assert "differs from its recomputation" in engine.tail()  # the worker's warning


def test_openai_server_reports_kvtier_hits_as_cached_tokens(
    model_dir: Path, kv_server: Server, tmp_path: Path
) -> None:
    options = EngineOptions(model_dir, 4096, 1 << 30, prefix_caching=False)
    with vllm_server(options, kvtier_transfer(kv_server.rpc), tmp_path / "api.log") as api:
        body = {"model": str(model_dir), "max_tokens": NEW_TOKENS, "temperature": 0}

        def complete(prompt: list[int]) -> dict[str, Any]:
            status, answer = post_json(api.url + "/v1/completions", {**body, "prompt": prompt})
            assert status == 200, answer
            usage: dict[str, Any] = answer["usage"]
            return usage

        fresh = tokens(50, 700)
        before = stored_objects(kv_server)
        assert complete(fresh)["prompt_tokens_details"]["cached_tokens"] == 0  # stores it
        # The answer leaves before its asynchronous saves commit: wait for its 2 chunks.
        chunks = full_chunks([fresh])
        stored = wait_for(lambda: stored_objects(kv_server), lambda n: n >= before + chunks)
        assert stored >= before + chunks
        usage = complete(fresh)  # vLLM's prefix caching is off: any hit is kvtier's
        assert usage["prompt_tokens"] == len(fresh)
        log = (tmp_path / "api.log").read_text()[-3000:]
        assert usage["prompt_tokens_details"]["cached_tokens"] == kvtier_hit(len(fresh)), log


def test_tenants_through_the_connector_and_a_pinned_system_prompt(
    engines: Engines, reference: dict[str, list[Any]], kvtier_server: ServerFactory, tmp_path: Path
) -> None:
    """The engine speaks for tenant acme (its token): requests with acme's
    cache_salt are cached, and their listed system prompt gets pinned; a
    request with another tenant's cache_salt is refused at HELLO and runs
    without the cache, with the same output."""
    tenants = tmp_path / "tenants.toml"
    tenants.write_text(tenants_toml({"acme": 'pin_bytes = "64MiB"'}))
    token, pins = tmp_path / "acme.token", tmp_path / "pins.json"
    token.write_text("acme-token")
    token.chmod(0o600)  # a secret file group or others may read is refused
    pins.write_text(json.dumps([SHARED[:512]]))
    server = kvtier_server.start("--chunk-size", str(CHUNK), "--tenants-file", str(tenants))
    engine = engines.start(
        "--kvtier", server.rpc, "--no-prefix-caching",
        "--kvtier-option", f"kvtier.auth_token_file={token}",
        "--kvtier-option", f"kvtier.pin_prefixes_file={pins}",
    )  # fmt: skip
    try:
        prompt = PROMPTS[0]
        cold = engine.generate([prompt], salts=["acme"])
        warm = engine.generate([prompt], salts=["acme"])
        assert warm[0]["cached"] == kvtier_hit(len(prompt)), engine.tail()
        assert_same(reference["prompts"][:1], cold)
        assert_same(reference["prompts"][:1], warm)
        other = engine.generate([prompt], salts=["globex"])
        assert other[0]["cached"] == 0  # another tenant's namespace: refused, no cache
        assert_same(reference["prompts"][:1], other)

        def status() -> dict[str, Any]:
            return server.status_json("ops-token")

        def settled(s: dict[str, Any]) -> bool:  # the pin and globex's HELLO are asynchronous
            pinned = s["storage"]["l1"]["tenant_pinned_bytes"].get("acme", 0)
            return pinned > 0 and s["server"]["errors"].get("forbidden", 0) >= 1

        seen = wait_for(status, settled)
        assert seen["storage"]["l1"]["tenant_pinned_bytes"]["acme"] > 0
        assert seen["server"]["errors"]["forbidden"] >= 1
        # the savings ledger: the engine reported its own prefill rate and load time
        (row,) = [r for r in call(server.http, "ops-token", "GET", "/admin/ledger")["namespaces"]
                  if r["tenant"] == "acme"]  # fmt: skip
        assert row["rate_samples"] > 0 and row["prefill_s_per_token"] > 0
        assert sum(row["served_tokens"].values()) >= kvtier_hit(len(prompt))
        # Saved is what the engine loaded (not what lookups served) at its own rate.
        assert row["loaded_tokens"] == kvtier_hit(len(prompt))
        assert row["load_s"] > 0 and row["saved_s"] > 0
        assert seen["server"]["pinned_chunks"] == 2  # the 512-token system prompt
    finally:
        engines.stop(engine)
