"""Reuse correctness of the transformers integration on real tiny models.

Every output is compared with ``assert_same_output`` against a no-cache
``KVTierModel(model).generate`` of the same prompt: the same greedy tokens and
max |Δlogit| <= 1e-4 over every generated step. The cases run through the
in-process ``StorageManager`` and through a real ``kvtier serve`` (over its
shared-memory arena and over bytes) where that makes sense. The last tests
show the comparison does fail when loaded KV is off, and that two engine
processes share KV through one server.

The chunk size is 16 tokens; a 70-token prompt has 4 full chunks (64 tokens).
"""

from __future__ import annotations

import copy
import json
import signal
import socket
import struct
import subprocess
import sys
import zlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM, PreTrainedModel

from kvtier.engine.hf import Generation, KVTierModel, kv_layout
from kvtier.engine.link import Hit, ServerLink
from kvtier.engine.shadow import ShadowCheck
from kvtier.keys import TokenHasher, salt_label
from kvtier.l1 import L1Config
from kvtier.process import clean_env, read_line, stop_process
from kvtier.protocol.status import ServerStatus
from kvtier.storage import StorageConfig, StorageManager
from tests.hf_helpers import (
    FAMILIES,
    DelegatingLink,
    PerturbingLink,
    assert_same_output,
    max_logit_diff,
    prompt,
    tiny_model,
)
from tests.integration.harness import ROOT, Server, ServerFactory, wait_for, wait_written_back
from tests.integration.hf_peer import build_prompt

CHUNK = 16
NEW = 4  # tokens generated per request
FAST_FAILURE = {"request_timeout_s": 0.2, "retry_s": 0.1, "heartbeat_s": 0}
BACKENDS = ("local", "server-shm", "server-bytes")


# --------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def models() -> dict[str, PreTrainedModel]:
    return {family: tiny_model(family) for family in FAMILIES}


@pytest.fixture(scope="module")
def shared_server(module_servers: ServerFactory) -> Server:
    """One server for the module's server-backed cases; each test uses prompts
    of its own (``seed``), so tests never hit each other's chunks."""
    return module_servers.start("--chunk-size", str(CHUNK))


@pytest.fixture
def seed(request: pytest.FixtureRequest) -> int:
    """A prompt seed of this test's own."""
    return zlib.crc32(request.node.nodeid.encode())


@dataclass
class Backend:
    """Makes engines on one cache: a ``StorageManager`` here, or a server."""

    kind: str
    storage: StorageManager | None = None
    server: Server | None = None
    engines: list[KVTierModel] = field(default_factory=list)

    def engine(self, model: PreTrainedModel, **options: Any) -> KVTierModel:
        if self.storage is not None:
            engine = KVTierModel(model, storage=self.storage, chunk_size=CHUNK, **options)
        else:
            assert self.server is not None
            client = {"shm": self.kind == "server-shm", "heartbeat_s": 0}
            engine = KVTierModel(model, server=self.server.rpc, client_options=client, **options)
            assert isinstance(engine.link, ServerLink)
            # shared_memory: whether the arena is mapped here, i.e. the shared-memory path runs.
            assert (engine.link.client.shared_memory) == client["shm"]
        self.engines.append(engine)
        return engine

    def assert_nothing_held(self) -> None:
        """No lookup lock, store reservation or request session is left."""
        if self.storage is not None:
            assert self.storage.held_locks() == 0
            assert self.storage.l1_status()["locked_objects"] == 0
            return
        link = self.engines[-1].link
        assert isinstance(link, ServerLink)
        status = link.client.status()
        assert status is not None
        assert status.storage.held_lookup_locks == 0
        assert (status.store_reservations, status.sessions) == (0, 0)

    def close(self) -> None:
        for engine in self.engines:
            engine.close()
        if self.storage is not None:
            self.storage.close()


