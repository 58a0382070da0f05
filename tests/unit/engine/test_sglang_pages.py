"""The SGLang backend's page format and keys (``kvtier.engine.sglang.pages``),
which load without SGLang: a pipeline stage and a context-parallel rank are in
the layout (so in the key root and the server's digest), decode context
parallelism is refused by name, and the chunk-size message names what helps.
The pool here stands in for SGLang's host pool with the attributes the format
reads; tests/integration/test_sglang_backend.py runs SGLang's own pools."""

from __future__ import annotations

from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from kvtier.engine.identity import ModelIdentity
from kvtier.engine.sglang.pages import EngineShard, PageFormat, PageKeys, chunk_size_mismatch

IDENTITY = ModelIdentity(model="tiny-test-model", salt="team-a")


@dataclass
class Pool:
    """SGLang's ``MHATokenToKVPoolHost`` as ``PageFormat.of`` reads it."""

    start_layer: Any = 0
    layer_num: int = 2
    page_size: int = 16
    head_num: int = 2
    head_dim: int = 16
    layout: str = "layer_first"
    dtype: torch.dtype = field(default=torch.bfloat16)

    def get_dummy_flat_data_page(self) -> torch.Tensor:
        size = 2 * self.layer_num * self.page_size * self.head_num * self.head_dim
        return torch.zeros(size, dtype=self.dtype)


def config(**fields: Any) -> SimpleNamespace:
    """SGLang's ``HiCacheStorageConfig`` fields the shard reads."""
    values = {"tp_rank": 0, "tp_size": 1, "is_mla_model": False, "pp_rank": 0, "pp_size": 1}
    values |= {"attn_cp_rank": 0, "attn_cp_size": 1, "dcp_size": 1}
    return SimpleNamespace(**(values | fields))


def page_format(pool: Pool, **fields: Any) -> PageFormat:
    return PageFormat.of(pool, EngineShard.of(config(**fields)))


def test_pipeline_stages_of_equal_layer_count_have_their_own_layout_and_keys() -> None:
    first = page_format(Pool(start_layer=0), pp_rank=0, pp_size=2)
    second = page_format(Pool(start_layer=2), pp_rank=1, pp_size=2)
    assert first.layout.format == "sglang-layer_first-pp0of2-layers0-2"
    assert second.layout.format == "sglang-layer_first-pp1of2-layers2-4"
    assert first.layout.digest() != second.layout.digest()
    keys = [PageKeys.of(IDENTITY, f.layout).hashes(["same-tokens"]) for f in (first, second)]
    assert keys[0] != keys[1]
    # Another split of the layers over the stages is another layout too.
    moved = page_format(Pool(start_layer=1), pp_rank=1, pp_size=2)
    assert moved.layout.digest() != second.layout.digest()


def test_context_parallel_ranks_have_their_own_layout() -> None:
    formats = [page_format(Pool(), attn_cp_rank=r, attn_cp_size=2) for r in (0, 1)]
    assert [f.layout.format for f in formats] == [
        "sglang-layer_first-cp0of2",
        "sglang-layer_first-cp1of2",
    ]
    both = page_format(Pool(start_layer=2), pp_rank=1, pp_size=2, attn_cp_rank=1, attn_cp_size=2)
    assert both.layout.format == "sglang-layer_first-pp1of2-layers2-4-cp1of2"


def test_one_stage_and_one_cp_rank_keep_the_format_they_always_had() -> None:
    assert page_format(Pool()).layout.format == "sglang-layer_first"
    assert EngineShard.of(config(tp_rank=1, tp_size=2)).label == "tp1"
    assert EngineShard.of(config(pp_rank=1, pp_size=2, attn_cp_size=2)).label == "tp0-pp1-cp0"


def test_a_stage_whose_pool_names_no_first_layer_is_refused() -> None:
    with pytest.raises(ValueError, match="--pp-size 1"):
        page_format(Pool(start_layer=None), pp_rank=1, pp_size=2)


def test_decode_context_parallelism_is_refused_by_name() -> None:
    with pytest.raises(ValueError, match="--dcp-size 2"):
        EngineShard.of(config(tp_rank=1, tp_size=2, is_mla_model=True, dcp_size=2))


def test_the_chunk_size_message_names_what_helps() -> None:
    """A page-64 engine fixed the server at 64 on ``--chunk-size 16``: a
    page-16 engine's log must not send it to restart with ``--chunk-size 16``
    (the page-64 engine fixes 64 again)."""
    text = chunk_size_mismatch(64, 16)
    assert "restart kvtier serve with --chunk-size 16" not in text
    assert "chunk size is 64 tokens and SGLang's page size is 16" in text
    assert "--chunk-size is a minimum: the first engine that registers rounds it up" in text
    assert "whose chunk size comes out as 16: kvtier serve --chunk-size 16, shared only" in text
    assert "SGLang engines of another page size need a server of their own" in text
    assert text.endswith("Or run this engine with --page-size 64")
