"""What ``KVTierModel`` tells the savings ledger (``CacheLink.report_usage``):
after each prefill, its forward (seconds and computed tokens, however few:
the ledger fits a fixed and a per-token part over them) and the tokens it
loaded from kvtier; after a blend, the tokens its segments loaded, and no
forward (a blend's is no prefill)."""

from __future__ import annotations

import pytest
import transformers

from kvtier.blend import BlendConfig
from kvtier.engine.hf import KVTierModel
from kvtier.engine.link import CacheLink
from kvtier.storage import StorageManager
from tests.hf_helpers import DelegatingLink, prompt, tiny_model

CHUNK = 16


class RecordingLink(DelegatingLink):
    """Keeps every usage report: (prefill seconds, computed tokens, load
    seconds, loaded tokens)."""

    def __init__(self, inner: CacheLink | None) -> None:
        super().__init__(inner)
        self.reports: list[tuple[float, int, float, int]] = []

    def report_usage(
        self, prefill_s: float, computed_tokens: int, load_s: float, loaded_tokens: int
    ) -> None:
        self.reports.append((prefill_s, computed_tokens, load_s, loaded_tokens))
        super().report_usage(prefill_s, computed_tokens, load_s, loaded_tokens)


@pytest.fixture(scope="module")
def llama() -> transformers.PreTrainedModel:
    return tiny_model("llama")


def test_a_prefill_reports_its_forward_and_what_it_loaded(
    llama: transformers.PreTrainedModel, storage: StorageManager
) -> None:
    engine = KVTierModel(llama, storage=storage, chunk_size=CHUNK)
    link = engine.link = RecordingLink(engine.link)
    ids = prompt(1, 50)  # three full chunks and 2 tokens
    cold = engine.prefill(ids)  # 50 tokens computed, nothing loaded
    warm = engine.prefill(ids)  # 48 loaded, 2 computed
    assert (cold.computed_tokens, warm.hit_tokens, warm.computed_tokens) == (50, 48, 2)
    assert link.reports == [
        (cold.timings.prefill_s, 50, 0.0, 0),
        (warm.timings.prefill_s, 2, warm.timings.load_s, 48),
    ]


def test_a_blend_reports_the_tokens_its_segments_loaded(
    llama: transformers.PreTrainedModel, storage: StorageManager
) -> None:
    engine = KVTierModel(llama, storage=storage, chunk_size=CHUNK)
    link = engine.link = RecordingLink(engine.link)
    documents = [prompt(2, 16), prompt(3, 40)]
    ids = documents[0] + documents[1] + prompt(4, 9)
    spans = [(0, 16), (16, 56)]
    config = BlendConfig(ratio=0.0)
    first = engine.prefill(ids, segments=spans, blend=config)  # computed alone, stored
    again = engine.prefill(ids, segments=spans, blend=config)  # found and loaded
    assert first.hit_tokens == 0 and again.hit_tokens > 0
    assert [loaded for *_, loaded in link.reports] == [0, again.hit_tokens]
    assert link.reports[1] == (0.0, 0, again.timings.load_s, again.hit_tokens)