@pytest.fixture(params=BACKENDS)
def backend(request: pytest.FixtureRequest) -> Iterator[Backend]:
    if request.param == "local":
        config = StorageConfig(l1=L1Config(size_bytes=64 << 20, populate=False))
        made = Backend("local", storage=StorageManager(config))
    else:
        made = Backend(request.param, server=request.getfixturevalue("shared_server"))
    try:
        yield made
    finally:
        made.close()


def reference(model: PreTrainedModel, ids: Sequence[int]) -> Generation:
    return KVTierModel(model).generate(ids, NEW)


def run(
    engine: KVTierModel,
    model: PreTrainedModel,
    ids: Sequence[int],
    *,
    hit: int,
    stored: int,
) -> Generation:
    """Generate through ``engine``; the output must be the reference's and the
    prefill must have reused ``hit`` and stored ``stored`` prompt tokens."""
    got = engine.generate(ids, NEW)
    assert_same_output(reference(model, ids), got)
    p = got.prefill
    assert (p.prompt_tokens, p.hit_tokens, p.stored_tokens) == (len(ids), hit, stored)
    assert p.computed_tokens == len(ids) - hit
    assert not p.load_failed
    return got


def object_bytes(model: PreTrainedModel) -> int:
    return kv_layout(model, CHUNK).object_bytes()


# ------------------------------------------------------- reuse, per backend


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_cold_write_then_hot_read(
    backend: Backend, models: dict[str, PreTrainedModel], family: str, seed: int
) -> None:
    model = models[family]
    engine = backend.engine(model)
    ids = prompt(seed, 70)

    cold = run(engine, model, ids, hit=0, stored=64)
    assert cold.prefill.bytes_stored == 4 * object_bytes(model)
    assert cold.prefill.bytes_loaded == 0 and cold.prefill.tokens_by_tier == {}
    backend.assert_nothing_held()

    hot = run(engine, model, ids, hit=64, stored=0)
    assert hot.prefill.tokens_by_tier == {"L1": 64}
    assert hot.prefill.bytes_loaded == 4 * object_bytes(model)
    backend.assert_nothing_held()


def test_partial_hit_diverging_mid_chunk(
    backend: Backend, models: dict[str, PreTrainedModel], seed: int
) -> None:
    model = models["llama"]
    engine = backend.engine(model)
    first = prompt(seed, 70)
    run(engine, model, first, hit=0, stored=64)

    # Diverges at token 40, inside chunk 2: chunks 0 and 1 are reused, and the
    # new prompt's chunks 2 and 3 are stored.
    second = first[:40] + prompt(seed + 1, 30)
    assert second[40] != first[40]
    run(engine, model, second, hit=32, stored=32)
    backend.assert_nothing_held()
    run(engine, model, second, hit=64, stored=0)
    run(engine, model, first, hit=64, stored=0)  # the first prompt's chunks are still there
    backend.assert_nothing_held()


def test_full_hit_recomputes_only_the_last_token(
    backend: Backend, models: dict[str, PreTrainedModel], seed: int
) -> None:
    model = models["llama"]
    engine = backend.engine(model)
    ids = prompt(seed, 64)  # exactly 4 chunks
    run(engine, model, ids, hit=0, stored=64)
    hot = run(engine, model, ids, hit=63, stored=0)
    assert hot.prefill.computed_tokens == 1
    assert hot.prefill.tokens_by_tier == {"L1": 64}
    # A prefix of a stored prompt that ends on a chunk boundary is a full hit too.
    longer = prompt(seed + 1, 70)
    run(engine, model, longer, hit=0, stored=64)
    run(engine, model, longer[:48], hit=47, stored=0)
    backend.assert_nothing_held()


def test_prompt_shorter_than_a_chunk(
    backend: Backend, models: dict[str, PreTrainedModel], seed: int
) -> None:
    model = models["llama"]
    engine = backend.engine(model)
    for n in (1, 10, CHUNK - 1):
        ids = prompt(seed + n, n)
        for _ in range(2):
            got = run(engine, model, ids, hit=0, stored=0)
            assert got.prefill.bytes_stored == got.prefill.bytes_loaded == 0
    # A prompt of one chunk after it: its chunk is new (nothing was stored before).
    run(engine, model, [*ids, 7], hit=0, stored=CHUNK)
    backend.assert_nothing_held()


