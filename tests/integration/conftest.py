"""Fixtures that run real ``kvtier serve`` processes and peer client processes
(see ``harness``). Whatever a test does, every process it started is stopped
by PID at teardown; a server that then does not exit 0 on SIGTERM, or that
logged a traceback, fails the test in teardown."""

from __future__ import annotations

import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from kvtier.keys import ObjectKey
from kvtier.l1 import L1Config
from kvtier.server.core import CacheServer
from kvtier.server.transport import ServerTransport
from kvtier.storage import StorageConfig, StorageManager
from tests import storage_parts
from tests.integration.harness import PeerFactory, Server, ServerFactory


@pytest.fixture
def kvtier_server(tmp_path: Path) -> Iterator[ServerFactory]:
    """``kvtier_server.start(...)`` / ``.restart(server)`` / ``.kill(server)``."""
    factory = ServerFactory(tmp_path)
    try:
        yield factory
    finally:
        problems = factory.close()
    assert not problems, "\n".join(problems)


@pytest.fixture(scope="module")
def module_servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerFactory]:
    """The same, for servers that a module's tests share (fewer starts and stops)."""
    factory = ServerFactory(tmp_path_factory.mktemp("servers"))
    try:
        yield factory
    finally:
        problems = factory.close()
    assert not problems, "\n".join(problems)


@pytest.fixture(scope="module")
def kv_server(module_servers: ServerFactory) -> Server:
    """One cache server (256 MiB of L1) that a module's engines share."""
    return module_servers.start("--l1-size", "256MiB")


@pytest.fixture
def server(kvtier_server: ServerFactory) -> Server:
    """One plain server (no auth, default TTLs)."""
    return kvtier_server.start()


@pytest.fixture
def peers(tmp_path: Path) -> Iterator[PeerFactory]:
    """``peers.spawn(...)`` / ``.read(proc)`` / ``.run(...)`` / ``.kill(proc)``."""
    factory = PeerFactory(tmp_path)
    try:
        yield factory
    finally:
        factory.close()


@dataclass
class Gated:
    address: str
    core: CacheServer
    storage: StorageManager
    gate: threading.Event  # L2 lookups wait for this


@pytest.fixture
def gated(monkeypatch: pytest.MonkeyPatch) -> Iterator[Gated]:
    """A cache server in this process whose L2 lookups wait until ``gate`` is set."""
    storage = StorageManager(
        StorageConfig(l1=L1Config(size_bytes=8 << 20, populate=False), l2=({"type": "mock"},))
    )
    gate = threading.Event()
    adapter: Any = storage_parts.adapters(storage)[0]
    real_lookup = adapter._lookup

    def gated_lookup(keys: Sequence[ObjectKey]) -> list[bool]:
        assert gate.wait(30), "the test never opened the gate"
        result: list[bool] = real_lookup(keys)
        return result

    monkeypatch.setattr(adapter, "_lookup", gated_lookup)
    core = CacheServer(storage, chunk_size=256)
    transport = ServerTransport(core, "tcp://127.0.0.1:0")
    stop = threading.Event()
    thread = threading.Thread(target=transport.serve, args=(stop,), daemon=True)
    thread.start()
    try:
        yield Gated(transport.address, core, storage, gate)
    finally:
        gate.set()
        stop.set()
        thread.join(10)
        core.close()
        storage.close()


CHAT_TEMPLATE = "{% for m in messages %}{{ m['content'] }} {% endfor %}"


def random_model(directory: Path, model_class: Any, config: Any) -> Path:
    """``model_class`` built from ``config`` with seed-0 random weights, saved
    in ``directory`` with a word-level tokenizer of its vocabulary."""
    import torch

    from kvtier.models import word_tokenizer

    torch.manual_seed(0)
    model_class(config).save_pretrained(directory)
    word_tokenizer(config.vocab_size).save_pretrained(directory)
    return directory


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 2-layer Llama (hidden 256, 4 query / 2 KV heads of dim 64), random
    weights, fp32, with a word-level tokenizer (``t0`` ... ``t1023``) whose
    chat template is the messages' words, in turn."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from kvtier.models import word_tokenizer

    directory = tmp_path_factory.mktemp("vllm-model")
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=1024,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=4096,
        tie_word_embeddings=False,
    )
    LlamaForCausalLM(config).save_pretrained(directory)
    tokenizer = word_tokenizer(config.vocab_size)
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(directory)
    return directory
