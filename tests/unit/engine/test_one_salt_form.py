"""One tenant salt, one namespace: the transformers integration, the vLLM
connector and the router hash a prompt under the same model and salt to the
same chunk hashes, whatever the salt (one that is not key-safe, with a space
or a '/', or one shaped like a hashed label, is hashed into its label first:
by all of them, once). Each path is taken as it runs: the transformers
engine's own lookup, the connector's hasher for a request's ``cache_salt``,
and the router's hasher over the namespace a cache server reports."""

from __future__ import annotations

from collections.abc import Sequence
from types import SimpleNamespace

import numpy as np
import pytest
import transformers

from kvtier.engine.hf import KVTierModel, kv_layout
from kvtier.engine.link import Hit
from kvtier.engine.vllm import clients
from kvtier.engine.vllm.settings import ConnectorSettings
from kvtier.keys import NamespaceLabel, model_label, salt_label
from kvtier.layout import KVLayout
from kvtier.protocol import messages as p
from kvtier.router.core import Node, Router
from kvtier.server.registrations import hash_namespace
from kvtier.storage import StorageManager
from tests.hf_helpers import DelegatingLink, prompt, tiny_model

MODEL = "org/tiny"  # a hub id given with its revision: nothing is read from the hub cache
REVISION = "r1"
CHUNK = 16
SALTS = ["", "acme", "acme corp", "team/a", "s-" + "0" * 32]
UNSAFE = ["acme corp", "team/a", "s-" + "0" * 32]  # each hashed into its label
IDS = prompt(7, 3 * CHUNK + 5)


class RecordingLink(DelegatingLink):
    """Passes every call on, keeping the hashes of each lookup."""

    def __init__(self, inner: object) -> None:
        super().__init__(inner)  # type: ignore[arg-type]
        self.looked_up: list[list[bytes]] = []

    def lookup(self, request_id: str, hashes: Sequence[bytes]) -> Hit:
        self.looked_up.append(list(hashes))
        return super().lookup(request_id, hashes)


@pytest.fixture(scope="module")
def llama() -> transformers.PreTrainedModel:
    return tiny_model("llama")


def through_transformers(
    llama: transformers.PreTrainedModel, storage: StorageManager, salt: str
) -> list[bytes]:
    engine = KVTierModel(
        llama, storage=storage, chunk_size=CHUNK, name=MODEL, revision=REVISION, salt=salt
    )
    link = RecordingLink(engine.link)
    engine.link = link
    engine.prefill(IDS)
    (hashes,) = link.looked_up
    return hashes


def connector_pool(
    llama: transformers.PreTrainedModel, monkeypatch: pytest.MonkeyPatch
) -> clients.ClientPool:
    """The connector's pool for vLLM serving ``MODEL``: the KV layout is the
    transformers engine's, so that only the namespace's identity and salt
    can tell the two apart (no client is made: nothing connects)."""

    def layout(vllm_config: object, chunk_size: int, groups: object = None) -> KVLayout:
        return kv_layout(llama, chunk_size)

    monkeypatch.setattr(clients, "engine_kv_layout", layout)
    model_config = SimpleNamespace(
        model=MODEL,
        revision=REVISION,
        hf_config=llama.config,
        get_total_num_kv_heads=lambda: llama.config.num_key_value_heads,
    )
    vllm_config = SimpleNamespace(
        model_config=model_config, cache_config=SimpleNamespace(block_size=CHUNK)
    )
    return clients.ClientPool(vllm_config, ConnectorSettings(), rank=0, client_id="test")


def through_vllm(pool: clients.ClientPool, salt: str) -> list[bytes]:
    cache_salt = pool.settings.salt_for(salt or None)  # a request's, as vLLM hands it over
    return pool.hasher(cache_salt, CHUNK).chunk_hashes(IDS)


def through_router(pool: clients.ClientPool, layout: KVLayout, salt: str) -> list[bytes]:
    """The router hashes with the namespace a cache server reports for the
    connector's HELLO (``/status`` ``hash_namespaces``) and the request's salt."""
    identity = pool.identity
    hello = p.Hello(
        version=p.PROTOCOL_VERSION,
        client_id="test",
        model=model_label(identity.model),
        layouts=[p.LayoutSpec.of(layout)],
        revision=identity.revision,
        lora=identity.lora,
        hash_model=identity.model,
    )
    router = Router([Node(0, "engine", "http://engine")])
    router.set_namespace(hash_namespace(hello, {0: layout}, CHUNK))
    hashes, chunk_size = router.chunk_hashes(np.asarray(IDS, dtype=np.uint32), salt)
    assert chunk_size == CHUNK
    return hashes


@pytest.mark.parametrize("salt", SALTS)
def test_the_engines_and_the_router_hash_a_salt_alike(
    llama: transformers.PreTrainedModel,
    storage: StorageManager,
    monkeypatch: pytest.MonkeyPatch,
    salt: str,
) -> None:
    pool = connector_pool(llama, monkeypatch)
    hf = through_transformers(llama, storage, salt)
    assert len(hf) == len(IDS) // CHUNK
    assert through_vllm(pool, salt) == hf
    assert through_router(pool, kv_layout(llama, CHUNK), salt) == hf


@pytest.mark.parametrize("salt", SALTS)
def test_the_keys_carry_the_salt_label_that_is_hashed(
    llama: transformers.PreTrainedModel, monkeypatch: pytest.MonkeyPatch, salt: str
) -> None:
    """The salt in the hash root is the salt label the engine's keys carry
    (and the router's prefetches name): labelled once, never twice."""
    label = NamespaceLabel.named(MODEL, salt)
    assert label.salt == salt_label(salt)
    assert (label.salt != salt) == (salt in UNSAFE)
    engine = KVTierModel(llama, name=MODEL, revision=REVISION, salt=salt)  # no cache
    assert engine.identity.label == label
    assert engine.identity.namespace(kv_layout(llama, CHUNK)).salt == label.salt
    pool = connector_pool(llama, monkeypatch)
    hasher = pool.hasher(pool.settings.salt_for(salt or None), CHUNK)
    assert hasher.namespace.salt == label.salt


def test_each_salt_is_its_own_namespace(
    llama: transformers.PreTrainedModel, storage: StorageManager
) -> None:
    """The salts above are all told apart (so the test above compares
    hashes that a wrong salt would change)."""
    first = {salt: through_transformers(llama, storage, salt)[0] for salt in SALTS}
    assert len(set(first.values())) == len(SALTS)