@pytest.mark.parametrize("change", ["salt", "revision", "name", "bfloat16"])
def test_identity_change_is_a_miss(
    backend: Backend, models: dict[str, PreTrainedModel], seed: int, change: str
) -> None:
    model = models["llama"]
    base: dict[str, Any] = {"salt": "tenant-a", "revision": "rev-1", "name": "tiny/llama"}
    other_model, other = model, dict(base)
    if change == "bfloat16":  # the same weights and revision: only the dtype differs
        other_model = copy.deepcopy(model).to(torch.bfloat16)
    else:
        other[change] = base[change] + "-other"
    ids = prompt(seed, 70)
    run(backend.engine(model, **base), model, ids, hit=0, stored=64)

    changed = backend.engine(other_model, **other)
    # A miss, and the chunks are stored again under the other namespace. (The
    # miss computes exactly what the reference does; a bfloat16 hit is not held
    # to 1e-4: prefilling in two parts rounds differently in bfloat16.)
    run(changed, other_model, ids, hit=0, stored=64)
    assert changed.prefill(ids).hit_tokens == 64
    # Control: a second engine with the first identity does hit.
    run(backend.engine(model, **base), model, ids, hit=64, stored=0)
    backend.assert_nothing_held()


def test_any_tenant_name_is_a_salt_and_stays_its_own(
    backend: Backend, models: dict[str, PreTrainedModel], seed: int
) -> None:
    """The adversarial run's findings: a salt such as an e-mail address was
    refused at HELLO (through a server the engine ran uncached) or raised (in
    process); and "acme corp" shared KV with the literal salt of its label."""
    model = models["llama"]
    ids = prompt(seed, 70)
    run(backend.engine(model, salt="alice@example.com"), model, ids, hit=0, stored=64)
    run(backend.engine(model, salt="alice@example.com"), model, ids, hit=64, stored=0)
    run(backend.engine(model, salt="acme corp"), model, ids, hit=0, stored=64)
    run(backend.engine(model, salt=salt_label("acme corp")), model, ids, hit=0, stored=64)
    backend.assert_nothing_held()


def test_default_identity_is_a_miss_for_other_weights(
    backend: Backend, models: dict[str, PreTrainedModel], seed: int
) -> None:
    """No revision given: the weights fingerprint keeps other weights apart."""
    model, retrained = models["llama"], tiny_model("llama", seed=1)
    ids = prompt(seed, 70)
    run(backend.engine(model), model, ids, hit=0, stored=64)
    run(backend.engine(retrained), retrained, ids, hit=0, stored=64)
    run(backend.engine(tiny_model("llama", seed=0)), model, ids, hit=64, stored=0)


def test_rope_config_change_is_a_miss(
    backend: Backend, models: dict[str, PreTrainedModel], seed: int
) -> None:
    model = models["llama"]
    stretched = tiny_model(
        "llama", rope_parameters={"rope_type": "default", "rope_theta": 500000.0}
    )  # the same weights: the RoPE base is not a weight
    ids = prompt(seed, 70)
    run(backend.engine(model), model, ids, hit=0, stored=64)
    got = backend.engine(stretched).generate(ids, NEW)
    assert_same_output(reference(stretched, ids), got)  # fails: |Δlogit| ~1e-2
    assert got.prefill.hit_tokens == 0


def test_perturbed_kv_fails_the_comparison(
    backend: Backend, models: dict[str, PreTrainedModel], seed: int
) -> None:
    """The suite can fail: KV off by 0.01 in one chunk is caught."""
    model = models["llama"]
    engine = backend.engine(model)
    ids = prompt(seed, 70)
    expected = reference(model, ids)
    run(engine, model, ids, hit=0, stored=64)

    link = PerturbingLink(engine.link, delta=0.01, chunks=[1])
    engine.link = link
    got = engine.generate(ids, NEW)
    assert got.prefill.hit_tokens == 64 and link.perturbed == 1
    assert max_logit_diff(expected, got) > 10 * 1e-4
    with pytest.raises(AssertionError, match=r"greedy tokens differ|max \|Δlogit\|"):
        assert_same_output(expected, got)

    engine.link = link.inner  # the cache itself was not touched
    run(engine, model, ids, hit=64, stored=0)
    backend.assert_nothing_held()


