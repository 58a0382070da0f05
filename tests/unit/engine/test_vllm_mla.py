"""The connector's MLA layout, its rank rule and its refusals, on stand-ins
for vLLM's configuration (vLLM must be importable: the page format asks its
platform; no engine runs)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch

pytest.importorskip("vllm")
from kvtier.counters import Counters
from kvtier.engine.vllm.clients import ClientPool
from kvtier.engine.vllm.handoff import Consume
from kvtier.engine.vllm.handoff_steps import HandoffSteps
from kvtier.engine.vllm.pages import PagedKV, engine_kv_layout, latent_format
from kvtier.engine.vllm.settings import ConnectorSettings
from kvtier.protocol.handoff import HandoffOutcome

pytestmark = pytest.mark.engine  # needs vLLM (no engine runs)

BLOCK = 16
CHUNK = 64
LATENT = 576


class ModelConfig:
    model = "org/tiny-mla"
    revision = "r1"
    dtype = torch.float32
    hf_config = SimpleNamespace(to_dict=lambda: {"model_type": "deepseek_v2"})

    def __init__(self, use_mla: bool) -> None:
        self.use_mla = use_mla

    def get_num_layers(self, parallel: Any) -> int:
        return 2

    def get_num_kv_heads(self, parallel: Any) -> int:
        return 1 if self.use_mla else max(1, 2 // parallel.tensor_parallel_size)

    def get_total_num_kv_heads(self) -> int:
        return 1 if self.use_mla else 2

    def get_head_size(self) -> int:
        return LATENT if self.use_mla else 64


def vllm_config(tp: int = 1, mla: bool = True, cache_dtype: str = "auto") -> Any:
    return SimpleNamespace(
        model_config=ModelConfig(mla),
        parallel_config=SimpleNamespace(pipeline_parallel_size=1, tensor_parallel_size=tp),
        cache_config=SimpleNamespace(block_size=BLOCK, cache_dtype=cache_dtype),
        attention_config=SimpleNamespace(backend=None),
    )


def test_an_mla_chunk_is_one_latent_object_whatever_the_tp_size() -> None:
    tp1, tp2 = (engine_kv_layout(vllm_config(tp), CHUNK) for tp in (1, 2))
    assert tp1 == tp2  # the same namespace: TP 2 stores what TP 1 loads
    assert (tp1.kind, tp1.kv_heads, tp1.head_dim, tp1.num_ranks) == ("latent", 1, LATENT, 1)
    assert tp1.object_bytes() == 2 * LATENT * 4 * CHUNK  # no K and V: one latent per token
    assert latent_format(tp1.format) and tp1.format.endswith(f"mla-bs{BLOCK}")
    dense = engine_kv_layout(vllm_config(mla=False), CHUNK)
    assert not latent_format(dense.format) and dense.digest() != tp1.digest()


def test_an_fp8_mla_cache_is_refused_by_name() -> None:
    with pytest.raises(ValueError, match="kv_cache_dtype fp8"):
        engine_kv_layout(vllm_config(cache_dtype="fp8"), CHUNK)


@pytest.mark.parametrize(
    ("mla", "rank", "stored_as", "replica"),
    [(True, 0, 0, False), (True, 1, 0, True), (True, -1, -1, False), (False, 1, 1, False)],
)
def test_only_rank_0_writes_an_mla_chunk_every_rank_reads_it(
    mla: bool, rank: int, stored_as: int, replica: bool
) -> None:
    pool = ClientPool(vllm_config(2, mla), ConnectorSettings(), rank, "test")
    assert (pool.rank, pool.replica, pool.num_ranks) == (stored_as, replica, 1 if mla else 2)


def test_latent_pages_round_trip_through_an_object() -> None:
    layout = engine_kv_layout(vllm_config(), CHUNK)
    caches = {f"model.layers.{i}.self_attn.attn": torch.randn(9, 1, BLOCK, LATENT) for i in (0, 1)}
    paged = PagedKV(caches, layout, BLOCK)
    chunk = torch.empty(layout.object_bytes(), dtype=torch.uint8).numpy()
    paged.copy_out([[3, 1, 7, 5]], chunk)
    target = {f"model.layers.{i}.self_attn.attn": torch.zeros(9, 1, BLOCK, LATENT) for i in (0, 1)}
    PagedKV(target, layout, BLOCK).scatter(chunk, [dict(enumerate([0, 2, 4, 6]))])
    for name, source in caches.items():
        assert torch.equal(target[name][[0, 2, 4, 6]], source[[3, 1, 7, 5]])


@pytest.mark.parametrize(
    ("mla", "producer_format"), [(False, "vllm-cpu-cpu_mla-bs16"), (True, "vllm-cpu-vec16-bs16")]
)
def test_a_hand_off_between_mla_and_non_mla_engines_is_refused(
    mla: bool, producer_format: str
) -> None:
    steps = HandoffSteps(
        ClientPool(vllm_config(1, mla), ConnectorSettings(), 0, "test"),
        ConnectorSettings(),
        Counters(),
    )
    role = Consume("h1", 128, "recompute", 0.0, "c", producer_format=producer_format)
    steps.name_source_chunks(role, list(range(128)), "", CHUNK)
    assert role.outcome == HandoffOutcome.LAYOUT_MISMATCH
    assert "MLA" in role.cause and producer_format in role.cause
    assert role.source_hashes == []
