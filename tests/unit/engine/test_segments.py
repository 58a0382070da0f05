"""Blended prefills through ``KVTierModel`` with a ``StorageManager`` in
process: the invariants against references (ratio 1 = full prefill, ratio 0 =
plain concatenation), segments of any length stored once and found again,
no prefix chunk ever stored from blended KV, no reuse across models, dtypes
or tenants, clear errors for bad spans and unsupported models, and a failing
cache that only costs a recomputation."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import transformers
from transformers import DynamicCache, GPT2Config, GPT2LMHeadModel

from kvtier.blend import BlendConfig, RopeShift
from kvtier.engine.hf import KVTierModel
from kvtier.engine.link import LocalLink
from kvtier.engine.tensors import dynamic_cache
from kvtier.protocol.client import Consume
from kvtier.storage import StorageManager
from tests.hf_helpers import TOLERANCE, DelegatingLink, assert_same_output, prompt, tiny_model
from tests.ledger import assert_clean

CHUNK = 16
# a system prompt at 0 (exact), documents of 5, 16 and 40 tokens (shorter than,
# as long as and longer than a chunk), then a question
PARTS = [prompt(1, 12), prompt(2, 5), prompt(3, 16), prompt(4, 40), prompt(5, 9)]


def joined(parts: list[list[int]]) -> tuple[list[int], list[tuple[int, int]]]:
    """The prompt and the spans of every part but the last (the question)."""
    ids: list[int] = []
    spans = []
    for part in parts[:-1]:
        spans.append((len(ids), len(ids) + len(part)))
        ids += part
    return ids + parts[-1], spans


@pytest.fixture(scope="module")
def llama() -> transformers.PreTrainedModel:
    return tiny_model("llama", num_hidden_layers=4)


def concatenated(
    model: transformers.PreTrainedModel,
    parts: list[list[int]],
    anchored: bool,
    at_offset: bool = True,
) -> torch.Tensor:
    """Plain concatenation, built by hand: each part's KV computed alone (or,
    ``anchored``, each but the first after the first: ``at_offset``, at the
    largest power of two <= its offset past the first part's end), K moved
    to its place, the question run on top. Its last logits."""
    shift = RopeShift.of(model)
    keys: list[list[torch.Tensor]] = [[] for _ in range(model.config.num_hidden_layers)]
    values: list[list[torch.Tensor]] = [[] for _ in range(model.config.num_hidden_layers)]
    offset = 0
    with torch.inference_mode():
        for i, part in enumerate(parts[:-1]):
            before = parts[0] if anchored and i > 0 else []
            past = offset - len(before)
            gap = 2 ** int(math.log2(past)) if before and at_offset and past > 0 else 0
            cache = DynamicCache()
            if before:
                model(torch.tensor([before]), past_key_values=cache, use_cache=True)
            at = torch.arange(len(part)) + len(before) + gap
            model(
                torch.tensor([part]), position_ids=at[None], past_key_values=cache, use_cache=True
            )
            for n, layer in enumerate(cache.layers):
                own = slice(len(before), None)
                keys[n].append(shift.rotate(layer.keys[:, :, own], past - gap))
                values[n].append(layer.values[:, :, own])
            offset += len(part)
        cache = dynamic_cache(
            [torch.cat(k, dim=2) for k in keys], [torch.cat(v, dim=2) for v in values]
        )
        out = model(torch.tensor([parts[-1]]), past_key_values=cache, use_cache=True)
    return out.logits[0, -1].float()


def test_ratio_one_is_full_prefill_and_generation_goes_on_from_it(
    llama: transformers.PreTrainedModel, storage: StorageManager
) -> None:
    ids, spans = joined(PARTS)
    reference = KVTierModel(llama).generate(ids, 6)
    engine = KVTierModel(llama, storage=storage, chunk_size=CHUNK)
    for mask in ("exact", "bottom_right"):  # with every position selected the two agree
        got = engine.generate(ids, 6, segments=spans, blend=BlendConfig(ratio=1.0, mask=mask))
        assert_same_output(reference, got, TOLERANCE)
        assert got.prefill.blend is not None and got.prefill.blend.work == 1.0
    assert_clean(storage)


@pytest.mark.parametrize(("anchored", "at_offset"), [(True, True), (True, False), (False, True)])
def test_ratio_zero_is_plain_concatenation(
    llama: transformers.PreTrainedModel, storage: StorageManager, anchored: bool, at_offset: bool
) -> None:
    ids, spans = joined(PARTS)
    engine = KVTierModel(llama, storage=storage, chunk_size=CHUNK)
    expected = concatenated(llama, PARTS, anchored, at_offset)
    other = concatenated(llama, PARTS, not anchored, at_offset)
    assert (expected - other).abs().max().item() > 0.01  # the anchor changes the KV
    if anchored:  # and so does the offset it is computed at (less, in this tiny model)
        placed = concatenated(llama, PARTS, anchored, not at_offset)
        assert (expected - placed).abs().max().item() > 10 * TOLERANCE
    for found in (0, 4):  # computed and stored, then loaded
        config = BlendConfig(ratio=0.0, anchor=anchored, at_offset=at_offset)
        got = engine.prefill(ids, segments=spans, blend=config)
        assert (got.logits - expected).abs().max().item() <= TOLERANCE
        full = KVTierModel(llama).prefill(ids).logits
        assert (got.logits - full).abs().max().item() > 0.01  # and it is not full prefill
        assert got.blend is not None and got.blend.segments_found == found
        assert got.blend.layer_tokens == [len(PARTS[-1])] * 4
        assert got.blend.recomputed_tokens == 0


def test_a_document_right_after_its_anchor_is_exact_and_never_recomputed(
    llama: transformers.PreTrainedModel, storage: StorageManager
) -> None:
    parts = [PARTS[0], PARTS[3], PARTS[4]]  # the system prompt, one document, the question
    ids, spans = joined(parts)
    full = KVTierModel(llama).prefill(ids).logits
    engine = KVTierModel(llama, storage=storage, chunk_size=CHUNK)
    for found in (0, 2):  # computed and stored, then loaded
        got = engine.prefill(ids, segments=spans, blend=BlendConfig(ratio=0.15))
        assert got.blend is not None and got.blend.segments_found == found
        assert (got.blend.exact_tokens, got.blend.candidate_tokens) == (52, 0)
        assert got.blend.layer_tokens == [len(parts[-1])] * 4  # the question only
        assert (got.logits - full).abs().max().item() <= TOLERANCE  # full prefill's
    # computed alone the same document lacks the system prompt: a candidate
    alone = engine.prefill(ids, segments=spans, blend=BlendConfig(ratio=0.0, anchor=False))
    assert alone.blend is not None and alone.blend.candidate_tokens == 40
    assert (alone.logits - full).abs().max().item() > 0.01


def test_segments_are_stored_alone_once_then_found_in_l1(
    llama: transformers.PreTrainedModel, storage: StorageManager
) -> None:
    ids, spans = joined(PARTS)
    engine = KVTierModel(llama, storage=storage, chunk_size=CHUNK)
    config = BlendConfig(ratio=0.3)
    first = engine.prefill(ids, segments=spans, blend=config)
    assert first.blend is not None
    assert (first.blend.segments, first.blend.segments_found) == (4, 0)
    pieces = 1 + 1 + 1 + 3  # 12, 5, 16 and 40 tokens at 16 per piece
    assert first.bytes_stored == pieces * engine._segments().layout.object_bytes()
    assert first.hit_tokens == 0 and first.blend.computed_alone_tokens == 73
    assert storage.l1_status()["resident_objects"] == pieces

    second = engine.prefill(ids, segments=spans, blend=config)
    assert second.blend is not None and second.blend.segments_found == 4
    assert second.tokens_by_tier == {"L1": pieces * CHUNK} and second.bytes_stored == 0
    assert torch.equal(second.logits, first.logits)
    stats = second.blend
    # exact: the system prompt and the document right after it, where it was computed
    assert (stats.reused_tokens, stats.exact_tokens, stats.candidate_tokens) == (73, 17, 56)
    # every layer: the question and the 0.3 x 56 = 17 candidates it reads most; its
    # first pass (the question alone, every layer) counts in the work
    question = len(PARTS[-1])
    assert stats.layer_tokens == [question + round(0.3 * 56)] * len(stats.layer_tokens)
    assert stats.work == pytest.approx((question + 17 + question) / len(ids))
    assert storage.l1_status()["resident_objects"] == pieces
    assert_clean(storage)


def test_the_same_documents_in_another_order_reuse_the_same_objects(
    llama: transformers.PreTrainedModel, storage: StorageManager
) -> None:
    engine = KVTierModel(llama, storage=storage, chunk_size=CHUNK)
    ids, spans = joined(PARTS)
    engine.prefill(ids, segments=spans, blend=BlendConfig(at_offset=False))
    shuffled = [PARTS[0], PARTS[3], PARTS[1], PARTS[2], prompt(9, 7)]
    ids2, spans2 = joined(shuffled)
    got = engine.prefill(ids2, segments=spans2, blend=BlendConfig(ratio=1.0, at_offset=False))
    assert got.blend is not None and got.blend.segments_found == 4
    full = KVTierModel(llama).prefill(ids2).logits
    assert (got.logits - full).abs().max().item() <= TOLERANCE


def test_at_offset_a_document_is_found_again_within_the_same_power_of_two(
    llama: transformers.PreTrainedModel, storage: StorageManager
) -> None:
    engine = KVTierModel(llama, storage=storage, chunk_size=CHUNK)
    document = PARTS[3]

    def blend(before: int) -> tuple[int, torch.Tensor]:
        """The prompt with ``before`` tokens between the system prompt and the
        document: the segments found, the logits."""
        ids, spans = joined([PARTS[0], prompt(20 + before, before), document, PARTS[4]])
        got = engine.prefill(ids, segments=spans, blend=BlendConfig(ratio=0.0))
        assert got.blend is not None
        return got.blend.segments_found, got.logits

    found, computed = blend(6)  # all computed; the document 4 past the system prompt
    assert found == 0
    assert blend(5)[0] == 2  # 5 tokens in: 4 past it again, found with the system prompt
    found, loaded = blend(6)  # the same prompt again: every segment loaded, the same logits
    assert found == 3 and torch.equal(loaded, computed)
    assert blend(8)[0] == 1  # 8 past it: another object
    # computed 8 past the system prompt and placed 8 past it, the document sits where
    # it was computed, but its KV never saw the 8 tokens before it: still a candidate
    ids, spans = joined([PARTS[0], prompt(28, 8), document, PARTS[4]])
    placed = engine.prefill(ids, segments=spans, blend=BlendConfig(ratio=0.0)).blend
    assert placed is not None and placed.segments_found == 3
    assert (placed.exact_tokens, placed.candidate_tokens) == (12 + 8, len(document))
    assert_clean(storage)


def test_documents_stored_after_a_system_prompt_are_found_after_it_only(
    llama: transformers.PreTrainedModel, storage: StorageManager
) -> None:
    engine = KVTierModel(llama, storage=storage, chunk_size=CHUNK)
    ids, spans = joined(PARTS)
    engine.prefill(ids, segments=spans)  # the system prompt alone, each document after it
    # another system prompt: its documents' KV would differ, so none is found
    other_ids, other_spans = joined([prompt(8, 12), *PARTS[1:]])
    got = engine.prefill(other_ids, segments=other_spans, blend=BlendConfig(ratio=0.0))
    assert got.blend is not None and got.blend.segments_found == 0
    # without the anchor only the system prompt (alone, at position 0) is the same object
    got = engine.prefill(ids, segments=spans, blend=BlendConfig(ratio=0.0, anchor=False))
    assert got.blend is not None and got.blend.segments_found == 1
    # and the anchored documents are still there for the first system prompt
    got = engine.prefill(ids, segments=spans, blend=BlendConfig(ratio=0.0))
    assert got.blend is not None and got.blend.segments_found == 4
    assert_clean(storage)


def test_blended_kv_is_never_stored_as_prefix_chunks(
    llama: transformers.PreTrainedModel, storage: StorageManager
) -> None:
    ids, spans = joined(PARTS)
    engine = KVTierModel(llama, storage=storage, chunk_size=CHUNK)
    engine.prefill(ids, segments=spans, blend=BlendConfig(ratio=0.15))
    plain = engine.prefill(ids)  # prefix reuse of the same prompt finds nothing
    assert plain.hit_tokens == 0 and plain.miss_reason


def test_segments_do_not_cross_models_dtypes_or_tenants(
    llama: transformers.PreTrainedModel, storage: StorageManager
) -> None:
    ids, spans = joined(PARTS)
    KVTierModel(llama, storage=storage, chunk_size=CHUNK, salt="acme").prefill(ids, segments=spans)
    others = [
        KVTierModel(llama, storage=storage, chunk_size=CHUNK, salt="globex"),
        KVTierModel(tiny_model("llama", seed=1, num_hidden_layers=4), storage=storage,
                    chunk_size=CHUNK, salt="acme"),
        KVTierModel(tiny_model("llama", num_hidden_layers=4).to(torch.bfloat16), storage=storage,
                    chunk_size=CHUNK, salt="acme"),
    ]  # fmt: skip
    for other in others:
        got = other.prefill(ids, segments=spans)
        assert got.blend is not None and got.blend.segments_found == 0
    same = KVTierModel(llama, storage=storage, chunk_size=CHUNK, salt="acme")
    got = same.prefill(ids, segments=spans)
    assert got.blend is not None and got.blend.segments_found == 4


def test_segments_of_a_prompt_and_prefix_chunks_never_share_keys(
    llama: transformers.PreTrainedModel, storage: StorageManager
) -> None:
    """A prompt that *is* one segment at position 0: its prefix chunks and its
    segment pieces are different objects."""
    ids = prompt(8, 48)
    engine = KVTierModel(llama, storage=storage, chunk_size=CHUNK)
    engine.prefill(ids)  # 3 prefix chunks
    got = engine.prefill([*ids, 1], segments=[(0, 48)])
    assert got.blend is not None and got.blend.segments_found == 0
    assert storage.l1_status()["resident_objects"] == 6


@pytest.mark.parametrize(
    ("segments", "says"),
    [
        ([(0, 10), (5, 20)], r"segments\[1\] \(5, 20\) starts before segments\[0\] ends"),
        ([(10, 20), (0, 5)], r"segments\[1\] \(0, 5\) starts before"),
        ([(0, 100)], r"segments\[0\] is \(0, 100\).*<= 31"),
        ([(-1, 4)], r"segments\[0\] is \(-1, 4\)"),
        ([(4, 4)], r"segments\[0\] is \(4, 4\)"),
        ([(1, 2, 3)], r"segments\[0\] is \(1, 2, 3\); give \(start, end\)"),
        (["ab"], r"segments\[0\]"),
    ],
)
def test_bad_segments_name_the_span(
    llama: transformers.PreTrainedModel, segments: list[object], says: str
) -> None:
    with pytest.raises(ValueError, match=says):
        KVTierModel(llama).prefill(prompt(1, 31), segments=segments)  # type: ignore[arg-type]


def test_models_whose_keys_cannot_move_are_refused() -> None:
    dynamic = tiny_model(
        "llama", rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e4}
    )
    with pytest.raises(ValueError, match="dynamic"):
        KVTierModel(dynamic).prefill(prompt(1, 20), segments=[(0, 10)])
    gpt2 = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64)).eval()
    with pytest.raises(ValueError, match="rotary"):
        KVTierModel(gpt2).prefill([1, 2, 3, 4], segments=[(0, 2)])


class FailingLoads(DelegatingLink):
    def load(self, request_id: str, start: int, end: int, consume: Consume) -> bool:
        self.inner.release(request_id, start, end)
        return False


def test_a_failing_load_computes_the_segment_and_nothing_is_held(
    llama: transformers.PreTrainedModel, storage: StorageManager
) -> None:
    ids, spans = joined(PARTS)
    engine = KVTierModel(llama, storage=storage, chunk_size=CHUNK)
    clean = engine.prefill(ids, segments=spans, blend=BlendConfig(ratio=0.3))
    engine.link = FailingLoads(engine.link)
    engine._segment_store = None
    got = engine.prefill(ids, segments=spans, blend=BlendConfig(ratio=0.3))
    assert got.blend is not None and got.blend.segments_found == 0
    assert (got.logits - clean.logits).abs().max().item() <= TOLERANCE
    assert_clean(storage)
    assert isinstance(engine.link.inner, LocalLink) and engine.link.inner._locked == {}


def test_without_a_cache_every_segment_is_computed(
    llama: transformers.PreTrainedModel,
) -> None:
    ids, spans = joined(PARTS)
    got = KVTierModel(llama).prefill(ids, segments=spans, blend=BlendConfig(ratio=0.0))
    assert got.blend is not None and got.blend.segments_found == 0
    assert (got.logits - concatenated(llama, PARTS, True)).abs().max().item() <= TOLERANCE
    assert np.isfinite(got.logits.numpy()).all()