def test_shadow_check_confirms_reuse_and_catches_wrong_kv(
    backend: Backend, models: dict[str, PreTrainedModel], seed: int
) -> None:
    """Every hit is sampled: the last loaded chunk is recomputed and compared.
    Honest reuse agrees to float32 rounding; KV that is off by 0.5 (what a
    checksum cannot see: another model's or prompt's KV) is a mismatch,
    counted here and, through a server, in the server's metrics."""
    model = models["llama"]
    shadow = ShadowCheck(1.0)
    engine = backend.engine(model, shadow=shadow)
    link = engine.link

    def reported() -> dict[str, int]:  # the server's counts (shared by the module's tests)
        assert isinstance(link, ServerLink)
        status = link.client.status()
        if status is None:
            return {}
        counts = status.server.shadow_chunks
        return {f"shadow_chunks.{k}": getattr(counts, k) for k in counts.__struct_fields__}

    before = reported() if isinstance(link, ServerLink) else {}
    ids = prompt(seed, 70)
    cold = run(engine, model, ids, hit=0, stored=64)
    assert cold.prefill.shadow_error is None  # nothing loaded, nothing to check
    hot = run(engine, model, ids, hit=64, stored=0)
    assert hot.prefill.shadow_error is not None and hot.prefill.shadow_error < 1e-4
    assert shadow.stats().checked_chunks == 1 and shadow.stats().mismatched_chunks == 0

    engine.link = PerturbingLink(link, delta=0.5, chunks=[3])
    wrong = engine.prefill(ids)
    assert wrong.hit_tokens == 64 and wrong.shadow_error is not None
    assert wrong.shadow_error > shadow.tolerance
    assert shadow.stats().checked_chunks == 2 and shadow.stats().mismatched_chunks == 1
    if isinstance(link, ServerLink):
        checked = before.get("shadow_chunks.checked", 0) + 2
        counted = wait_for(reported, lambda c: c.get("shadow_chunks.checked") == checked)
        mismatched = counted["shadow_chunks.mismatched"] - before.get("shadow_chunks.mismatched", 0)
        assert (counted["shadow_chunks.checked"], mismatched) == (checked, 1)
    engine.link = link
    backend.assert_nothing_held()


# ------------------------------------------------- server failures and L2


def engine_status(engine: KVTierModel) -> ServerStatus | None:
    link = engine.link
    assert isinstance(link, ServerLink)
    return link.client.status()


def chunk_files(server: Server, engine: KVTierModel, ids: Sequence[int]) -> list[Path]:
    """The fs L2 file of each full chunk of ``ids``, in prompt order."""
    hasher = TokenHasher(engine.identity.namespace(kv_layout(engine.model, CHUNK)), CHUNK)
    files = []
    for digest in hasher.chunk_hashes(ids):
        (path,) = server.cache_dir.glob(f"*/*/*{digest.hex()}.kv")
        files.append(path)
    return files


def corrupt(path: Path) -> None:
    """Flip payload bytes in place; the size and the header stay as they were."""
    data = bytearray(path.read_bytes())
    (header_len,) = struct.unpack_from("<H", data, 6)
    for i in range(header_len, len(data), 97):
        data[i] ^= 0xFF
    path.write_bytes(data)
    assert path.stat().st_size == len(data)


