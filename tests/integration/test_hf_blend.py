"""Segments through a real ``kvtier serve``: one engine computes and stores
a prompt's segments, another engine (its own client) blends them into a
prompt with the documents in another order; they come back from L1, and from
the fs L2 after a restart; another tenant's engine never sees them; and the
blend at ratio 1 is the no-cache reference, token for token."""

from __future__ import annotations

import pytest
import torch
from transformers import PreTrainedModel

from kvtier.blend import BlendConfig
from kvtier.engine.hf import KVTierModel
from kvtier.engine.link import ServerLink
from tests.hf_helpers import assert_same_output, prompt, tiny_model
from tests.integration.harness import Server, ServerFactory, wait_written_back

CHUNK = 16


@pytest.fixture(scope="module")
def model() -> PreTrainedModel:
    return tiny_model("llama", num_hidden_layers=4)


def rag(parts: list[list[int]], question: list[int]) -> tuple[list[int], list[tuple[int, int]]]:
    ids: list[int] = []
    spans = []
    for part in parts:
        spans.append((len(ids), len(ids) + len(part)))
        ids += part
    return ids + question, spans


SYSTEM, DOCS = prompt(20, 11), [prompt(21, 30), prompt(22, 9), prompt(23, 50)]


def engine(model: PreTrainedModel, server: Server, salt: str = "acme") -> KVTierModel:
    return KVTierModel(model, server=server.rpc, salt=salt)


@pytest.mark.slow
def test_segments_are_shared_through_the_server_in_any_order(
    kvtier_server: ServerFactory, model: PreTrainedModel
) -> None:
    server = kvtier_server.start("--chunk-size", str(CHUNK))
    writer = engine(model, server)
    ids, spans = rag([SYSTEM, *DOCS], prompt(24, 6))
    # documents computed right after the system prompt, found at any offset
    first = writer.prefill(ids, segments=spans, blend=BlendConfig(at_offset=False))
    assert first.blend is not None and first.blend.segments_found == 0 and first.bytes_stored

    reader = engine(model, server)
    shuffled, spans2 = rag([SYSTEM, DOCS[2], DOCS[0], DOCS[1]], prompt(25, 8))
    got = reader.generate(
        shuffled, 4, segments=spans2, blend=BlendConfig(ratio=1.0, at_offset=False)
    )
    assert got.prefill.blend is not None and got.prefill.blend.segments_found == 4
    assert got.prefill.tokens_by_tier == {"L1": (1 + 2 + 1 + 4) * CHUNK}
    assert_same_output(KVTierModel(model).generate(shuffled, 4), got)

    stranger = engine(model, server, salt="globex")
    other = stranger.prefill(shuffled, segments=spans2, blend=BlendConfig(at_offset=False))
    assert other.blend is not None and other.blend.segments_found == 0
    assert isinstance(reader.link, ServerLink)
    wait_written_back(reader.link.client.status, 8 + 8)  # both tenants' pieces are on disk
    for client in (writer, reader, stranger):
        client.close()
    restarted = kvtier_server.restart(server, "--chunk-size", str(CHUNK))
    after = engine(model, restarted)
    placed = BlendConfig(ratio=0.15, at_offset=False)
    again = after.prefill(shuffled, segments=spans2, blend=placed)
    assert again.blend is not None and again.blend.segments_found == 4
    assert set(again.tokens_by_tier) == {"fs"}
    before = KVTierModel(model).prefill(shuffled, segments=spans2, blend=placed)
    assert torch.allclose(again.logits, before.logits, atol=1e-5)
    after.close()
