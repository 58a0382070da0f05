"""L2 codecs under the transformers integration: KV that comes back from an
L2 stored with zstd gives the no-cache output exactly; a model that lets
slow tiers keep its KV as int8 gets keys of its own, and its hits from L2
are close to, not equal to, exact KV."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
import transformers

from kvtier.engine.hf import KVTierModel
from kvtier.l1 import L1Config
from kvtier.storage import StorageConfig, StorageManager
from tests.hf_helpers import assert_same_output, prompt, tiny_model

CHUNK = 16


@pytest.fixture(scope="module")
def llama() -> transformers.PreTrainedModel:
    return tiny_model("llama")


def tiered(codec: str) -> StorageManager:
    return StorageManager(
        StorageConfig(
            l1=L1Config(size_bytes=64 << 20, populate=False),
            l2=({"type": "mock", "codec": codec},),
        )
    )


@pytest.fixture
def zstd_storage() -> Iterator[StorageManager]:
    with tiered("zstd") as storage:
        yield storage


@pytest.fixture
def int8_storage() -> Iterator[StorageManager]:
    with tiered("int8") as storage:
        yield storage


def from_l2(engine: KVTierModel, storage: StorageManager, ids: list[int]) -> None:
    """Store ``ids``' chunks, write them back to L2, and empty L1."""
    engine.prefill(ids)
    assert storage.flush(30)
    storage.clear_l1()


def test_a_zstd_l2_gives_back_exact_kv(
    llama: transformers.PreTrainedModel, zstd_storage: StorageManager
) -> None:
    engine = KVTierModel(llama, storage=zstd_storage, chunk_size=CHUNK)
    ids = prompt(3, 70)
    from_l2(engine, zstd_storage, ids)
    got = engine.generate(ids, 4)
    assert got.prefill.tokens_by_tier == {"mock": 64}
    assert_same_output(KVTierModel(llama).generate(ids, 4), got)
    stored = zstd_storage.status()["l2"]["mock"]  # type: ignore[index]
    assert stored["codec"] == "zstd" and stored.get("corrupt_objects", 0) == 0


def test_int8_kv_has_keys_of_its_own_and_comes_back_close(
    llama: transformers.PreTrainedModel, int8_storage: StorageManager
) -> None:
    ids = prompt(4, 70)
    exact = KVTierModel(llama, storage=int8_storage, chunk_size=CHUNK)
    lossy = KVTierModel(llama, storage=int8_storage, chunk_size=CHUNK, lossy_codec="int8")
    from_l2(exact, int8_storage, ids)
    assert lossy.prefill(ids).hit_tokens == 0  # exact KV is never served as lossy's, nor back
    from_l2(lossy, int8_storage, ids)
    assert exact.prefill(ids).tokens_by_tier == {"mock": 64}  # stored as it is: exact
    int8_storage.clear_l1()
    sizes = dict(int8_storage.held_sizes("mock"))
    assert len(sizes) == 8 and len(set(sizes.values())) == 2  # 4 exact and 4 int8 objects
    got = lossy.prefill(ids)
    assert got.tokens_by_tier == {"mock": 64} and not got.load_failed
    reference = KVTierModel(llama).prefill(ids)
    error = float((got.logits - reference.logits).abs().max())
    assert 0 < error < 0.05 * float(reference.logits.abs().max())
    agree = torch.equal(got.logits.argmax(), reference.logits.argmax())
    assert agree