@pytest.mark.parametrize(
    ("drop_l1", "corrupted", "hit"),
    [("clear", [0, 1, 2, 3], 0), ("clear", [2], 32), ("restart", [0], 0)],
    ids=["clear-all", "clear-chunk-2", "restart-chunk-0"],
)
def test_corrupted_l2_object_is_a_miss(
    kvtier_server: ServerFactory,
    models: dict[str, PreTrainedModel],
    seed: int,
    drop_l1: str,
    corrupted: list[int],
    hit: int,
) -> None:
    model = models["llama"]
    server = kvtier_server.start("--chunk-size", str(CHUNK))
    ids = prompt(seed, 70)
    with KVTierModel(model, server=server.rpc, client_options={"heartbeat_s": 0}) as engine:
        run(engine, model, ids, hit=0, stored=64)
        wait_written_back(lambda: engine_status(engine), 4)
        if drop_l1 == "clear":
            code, body = server.http_get("/clear", method="POST")
            assert (code, json.loads(body)) == (200, {"cleared": 4})
        else:
            server = kvtier_server.restart(server, "--chunk-size", str(CHUNK))
        files = chunk_files(server, engine, ids)
        for chunk in corrupted:
            corrupt(files[chunk])

        # The chunks before the first corrupted one come from the fs L2; the
        # rest are computed (and stored again), and the output is unchanged.
        got = run(engine, model, ids, hit=hit, stored=64 - hit)
        assert got.prefill.tokens_by_tier == ({"fs": hit} if hit else {})
        status = engine_status(engine)
        assert status is not None and status.storage.held_lookup_locks == 0
        run(engine, model, ids, hit=64, stored=0)


def unused_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
    return port


def test_server_down_from_the_start(models: dict[str, PreTrainedModel], seed: int) -> None:
    model = models["llama"]
    address = f"tcp://127.0.0.1:{unused_port()}"
    with KVTierModel(model, server=address, client_options=FAST_FAILURE) as engine:
        assert engine.link is not None and engine.link.chunk_size is None
        for n in (70, 64, 5):
            got = run(engine, model, prompt(seed + n, n), hit=0, stored=0)
            assert got.prefill.tokens_by_tier == {} and got.prefill.bytes_loaded == 0


def test_server_killed_between_requests(
    kvtier_server: ServerFactory, models: dict[str, PreTrainedModel], seed: int
) -> None:
    model = models["llama"]
    server = kvtier_server.start("--chunk-size", str(CHUNK))
    ids = prompt(seed, 70)
    with KVTierModel(
        model, server=server.rpc, client_options=FAST_FAILURE, lookup_timeout_s=0.5
    ) as engine:
        run(engine, model, ids, hit=0, stored=64)
        wait_written_back(lambda: engine_status(engine), 4)
        kvtier_server.kill(server)

        run(engine, model, ids, hit=0, stored=0)  # down: computed, nothing stored
        run(engine, model, prompt(seed + 1, 30), hit=0, stored=0)

        # Back on the same port and fs L2: the engine reconnects and hits from disk.
        kvtier_server.start(
            "--chunk-size", str(CHUNK), cache_dir=server.cache_dir, port=server.port
        )
        link = engine.link
        assert link is not None
        assert wait_for(lambda: link.chunk_size, lambda size: size is not None) == CHUNK
        got = run(engine, model, ids, hit=64, stored=0)
        assert got.prefill.tokens_by_tier == {"fs": 64}


class KillAfterLookup(DelegatingLink):
    """The server dies after the lookup answered a hit, before the load."""

    def __init__(self, inner: Any, kill: Any) -> None:
        super().__init__(inner)
        self.kill = kill

    def lookup(self, request_id: str, hashes: Sequence[bytes]) -> Hit:
        hit = self.inner.lookup(request_id, hashes)
        self.kill()
        return hit


def test_server_dies_between_lookup_and_load(
    kvtier_server: ServerFactory, models: dict[str, PreTrainedModel], seed: int
) -> None:
    model = models["llama"]
    server = kvtier_server.start("--chunk-size", str(CHUNK))
    ids = prompt(seed, 70)
    with KVTierModel(model, server=server.rpc, client_options=FAST_FAILURE) as engine:
        run(engine, model, ids, hit=0, stored=64)
        engine.link = KillAfterLookup(engine.link, lambda: kvtier_server.kill(server))
        got = engine.generate(ids, NEW)
        assert_same_output(reference(model, ids), got)
        assert got.prefill.load_failed
        assert (got.prefill.hit_tokens, got.prefill.computed_tokens) == (0, 70)
        assert got.prefill.stored_tokens == 0


# ------------------------------------------------- two engine processes


@dataclass(eq=False)
class HFPeers:
    """``python -m tests.integration.hf_peer`` processes, killed at teardown."""

    tmp_path: Path
    procs: list[subprocess.Popen[str]] = field(default_factory=list)

    def spawn(self, *args: str) -> subprocess.Popen[str]:
        log = (self.tmp_path / f"hf-peer-{len(self.procs)}.log").open("w")
        with log:
            proc = subprocess.Popen(
                [sys.executable, "-m", "tests.integration.hf_peer", *args],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=log,
                text=True,
                cwd=ROOT,
                env=clean_env(),
            )
        self.procs.append(proc)
        return proc

    def go(self, proc: subprocess.Popen[str]) -> dict[str, Any]:
        """Let a peer started with ``--wait`` run; its JSON line."""
        assert proc.stdin is not None and proc.stdout is not None
        proc.stdin.write("go\n")
        proc.stdin.flush()
        line = read_line(proc.stdout, 60.0)
        if not line:
            log = (self.tmp_path / f"hf-peer-{self.procs.index(proc)}.log").read_text()
            raise AssertionError(f"hf_peer printed nothing (status {proc.poll()}); log:\n{log}")
        assert proc.wait(timeout=30) == 0
        result: dict[str, Any] = json.loads(line)
        return result

    def close(self) -> None:
        for proc in self.procs:
            stop_process(proc, signal.SIGKILL)
            for stream in (proc.stdin, proc.stdout):
                if stream is not None:
                    stream.close()


@pytest.fixture
def hf_peers(tmp_path: Path) -> Iterator[HFPeers]:
    peers = HFPeers(tmp_path)
    try:
        yield peers
    finally:
        peers.close()


@dataclass
class PeerOutput:
    tokens: list[int]
    logits: torch.Tensor


@pytest.mark.slow
def test_two_engine_processes_share_one_server(
    shared_server: Server, hf_peers: HFPeers, models: dict[str, PreTrainedModel], tmp_path: Path
) -> None:
    """The model's directory names it: no other test shares these chunks."""
    model_dir = tmp_path / "model"
    models["llama"].save_pretrained(model_dir)
    common = ["--server", shared_server.rpc, "--model-dir", str(model_dir)]
    common += ["--new-tokens", str(NEW), "--prompt-tokens", "14"]
    shared = ["--prefix-seed", "5", "--prefix-tokens", "56"]  # 3 full chunks and 8 tokens
    # Both start (import torch, load the model) at once; each runs when told to.
    writer = hf_peers.spawn(*common, *shared, "--prompt-seed", "6", "--wait")
    reader = hf_peers.spawn(*common, *shared, "--prompt-seed", "7", "--wait")
    prompts = {seed: build_prompt(5, 56, seed, 14) for seed in (6, 7)}
    assert prompts[6][56] != prompts[7][56]

    loaded = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    stored = hf_peers.go(writer)
    assert (stored["hit_tokens"], stored["stored_tokens"]) == (0, 64)
    assert stored["chunk_size"] == CHUNK
    read = hf_peers.go(reader)
    assert read["hit_tokens"] == 48  # the shared prefix's full chunks
    assert read["stored_tokens"] == 16  # its own fourth chunk

    for out, prompt_seed in ((stored, 6), (read, 7)):
        ids = prompts[prompt_seed]
        assert out["prompt_tokens"] == len(ids) == 70
        got = PeerOutput(out["tokens"], torch.tensor(out["logits"], dtype=torch.float32))
        assert_same_output(KVTierModel(loaded).generate(ids, NEW), got)
